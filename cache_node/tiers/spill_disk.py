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
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_node.tiers import spill_format as fmt
from cache_node.tiers.fair_lru import FairLRU, HolderWeights, holder_of
from cache_node.tiers.spill_disk_faults import READ_ATTEMPTS, DiskFaults
from cache_node.tiers.spill_format import BlockFormat, SpillBlocksCorrupt, SpillCorruptError
from cache_node.tiers.spill_unserved import UnservedFiles

logger = logging.getLogger(__name__)

TIER_DISK = "spill_disk"
Emit = Callable[[str, bytes, str], None]  # (event, block_hash, tier)


@dataclass
class _SpillFile:
    path: Path
    size_bytes: int
    live: set[bytes]  # hashes of this file that the index still points at


class DiskTier:
    """Group files under ``root_dir`` holding at most ``budget_bytes`` of files, the files it
    does not serve (``unserved``: unindexed, quarantined) included.

    Args:
        root_dir: directory of the group files (created if missing).
        block_format: shape, dtype and kv_format of every block.
        budget_bytes: bytes of files kept (0: writes are dropped).
        max_blocks_per_file: most blocks per group file.
        emit: receives "stored"/"removed" events of this tier.
        counters: shared fault counters (``corrupt_reads``: reads that found a file or blocks
            corrupt; ``corrupt_blocks``: blocks dropped alone for a failed checksum;
            ``quarantined_files``, ``io_errors``, ``io_retries``, ``missing_files``,
            ``skipped_files``, ``evicted_files``, ``removed_unindexed_files``,
            ``removed_quarantined_files``).
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
        self.unserved = UnservedFiles(root_dir, budget_bytes, counters)
        self._faults = DiskFaults(block_format, self.unserved, counters)
        self._rebuild()

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
        file dropped from the index; a transient OSError (after retries) keeps the file. A
        block that fails its checksum misses and is dropped; the file's other rows are read.
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

    def flush(self) -> None:
        """Drop every file: the indexed ones, the others in ``root_dir`` and the quarantined
        ones (their headers hold prompts' token ids)."""
        for name in list(self._files):
            self._drop_file(name)
        for path in fmt.list_group_files(self.root_dir):
            fmt.remove_file(path)
        self.unserved.forget_unindexed()
        self.unserved.clear_quarantine()

    def drop_holders(self, holders: Collection[str]) -> int:
        """Delete every indexed file of each of ``holders`` (namespaces without their salt:
        ``holder_of``), with their blocks' "removed" events; returns the blocks dropped. Files
        it does not serve (unindexed, quarantined) whose verified header names one of them
        are deleted too (``UnservedFiles.drop_holders``; counted as removed files)."""
        names = [name for name in self._files if self._files.holder(name) in holders]
        dropped = 0
        for name in names:
            dropped += len(self._files[name].live)
            self._drop_file(name)
        self.unserved.drop_holders(holders)
        return dropped

    def expire_quarantine(self, now_ns: int | None = None) -> int:
        """``UnservedFiles.expire``: delete quarantined files past their age limit."""
        return self.unserved.expire(now_ns)

    def _write_file(
        self, namespace: str, hashes: list[bytes], blocks: np.ndarray | Sequence[np.ndarray], tokens: list[bytes]
    ) -> None:
        if self.budget_bytes == 0:
            return
        name = uuid.uuid4().hex + fmt.FILE_SUFFIX
        path = self.root_dir / name
        try:
            size_bytes = fmt.write_group(path, hashes, blocks, namespace, self.block_format, tokens)
        except OSError as exc:
            logger.warning("spill write %s failed, %d blocks dropped: %s", path, len(hashes), exc)
            self._counters["io_errors"] += 1
            return
        self._add_file(name, path, size_bytes, dict(zip(hashes, tokens)), namespace)

    def _add_file(
        self, name: str, path: Path, size_bytes: int, blocks: dict[bytes, bytes], namespace: str
    ) -> None:
        """Index a file's ``blocks`` (block_hash -> token_bytes) of ``namespace``."""
        self._files.put(name, _SpillFile(path, size_bytes, set(blocks)), holder_of(namespace), size_bytes)
        self.bytes_used += size_bytes
        for block_hash, tokens in blocks.items():
            self.index[block_hash] = name
            self.tokens[block_hash] = tokens
            self._emit("stored", block_hash, TIER_DISK)

    def _evict_over_budget(self) -> None:
        """Free what passes the budget: unindexed files first (they can never be served), then
        indexed files by ``fair_lru``."""
        self.unserved.expire()
        need = self.bytes_used + self.unserved.bytes - self.budget_bytes
        need -= self.unserved.free(need)
        for name in self._files.victims(need):
            self._drop_file(name)
            self._counters["evicted_files"] += 1

    def _drop_file(self, name: str) -> None:
        fmt.remove_file(self._forget(name).path)  # a no-op when already gone

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
            self._faults.retry(lambda: self._read_into(path, hashes, out, rows))
        except SpillBlocksCorrupt as exc:
            self._drop_corrupt_blocks(name, [hashes[j] for j in exc.positions], exc)
            bad = set(exc.positions)
            return [j for j in range(len(hashes)) if j not in bad]
        except SpillCorruptError as exc:
            self._faults.quarantine(path, exc)
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

    def _read_into(self, path: Path, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> None:
        """``fmt.read_blocks`` of ``hashes`` into ``out[rows]``; on ``SpillBlocksCorrupt`` the
        verified rows are in place before it propagates."""
        if rows == list(range(rows[0], rows[0] + len(rows))):  # read straight into place
            fmt.read_blocks(path, self.block_format, hashes, out[rows[0] : rows[0] + len(rows)])
            return
        staged = np.empty((len(hashes), *self.block_format.shape), self.block_format.np_dtype)
        try:
            fmt.read_blocks(path, self.block_format, hashes, staged)
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
            self._faults.set_aside(spill_file.path)

    def _rebuild(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        try:
            paths = self._faults.retry(lambda: fmt.list_group_files(self.root_dir))
        except OSError as exc:
            logger.warning("cannot list spill dir %s (starting with an empty index): %s",
                           self.root_dir, exc)
            self._counters["io_errors"] += 1
            return
        self.unserved.scan_quarantine()  # first: files quarantined below are its newest
        headers = [(path, header) for path in paths if (header := self._faults.read_index_header(path))]
        newest: dict[bytes, Path] = {}  # block_hash -> the newest file holding it
        for path, header in headers:
            newest.update(dict.fromkeys(header.block_hashes, path))
        for path, header in headers:  # oldest first: the newest file is the most recently used
            blocks = zip(header.block_hashes, header.block_tokens)
            live = {h: tokens for h, tokens in blocks if newest[h] == path}
            if not live:
                fmt.remove_file(path)  # every block is held by a newer file
                continue
            self._add_file(path.name, path, header.file_bytes, live, header.namespace)
        self._evict_over_budget()
