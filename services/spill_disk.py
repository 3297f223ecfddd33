"""The disk tier of a spill store: an index of group files with a byte budget, LRU by file.

A file's recency is the last touch of any of its blocks; eviction drops whole files (evicting
single blocks of a partly live file would free no bytes). The index is rebuilt from the file
headers on construction, so a restarted spill node keeps its disk hits. Not thread-safe: the
owning ``SpillStore`` serializes calls.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services import spill_format as fmt
from services.spill_format import BlockFormat, SpillCorruptError

logger = logging.getLogger(__name__)

TIER_DISK = "spill_disk"
Emit = Callable[[str, bytes, str], None]  # (event, block_hash, tier)


@dataclass
class _SpillFile:
    path: Path
    size_bytes: int
    live: set[bytes]  # hashes of this file that the index still points at


class DiskTier:
    """Group files under ``root_dir`` holding at most ``budget_bytes`` of files.

    Args:
        root_dir: directory of the group files (created if missing).
        block_format: shape, dtype and kv_format of every block.
        budget_bytes: bytes of files kept (0: writes are dropped).
        max_blocks_per_file: most blocks per group file.
        emit: receives "stored"/"removed" events of this tier.
        counters: shared fault counters (``corrupt_reads``, ``io_errors``, ``evicted_files``).
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
        self._files: OrderedDict[str, _SpillFile] = OrderedDict()  # LRU first
        self.bytes_used = 0
        self._rebuild()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_files(self) -> int:
        return len(self._files)

    def write(self, namespace: str, hashes: Sequence[bytes], blocks: np.ndarray) -> None:
        """Write ``blocks`` (n, *shape) as group files of at most ``max_blocks_per_file``."""
        step = self.max_blocks_per_file
        for start in range(0, len(hashes), step):
            self._write_file(namespace, list(hashes[start : start + step]), blocks[start : start + step])
            self._evict_over_budget()

    def read(self, hashes: Sequence[bytes], out: np.ndarray, rows: Sequence[int]) -> list[int]:
        """Read ``hashes`` (all held) into ``out[rows]``; returns the rows read successfully.

        A file that is missing, truncated, unreadable or corrupt is dropped and its rows miss.
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
        self._files.move_to_end(self.index[block_hash])

    def flush(self) -> None:
        """Drop every file, including files in ``root_dir`` not in the index."""
        for name in list(self._files):
            self._drop_file(name)
        for path in fmt.list_group_files(self.root_dir):
            fmt.remove_file(path)

    def _write_file(self, namespace: str, hashes: list[bytes], blocks: np.ndarray) -> None:
        if self.budget_bytes == 0:
            return
        name = uuid.uuid4().hex + fmt.FILE_SUFFIX
        path = self.root_dir / name
        try:
            size_bytes = fmt.write_group(path, hashes, blocks, namespace, self.block_format)
        except OSError as exc:
            logger.warning("spill write %s failed, %d blocks dropped: %s", path, len(hashes), exc)
            self._counters["io_errors"] += 1
            return
        self._add_file(name, path, size_bytes, hashes)

    def _add_file(self, name: str, path: Path, size_bytes: int, hashes: list[bytes]) -> None:
        self._files[name] = _SpillFile(path, size_bytes, set(hashes))
        self.bytes_used += size_bytes
        for block_hash in hashes:
            self.index[block_hash] = name
            self._emit("stored", block_hash, TIER_DISK)

    def _evict_over_budget(self) -> None:
        while self._files and self.bytes_used > self.budget_bytes:
            self._drop_file(next(iter(self._files)))
            self._counters["evicted_files"] += 1

    def _drop_file(self, name: str) -> None:
        spill_file = self._files.pop(name)
        self.bytes_used -= spill_file.size_bytes
        for block_hash in spill_file.live:
            del self.index[block_hash]
            self._emit("removed", block_hash, TIER_DISK)
        fmt.remove_file(spill_file.path)  # a no-op when already gone

    def _read_file(self, name: str, hashes: list[bytes], out: np.ndarray, rows: list[int]) -> bool:
        try:
            path = self._files[name].path
            if rows == list(range(rows[0], rows[0] + len(rows))):  # read straight into place
                fmt.read_blocks(path, self.block_format, hashes, out[rows[0] : rows[0] + len(rows)])
            else:
                out[rows] = fmt.read_blocks(path, self.block_format, hashes)
            self._files.move_to_end(name)
            return True
        except (SpillCorruptError, OSError) as exc:
            self._count_fault(exc, self._files[name].path)
            self._drop_file(name)
            return False

    def _rebuild(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        for path in fmt.list_group_files(self.root_dir):
            self._index_file(path)
        self._evict_over_budget()

    def _index_file(self, path: Path) -> None:
        try:
            header = fmt.read_header(path)
        except (SpillCorruptError, OSError) as exc:
            self._count_fault(exc, path)
            return
        if not header.matches(self.block_format):
            logger.warning("skipping spill file %s of another block format", path)
            return
        live = [h for h in dict.fromkeys(header.block_hashes) if h not in self.index]
        if not live:
            fmt.remove_file(path)  # every block is held by an older file
            return
        self._add_file(path.name, path, header.file_bytes, live)

    def _count_fault(self, exc: Exception, path: Path) -> None:
        """Count a read fault and delete the file: its blocks are lost either way."""
        fault = "corrupt_reads" if isinstance(exc, SpillCorruptError) else "io_errors"
        logger.warning("spill file %s dropped (%s): %s", path, fault, exc)
        self._counters[fault] += 1
        fmt.remove_file(path)
