"""SpillStore data faults and restarts: every fault is a miss, never an error or wrong bytes.

A block failing its checksum is dropped alone, its file serving the rest; a file whose header,
length or format fails is quarantined (moved aside, not deleted: the quarantine's bounds are in
tests/test_spill_unserved.py); a transient OSError is retried, counted and a miss, and leaves
the file where it was.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from cache_node.tiers import spill_disk_faults, spill_format
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillEvent, SpillStore
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, listed, make_blocks


def disk_store(root: Path, num_blocks: int = 4) -> tuple[SpillStore, Path]:
    """A store whose ``num_blocks`` blocks sit in one group file; returns (store, file)."""
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(num_blocks)), make_blocks(range(num_blocks)), "ns")
    (path,) = files_in(root)
    store.take_events()
    return store, path


def assert_all_miss(store: SpillStore, path: Path, fault: str, faults: int = 1) -> None:
    """Every block of ``path`` misses and is dropped from the index, ``faults`` counted as
    ``fault``."""
    misses = store.stats()["misses"] + 4
    hits = store.get(hashes_of(range(4)))
    assert (hits.hashes, hits.tiers, hits.blocks.shape) == ([], [], (0, *FMT.shape))
    assert store.contains(hashes_of(range(4))) == [None] * 4
    stats = store.stats()
    assert (stats[fault], stats["misses"], stats["files"], stats["disk_bytes"]) == (faults, misses, 0, 0)
    assert not path.exists()
    assert sorted(store.take_events()) == sorted(
        SpillEvent("removed", h, "spill_disk") for h in hashes_of(range(4))
    )


def assert_quarantined(store: SpillStore, path: Path, damaged: bytes, corrupt_reads: int = 1) -> None:
    """``path``'s blocks miss; the file is moved, byte for byte, into the quarantine folder."""
    assert_all_miss(store, path, "corrupt_reads", corrupt_reads)
    moved = path.parent / spill_format.QUARANTINE_DIR / path.name
    assert moved.read_bytes() == damaged
    assert store.stats()["quarantined_files"] == 1


def test_deleted_file_is_a_miss(tmp_path: Path) -> None:
    """Fault: a group file deleted behind the store's back (operator, tmp cleaner)."""
    store, path = disk_store(tmp_path)
    path.unlink()
    assert_all_miss(store, path, "missing_files")


def test_truncated_file_is_quarantined(tmp_path: Path) -> None:
    """Fault: a group file cut short (crash during copy, full disk)."""
    store, path = disk_store(tmp_path)
    os.truncate(path, path.stat().st_size - 7)
    assert_quarantined(store, path, path.read_bytes())


def flip_blocks(path: Path, blocks: list[int]) -> bytes:
    """Flip 10 bytes inside the payload of each of ``blocks`` (of 4) of group file ``path``;
    returns the file's new bytes."""
    data = bytearray(path.read_bytes())
    payload = len(data) - 4 * BLOCK
    for k in blocks:
        at = payload + k * BLOCK + 50
        data[at : at + 10] = bytes(b ^ 0x5A for b in data[at : at + 10])
    path.write_bytes(bytes(data))
    return bytes(data)


