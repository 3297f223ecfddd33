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

The holder also writes its ``owner`` (a spill node's Ray namespace and actor name), so a refused
opener can tell this node's own previous process (Ray restarted the actor while the old worker
was still exiting: wait for it) from another deployment's store on the same directory (a
misconfiguration for the operator to fix): ``SpillDirLocked.owner``.
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
"""File in a spill directory whose ``flock`` its store holds; holds ``"<pid> <host> [<owner>]\\n"``."""

MAX_OWNER_CHARS = 200
"""Longest owner written into the lock file (longer ones are cut)."""

_READ_BYTES = 4096  # the longest line written: a pid, a 255-char host and a 200-char owner, UTF-8
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_POLL_S = 0.05


class SpillDirLocked(OSError):
    """A spill directory whose lock another store holds (``errno`` EWOULDBLOCK).

    Attributes (as the holder wrote them into the lock file; what it did not write is 0 or ""):
        pid: the holder's process id.
        host: the holder's host name.
        owner: the holder's owner (``lock_spill_dir``'s ``owner``: a spill node's
            ``"<ray namespace>/<actor name>"``).
    """

    pid: int = 0
    host: str = ""
    owner: str = ""


def lock_spill_dir(dir_fd: int, path: os.PathLike[str] | str, wait_s: float = 0.0, owner: str = "") -> int:
    """Take the exclusive lock of the spill directory open at ``dir_fd`` (``path``: its name, for
    messages): returns the lock file's descriptor, which holds it until closed.

    ``wait_s``: how long to retry while another holds it (0: fail at once). ``owner``: who
    holds it, written into the lock file after the pid and host for the next opener (a spill
    node's ``"<ray namespace>/<actor name>"``; whitespace and control characters become "_", cut
    at ``MAX_OWNER_CHARS``). The lock file is created (0600) if missing, never through a link,
    and must be a regular file.

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
                    pid, host, holder_owner = _holder(fd)
                    who = f"pid {pid}" if pid else "holder's pid unknown"
                    who += (f" on {host}" if host else "") + (f", {holder_owner}" if holder_owner else "")
                    exc = SpillDirLocked(
                        errno.EWOULDBLOCK,
                        f"spill directory {path} is in use by another spill store ({who}; waited "
                        f"{wait_s:g} s): two stores on one directory delete each other's files. Stop the "
                        "other one, or give each deployment and spill node a directory of its own "
                        "(spill_dir)")
                    exc.pid, exc.host, exc.owner = pid, host, holder_owner
                    raise exc from None
                time.sleep(min(_POLL_S, left))
        with contextlib.suppress(OSError):  # who holds it, for the next opener's message; best effort
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {_clean(owner)}".rstrip().encode() + b"\n", 0)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _clean(owner: str, limit: int = MAX_OWNER_CHARS) -> str:
    """``owner`` as one word of the lock file: whitespace and control characters as "_", cut at
    ``limit`` characters."""
    return "".join("_" if ch.isspace() or not ch.isprintable() else ch for ch in owner[:limit])


def stored_owner(owner: str) -> str:
    """``owner`` as the lock file stores it and ``SpillDirLocked.owner`` reads it back (cleaned,
    cut at ``MAX_OWNER_CHARS``): what a holder's owner is compared with."""
    return _clean(owner)


def _holder(fd: int) -> tuple[int, str, str]:
    """The holder as its lock file names it: (pid, host, owner); 0 or "" for what it does not
    say (an unreadable or foreign file: its words are checked, never trusted further; host and
    owner ``_clean``ed, as written). Regression (s37): a file written by another program carried
    ESC sequences in its host and owner to ``kvstrata status``'s terminal."""
    try:
        words = os.pread(fd, _READ_BYTES, 0).decode("utf-8", "replace").split()
    except OSError:
        words = []
    if not words or not words[0].isdigit() or len(words[0]) > 10:
        return 0, "", ""
    host = _clean(words[1], 255) if len(words) > 1 else ""
    owner = _clean(words[2]) if len(words) > 2 else ""
    return int(words[0]), host, owner
