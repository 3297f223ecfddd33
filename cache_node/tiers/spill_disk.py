"""The disk tier of a spill store: an index of group files with a byte budget, LRU by file.

A file's recency is the last touch of any of its blocks; eviction drops whole files (evicting
single blocks of a partly live file would free no bytes), the least recently used file of the
tenant holding the most bytes per unit of its weight first (``fair_lru``; a file holds one
namespace's blocks; the weights are the store's, learnt from puts, so after a restart a tenant
counts as weight 1 until its next put). The index is rebuilt from the file headers on
construction, so a restarted spill node keeps its disk hits. Not thread-safe: the
owning ``SpillStore`` serializes calls.

Faults (which are retried, which quarantine a file, which leave it unindexed:
``spill_disk_faults``), as the index sees them: a block that fails its checksum in a file
whose header verified (``SpillBlocksCorrupt``) is dropped from the index alone
(``corrupt_blocks``): every block has its own checksum, so the file's other blocks are still
served, and a file left with no block is moved into the quarantine folder. Regression (review
26b F3): one bad block quarantined its whole file, up to ``MAX_BLOCKS_PER_FILE`` blocks of a
tenant's batch. A file corrupt as a whole (``SpillCorruptError``) is taken out of the index
and quarantined. A transient ``OSError`` that outlasts its retries is counted
(``io_errors``) and the read is a miss, the file staying on disk and in the index. A file
that is gone (ENOENT) is dropped from the index (``missing_files``). At a restart a block
held by several files is indexed from the newest (a block dropped as corrupt that was written
again later is served from its new copy); a block that failed its checksum before is indexed
again from its file, and dropped again at its next read.

The budget bounds the whole directory: unindexed and quarantined files count against it
(``spill_unserved``), and unindexed ones, which can never be served, are deleted (oldest
first) before any indexed file is evicted; the quarantine keeps only its newest files, none
older than ``QUARANTINE_MAX_AGE_S``. A flush deletes every file, quarantined ones too; dropping
holders deletes their files, served or not (``UnservedFiles.drop_holders``).

The directory is held open from construction (``spill_format.SpillDir``) and every name is
resolved in it: a FIFO, device or link named like a group file is never opened (F1 of review
30e: one hung the store's constructor or a ``get`` holding its lock), a directory swapped for
a link is never followed, and one deleted while running is made again at the next write that
finds it gone (``dir_recreated``; its index is emptied, since its files went with it; F4).

The volume may fill before the budget does (a shared disk, a budget set too large): before
each file is written the tier makes room for it on the volume as it does for the budget
(``fstatvfs``: unindexed files first, then indexed ones by ``fair_lru``, counted in
``disk_full_evicted_files``), and a write that still fails with ENOSPC/EDQUOT
(``disk_full_writes``) evicts at least the file's size and is tried once more. Regression
(review 30e F2): the tier kept its oldest files and dropped every new write for good.

Deletions of many files (``flush``, ``drop_holders``) take the files out of the index and
return a ``PendingRemoval`` that the caller runs after releasing its lock (F3: 5,000 unlinks
held another tenant's get of a RAM block for 5.8 s); file names are unique (a uuid each), so a
late unlink never deletes a file written after. A file whose unlink fails (EROFS, EIO), or is
never tried (no descriptor of the directory could be had: EMFILE), stays counted against the
budget and is tried again at each budget pass and ``expire_quarantine``
(``UnservedFiles.undeleted``, ``unlink_errors``): a file the index forgot is either deleted or
on that list (review 31 F2: without a descriptor, or when a flush could not list the
directory, the files were in no book, and a restart indexed and served them again). That list
is in memory, so what a restart must not serve is recorded on disk before any file goes: a
flush's write sequence in ``FLUSH_FILE`` (``flush``: every group file at or below it is deleted
at a restart, never indexed; session 32: a restart before the retry, or a node killed among a
flush's unlinks, served the flushed KV again), and the holders dropped for good in
``TOMBSTONE_FILE`` (``save_dropped``: a file of one of them is deleted at a restart, never
indexed; F5: a deleted tenant's file that could not be deleted was indexed and served again).
A deletion that could record neither and left files behind is not acknowledged
(``SpillDeletionNotDurable``, raised by the owning ``SpillStore``).

A restart indexes each block from the file of the highest write sequence holding it (``seq``
in the header: each write's is ``max(last + 1, time_ns())``, continued from the largest one
found at a restart), not by mtime (F6: after a clock step back, an old copy of a block that had
failed its checksum won over the copy written again after it). The writer keeps within the
reader's bound (``spill_format.MAX_SEQ``; ``_next_seq``: review 31 F1, every write after a
file at the bound was quarantined at the next restart).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np

from cache_node.msgpack_bounds import UnpackBounds, unpackb_within
from cache_node.tiers import spill_format as fmt
from cache_node.tiers.fair_lru import FairLRU, HolderWeights, holder_of
from cache_node.tiers.spill_disk_faults import READ_ATTEMPTS, DiskFaults
from cache_node.tiers.spill_format import (
    BlockFormat,
    SpillBlocksCorrupt,
    SpillCorruptError,
    SpillDir,
)
from cache_node.tiers.spill_unserved import UnservedFiles, own_size

logger = logging.getLogger(__name__)

TIER_DISK = "spill_disk"
Emit = Callable[[str, bytes, str], None]  # (event, block_hash, tier)

TOMBSTONE_FILE = fmt.TOMBSTONE_FILE
MAX_TOMBSTONES = 65536
"""Holders ``TOMBSTONE_FILE`` keeps, the newest (``spill_store.MAX_DROPPED_HOLDERS``)."""
_TOMBSTONE_BOUNDS = UnpackBounds(
    max_array_len=MAX_TOMBSTONES, max_map_len=0, max_str_len=0, max_bin_len=32,
    max_containers=1, max_elements=MAX_TOMBSTONES,
)
_MAX_TOMBSTONE_BYTES = 8 + MAX_TOMBSTONES * 34
FLUSH_FILE = fmt.FLUSH_FILE
_FLUSH_BOUNDS = UnpackBounds(
    max_array_len=0, max_map_len=4, max_str_len=16, max_bin_len=0, max_containers=1, max_elements=8,
)
_MAX_FLUSH_BYTES = 64  # {"seq": <uint64>} packs to 15
_FLUSH_UNKNOWN = fmt.MAX_SEQ  # a ``FLUSH_FILE`` that cannot be read: every file found counts as flushed
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

SEQ_HEADROOM = 1 << 56
"""Write sequences kept above the clock's reach for counting on (``_next_seq``): 7.2e16, two
millennia of a million files a second."""
SEQ_CLOCK_MAX = fmt.MAX_SEQ - SEQ_HEADROOM
"""Largest clock reading (ns, late 2113) ``_next_seq`` takes as a write sequence: a clock past
it (an RTC glitch, or 2114) counts on from the last sequence by one, below ``fmt.MAX_SEQ``."""


@dataclass
class _SpillFile:
    path: Path  # root_dir / its name (for log lines; every operation goes by name in the directory fd)
    size_bytes: int
    live: set[bytes]  # hashes of this file that the index still points at


class SpillDeletionNotDurable(OSError):
    """A flush or a holder's drop that left files on disk (their unlink failed, or was never
    tried) and could not record itself either (``FLUSH_FILE``, ``TOMBSTONE_FILE``: a read-only or
    failing volume): a restart before a later try deletes them would index and serve them
    again, so the deletion is not acknowledged. They are out of the index and counted as
    undeleted meanwhile (tried again at each sweep); calling the flush or drop again records it
    anew."""


@dataclass
class PendingRemoval:
    """Files taken out of the index, to unlink after the owner's lock is released (``run``):
    ``(name, size)`` in the directory of ``dir_fd`` (a ``dup``, closed by ``run``). ``dir_fd``
    None: no descriptor could be had (``error``), so none is deleted and every file is handed
    back as failed, to be counted and tried again (``DiskTier.unlink_failed``): a file the index
    forgot is either deleted or on the undeleted list.

    ``recorded``: a restart never serves these files even if they stay on disk (the flush's
    sequence is in ``FLUSH_FILE``, or the holders dropped are in ``TOMBSTONE_FILE``); when False
    and some cannot be deleted, the owner raises ``SpillDeletionNotDurable``. A flush's:
    ``flush_seq`` (what ``FLUSH_FILE`` records) and ``complete`` (its listing of the directory
    held every group file), for ``DiskTier.flush_done``."""

    dir_fd: int | None
    files: list[tuple[str, int]] = field(default_factory=list)
    error: OSError | None = None  # why ``dir_fd`` is None
    recorded: bool = True
    flush_seq: int | None = None
    complete: bool = True

    def run(self) -> list[tuple[str, int, OSError]]:
        """Unlink every file (gone already: done); returns those that failed, with the error,
        for ``DiskTier.unlink_failed`` (every file when there is no ``dir_fd``)."""
        if self.dir_fd is None:
            error = self.error or OSError(errno.EBADF, "no descriptor of the spill directory")
            return [(name, size, error) for name, size in self.files]
        failed: list[tuple[str, int, OSError]] = []
        try:
            for name, size in self.files:
                error = fmt.unlink_at(self.dir_fd, name)
                if error is not None:
                    failed.append((name, size, error))
        finally:
            os.close(self.dir_fd)
            self.dir_fd = None
        return failed


class DiskTier:
    """Group files under ``root_dir`` holding at most ``budget_bytes`` of files, the files it
    does not serve (``unserved``: unindexed, quarantined, undeleted) included.

    Args:
        root_dir: directory of the group files (created if missing; held open from here on).
        block_format: shape, dtype and kv_format of every block.
        budget_bytes: bytes of files kept (0: writes are dropped).
        max_blocks_per_file: most blocks per group file.
        emit: receives "stored"/"removed" events of this tier.
        counters: shared fault counters (``corrupt_reads``: reads that found a file or blocks
            corrupt; ``corrupt_blocks``: blocks dropped alone for a failed checksum;
            ``quarantined_files``, ``io_errors``, ``io_retries``, ``missing_files``,
            ``skipped_files``, ``evicted_files``, ``removed_unindexed_files``,
            ``removed_quarantined_files``, ``disk_full_writes``, ``disk_full_evicted_files``,
            ``unlink_errors``, ``dir_recreated``, ``tombstoned_files``).

        lock_wait_s: how long to wait for the directory's lock while another store holds it
            (``spill_format.SpillDir``; 0: fail at once).
        lock_owner: who holds the lock (``spill_lock.lock_spill_dir``'s ``owner``).

    Raises ``spill_format.UnsafeSpillDir`` when ``root_dir`` is a link or not a directory, and
    ``spill_lock.SpillDirLocked`` when another store holds it (review s35 D S2).
    """

    def __init__(
        self,
        root_dir: Path,
        block_format: BlockFormat,
        budget_bytes: int,
        max_blocks_per_file: int,
        emit: Emit,
        counters: Counter[str],
        weights: HolderWeights | None = None,
        lock_wait_s: float = 0.0,
        lock_owner: str = "",
    ) -> None:
        self.root_dir = root_dir
        self.block_format = block_format
        self.budget_bytes = budget_bytes
        self.max_blocks_per_file = max_blocks_per_file
        self._emit = emit
        self._counters = counters
        self.index: dict[bytes, str] = {}  # block_hash -> file name
        self.tokens: dict[bytes, bytes] = {}  # block_hash -> its token_bytes (b"": unknown)
        # file name -> file, per tenant in LRU order (regression: one LRU over all tenants let
        # one tenant's writes delete every other tenant's files)
        self._files: FairLRU[str, _SpillFile] = FairLRU(weights)
        self.bytes_used = 0  # bytes of the files in the index
        self.dir = SpillDir(root_dir, lock_wait_s, lock_owner)
        self.unserved = UnservedFiles(self.dir, budget_bytes, counters)
        self._faults = DiskFaults(block_format, self.unserved, counters)
        self._seq = 0  # the last write sequence written or found (``_next_seq``)
        self._seq_saturated = False  # ``_next_seq`` reached ``fmt.MAX_SEQ`` (logged once)
        # SHA-256 of each holder dropped for good, oldest first (``TOMBSTONE_FILE``)
        self._tombstones: OrderedDict[bytes, None] = OrderedDict()
        self._tombstone_dirty = False  # a ``save_dropped`` failed: tried again by expire_quarantine
        self._flushed_seq: int | None = None  # what ``FLUSH_FILE`` records (None: no such file)
        try:
            self._rebuild()
        except BaseException:
            self.dir.close()  # the lock goes now, not when the collector finds this object
            raise

    def close(self) -> None:
        """Release the directory and its lock (idempotent); later reads miss and writes fail."""
        self.dir.close()

    def __del__(self) -> None:
        if hasattr(self, "dir"):
            self.dir.close()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_files(self) -> int:
        return len(self._files)

    def write(
        self, namespace: str, hashes: Sequence[bytes], blocks: np.ndarray | Sequence[np.ndarray],
        tokens: Sequence[bytes],
    ) -> None:
        """Write ``blocks`` ((n, *shape), or n arrays of the block shape), with each block's
        ``token_bytes`` ``tokens[i]``, as group files of at most ``max_blocks_per_file``."""
        step = self.max_blocks_per_file
        for start in range(0, len(hashes), step):
            end = start + step
            self._write_file(namespace, list(hashes[start:end]), blocks[start:end], list(tokens[start:end]))
            self._evict_over_budget()

    def read(self, hashes: Sequence[bytes], out: np.ndarray, rows: Sequence[int]) -> list[int]:
        """Read ``hashes`` (all held) into ``out[rows]``; returns the rows read successfully.

        The rows of a file that cannot be read miss: a corrupt file is quarantined and a gone
        file (or a name that is no regular file now) dropped from the index; a transient
        OSError (after retries) keeps the file. A block that fails its checksum misses and is
        dropped; the file's other rows are read.
        """
        by_file: dict[str, list[int]] = {}
        for k, block_hash in enumerate(hashes):
            by_file.setdefault(self.index[block_hash], []).append(k)
        done: list[int] = []
        for name, ks in by_file.items():
            read = self._read_file(name, [hashes[k] for k in ks], out, [rows[k] for k in ks])
            done.extend(rows[ks[j]] for j in read)
        return sorted(done)

    def touch(self, block_hash: bytes) -> None:
        self._files.touch(self.index[block_hash])

    def flush(self) -> PendingRemoval:
        """Drop every file from the index (their "removed" events) and the books, delete the
        quarantined ones (their headers hold prompts' token ids), and return the group files in
        the directory (the indexed ones, the others, the undeleted: each name the books hold,
        and each listed) for the caller to unlink outside its lock (``PendingRemoval.run``, then
        ``unlink_failed`` and ``flush_done``). Regression (review 31 F2): a listing that failed
        deleted nothing, and the forgotten files were indexed and served again at a restart.

        First the flush takes a write sequence and records it in ``FLUSH_FILE`` (fsync'd, by a
        rename): every group file written before has a lower one, every later write a higher
        one, and a restart deletes each file at or below it (``_rebuild``). Regression (session
        32): a file whose unlink failed was on the undeleted list in memory only, so a restart
        before the sweep that deleted it (or a node killed among a flush's unlinks) indexed and
        served the flushed KV again. A record that cannot be written is logged and counted
        (``io_errors``; ``PendingRemoval.recorded`` False)."""
        seq = self._record_flush()
        pending = self._pending([])
        pending.recorded, pending.flush_seq = seq is not None, seq
        files = {name: self._files[name].size_bytes for name in self._files}  # every name the books hold
        files.update(self.unserved.root_files())
        for name in list(self._files):
            self._forget(name)
        try:
            listed = fmt.list_group_names(self.dir.fd, links=True)
        except OSError as exc:  # the files the books hold are still deleted (review 31 F2)
            logger.warning("cannot list spill dir %s to flush it (deleting the %d files it knows): %s",
                           self.root_dir, len(files), exc)
            self._counters["io_errors"] += 1
            listed, pending.complete = [], False
        for group in listed:  # a name the books do not hold: put there since
            if group.name not in files:
                files[group.name] = own_size(self.dir.fd, group.name) or 0
        pending.files = list(files.items())
        self.unserved.forget_unindexed()
        self.unserved.clear_quarantine()
        return pending

    def drop_holders(self, holders: Collection[str]) -> tuple[int, PendingRemoval]:
        """Take every indexed file of each of ``holders`` (namespaces without their salt:
        ``holder_of``) out of the index, with their blocks' "removed" events; returns the blocks
        dropped and the files, for the caller to unlink outside its lock
        (``PendingRemoval.run``, then ``unlink_failed``). Files it does not serve (unindexed,
        quarantined) whose verified header names one of them are deleted now
        (``UnservedFiles.drop_holders``; counted as removed files)."""
        names = [name for name in self._files if self._files.holder(name) in holders]
        dropped = 0
        pending = self._pending([])
        for name in names:
            spill_file = self._forget(name)
            dropped += len(spill_file.live)
            pending.files.append((name, spill_file.size_bytes))
        self.unserved.drop_holders(holders)
        return dropped, pending

    def flush_done(self, seq: int) -> None:
        """The flush that recorded ``seq`` deleted every group file of the directory: its
        ``FLUSH_FILE`` is deleted, after a ``fsync`` of the directory has made those deletions
        durable, unless a later flush recorded its own since (a flush that left files behind
        keeps its record). Kept when either fails (a restart then deletes what it covers: no
        harm, since nothing written after it is covered)."""
        if self._flushed_seq != seq:
            return
        try:
            os.fsync(self.dir.fd)
        except OSError:
            return
        if fmt.unlink_at(self.dir.fd, FLUSH_FILE) is None:
            self._flushed_seq = None

    def _record_flush(self) -> int | None:
        """Take the next write sequence and keep it in ``FLUSH_FILE`` (``write_small_file``:
        fsync'd, renamed over the old one, the directory fsync'd); returns it, or None when it
        could not be written (logged, counted in ``io_errors``)."""
        seq = self._next_seq()
        try:
            fmt.write_small_file(FLUSH_FILE, msgpack.packb({"seq": seq}), self.dir.fd)
        except OSError as exc:
            logger.warning("could not record the flush of %s in %s (a restart may index again the files it "
                           "cannot delete): %s", self.root_dir, FLUSH_FILE, exc)
            self._counters["io_errors"] += 1
            return None
        self._flushed_seq = seq
        return seq

    def _load_flush(self) -> int | None:
        """The write sequence ``FLUSH_FILE`` records: None when there is none; ``_FLUSH_UNKNOWN``
        (every file found counts as flushed) when it cannot be read (after ``READ_ATTEMPTS``
        tries of a transient error), is malformed or is no regular file (logged, counted in
        ``io_errors``): its bytes are untrusted, and what it covered is unknown, so nothing that
        might have been flushed is served."""
        try:
            fields = self._read_record(FLUSH_FILE, _MAX_FLUSH_BYTES, _FLUSH_BOUNDS, "a flush record")
            seq = fields.get("seq") if isinstance(fields, dict) else None
            if type(seq) is not int or not 0 <= seq <= fmt.MAX_SEQ:
                raise ValueError("not a flush record")
        except fmt.NotRegularFile as exc:
            error: Exception = exc
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # msgpack's errors are ValueErrors
            error = exc
        else:
            return seq
        self._unsound_record(FLUSH_FILE, error, "every group file found counts as flushed, deleted, none indexed")
        return _FLUSH_UNKNOWN

    def _read_record(self, name: str, max_bytes: int, bounds: UnpackBounds, what: str) -> object:
        """The msgpack value of the small record file ``name`` of the spill directory (read
        without following a link, at most ``max_bytes``, unpacked within ``bounds``); a
        transient OSError is tried again (``DiskFaults.retry``). Regression (review s32): one
        EIO while reading the dropped holders' list at startup deleted the whole spill tier.

        Raises:
            FileNotFoundError: there is none (``NotRegularFile``: the name is no regular file).
            OSError: it cannot be read after ``READ_ATTEMPTS`` tries.
            ValueError: it is longer than ``max_bytes`` or is no msgpack within ``bounds``.
        """
        def read() -> bytes:
            fd = fmt.open_regular(name, self.dir.fd)
            with open(fd, "rb", buffering=0) as f:
                return f.read(max_bytes + 1)
        raw = self._faults.retry(read)
        if len(raw) > max_bytes:
            raise ValueError(f"longer than {max_bytes} bytes")
        return unpackb_within(raw, bounds, what)

    def _unsound_record(self, name: str, error: Exception, consequence: str) -> None:
        """Log (naming the error's type, whose message may be empty) and count a record file
        that cannot be trusted."""
        logger.warning("%s is unreadable or malformed (%s: %s): %s", self.root_dir / name,
                       type(error).__name__, error, consequence)
        self._counters["io_errors"] += 1

    def unlink_failed(self, failed: Sequence[tuple[str, int, OSError]]) -> None:
        """Files of a ``PendingRemoval`` that could not be deleted: counted against the budget and
        tried again later (``UnservedFiles.doom``; many are logged in one line)."""
        if len(failed) > 1:
            logger.warning("could not delete %d spill files of %s (%d B), kept counted and tried again later: %s",
                           len(failed), self.root_dir, sum(size for _, size, _ in failed), failed[0][2])
        for name, size, error in failed:
            self.unserved.doom(name, size, error, log=len(failed) == 1)

    def tombstoned(self, holder: str) -> bool:
        """Whether ``holder`` was dropped for good (``save_dropped``), before a restart too."""
        return bool(self._tombstones) and _digest(holder) in self._tombstones

    @property
    def tombstones_unsaved(self) -> bool:
        """Whether the last write of ``TOMBSTONE_FILE`` failed (tried again by each sweep)."""
        return self._tombstone_dirty

    def save_dropped(self, holders: Collection[str]) -> bool:
        """Add ``holders`` (dropped for good) to ``TOMBSTONE_FILE`` (the newest
        ``MAX_TOMBSTONES`` kept), so that a restart deletes their files instead of indexing
        them; returns whether it was written. A failed write is logged, counted (``io_errors``)
        and tried again at the next ``expire_quarantine``."""
        for holder in holders:
            digest = _digest(holder)
            self._tombstones.pop(digest, None)
            self._tombstones[digest] = None
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        return self._save_tombstones()

    def _save_tombstones(self) -> bool:
        try:
            fmt.write_small_file(TOMBSTONE_FILE, msgpack.packb(list(self._tombstones), use_bin_type=True),
                                 self.dir.fd)
        except OSError as exc:
            logger.warning("could not keep the dropped holders in %s (tried again at the next sweep): %s",
                           self.root_dir / TOMBSTONE_FILE, exc)
            self._counters["io_errors"] += 1
            self._tombstone_dirty = True
            return False
        self._tombstone_dirty = False
        return True

    def expire_quarantine(self, now_ns: int | None = None) -> int:
        """``UnservedFiles.expire``: delete quarantined files past their age limit; also tries
        again the deletions that failed (``UnservedFiles.retry_removals``) and a failed
        ``save_dropped``."""
        self.unserved.retry_removals()
        if self._tombstone_dirty:
            self._save_tombstones()
        return self.unserved.expire(now_ns)

    def _pending(self, files: list[tuple[str, int]]) -> PendingRemoval:
        """A ``PendingRemoval`` of ``files`` holding its own descriptor of the directory. When
        none can be had (EMFILE), none of its files is deleted by ``run``: each comes back as
        failed, counted as undeleted (against the budget) and tried again at each budget pass
        and sweep. Regression (review 31 F2): its files were in no book and never tried again,
        so a flushed file was indexed and served again at a restart, and a deleted tenant's
        files (its token ids) stayed."""
        try:
            return PendingRemoval(self.dir.dup(), files)
        except OSError as exc:
            logger.warning("cannot delete spill files of %s now (%s): kept counted, tried again later",
                           self.root_dir, exc)
            return PendingRemoval(None, files, exc)

    def _next_seq(self) -> int:
        """The next write sequence: rising, past every one found at the restart, close to the
        wall clock while the clock does not step back, and never past ``fmt.MAX_SEQ`` (what a
        reader takes as sound).

        A clock reading counts up to ``SEQ_CLOCK_MAX``, so a clock past it counts on by one with
        ``SEQ_HEADROOM`` sequences left. Only a header found at the bound (no ``DiskTier``
        writes one there now: a crafted file, or an older writer's) leaves none: the sequence
        then stays at ``fmt.MAX_SEQ`` (logged once), and a restart orders the files that share
        it by mtime, then name: a copy of a block may be picked over a newer one (its checksum
        still guards it), but no write is lost. Regression (review 31 F1): unbounded, every
        write after a file at ``MAX_SEQ`` (or under a clock past 2116) had a sequence the next
        restart read as corrupt, and every block spilled since was quarantined at each restart."""
        seq = max(self._seq + 1, min(time.time_ns(), SEQ_CLOCK_MAX))
        if seq > fmt.MAX_SEQ:
            if not self._seq_saturated:
                logger.warning("spill write sequence of %s is at its bound %d (a file claims it): new files "
                               "share it, a restart orders them by mtime", self.root_dir, fmt.MAX_SEQ)
                self._seq_saturated = True
            seq = fmt.MAX_SEQ
        self._seq = seq
        return seq

    def _write_file(
        self, namespace: str, hashes: list[bytes], blocks: np.ndarray | Sequence[np.ndarray], tokens: list[bytes]
    ) -> None:
        if self.budget_bytes == 0:
            return
        name = uuid.uuid4().hex + fmt.FILE_SUFFIX
        estimate = self._file_estimate(hashes, tokens)
        self._make_room_on_volume(estimate)
        for attempt in (1, 2):
            try:
                size_bytes = fmt.write_group(Path(name), hashes, blocks, namespace, self.block_format, tokens,
                                             seq=self._next_seq(), dir_fd=self.dir.fd)
                break
            except OSError as exc:
                if attempt == 1 and self._recover(exc, estimate):
                    continue
                logger.warning("spill write %s failed, %d blocks dropped: %s", self.root_dir / name, len(hashes), exc)
                self._counters["io_errors"] += 1
                return
        self._add_file(name, size_bytes, dict(zip(hashes, tokens)), namespace)

    def _recover(self, exc: OSError, estimate: int) -> bool:
        """Whether the write that failed with ``exc`` is worth one more try: the volume was full
        (room made, at least the file's size) or the directory was deleted (made again)."""
        if exc.errno in _NO_ROOM:
            self._counters["disk_full_writes"] += 1
            logger.warning("spill volume of %s is full below the budget (%d B held): making room for %d B",
                           self.root_dir, self.bytes_used + self.unserved.bytes, estimate)
            return self._evict(estimate, "disk_full_evicted_files") > 0
        if exc.errno == errno.ENOENT and self.dir.gone():
            return self._recreate_dir()
        return False

    def _recreate_dir(self) -> bool:
        """The directory was deleted while running: empty the index (its files went with it),
        make it again and hold the new one. False when it cannot be (logged)."""
        try:
            self.dir.reopen()
        except OSError as exc:
            logger.warning("spill dir %s was deleted and cannot be made again: %s", self.root_dir, exc)
            return False
        logger.warning("spill dir %s was deleted while running: made again; its %d files were lost",
                       self.root_dir, len(self._files))
        self._counters["dir_recreated"] += 1
        for name in list(self._files):
            self._forget(name)
        self.unserved.forget_all()
        return True

    def _file_estimate(self, hashes: list[bytes], tokens: list[bytes]) -> int:
        """An upper bound on the bytes a group file of these blocks takes on the volume."""
        header = 4096 + len(hashes) * (fmt.HASH_BYTES + fmt.CHECKSUM_BYTES + 16) + sum(map(len, tokens))
        return header + len(hashes) * self.block_format.block_nbytes

    def _make_room_on_volume(self, need: int) -> None:
        """Evict (unindexed files first, then ``fair_lru``) until the volume has ``need`` bytes
        free, if it has not (``fstatvfs`` of the directory; counted in
        ``disk_full_evicted_files``)."""
        try:
            vfs = os.fstatvfs(self.dir.fd)
        except OSError:
            return
        if not vfs.f_blocks:  # a file system that reports no sizes: ENOSPC alone tells (``_recover``)
            return
        free = vfs.f_bavail * vfs.f_frsize
        short = need + vfs.f_frsize - free
        if short > 0:
            self._evict(short, "disk_full_evicted_files")

    def _evict(self, need: int, counter: str) -> int:
        """Free ``need`` bytes: unindexed and undeleted files first, then indexed files by
        ``fair_lru`` (each counted in ``counter``); returns the bytes freed."""
        freed = self.unserved.free(need)
        for name in self._files.victims(need - freed):
            size = self._files[name].size_bytes
            if self._drop_file(name):
                freed += size
            self._counters[counter] += 1
        return freed

    def _add_file(self, name: str, size_bytes: int, blocks: dict[bytes, bytes], namespace: str) -> None:
        """Index a file's ``blocks`` (block_hash -> token_bytes) of ``namespace``."""
        spill_file = _SpillFile(self.root_dir / name, size_bytes, set(blocks))
        self._files.put(name, spill_file, holder_of(namespace), size_bytes)
        self.bytes_used += size_bytes
        for block_hash, tokens in blocks.items():
            self.index[block_hash] = name
            self.tokens[block_hash] = tokens
            self._emit("stored", block_hash, TIER_DISK)

    def _evict_over_budget(self) -> None:
        """Free what passes the budget: unindexed files first (they can never be served), then
        indexed files by ``fair_lru``."""
        self.unserved.expire()
        self._evict(self.bytes_used + self.unserved.bytes - self.budget_bytes, "evicted_files")

    def _drop_file(self, name: str) -> bool:
        """Forget file ``name`` and unlink it (True; one gone already counts). One that cannot
        be deleted stays counted and is tried again later (False)."""
        spill_file = self._forget(name)
        error = fmt.unlink_at(self.dir.fd, name)
        if error is not None:
            self.unserved.doom(name, spill_file.size_bytes, error)
            return False
        return True

    def _forget(self, name: str) -> _SpillFile:
        """Take a file out of the index (its blocks' "removed" events); the file is untouched."""
        spill_file = self._files.pop(name)
        self.bytes_used -= spill_file.size_bytes
        for block_hash in spill_file.live:
            del self.index[block_hash]
            del self.tokens[block_hash]
            self._emit("removed", block_hash, TIER_DISK)
        return spill_file

    def _read_file(self, name: str, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> list[int]:
        """Read ``hashes`` of file ``name`` into ``out[rows]``; returns the positions j (in
        ``hashes``) read and verified."""
        path = self._files[name].path
        try:
            self._faults.retry(lambda: self._read_into(name, hashes, out, rows))
        except SpillBlocksCorrupt as exc:
            self._drop_corrupt_blocks(name, [hashes[j] for j in exc.positions], exc)
            bad = set(exc.positions)
            return [j for j in range(len(hashes)) if j not in bad]
        except SpillCorruptError as exc:
            self._faults.quarantine(name, exc)
            self._forget(name)
            return []
        except fmt.NotRegularFile as exc:  # not ours: forgotten, never opened, never deleted
            logger.warning("spill file %s was replaced by something that is no regular file, its blocks "
                           "dropped (left as it is): %s", path, exc)
            self._counters["missing_files"] += 1
            self._forget(name)
            return []
        except FileNotFoundError as exc:
            logger.warning("spill file %s is gone, its blocks dropped: %s", path, exc)
            self._counters["missing_files"] += 1
            self._drop_file(name)
            return []
        except OSError as exc:
            logger.warning("spill read of %s failed %d times (a miss; file kept): %s",
                           path, READ_ATTEMPTS, exc)
            self._counters["io_errors"] += 1
            return []
        self._files.touch(name)
        return list(range(len(hashes)))

    def _read_into(self, name: str, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> None:
        """``fmt.read_blocks`` of ``hashes`` of file ``name`` into ``out[rows]``; on
        ``SpillBlocksCorrupt`` the verified rows are in place before it propagates."""
        fd = self.dir.fd
        if rows == list(range(rows[0], rows[0] + len(rows))):  # read straight into place
            fmt.read_blocks(name, self.block_format, hashes, out[rows[0] : rows[0] + len(rows)], fd)
            return
        staged = np.empty((len(hashes), *self.block_format.shape), self.block_format.np_dtype)
        try:
            fmt.read_blocks(name, self.block_format, hashes, staged, fd)
        except SpillBlocksCorrupt:
            out[rows] = staged
            raise
        out[rows] = staged

    def _drop_corrupt_blocks(self, name: str, bad: list[bytes], exc: SpillBlocksCorrupt) -> None:
        """Take the blocks ``bad`` of file ``name`` out of the index ("removed" events); the
        file keeps serving its other blocks, or is quarantined when none is left."""
        spill_file = self._files[name]
        logger.warning("spill file %s: %d blocks failed their checksums and were dropped, its other "
                       "%d kept: %s", spill_file.path, len(bad), len(spill_file.live) - len(bad), exc)
        self._counters["corrupt_reads"] += 1
        self._counters["corrupt_blocks"] += len(bad)
        for block_hash in bad:
            spill_file.live.discard(block_hash)
            del self.index[block_hash]
            del self.tokens[block_hash]
            self._emit("removed", block_hash, TIER_DISK)
        if spill_file.live:
            self._files.touch(name)
        else:
            self._forget(name)
            self._faults.set_aside(name)

    def _load_tombstones(self) -> bool:
        """Read the holders ``TOMBSTONE_FILE`` lists (none when it is missing); False when it
        cannot be read (after ``READ_ATTEMPTS`` tries of a transient error), is malformed or is
        no regular file (logged, counted in ``io_errors``): which holders were dropped is
        unknown then, so the caller serves nothing it finds (``_rebuild``). Regression
        (session 32): such a list was ignored, and a restart served the files of every holder
        it had named."""
        try:
            digests = self._read_record(TOMBSTONE_FILE, _MAX_TOMBSTONE_BYTES, _TOMBSTONE_BOUNDS,
                                        "the dropped holders")
            if not isinstance(digests, list) or not all(isinstance(d, bytes) and len(d) == 32 for d in digests):
                raise ValueError("not a list of holder digests")
        except fmt.NotRegularFile as exc:
            error: Exception = exc
        except FileNotFoundError:
            return True
        except (OSError, ValueError) as exc:  # msgpack's errors are ValueErrors
            error = exc
        else:
            self._tombstones = OrderedDict.fromkeys(digests)
            return True
        self._unsound_record(TOMBSTONE_FILE, error, "every group file found counts as a dropped holder's, "
                                                    "deleted, none indexed")
        return False

    def _rebuild(self) -> None:
        flushed = self._load_flush()
        if flushed is not None and flushed != _FLUSH_UNKNOWN:  # every later write is past it
            self._seq, self._flushed_seq = flushed, flushed
        try:
            listed = self._faults.retry(lambda: fmt.list_group_names(self.dir.fd, links=True))
        except OSError as exc:
            logger.warning("cannot list spill dir %s (starting with an empty index): %s",
                           self.root_dir, exc)
            self._counters["io_errors"] += 1
            return
        if not self._load_tombstones():  # which holders were dropped is unknown: a flush, in effect
            flushed = _FLUSH_UNKNOWN
        self.unserved.scan_quarantine()  # first: files quarantined below are its newest
        headers = []
        for name, mtime_ns, link in listed:
            if link:  # never followed: an unindexed name, deleted first when the budget needs room
                logger.warning("spill file %s is a symbolic link: not followed, not indexed", self.root_dir / name)
                self.unserved.add_unindexed(name)
                continue
            header = self._faults.read_index_header(name)
            if header is None:
                continue
            self._seq = max(self._seq, header.seq)
            if self.tombstoned(holder_of(header.namespace)):  # a holder dropped for good: deleted again
                self._counters["tombstoned_files"] += 1
                self._unlink(name, header.file_bytes)
                continue
            if flushed is not None and header.seq <= flushed:  # flushed before: deleted again
                self._counters["flushed_files"] += 1
                self._unlink(name, header.file_bytes)
                continue
            headers.append((header.seq, mtime_ns, name, header))
        headers.sort(key=lambda item: item[:3])  # by write sequence (files of before it: by mtime)
        newest: dict[bytes, str] = {}  # block_hash -> the newest file holding it
        for _, _, name, header in headers:
            newest.update(dict.fromkeys(header.block_hashes, name))
        for _, _, name, header in headers:  # oldest first: the newest file is the most recently used
            blocks = zip(header.block_hashes, header.block_tokens)
            live = {h: tokens for h, tokens in blocks if newest[h] == name}
            if not live:
                self._unlink(name, header.file_bytes)  # every block is held by a newer file
                continue
            self._add_file(name, header.file_bytes, live, header.namespace)
        if flushed == _FLUSH_UNKNOWN and self._record_flush() is not None:
            # recorded past every file found (deleted) and the clock: a file whose unlink failed
            # stays covered, so the dropped holders' list (its holders unknown: their files are
            # gone) is written again too, and the next restart reads both as sound
            self._save_tombstones()
        self._evict_over_budget()

    def _unlink(self, name: str, size: int) -> None:
        """Unlink an unindexed group file; one that cannot be deleted stays counted and is
        tried again later."""
        error = fmt.unlink_at(self.dir.fd, name)
        if error is not None:
            self.unserved.doom(name, size, error)


def _digest(holder: str) -> bytes:
    return hashlib.sha256(holder.encode("utf-8", "surrogatepass")).digest()