def test_a_block_failing_its_checksum_is_dropped_and_its_file_keeps_serving(tmp_path: Path) -> None:
    """issue 18 fault 5: bit rot in block 3's payload is caught by its checksum and never
    returned as KV. Regression (review 26b F3): the whole file was quarantined, so blocks 0-2,
    intact under their own checksums, were dropped with it (up to 1,024 blocks a file). Now only
    block 3 is dropped (counted, its "removed" event), and the file stays, unchanged, serving
    the others, with no second corrupt read."""
    store, path = disk_store(tmp_path)
    damaged = flip_blocks(path, [3])
    hits = store.get(hashes_of(range(4)))
    assert (hits.hashes, hits.tiers) == (hashes_of(range(3)), ["spill_disk"] * 3)
    assert hits.blocks.tobytes() == make_blocks(range(3)).tobytes()
    assert store.take_events() == [SpillEvent("removed", hashes_of([3])[0], "spill_disk")]
    assert store.contains(hashes_of(range(4))) == ["spill_disk"] * 3 + [None]
    hits = store.get(hashes_of([2, 9, 0, 1]))  # rows 0, 2, 3: read through a staging buffer
    assert hits.blocks.tobytes() == make_blocks([2, 0, 1]).tobytes()
    stats = store.stats()
    assert (stats["corrupt_reads"], stats["corrupt_blocks"], stats["quarantined_files"]) == (1, 1, 0)
    assert (stats["files"], stats["blocks_spill_disk"], stats["disk_bytes"]) == (1, 3, len(damaged))
    assert (stats["hits_spill_disk"], stats["misses"]) == (6, 2)
    assert path.read_bytes() == damaged and not (tmp_path / spill_format.QUARANTINE_DIR).exists()


def test_blocks_failing_in_a_scattered_read_are_dropped_and_the_rest_served(tmp_path: Path) -> None:
    """F3 through the staging path (rows not contiguous): blocks 1 and 3 fail, 0 and 2 come
    back exact in their rows, between a RAM hit and a miss."""
    store, path = disk_store(tmp_path)
    flip_blocks(path, [1, 3])
    store.put(hashes_of([7]), make_blocks([7]), "ns")  # RAM budget 0: a file of its own
    hits = store.get(hashes_of([3, 7, 0, 9, 1, 2]))
    assert hits.hashes == hashes_of([7, 0, 2])
    assert hits.blocks.tobytes() == make_blocks([7, 0, 2]).tobytes()
    stats = store.stats()
    assert (stats["corrupt_reads"], stats["corrupt_blocks"], stats["blocks_spill_disk"]) == (1, 2, 3)


def test_a_file_whose_every_block_failed_is_quarantined(tmp_path: Path) -> None:
    """F3: a file left with no block it can serve (blocks 0 and 2 failed at one read, 1 and 3
    at the next) is moved aside into the quarantine folder, byte for byte, counted once."""
    store, path = disk_store(tmp_path)
    damaged = flip_blocks(path, [0, 1, 2, 3])
    assert store.get(hashes_of([0, 2])).hashes == []
    assert path.exists() and store.stats()["blocks_spill_disk"] == 2
    assert_quarantined(store, path, damaged, corrupt_reads=2)
    assert store.stats()["corrupt_blocks"] == 4


def test_a_block_written_again_after_failing_is_served_from_its_new_file_after_a_restart(
    tmp_path: Path,
) -> None:
    """F3 and a restart: the old file still lists the block that failed. The restarted index
    takes each block from the newest file holding it, so the block put again later is a hit,
    and the old file's intact blocks too."""
    store, path = disk_store(tmp_path)
    flip_blocks(path, [3])
    assert len(store.get(hashes_of(range(4))).hashes) == 3
    store.put(hashes_of([3]), make_blocks([3]), "ns")
    (new,) = [p for p in files_in(tmp_path) if p != path]
    os.utime(path, ns=(10**18, 10**18))  # write order, whatever the clock's resolution
    os.utime(new, ns=(10**18 + 1, 10**18 + 1))
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    hits = restarted.get(hashes_of(range(4)))
    assert hits.hashes == hashes_of(range(4))
    assert hits.blocks.tobytes() == make_blocks(range(4)).tobytes()
    assert (restarted.stats()["corrupt_reads"], restarted.stats()["files"]) == (0, 2)


