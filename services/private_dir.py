"""Directories only the service's user may change: the state directory (``tenants.sqlite``,
``admin_key``, ``ray_token``, ``gateway.json``) and each spill node's directory (prompts' KV
and token ids).

``ensure_private_dir`` makes a missing directory with mode 0700 and refuses one that exists
but is owned by another user or writable by its group or by others, as ssh refuses a
``~/.ssh`` that others could write (``StrictModes``): whoever can write the directory can
replace the files in it (another tenant database, an admin key of their choosing, a
``gateway.json`` naming their own gateway, spill files served as cached KV), whatever the
files' own modes. Only the directory itself is checked, not its parents: a parent others may
write without the sticky bit (a shared volume mounted 0777) lets them rename the directory
away, so keep such a volume to the service's user.

Regression (security review 23d): the directories were made with ``mkdir(mode=0o700,
exist_ok=True)``, which leaves an existing directory's mode as it is, so a state directory
made group- or world-writable earlier (by hand, by a umask, by another tool) was used as it
was.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeDirectoryError(PermissionError):
    """A directory another user could change; the message names it and the fix."""


def ensure_private_dir(path: str | Path) -> Path:
    """``path`` (missing parents too) as a directory of this user's, made with mode 0700 when
    missing (``check_private_dir``); returns it.

    Raises:
        UnsafeDirectoryError: ``path`` is owned by another user, or writable by its group or
            by others.
        OSError: ``path`` cannot be made, or is not a directory.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_dir(path)
    return path


def is_private(st: os.stat_result) -> bool:
    """Whether the directory whose status is ``st`` passes ``check_private_dir``: owned by this
    user, writable by neither its group nor others."""
    return st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022


def check_private_dir(path: str | Path) -> None:
    """Refuse the existing directory ``path`` if another user could change what is in it.

    Raises:
        UnsafeDirectoryError: ``path`` is owned by another user, or writable by its group or
            by others (the message names it and the fix).
        OSError: ``path`` cannot be read.
    """
    st = Path(path).stat()
    uid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        raise UnsafeDirectoryError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid}): that user can replace the "
            f"files kvstrata keeps there. Use a directory of your own (state_dir, spill_dir), or "
            f"`chown {uid} {path}` and `chmod 700 {path}`")
    writers = [who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit]
    if writers:
        raise UnsafeDirectoryError(
            f"{path} is writable by {' and '.join(writers)} (mode {mode:04o}): another user could replace the "
            f"files kvstrata keeps there. Run `chmod 700 {path}` (or at least `chmod go-w {path}`)")
