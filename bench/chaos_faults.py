"""Disk faults injected at the OS-call level inside a running process (the spill node's).

The machine runs as root, so a read-only directory would not stop a write; instead the Python
entry points a process opens and lists files through (``builtins.open``/``io.open``,
``os.open``, ``os.scandir``, ``os.listdir``, ``os.replace``/``os.rename``) raise the ``OSError``
a failing disk gives for any path under ``root``: ``EIO`` for reads and listings, ``ENOSPC`` for
anything that creates or writes. Deleting (``os.remove``/``os.unlink``) is left alone on
purpose: what the process deletes during a transient fault is what the test measures.

Run inside an actor with ``handle.__ray_call__.remote(inject_disk_faults, root)``; the first
argument of each function is the actor instance (unused).
"""

from __future__ import annotations

import builtins
import errno
import io
import os
from typing import Any

_ORIGINALS: dict[tuple[Any, str], Any] = {}
_COUNTS: dict[str, int] = {"read": 0, "write": 0}

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _under(path: Any, root: str) -> bool:
    if isinstance(path, int):
        return False
    try:
        return os.path.abspath(os.fsdecode(path)).startswith(root)
    except TypeError:
        return False


def _fail(kind: str, path: Any) -> OSError:
    _COUNTS[kind] += 1
    code = errno.EIO if kind == "read" else errno.ENOSPC
    return OSError(code, os.strerror(code), os.fsdecode(path))


def _patch(owner: Any, name: str, make: Any) -> None:
    original = _ORIGINALS.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, make(original))


def inject_disk_faults(_actor: Any, root: str) -> None:
    """From now on every open/list/rename under ``root`` in this process fails (EIO/ENOSPC)."""
    root = os.path.abspath(root)

    def opener(original: Any) -> Any:
        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if _under(file, root):
                raise _fail("read" if set(mode) <= set("rbt") else "write", file)
            return original(file, mode, *args, **kwargs)
        return open_

    def os_opener(original: Any) -> Any:
        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
            if _under(path, root):
                raise _fail("write" if flags & _WRITE_FLAGS else "read", path)
            return original(path, flags, *args, **kwargs)
        return open_

    def lister(original: Any) -> Any:
        def list_(path: Any = ".", *args: Any, **kwargs: Any) -> Any:
            if _under(path, root):
                raise _fail("read", path)
            return original(path, *args, **kwargs)
        return list_

    def mover(original: Any) -> Any:
        def move(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if _under(src, root) or _under(dst, root):
                raise _fail("write", dst)
            return original(src, dst, *args, **kwargs)
        return move

    _patch(builtins, "open", opener)
    _patch(io, "open", opener)
    _patch(os, "open", os_opener)
    _patch(os, "scandir", lister)
    _patch(os, "listdir", lister)
    _patch(os, "replace", mover)
    _patch(os, "rename", mover)


def clear_disk_faults(_actor: Any) -> dict[str, int]:
    """Restore the real calls; returns how many reads and writes failed while injected."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
    counts = dict(_COUNTS)
    _COUNTS.update(read=0, write=0)
    return counts


def dir_snapshot(root: str) -> dict[str, int]:
    """Relative path -> size in bytes of every file under ``root`` (this process, real calls)."""
    out: dict[str, int] = {}
    for base, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out
