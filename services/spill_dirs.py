"""Spill directories of spill nodes a deployment no longer runs, deleted at its start.

The launcher gives spill node i the directory ``<spill root>/<i>`` (``<state_dir>/spill``, or
``spill_dir``). Regression (review 26b F4): after a start with fewer spill nodes
(``num_spill_nodes``), the directories of the indices past the count were never opened again:
no deleted tenants' sweep, no disk budget, and their group files' headers kept tenants' prompt
token ids for good. ``remove_retired_spill_dirs`` deletes them at each start: the launcher on
its machine (any count, 0 included), and each spill node on its own machine
(``services.spill_node``: a spill volume the launcher cannot see).

Only what a spill node made is deleted, and no link is followed:

- the spill root is opened without following a link, and must be private
  (``services.private_dir``): whoever else may write it could rename a live node's directory to
  a retired index;
- a retired directory is named by a canonical decimal index at or past the count, and is a
  directory (not a link) of this user that its group and others cannot write (a spill node
  makes it 0700);
- it holds only what a spill node writes: group files (``*.kvs``) and temp files of unfinished
  writes (links among them are unlinked, never followed), ``metrics_port``, the store's list
  of dropped holders (``TOMBSTONE_FILE``), flush record (``FLUSH_FILE``) and lock file
  (``LOCK_FILE``), and a ``quarantine`` folder of this user's holding group files. A directory
  holding anything else is left whole, and logged;
- no store holds it: its lock (``cache_node.tiers.spill_lock``) is taken for the deletion, and
  a directory a live spill store holds (an old deployment's node still running, say) is left
  whole, and logged.

Everything is deleted through directory descriptors (``unlink``/``rmdir`` with ``dir_fd``), so a
name swapped for a link meanwhile is never followed.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from cache_node.tiers.spill_format import (
    FILE_SUFFIX,
    FLUSH_FILE,
    QUARANTINE_DIR,
    TEMP_PREFIX,
    TOMBSTONE_FILE,
)
from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked, lock_spill_dir
from services.private_dir import is_private

log = logging.getLogger(__name__)

METRICS_PORT_FILE = "metrics_port"
"""The port a spill node served ``/metrics`` on, in its directory (``SpillNode._serve_metrics``)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_OWN_FILES = (METRICS_PORT_FILE, TOMBSTONE_FILE, FLUSH_FILE, LOCK_FILE)


def remove_retired_spill_dirs(root: str | Path, num_spill_nodes: int) -> list[str]:
    """Delete the directories ``<root>/<j>`` of spill nodes j >= ``num_spill_nodes`` that a spill
    node made (see the module); returns the names deleted, in index order. A missing root is
    nothing to do; a root or a directory that fails a check is logged and left. Never raises
    for what it finds on disk."""
    root = Path(root)
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("spill root %s not searched for retired spill nodes' directories: %s", root, exc)
        return []
    try:
        if not is_private(os.fstat(root_fd)):
            log.warning("spill root %s is another user's or writable by its group or others: retired spill "
                        "nodes' directories in it are kept (chmod 700 it to have them deleted)", root)
            return []
        retired = sorted((name for name in os.listdir(root_fd) if _index(name) >= num_spill_nodes), key=int)
        return [name for name in retired if _remove_node_dir(root_fd, name, root / name)]
    except OSError as exc:
        log.warning("spill root %s: retired spill nodes' directories not deleted: %s", root, exc)
        return []
    finally:
        os.close(root_fd)


def _index(name: str) -> int:
    """The spill node index ``name`` spells (canonical decimal), or -1."""
    if name.isascii() and name.isdigit() and str(int(name)) == name:
        return int(name)
    return -1


def _remove_node_dir(root_fd: int, name: str, path: Path) -> bool:
    """Delete the retired spill node directory ``name`` of ``root_fd`` when it passes the checks;
    whether it is gone."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return False  # another start (a spill node of this machine) deleted it
    except OSError as exc:  # a link (ELOOP), not a directory (ENOTDIR)
        log.warning("kept %s: not a spill node's directory (%s)", path, exc)
        return False
    lock_fd = -1
    try:
        if not is_private(os.fstat(fd)):
            log.warning("kept %s: another user's or writable by its group or others, not a spill node's", path)
            return False
        if not _only_spill_files(fd):  # before the lock, which would make a lock file in it
            log.warning("kept %s: it holds files a spill node does not write", path)
            return False
        lock_fd = lock_spill_dir(fd, path)  # a live store's directory is never emptied under it
        if not _empty_spill_dir(fd, top=True):
            log.warning("kept %s: it holds files a spill node does not write", path)
            return False
        os.rmdir(name, dir_fd=root_fd)
    except FileNotFoundError:
        return False  # deleted meanwhile by another start
    except SpillDirLocked as exc:
        log.warning("kept %s: a spill store runs on it: %s", path, exc)
        return False
    except OSError as exc:
        log.warning("retired spill node directory %s not deleted: %s", path, exc)
        return False
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        os.close(fd)
    log.warning("deleted %s: the directory of a spill node this deployment no longer runs (num_spill_nodes)", path)
    return True


def _only_spill_files(dir_fd: int, top: bool = True) -> bool:
    """Whether every entry of ``dir_fd`` (``top``: a spill node's directory; else its quarantine
    folder) is one a spill node writes there. Raises OSError."""
    for name in os.listdir(dir_fd):
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        file = stat.S_ISREG(mode) or stat.S_ISLNK(mode)
        group = (name.endswith(FILE_SUFFIX) or (top and name.startswith(TEMP_PREFIX))) and file
        own = top and ((name in _OWN_FILES and stat.S_ISREG(mode)) or (name == QUARANTINE_DIR and stat.S_ISDIR(mode)))
        if not (group or own):
            return False
    return True



def _empty_spill_dir(dir_fd: int, top: bool) -> bool:
    """Unlink everything in ``dir_fd`` (``top``: a spill node's directory, its quarantine folder
    emptied and removed too; else that folder) when every entry is one a spill node writes
    there; False, nothing deleted, when one is not. Raises OSError."""
    names = os.listdir(dir_fd)
    quarantine = -1
    if top and QUARANTINE_DIR in names:
        quarantine = os.open(QUARANTINE_DIR, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        if not _only_spill_files(dir_fd, top):
            return False
        if quarantine >= 0 and (os.fstat(quarantine).st_uid != os.geteuid()
                                or not _empty_spill_dir(quarantine, top=False)):
            return False
        for name in names:
            try:
                if name == QUARANTINE_DIR and top:
                    os.rmdir(name, dir_fd=dir_fd)
                else:
                    os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass  # deleted meanwhile by another start
        return True
    finally:
        if quarantine >= 0:
            os.close(quarantine)