def test_header_garbage_is_quarantined(tmp_path: Path) -> None:
    """Fault: garbage written over the header (magic, length and msgpack map)."""
    store, path = disk_store(tmp_path)
    data = bytearray(path.read_bytes())
    data[0:64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    assert_quarantined(store, path, bytes(data))


def fail_opens_of(monkeypatch: pytest.MonkeyPatch, path: Path, err: int, times: int) -> list[int]:
    """Make the next ``times`` opens of ``path`` by the spill format raise OSError(``err``).

    Returns the list that counts the failed opens. Other paths open normally (a name opened
    in the spill directory's descriptor is compared by name).
    """
    failed: list[int] = []

    def flaky_open(file: object, *args: object, **kwargs: object) -> object:
        if Path(str(file)) in (path, Path(path.name)) and len(failed) < times:
            failed.append(err)
            raise OSError(err, os.strerror(err), str(file))
        return open(file, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(spill_format, "open", flaky_open, raising=False)
    return failed


@pytest.mark.parametrize("err", [errno.EIO, errno.EMFILE, errno.EACCES])
def test_transient_read_error_is_a_miss_and_keeps_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """issue 18 fault 5: an OSError on a spill read (EIO, EMFILE, EACCES) deleted the whole
    group file. It must be retried a bounded number of times, then be a miss that is counted,
    leave the file on disk byte for byte and in the index, and hit once the fault clears."""
    store, path = disk_store(tmp_path)
    before = path.read_bytes()
    store.take_events()
    failed = fail_opens_of(monkeypatch, path, err, times=10**6)
    hits = store.get(hashes_of(range(4)))
    assert (hits.hashes, hits.tiers) == ([], [])
    assert len(failed) == spill_disk_faults.READ_ATTEMPTS
    assert path.read_bytes() == before
    assert store.contains(hashes_of(range(4))) == ["spill_disk"] * 4
    stats = store.stats()
    counts = (stats["io_errors"], stats["io_retries"], stats["misses"], stats["files"])
    assert counts == (1, spill_disk_faults.READ_ATTEMPTS - 1, 4, 1)
    assert (stats["corrupt_reads"], stats["quarantined_files"]) == (0, 0)
    assert store.take_events() == []  # the global index is not told the blocks are gone
    monkeypatch.undo()  # the fault clears
    hits = store.get(hashes_of(range(4)))
    assert hits.tiers == ["spill_disk"] * 4
    assert hits.blocks.tobytes() == make_blocks(range(4)).tobytes()


def test_read_error_that_clears_within_the_retries_is_a_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 18 fault 5: one EMFILE (too many open files) then success: a hit, one retry."""
    store, path = disk_store(tmp_path)
    failed = fail_opens_of(monkeypatch, path, errno.EMFILE, times=1)
    hits = store.get(hashes_of(range(4)))
    assert failed == [errno.EMFILE]
    assert hits.blocks.tobytes() == make_blocks(range(4)).tobytes()
    stats = store.stats()
    assert (stats["io_retries"], stats["io_errors"], stats["hits_spill_disk"]) == (1, 0, 4)


@pytest.mark.parametrize("err", [errno.EIO, errno.EMFILE, errno.EACCES])
def test_transient_error_during_restart_reindex_keeps_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """issue 18 fault 5: an OSError while a restarted store re-reads a file's header deleted
    the file. It must stay on disk untouched (counted) while the disk budget has room, and be
    indexed by a later restart."""
    old, path = disk_store(tmp_path)
    before = path.read_bytes()
    failed = fail_opens_of(monkeypatch, path, err, times=10**6)
    old.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert len(failed) == spill_disk_faults.READ_ATTEMPTS
    assert restarted.contains(hashes_of(range(4))) == [None] * 4
    stats = restarted.stats()
    assert (stats["io_errors"], stats["corrupt_reads"], stats["files"]) == (1, 0, 0)
    assert path.read_bytes() == before
    monkeypatch.undo()
    restarted.close()  # a restart: the old process is gone, its lock with it
    again = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert again.get(hashes_of(range(4))).blocks.tobytes() == make_blocks(range(4)).tobytes()


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES])
def test_failed_write_keeps_the_index_and_other_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    """issue 18 fault 5: EIO/EACCES while writing a group file drops only that write: no temp
    file is left, the files already written stay byte for byte and keep serving hits. (ENOSPC
    makes room first and tries once more: tests/test_spill_disk_faults.py.)"""
    store, path = disk_store(tmp_path)
    before = path.read_bytes()

    def failing_fsync(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(spill_format.os, "fsync", failing_fsync)
    store.put(hashes_of(range(4, 8)), make_blocks(range(4, 8)), "ns")
    monkeypatch.undo()
    assert listed(tmp_path) == [path.name]
    assert path.read_bytes() == before
    assert store.contains(hashes_of(range(8))) == ["spill_disk"] * 4 + [None] * 4
    assert store.stats()["io_errors"] == 1
    assert store.get(hashes_of(range(4))).blocks.tobytes() == make_blocks(range(4)).tobytes()


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
    store.close()  # a restart: the old process is gone, its lock with it
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


def test_restart_quarantines_corrupt_and_drops_temp_files(tmp_path: Path) -> None:
    """Fault: a crash mid-write leaves a temp file; garbage under a group name."""
    disk_store(tmp_path)[0].close()  # a restart: the old process is gone, its lock with it
    (tmp_path / (spill_format.TEMP_PREFIX + "x.part")).write_bytes(b"half a file")
    (tmp_path / ("junk" + spill_format.FILE_SUFFIX)).write_bytes(b"garbage")
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.match_prefix(hashes_of(range(4))) == 4
    assert listed(tmp_path) == sorted([files_in(tmp_path)[0].name, "quarantine"])
    assert os.listdir(tmp_path / "quarantine") == ["junk" + spill_format.FILE_SUFFIX]
    assert (restarted.stats()["corrupt_reads"], restarted.stats()["quarantined_files"]) == (1, 1)


def test_restart_skips_files_of_another_block_format(tmp_path: Path) -> None:
    disk_store(tmp_path)[0].close()  # a restart: the old process is gone, its lock with it
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
    store.close()  # a restart: the old process is gone, its lock with it
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


def test_restart_quarantines_a_crafted_header_at_the_cost_of_its_bytes(tmp_path: Path) -> None:
    """Regression (review 25a G): a spill node's start unpacked every group file's header (up
    to 64 MiB) with msgpack's default limits: a crafted 16 MiB header of empty maps cost
    1.16 GiB before its file was quarantined. Now the review's file is refused by its length
    and a crafted header within it (nested empty maps, each array within the bounds) after a
    handful of containers: both are quarantined, the store's own file still serves, and the
    start's Python memory stays within a few times the largest header read."""
    import struct
    import tracemalloc

    import msgpack
    import xxhash

    disk_store(tmp_path)[0].close()  # a restart: the old process is gone, its lock with it
    n = (16 << 20) - 5
    width = spill_format.MAX_BLOCKS_PER_FILE
    for name, header in (("big", b"\xdd" + struct.pack(">I", n) + b"\x80" * n),
                         ("nested", msgpack.packb([[{}] * width] * (spill_format.MAX_HEADER_BYTES // (width + 3))))):
        prefix = b"KVSP" + struct.pack("<I", len(header)) + xxhash.xxh3_128_digest(header)
        (tmp_path / (name + spill_format.FILE_SUFFIX)).write_bytes(prefix + header)
    tracemalloc.start()
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=1 << 30)  # a quarantine of 128 MiB
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert (restarted.stats()["corrupt_reads"], restarted.stats()["quarantined_files"]) == (2, 2)
    assert restarted.match_prefix(hashes_of(range(4))) == 4
    assert sorted(os.listdir(tmp_path / "quarantine")) == ["big.kvs", "nested.kvs"]
    assert peak < 4 * spill_format.MAX_HEADER_BYTES  # the old start: ~1.7 GiB
