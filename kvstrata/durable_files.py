"""Files written atomically and durably: ``write_file_atomic``.

Every file the product writes for a reader to find later (an API key, Prometheus's targets, a
checkpoint's cached model identity, a workload's report files) goes through it, so a crash
(power loss) at any point leaves the old file or the new one whole, never an empty or cut-short
one. It lives here, beside the generated contracts (``kvstrata.v1``), because ``cache_node``
and ``tenants`` both use it and neither imports the other (``services`` imports both; docs/
conventions.md). The spill store keeps its own writer (``cache_node.tiers.spill_format``:
relative to an open directory, its temp names part of the spill directory's format).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_file_atomic(path: str | Path, data: str | bytes, mode: int) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically and durably, with
    permission bits ``mode`` (0600 for a secret, 0644 for a file another user's process reads,
    such as Prometheus's targets).

    The data goes to a temp file in the same directory (created 0600, then ``mode``), is
    fsynced, and replaces ``path`` with ``os.replace``; the directory is fsynced after. A crash
    at any point leaves either the old file whole or the new one whole (plus, at worst, a stray
    ``.<name>.*`` temp file), never a partial one; a write that fails leaves no temp file.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            if mode != 0o600:
                os.fchmod(f.fileno(), mode)
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
