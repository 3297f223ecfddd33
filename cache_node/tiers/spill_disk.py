"""The disk tier of a spill store: an index of group files with a byte budget, LRU by file.

A file's recency is the last touch of any of its blocks; eviction drops whole files (evicting
single blocks of a partly live file would free no bytes), the least recently used file of the
tenant holding the most bytes first (``fair_lru``; a file holds one namespace's blocks). The index is rebuilt from the file
headers on construction, so a restarted spill node keeps its disk hits. Not thread-safe: the
owning ``SpillStore`` serializes calls.

Faults: only a verified checksum or format failure (``SpillCorruptError``) takes a file out
of service, and it is moved into the quarantine folder (``UnservedFiles.quarantine``). Any
other ``OSError`` (EIO, EMFILE, EACCES, ENOSPC...) is transient: it is retried
``READ_ATTEMPTS`` times with a short backoff, then counted (``io_errors``) and the read is a
miss, the file staying on disk and in the index; a file whose header cannot be read at a
restart stays on disk unindexed. A file that is gone (ENOENT) is dropped from the index
(``missing_files``). A file of another format version or block format is skipped at a restart
(``skipped_files``): left on disk, never indexed.

The budget bounds the whole directory: unindexed and quarantined files count against it
(``spill_unserved``), and unindexed ones, which can never be served, are deleted (oldest
first) before any indexed file is evicted; the quarantine keeps only its newest files.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from cache_node.tiers import spill_format as fmt
from cache_node.tiers.fair_lru import FairLRU, holder_of
from cache_node.tiers.spill_format import BlockFormat, SpillCorruptError, SpillFormatMismatch
from cache_node.tiers.spill_unserved import UnservedFiles

logger = logging.getLogger(__name__)

TIER_DISK = "spill_disk"
READ_ATTEMPTS = 3  # tries of one file read or header read before a transient OSError is a miss
RETRY_BACKOFF_S = 0.005  # sleep before retry k (k = 1, 2, ...): RETRY_BACKOFF_S * 2**(k - 1)
Emit = Callable[[str, bytes, str], None]  # (event, block_hash, tier)
_T = TypeVar("_T")


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
        counters: shared fault counters (``corrupt_reads``, ``quarantined_files``, ``io_errors``,
            ``io_retries``, ``missing_files``, ``skipped_files``, ``evicted_files``,
            ``removed_unindexed_files``, ``removed_quarantined_files``).
    """

    def __init__(
        self,
        root_dir: Path,
        block_format: BlockFormat,
        budget_bytes: int,
        max_blocks_per_file: int,
        emit: Emit,
        counters: Counter[str],
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
        self._files: FairLRU[str, _SpillFile] = FairLRU()
        self.bytes_used = 0  # bytes of the files in the index
        self.unserved = UnservedFiles(root_dir, budget_bytes, counters)
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
        file dropped from the index; a transient OSError (after retries) keeps the file.
        """
        by_file: dict[str, list[int]] = {}
        for k, block_hash in enumerate(hashes):
            by_file.setdefault(self.index[block_hash], []).append(k)
        done: list[int] = []
        for name, ks in by_file.items():
            if self._read_file(name, [hashes[k] for k in ks], out, [rows[k] for k in ks]):
                done.extend(rows[k] for k in ks)
        return sorted(done)

    def touch(self, block_hash: bytes) -> None:
        self._files.touch(self.index[block_hash])

    def flush(self) -> None:
        """Drop every file, including files in ``root_dir`` not in the index."""
        for name in list(self._files):
            self._drop_file(name)
        for path in fmt.list_group_files(self.root_dir):
            fmt.remove_file(path)
        self.unserved.forget_unindexed()

    def drop_holders(self, holders: Collection[str]) -> int:
        """Delete every indexed file of each of ``holders`` (namespaces without their salt:
        ``holder_of``), with their blocks' "removed" events; returns the blocks dropped. Files
        it does not serve (unindexed, quarantined) are not opened and stay until the budget
        evicts them."""
        names = [name for name in self._files if self._files.holder(name) in holders]
        dropped = 0
        for name in names:
            dropped += len(self._files[name].live)
            self._drop_file(name)
        return dropped

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

    def _read_file(self, name: str, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> bool:
        path = self._files[name].path
        try:
            self._retry(lambda: self._read_into(path, hashes, out, rows))
        except SpillCorruptError as exc:
            self._quarantine(path, exc)
            self._forget(name)
            return False
        except FileNotFoundError as exc:
            logger.warning("spill file %s is gone, its blocks dropped: %s", path, exc)
            self._counters["missing_files"] += 1
            self._drop_file(name)
            return False
        except OSError as exc:
            logger.warning("spill read of %s failed %d times (a miss; file kept): %s",
                           path, READ_ATTEMPTS, exc)
            self._counters["io_errors"] += 1
            return False
        self._files.touch(name)
        return True

    def _read_into(self, path: Path, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> None:
        if rows == list(range(rows[0], rows[0] + len(rows))):  # read straight into place
            fmt.read_blocks(path, self.block_format, hashes, out[rows[0] : rows[0] + len(rows)])
        else:
            out[rows] = fmt.read_blocks(path, self.block_format, hashes)

    def _retry(self, call: Callable[[], _T]) -> _T:
        """``call()``, retried on a transient OSError (not ENOENT) up to ``READ_ATTEMPTS`` times."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return call()
            except FileNotFoundError:
                raise
            except OSError:
                if attempt == READ_ATTEMPTS:
                    raise
                self._counters["io_retries"] += 1
                time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _rebuild(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        try:
            paths = self._retry(lambda: fmt.list_group_files(self.root_dir))
        except OSError as exc:
            logger.warning("cannot list spill dir %s (starting with an empty index): %s",
                           self.root_dir, exc)
            self._counters["io_errors"] += 1
            return
        self.unserved.scan_quarantine()  # first: files quarantined below are its newest
        for path in paths:
            self._index_file(path)
        self._evict_over_budget()

    def _index_file(self, path: Path) -> None:
        try:
            header = self._retry(lambda: fmt.read_header(path))
        except SpillCorruptError as exc:
            self._quarantine(path, exc)
            return
        except SpillFormatMismatch as exc:
            logger.warning("skipping spill file %s: %s", path, exc)
            self._counters["skipped_files"] += 1
            self.unserved.add_unindexed(path)
            return
        except FileNotFoundError:
            return  # vanished since the listing
        except OSError as exc:
            logger.warning("spill file %s not indexed (left on disk for the next restart, "
                           "deleted first when the disk budget needs room): %s", path, exc)
            self._counters["io_errors"] += 1
            self.unserved.add_unindexed(path)
            return
        if not header.matches(self.block_format):
            logger.warning("skipping spill file %s of another block format", path)
            self._counters["skipped_files"] += 1
            self.unserved.add_unindexed(path)
            return
        blocks = zip(header.block_hashes, header.block_tokens)
        live = {h: tokens for h, tokens in blocks if h not in self.index}
        if not live:
            fmt.remove_file(path)  # every block is held by an older file
            return
        self._add_file(path.name, path, header.file_bytes, live, header.namespace)

    def _quarantine(self, path: Path, exc: SpillCorruptError) -> None:
        """Count a verified corruption and move the file aside (``UnservedFiles.quarantine``)."""
        logger.warning("spill file %s is corrupt, quarantined: %s", path, exc)
        self._counters["corrupt_reads"] += 1
        if self.unserved.quarantine(path):
            self._counters["quarantined_files"] += 1
