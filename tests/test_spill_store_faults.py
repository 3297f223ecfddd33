"""SpillStore data faults and restarts: every fault is a miss, never an error or wrong bytes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from services import spill_format
from services.spill_format import BlockFormat
from services.spill_store import SpillEvent, SpillStore
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, make_blocks


def disk_store(root: Path, num_blocks: int = 4) -> tuple[SpillStore, Path]:
    """A store whose ``num_blocks`` blocks sit in one group file; returns (store, file)."""
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(num_blocks)), make_blocks(range(num_blocks)), "ns")
    (path,) = files_in(root)
    store.take_events()
    return store, path


def assert_all_miss(store: SpillStore, path: Path, fault: str) -> None:
    hits = store.get(hashes_of(range(4)))
    assert (hits.hashes, hits.tiers, hits.blocks.shape) == ([], [], (0, *FMT.shape))
    assert store.contains(hashes_of(range(4))) == [None] * 4
    stats = store.stats()
    assert (stats[fault], stats["misses"], stats["files"], stats["disk_bytes"]) == (1, 4, 0, 0)
    assert not path.exists()
    assert sorted(store.take_events()) == sorted(
        SpillEvent("removed", h, "spill_disk") for h in hashes_of(range(4))
    )


def test_deleted_file_is_a_miss(tmp_path: Path) -> None:
    """Fault: a group file deleted behind the store's back (operator, tmp cleaner)."""
    store, path = disk_store(tmp_path)
    path.unlink()
    assert_all_miss(store, path, "io_errors")


def test_truncated_file_is_a_miss(tmp_path: Path) -> None:
    """Fault: a group file cut short (crash during copy, full disk)."""
    store, path = disk_store(tmp_path)
    os.truncate(path, path.stat().st_size - 7)
    assert_all_miss(store, path, "corrupt_reads")


def test_flipped_bytes_are_a_miss_by_checksum(tmp_path: Path) -> None:
    """Fault: bit rot in the payload; the block checksum must catch it, not return wrong bytes."""
    store, path = disk_store(tmp_path)
    data = bytearray(path.read_bytes())
    data[-20:-10] = bytes(b ^ 0x5A for b in data[-20:-10])  # inside block 3
    path.write_bytes(bytes(data))
    assert_all_miss(store, path, "corrupt_reads")


def test_header_garbage_is_a_miss(tmp_path: Path) -> None:
    """Fault: garbage written over the header (magic, length and msgpack map)."""
    store, path = disk_store(tmp_path)
    data = bytearray(path.read_bytes())
    data[0:64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    assert_all_miss(store, path, "corrupt_reads")


def test_reader_raising_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: the OS read path fails (EIO from a dying disk) while opening the file."""
    store, path = disk_store(tmp_path)

    def failing_open(*args: object, **kwargs: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(spill_format, "open", failing_open, raising=False)
    assert_all_miss(store, path, "io_errors")


def test_ram_hits_survive_a_disk_fault_in_the_same_get(tmp_path: Path) -> None:
    """Fault: one bad file must not fail the whole batched get."""
    store = SpillStore(tmp_path, FMT, ram_bytes=2 * BLOCK, disk_bytes=DISK, demote_low_watermark=0)
    store.put(hashes_of(range(3)), make_blocks(range(3)), "ns")  # 0..2 to disk
    store.put(hashes_of([3]), make_blocks([3]), "ns")  # stays in RAM
    files_in(tmp_path)[0].unlink()
    hits = store.get(hashes_of(range(4)))
    assert (hits.hashes, hits.tiers) == (hashes_of([3]), ["spill_ram"])
    assert hits.blocks.tobytes() == make_blocks([3]).tobytes()


def test_restart_rebuilds_index_without_rewriting_files(tmp_path: Path) -> None:
    """Fault: a restart that loses disk hits, or rewrites (re-fsyncs) every file on startup."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(128)), make_blocks(range(128)), "ns")
    before = {
        f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size)
        for f in files_in(tmp_path)
    }
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(128))) == ["spill_disk"] * 128
    hits = restarted.get(hashes_of(range(128)))
    assert hits.blocks.tobytes() == make_blocks(range(128)).tobytes()
    after = {
        f.name: (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size)
        for f in files_in(tmp_path)
    }
    assert after == before
    assert restarted.stats()["disk_bytes"] == store.stats()["disk_bytes"]
    events = restarted.take_events()
    assert sorted(events) == sorted(
        SpillEvent("stored", h, "spill_disk") for h in hashes_of(range(128))
    )


def test_restart_drops_corrupt_and_temp_files(tmp_path: Path) -> None:
    """Fault: a crash mid-write leaves a temp file; garbage under a group name."""
    disk_store(tmp_path)
    (tmp_path / (spill_format.TEMP_PREFIX + "x.part")).write_bytes(b"half a file")
    (tmp_path / ("junk" + spill_format.FILE_SUFFIX)).write_bytes(b"garbage")
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.match_prefix(hashes_of(range(4))) == 4
    assert len(os.listdir(tmp_path)) == 1
    assert restarted.stats()["corrupt_reads"] == 1


def test_restart_skips_files_of_another_block_format(tmp_path: Path) -> None:
    disk_store(tmp_path)
    other = BlockFormat(shape=FMT.shape, dtype="float16", kv_format="fp16")
    restarted = SpillStore(tmp_path, other, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of([0])) == [None]
    assert len(files_in(tmp_path)) == 1


def test_restart_with_smaller_disk_budget_evicts_oldest_files(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=2)
    for pair in ([0, 1], [2, 3], [4, 5]):
        store.put(hashes_of(pair), make_blocks(pair), "ns")
    write_order = {block_hash: age for age, block_hash in enumerate(hashes_of([0, 2, 4]))}
    for path in files_in(tmp_path):  # make mtimes follow write order exactly
        age = write_order[spill_format.read_header(path).block_hashes[0]]
        os.utime(path, ns=(10**18 + age, 10**18 + age))
    pair_bytes = store.stats()["disk_bytes"] // 3
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=2 * pair_bytes)
    assert restarted.contains(hashes_of(range(6))) == [None, None] + ["spill_disk"] * 4


def test_concurrent_puts_and_gets_keep_bytes_exact(tmp_path: Path) -> None:
    """Fault: unsynchronized state under a threaded actor (lost blocks, torn reads)."""
    store = SpillStore(tmp_path, FMT, ram_bytes=8 * BLOCK, disk_bytes=DISK, max_blocks_per_file=4)
    errors: list[str] = []

    def worker(start: int) -> None:
        for i in range(start, start + 40, 4):
            store.put(hashes_of(range(i, i + 4)), make_blocks(range(i, i + 4)), "ns")
            hits = store.get(hashes_of(range(i, i + 4)))
            if hits.blocks.tobytes() != make_blocks(range(i, i + 4)).tobytes():
                errors.append(f"wrong bytes at {i}")

    threads = [threading.Thread(target=worker, args=(t * 1000,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = store.stats()
    assert stats["blocks_spill_ram"] + stats["blocks_spill_disk"] == 160
    assert np.array_equal(store.get(hashes_of([3036])).blocks, make_blocks([3036]))
