"""A real small filesystem for disk-full tests: ``tiny_disk`` (a 256 KiB tmpfs of its own,
mode 0700; root only, else the test is skipped) and ``fill_disk`` (filled to its last byte)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted at ``tmp_path / "tiny"`` for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tiny"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=700", "tmpfs", str(mount)],
                      check=False, capture_output=True).returncode != 0:
        pytest.skip("this host refuses a tmpfs mount")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill_disk(root: Path) -> Path:
    """Write ``root / "filler"`` until the disk is full (ENOSPC); returns it (unlink it to free
    the room)."""
    filler = root / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 512)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler
