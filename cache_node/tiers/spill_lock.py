"""One store per spill directory: an exclusive ``flock`` on ``LOCK_FILE`` in it.

Regression (review s35 D S2): nothing locked a spill directory. Two stores on one directory (a
``spill_dir`` shared by two deployments, or an old spill process still alive when its
replacement started) deleted each other's temp files at start (a write in flight failed and its
blocks were dropped), each one's ``flush`` deleted the other's group files, and each rewrote
``TOMBSTONE_FILE`` with only its own dropped holders, so a deleted tenant's file the other had
recorded could be indexed and served again after a restart.

``SpillDir`` (``spill_format``) takes the lock when it opens its directory and holds it until
``close``; a second opener, in this process or another, gets ``SpillDirLocked`` naming the
directory and the holder's pid and host (written into the file by the holder). The lock is an
``flock`` on the file's open description: the kernel drops it when its holder's process ends,
however it ends, so a spill node Ray restarts after a crash (a new process) takes it at once,
and no stale lock file ever needs deleting (the file is never deleted: an unlink would let two
openers lock two different files of that name).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time

LOCK_FILE = "spill.lock"
"""File in a spill directory whose ``flock`` its store holds; holds ``"<pid> <host>\\n"``."""

_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_POLL_S = 0.05


class SpillDirLocked(OSError):
    """A spill directory whose lock another store holds (``errno`` EWOULDBLOCK)."""


def lock_spill_dir(dir_fd: int, path: os.PathLike[str] | str, wait_s: float = 0.0) -> int:
    """Take the exclusive lock of the spill directory open at ``dir_fd`` (``path``: its name, for
    messages): returns the lock file's descriptor, which holds it until closed.

    ``wait_s``: how long to retry while another holds it (0: fail at once). The lock file is
    created (0600) if missing, never through a link, and must be a regular file.

    Raises:
        SpillDirLocked: another store holds it still after ``wait_s``.
        OSError: the lock file cannot be made or opened, or is not a regular file (ELOOP for a
            link, EINVAL otherwise).
    """
    try:
        fd = os.open(LOCK_FILE, _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"spill directory {path}: its lock file {LOCK_FILE} is a link") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"spill directory {path}: its lock file {LOCK_FILE} is not a regular file")
        deadline = time.monotonic() + max(0.0, wait_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SpillDirLocked(
                        errno.EWOULDBLOCK,
                        f"spill directory {path} is in use by another spill store ({_holder(fd)}; waited "
                        f"{wait_s:g} s): two stores on one directory delete each other's files. Stop the "
                        "other one, or give each deployment and spill node a directory of its own "
                        "(spill_dir)") from None
                time.sleep(min(_POLL_S, left))
        with contextlib.suppress(OSError):  # who holds it, for the next opener's message; best effort
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int) -> str:
    """The holder as its lock file names it: ``"pid <pid> on <host>"``, or what is unknown."""
    try:
        words = os.pread(fd, 256, 0).decode("utf-8", "replace").split()
    except OSError:
        words = []
    if len(words) >= 1 and words[0].isdigit():
        return f"pid {words[0]}" + (f" on {words[1]}" if len(words) > 1 else "")
    return "holder's pid unknown"
