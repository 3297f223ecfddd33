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
with ``unlink`` relative to the directory's descriptor (``spill_format.SpillDir``; the folder
opened in it with ``O_NOFOLLOW``): a symbolic link goes, never what it points at, and a
directory, FIFO or device is neither counted nor touched. A quarantine folder that is a link
or not a directory is never listed, moved into or emptied (the corrupt file then stays in the
root, unindexed). A file that cannot be deleted (EROFS, EIO, EPERM), or whose quarantine
folder cannot be opened now (EMFILE), is not forgotten: it stays counted against the budget as
*undeleted* and its deletion is tried again at each budget pass and sweep (``retry_removals``;
regression, review 30e F5: it left the books at once, so it was orphaned outside the budget
for good; review 31 F2: a flush, the age limit or the folder's bounds forgot quarantined files
undeleted when the folder could not be opened). The list is in memory only: a restart lists
the directory again, and ``DiskTier``'s records on disk (its flush record and list of dropped
holders) keep it from indexing a flushed or dropped file that is still there.

Quarantine ages count from the wall-clock time a file was moved aside (its mtime, so a restart
keeps counting), but one that lies in the future (the clock stepped back since) counts from
now: a step back never keeps a file past ``QUARANTINE_MAX_AGE_S`` after it was noticed
(review 30e F6).

Regression (security review secrev20 S5): these files counted against no budget, so each
change of block format left up to another ``spill_disk_bytes`` behind for good (1.90x the
budget in the review's repro) and the quarantine grew forever. Regression (review 26b F5): a
flush and a deleted tenant's namespace drop left the quarantined files (and a drop the
unindexed ones), their headers naming the tenant's prompt token ids, until the budget needed
room: a store with room kept them for good.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from cache_node.tiers.fair_lru import holder_of
from cache_node.tiers.spill_format import (
    DIR_FLAGS,
    QUARANTINE_DIR,
    SpillDir,
    read_namespace,
    unlink_at,
)

logger = logging.getLogger(__name__)

QUARANTINE_MAX_FILES = 16
"""Quarantined files kept, the newest; older ones are deleted."""

QUARANTINE_BUDGET_SHARE = 0.125
"""Share of the disk budget the quarantine may take, the newest files kept."""

QUARANTINE_MAX_AGE_S = 24 * 3600.0
"""Longest a quarantined file is kept for an operator, from when it was moved aside (its
mtime, set then): older ones are deleted by ``expire`` (each write, each sweep of a spill node)."""

_UNREAD = "\0unread"  # a holder not looked up yet (no namespace holds a NUL)
UNINDEXED, QUARANTINED = "unindexed", "quarantined"


@dataclass
class _File:
    size: int
    mtime_ns: int  # quarantined: when it was moved aside
    holder: str | None = _UNREAD  # holder_of its header's namespace; None: unreadable


