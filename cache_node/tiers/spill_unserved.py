"""Files in a spill directory that the disk tier does not serve, kept within its budget.

Two kinds. *Unindexed* group files in the root: another format version or block format (a
model, dtype or ``kv_format`` change under the same ``spill_dir``), a header unreadable at a
restart, a corrupt file that could not be moved aside. *Quarantined* files: a file that failed
its checksum or format check, moved unchanged into ``QUARANTINE_DIR`` for an operator. Neither
is ever served, but both take disk, so both count against the disk tier's byte budget
(``spill_disk_bytes``): ``DiskTier`` deletes unindexed files, oldest first, before it evicts a
file it serves (``free``), and the quarantine keeps only its newest ``QUARANTINE_MAX_FILES``
files within ``QUARANTINE_BUDGET_SHARE`` of the budget, none older than
``QUARANTINE_MAX_AGE_S`` (``expire``). Their headers hold prompts' token ids, so a flush deletes
both kinds (``clear_quarantine``; the root's group files are the disk tier's to delete), and
dropping a holder (a deleted tenant's namespace) deletes each of them whose verified header
names it (``drop_holders``); a file whose header cannot be read names no one and waits for the
budget, the age limit or a flush. Every deletion is logged and counted
(``removed_unindexed_files``, ``removed_quarantined_files``).

Only plain names listed in the spill directory or in its quarantine folder are ever deleted,
with ``unlink``: a symbolic link goes, never what it points at, and a directory or device is
neither counted nor touched. A quarantine folder that is a link or not a directory is never
listed, moved into or emptied (the corrupt file then stays in the root, unindexed).

Regression (security review secrev20 S5): these files counted against no budget, so each
change of block format left up to another ``spill_disk_bytes`` behind for good (1.90x the
budget in the review's repro) and the quarantine grew forever. Regression (review 26b F5): a
flush and a deleted tenant's namespace drop left the quarantined files (and a drop the
unindexed ones), their headers naming the tenant's prompt token ids, until the budget needed
room: a store with room kept them for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from cache_node.tiers.fair_lru import holder_of
from cache_node.tiers.spill_format import QUARANTINE_DIR, read_namespace

logger = logging.getLogger(__name__)

QUARANTINE_MAX_FILES = 16
"""Quarantined files kept, the newest; older ones are deleted."""

QUARANTINE_BUDGET_SHARE = 0.125
"""Share of the disk budget the quarantine may take, the newest files kept."""

QUARANTINE_MAX_AGE_S = 24 * 3600.0
"""Longest a quarantined file is kept for an operator, from when it was moved aside (its
mtime, set then): older ones are deleted by ``expire`` (each write, each sweep of a spill node)."""

_UNREAD = "\0unread"  # a holder not looked up yet (no namespace holds a NUL)


@dataclass
class _File:
    size: int
    mtime_ns: int  # quarantined: when it was moved aside
    holder: str | None = _UNREAD  # holder_of its header's namespace; None: unreadable


class UnservedFiles:
    """Unindexed and quarantined files of one spill directory: names, sizes, oldest first.

    Args:
        root_dir: the spill directory (its group files' folder).
        budget_bytes: the disk tier's budget; the quarantine keeps at most
            ``QUARANTINE_BUDGET_SHARE`` of it.
        counters: the store's fault counters (``removed_unindexed_files``,
            ``removed_quarantined_files``, ``io_errors``).
    """

    def __init__(self, root_dir: Path, budget_bytes: int, counters: Counter[str]) -> None:
        self.root_dir = root_dir
        self.quarantine_dir = root_dir / QUARANTINE_DIR
        self.quarantine_max_bytes = int(budget_bytes * QUARANTINE_BUDGET_SHARE)
        self._counters = counters
        self.unindexed: OrderedDict[str, _File] = OrderedDict()  # name in root_dir, oldest first
        self.quarantined: OrderedDict[str, _File] = OrderedDict()  # name in quarantine_dir, oldest first
        self.unindexed_bytes = 0
        self.quarantined_bytes = 0

    @property
    def bytes(self) -> int:
        return self.unindexed_bytes + self.quarantined_bytes

    def add_unindexed(self, path: Path) -> None:
        """Count ``path`` (a group file listed in ``root_dir``, not indexed) as the newest
        unindexed file; a directory, device or vanished path is not counted."""
        size = _own_size(path)
        if size is not None and path.parent == self.root_dir and _plain(path.name):
            old = self.unindexed.pop(path.name, None)
            self.unindexed_bytes += size - (old.size if old else 0)
            self.unindexed[path.name] = _File(size, 0)

    def forget_unindexed(self) -> None:
        """Every unindexed file is gone (``DiskTier.flush`` deleted the root's group files)."""
        self.unindexed.clear()
        self.unindexed_bytes = 0

    def free(self, need: int) -> int:
        """Delete unindexed files, oldest first, until ``need`` bytes are freed or none is left;
        returns the bytes freed (0 when ``need`` <= 0)."""
        freed = 0
        while freed < need and self.unindexed:
            name, entry = self.unindexed.popitem(last=False)
            self.unindexed_bytes -= entry.size
            self._remove(self.root_dir / name, entry.size, "unindexed", "to keep the disk budget")
            freed += entry.size
        return freed

    def drop_holders(self, holders: Collection[str]) -> int:
        """Delete every unindexed and quarantined file whose verified header names a namespace of
        one of ``holders`` (``holder_of``; each header read once, ``read_namespace``); returns
        how many. A file whose header cannot be read is kept (the budget, ``expire`` or a flush
        deletes it)."""
        removed = 0
        for kind, folder, files in (("unindexed", self.root_dir, self.unindexed),
                                    ("quarantined", self.quarantine_dir, self.quarantined)):
            for name, entry in list(files.items()):
                if entry.holder == _UNREAD:
                    namespace = read_namespace(folder / name)
                    entry.holder = None if namespace is None else holder_of(namespace)
                if entry.holder in holders:
                    self._pop(kind, name)
                    self._remove(folder / name, entry.size, kind, "its namespace was dropped")
                    removed += 1
        return removed

    def clear_quarantine(self) -> int:
        """Delete every file in the quarantine folder (a flush), those not counted yet too;
        returns how many. A folder that is a link or not a directory is not touched."""
        removed = 0
        if self._quarantine_dir_usable(create=False):
            found: list[tuple[str, os.stat_result | None]]
            try:
                found = [(e.name, e.stat(follow_symlinks=False)) for e in os.scandir(self.quarantine_dir)
                         if _plain(e.name)]
            except OSError as exc:
                logger.warning("cannot list spill quarantine %s: %s", self.quarantine_dir, exc)
                self._counters["io_errors"] += 1
                found = [(name, None) for name in self.quarantined]
            for name, st in found:
                if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    size = st.st_size if st is not None else self.quarantined[name].size
                    removed += self._remove(self.quarantine_dir / name, size, "quarantined", "by a flush")
        self.quarantined.clear()
        self.quarantined_bytes = 0
        return removed

    def expire(self, now_ns: int | None = None) -> int:
        """Delete the quarantined files moved aside more than ``QUARANTINE_MAX_AGE_S`` before
        ``now_ns`` (wall clock, ns; None: now); returns how many."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        oldest = now_ns - int(QUARANTINE_MAX_AGE_S * 1e9)
        removed = 0
        for name, entry in list(self.quarantined.items()):
            if entry.mtime_ns < oldest:
                self._pop("quarantined", name)
                removed += self._remove(self.quarantine_dir / name, entry.size, "quarantined",
                                        f"older than {QUARANTINE_MAX_AGE_S:g} s")
        return removed

    def quarantine(self, path: Path) -> bool:
        """Move the corrupt group file ``path`` (in ``root_dir``) unchanged into the quarantine
        folder as its newest file, then delete the oldest past the folder's bounds. Returns
        False when it could not be moved: it stays where it is, counted as unindexed."""
        target = self.quarantine_dir / path.name
        try:
            if not self._quarantine_dir_usable(create=True):
                raise OSError(f"{self.quarantine_dir} is not a plain directory")
            os.replace(path, target)
        except OSError as exc:
            logger.warning("could not quarantine spill file %s (left in place, unindexed): %s", path, exc)
            self.add_unindexed(path)
            return False
        now_ns = time.time_ns()
        with contextlib.suppress(OSError):  # the age limit counts from here, at a restart too
            os.utime(target, ns=(now_ns, now_ns), follow_symlinks=False)
        self._add_quarantined(path.name, _own_size(target) or 0, now_ns)
        self._trim_quarantine()
        return True

    def scan_quarantine(self) -> None:
        """Count the files already in the quarantine folder (at a restart), oldest first, and
        delete the oldest past its bounds."""
        if not self._quarantine_dir_usable(create=False):
            return
        try:
            entries = [e for e in os.scandir(self.quarantine_dir) if _plain(e.name)]
            found = [(e.stat(follow_symlinks=False), e.name) for e in entries]
        except OSError as exc:
            logger.warning("cannot list spill quarantine %s: %s", self.quarantine_dir, exc)
            self._counters["io_errors"] += 1
            return
        owned = [(st.st_mtime_ns, name, st.st_size) for st, name in found
                 if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)]
        for mtime_ns, name, size in sorted(owned):
            self._add_quarantined(name, size, mtime_ns)
        self._trim_quarantine()

    def _add_quarantined(self, name: str, size: int, mtime_ns: int) -> None:
        """``name`` is the newest quarantined file (one of the same name was replaced)."""
        self._pop("quarantined", name)
        self.quarantined_bytes += size
        self.quarantined[name] = _File(size, mtime_ns)

    def _pop(self, kind: str, name: str) -> None:
        """Forget ``name`` of ``kind`` ("unindexed" or "quarantined"), if counted."""
        files = self.unindexed if kind == "unindexed" else self.quarantined
        entry = files.pop(name, None)
        if entry is not None and kind == "unindexed":
            self.unindexed_bytes -= entry.size
        elif entry is not None:
            self.quarantined_bytes -= entry.size

    def _trim_quarantine(self) -> None:
        """Delete the oldest quarantined files past the folder's count and byte bounds, and
        any past its age limit (``expire``)."""
        while self.quarantined and (len(self.quarantined) > QUARANTINE_MAX_FILES
                                    or self.quarantined_bytes > self.quarantine_max_bytes):
            name, entry = self.quarantined.popitem(last=False)
            self.quarantined_bytes -= entry.size
            self._remove(self.quarantine_dir / name, entry.size, "quarantined", "to keep the quarantine's bounds")
        self.expire()

    def _quarantine_dir_usable(self, create: bool) -> bool:
        """Whether the quarantine folder is a directory and not a link (made when ``create``
        and missing)."""
        try:
            mode = self.quarantine_dir.lstat().st_mode
        except FileNotFoundError:
            if not create:
                return False
            self.quarantine_dir.mkdir()
            return True
        except OSError:
            return False
        if stat.S_ISDIR(mode):
            return True
        logger.warning("spill quarantine %s is not a plain directory: not used", self.quarantine_dir)
        return False

    def _remove(self, path: Path, size: int, kind: str, why: str) -> int:
        """Unlink the ``kind`` file ``path`` (1, counted in ``removed_<kind>_files``; 0 when it
        could not be deleted, counted in ``io_errors``)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("could not delete %s spill file %s (%d B): %s", kind, path, size, exc)
            self._counters["io_errors"] += 1
            return 0
        logger.warning("deleted %s spill file %s (%d B) %s", kind, path, size, why)
        self._counters[f"removed_{kind}_files"] += 1
        return 1


def _own_size(path: Path) -> int | None:
    """Bytes of ``path`` itself when it is a regular file or a symbolic link (never followed);
    None for anything else or a path that is gone."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else None


def _plain(name: str) -> bool:
    """Whether ``name`` is one path component (no separator, not "." or "..")."""
    return name not in ("", ".", "..") and os.sep not in name and (os.altsep is None or os.altsep not in name)