class UnservedFiles:
    """Unindexed and quarantined files of one spill directory: names, sizes, oldest first.

    Args:
        spill_dir: the spill directory (its group files' folder), held open.
        budget_bytes: the disk tier's budget; the quarantine keeps at most
            ``QUARANTINE_BUDGET_SHARE`` of it.
        counters: the store's fault counters (``removed_unindexed_files``,
            ``removed_quarantined_files``, ``io_errors``, ``unlink_errors``).
    """

    def __init__(self, spill_dir: SpillDir, budget_bytes: int, counters: Counter[str]) -> None:
        self.spill_dir = spill_dir
        self.root_dir = spill_dir.path
        self.quarantine_dir = self.root_dir / QUARANTINE_DIR
        self.quarantine_max_bytes = int(budget_bytes * QUARANTINE_BUDGET_SHARE)
        self._counters = counters
        self.unindexed: OrderedDict[str, _File] = OrderedDict()  # name in root_dir, oldest first
        self.quarantined: OrderedDict[str, _File] = OrderedDict()  # name in quarantine_dir, oldest first
        # files whose unlink failed, (kind, name) -> size: still on disk, retried (``retry_removals``)
        self.undeleted: OrderedDict[tuple[str, str], int] = OrderedDict()
        self.unindexed_bytes = 0
        self.quarantined_bytes = 0
        self.undeleted_bytes = 0

    @property
    def bytes(self) -> int:
        return self.unindexed_bytes + self.quarantined_bytes + self.undeleted_bytes

    def add_unindexed(self, name: str) -> None:
        """Count ``name`` (a group file listed in the spill directory, not indexed) as the
        newest unindexed file; a directory, FIFO, device or vanished name is not counted."""
        size = own_size(self.spill_dir.fd, name)
        if size is not None and _plain(name):
            old = self.unindexed.pop(name, None)
            self.unindexed_bytes += size - (old.size if old else 0)
            self.unindexed[name] = _File(size, 0)

    def root_files(self) -> dict[str, int]:
        """Every file in the spill directory itself these books hold, name -> bytes: the
        unindexed ones and those whose unlink failed there (what a flush must delete besides
        the indexed files)."""
        files = {name: entry.size for name, entry in self.unindexed.items()}
        files.update((name, size) for (kind, name), size in self.undeleted.items() if kind == UNINDEXED)
        return files

    def forget_unindexed(self) -> None:
        """Every unindexed file is gone (``DiskTier.flush`` deleted the root's group files)."""
        self.unindexed.clear()
        self.unindexed_bytes = 0
        for key in [key for key in self.undeleted if key[0] == UNINDEXED]:
            self.undeleted_bytes -= self.undeleted.pop(key)

    def forget_all(self) -> None:
        """The directory was deleted and made again: nothing of it is left to count."""
        self.forget_unindexed()
        self.undeleted.clear()
        self.quarantined.clear()
        self.unindexed_bytes = self.quarantined_bytes = self.undeleted_bytes = 0

    def free(self, need: int) -> int:
        """Delete undeleted files (``retry_removals``), then unindexed files, oldest first, until
        ``need`` bytes are freed or none is left; returns the bytes freed (0 when ``need`` <= 0)."""
        if need <= 0:
            return 0
        freed = self.retry_removals()
        while freed < need and self.unindexed:
            name, entry = self.unindexed.popitem(last=False)
            self.unindexed_bytes -= entry.size
            if self._remove(UNINDEXED, name, entry.size, "to keep the disk budget"):
                freed += entry.size
        return freed

    def doom(self, name: str, size: int, error: OSError, log: bool = True) -> None:
        """A group file ``name`` of ``size`` bytes in the spill directory whose unlink failed with
        ``error`` (or was never tried: no descriptor): counted as undeleted (against the budget)
        and deleted again later (``retry_removals``); logged unless ``log`` is False (the caller
        logged many at once)."""
        if log:
            logger.warning("could not delete spill file %s (%d B), kept counted and tried again later: %s",
                           self.root_dir / name, size, error)
        self._counters["unlink_errors"] += 1
        self._add_undeleted(UNINDEXED, name, size)

    def retry_removals(self) -> int:
        """Try again to delete each file whose unlink failed; returns the bytes freed. One whose
        folder cannot be opened now (EMFILE) is kept for the next try; one whose quarantine
        folder is gone (or is no plain directory now) is no longer there: forgotten."""
        freed = 0
        for (kind, name), size in list(self.undeleted.items()):
            try:
                with self._folder(kind, strict=True) as folder:
                    error = None if folder is None else unlink_at(folder, name)
            except OSError:
                continue
            if error is not None:
                continue
            del self.undeleted[kind, name]
            self.undeleted_bytes -= size
            freed += size
            if folder is None:
                logger.warning("%s spill file %s (%d B) left with its folder", kind, name, size)
                continue
            logger.warning("deleted %s spill file %s (%d B) on a later try", kind, name, size)
            self._counters[f"removed_{kind}_files"] += 1
        return freed

    def drop_holders(self, holders: Collection[str]) -> int:
        """Delete every unindexed and quarantined file whose verified header names a namespace of
        one of ``holders`` (``holder_of``; each header read once, ``read_namespace``); returns
        how many. A file whose header cannot be read is kept (the budget, ``expire`` or a flush
        deletes it)."""
        removed = 0
        for kind, files in ((UNINDEXED, self.unindexed), (QUARANTINED, self.quarantined)):
            with contextlib.ExitStack() as stack:
                try:
                    folder = stack.enter_context(self._folder(kind, strict=True))
                except OSError as exc:  # (EMFILE) the holders' files known so far: undeleted, tried again
                    self._defer(kind, [name for name, entry in files.items() if entry.holder in holders], exc)
                    continue
                if folder is None:
                    continue
                for name, entry in list(files.items()):
                    if entry.holder == _UNREAD:
                        namespace = read_namespace(name, folder)
                        entry.holder = None if namespace is None else holder_of(namespace)
                    if entry.holder in holders:
                        self._pop(kind, name)
                        removed += self._remove(kind, name, entry.size, "its namespace was dropped", folder)
        return removed

    def clear_quarantine(self) -> int:
        """Delete every file in the quarantine folder (a flush), those not counted yet too;
        returns how many. A folder that is a link or not a directory is not touched."""
        removed = 0
        with contextlib.ExitStack() as stack:
            try:
                folder = stack.enter_context(self._folder(QUARANTINED, strict=True))
            except OSError as exc:  # (EMFILE) not deleted now, not forgotten: tried again (review 31 F2)
                self._defer(QUARANTINED, list(self.quarantined), exc)
                return 0
            if folder is not None:
                found: list[tuple[str, os.stat_result | None]]
                try:
                    with os.scandir(folder) as entries:
                        found = [(e.name, e.stat(follow_symlinks=False)) for e in entries if _plain(e.name)]
                except OSError as exc:
                    logger.warning("cannot list spill quarantine %s: %s", self.quarantine_dir, exc)
                    self._counters["io_errors"] += 1
                    found = [(name, None) for name in self.quarantined]
                for name, st in found:
                    if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                        size = st.st_size if st is not None else self.quarantined[name].size
                        removed += self._remove(QUARANTINED, name, size, "by a flush", folder)
        self.quarantined.clear()
        self.quarantined_bytes = 0
        return removed

    def expire(self, now_ns: int | None = None) -> int:
        """Delete the quarantined files moved aside more than ``QUARANTINE_MAX_AGE_S`` before
        ``now_ns`` (wall clock, ns; None: now); returns how many. A file moved aside after
        ``now_ns`` (the clock stepped back) counts as moved aside at ``now_ns``."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        oldest = now_ns - int(QUARANTINE_MAX_AGE_S * 1e9)
        removed = 0
        for name, entry in list(self.quarantined.items()):
            if entry.mtime_ns > now_ns:  # the clock stepped back: its age counts from now
                entry.mtime_ns = now_ns
                with self._folder(QUARANTINED) as folder, contextlib.suppress(OSError, TypeError):
                    os.utime(name, ns=(now_ns, now_ns), dir_fd=folder, follow_symlinks=False)
            elif entry.mtime_ns < oldest:
                self._pop(QUARANTINED, name)
                removed += self._remove(QUARANTINED, name, entry.size, f"older than {QUARANTINE_MAX_AGE_S:g} s")
        return removed

    def quarantine(self, name: str) -> bool:
        """Move the corrupt group file ``name`` (in the spill directory) unchanged into the
        quarantine folder as its newest file, then delete the oldest past the folder's bounds.
        Returns False when it could not be moved: it stays where it is, counted as unindexed."""
        now_ns = time.time_ns()
        with self._folder(QUARANTINED, create=True) as folder:
            try:
                if folder is None:
                    raise OSError(f"{self.quarantine_dir} is not a plain directory")
                os.replace(name, name, src_dir_fd=self.spill_dir.fd, dst_dir_fd=folder)
            except OSError as exc:
                logger.warning("could not quarantine spill file %s (left in place, unindexed): %s",
                               self.root_dir / name, exc)
                self.add_unindexed(name)
                return False
            with contextlib.suppress(OSError):  # the age limit counts from here, at a restart too
                os.utime(name, ns=(now_ns, now_ns), dir_fd=folder, follow_symlinks=False)
            size = own_size(folder, name) or 0
        self._add_quarantined(name, size, now_ns)
        self._trim_quarantine()
        return True

    def scan_quarantine(self) -> None:
        """Count the files already in the quarantine folder (at a restart), oldest first, and
        delete the oldest past its bounds."""
        with self._folder(QUARANTINED) as folder:
            if folder is None:
                return
            try:
                with os.scandir(folder) as entries:
                    found = [(e.stat(follow_symlinks=False), e.name) for e in entries if _plain(e.name)]
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
        self._pop(QUARANTINED, name)
        self.quarantined_bytes += size
        self.quarantined[name] = _File(size, mtime_ns)

    def _defer(self, kind: str, names: list[str], error: OSError) -> None:
        """``names`` of ``kind`` (counted) could not be deleted now (``error``: their folder
        could not be opened): moved to the undeleted files, counted and tried again
        (``retry_removals``). Logged once, each counted in ``unlink_errors``."""
        if not names:
            return
        logger.warning("could not delete %d %s spill files of %s now, kept counted and tried again later: %s",
                       len(names), kind, self.root_dir, error)
        files = self.unindexed if kind == UNINDEXED else self.quarantined
        for name in names:
            size = files[name].size
            self._pop(kind, name)
            self._counters["unlink_errors"] += 1
            self._add_undeleted(kind, name, size)

    def _add_undeleted(self, kind: str, name: str, size: int) -> None:
        self.undeleted_bytes += size - self.undeleted.pop((kind, name), 0)
        self.undeleted[kind, name] = size

    def _pop(self, kind: str, name: str) -> None:
        """Forget ``name`` of ``kind`` ("unindexed" or "quarantined"), if counted."""
        files = self.unindexed if kind == UNINDEXED else self.quarantined
        entry = files.pop(name, None)
        if entry is not None and kind == UNINDEXED:
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
            self._remove(QUARANTINED, name, entry.size, "to keep the quarantine's bounds")
        self.expire()

    @contextlib.contextmanager
    def _folder(self, kind: str, create: bool = False, strict: bool = False) -> Iterator[int | None]:
        """The descriptor of ``kind``'s folder: the spill directory's, or the quarantine folder
        opened in it without following a link (made when ``create`` and missing; closed after).
        None when the quarantine folder is missing, a link or not a directory (its files are
        not there to delete), or could not be opened (EMFILE, EACCES, EIO); with ``strict``
        that last case raises the OSError instead (its files are there: the caller keeps them
        counted)."""
        if kind == UNINDEXED:
            yield self.spill_dir.fd
            return
        try:
            fd = os.open(QUARANTINE_DIR, DIR_FLAGS, dir_fd=self.spill_dir.fd)
        except FileNotFoundError:
            fd = None
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(QUARANTINE_DIR, 0o700, dir_fd=self.spill_dir.fd)
                with contextlib.suppress(OSError):
                    fd = os.open(QUARANTINE_DIR, DIR_FLAGS, dir_fd=self.spill_dir.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                logger.warning("spill quarantine %s is not a plain directory: not used", self.quarantine_dir)
            elif strict:
                raise
            fd = None
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _remove(self, kind: str, name: str, size: int, why: str, folder: int | None = None) -> int:
        """Unlink the ``kind`` file ``name`` (in ``folder``, else ``kind``'s folder); returns 1
        when deleted. One that cannot be deleted (0) is logged, counted in ``unlink_errors`` and
        kept counted as undeleted, tried again later (``retry_removals``)."""
        if folder is None:
            try:
                with self._folder(kind, strict=True) as opened:
                    return self._remove(kind, name, size, why, opened) if opened is not None else 0
            except OSError as error:  # its folder could not be opened (EMFILE): not forgotten (review 31 F2)
                return self._failed(kind, name, size, error)
        error = unlink_at(folder, name)
        if error is not None:
            return self._failed(kind, name, size, error)
        logger.warning("deleted %s spill file %s (%d B) %s", kind, name, size, why)
        self._counters[f"removed_{kind}_files"] += 1
        return 1

    def _failed(self, kind: str, name: str, size: int, error: OSError) -> int:
        """The ``kind`` file ``name`` could not be deleted (``error``): logged, counted in
        ``unlink_errors`` and kept counted as undeleted, tried again later. Returns 0."""
        logger.warning("could not delete %s spill file %s (%d B), kept counted and tried again later: %s",
                       kind, name, size, error)
        self._counters["unlink_errors"] += 1
        self._add_undeleted(kind, name, size)
        return 0


def own_size(dir_fd: int, name: str) -> int | None:
    """Bytes of ``name`` in ``dir_fd`` itself when it is a regular file or a symbolic link (never
    followed); None for anything else or a name that is gone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode) else None


def _plain(name: str) -> bool:
    """Whether ``name`` is one path component (no separator, not "." or "..")."""
    return name not in ("", ".", "..") and os.sep not in name and (os.altsep is None or os.altsep not in name)
