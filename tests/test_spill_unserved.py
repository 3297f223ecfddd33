"""Spill files the store does not serve (unindexed, quarantined) count against its disk budget
and are deleted first, oldest first; nothing outside the spill directory is ever deleted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cache_node.tiers import spill_format, spill_unserved
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_lock import LOCK_FILE
from cache_node.tiers.spill_store import SpillStore
from services.metrics.spill import SpillMetrics
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, listed, make_blocks
from tests.test_spill_store_faults import fail_opens_of

OTHER = BlockFormat(shape=FMT.shape, dtype="float32", kv_format="fq32")  # a kv_format change


def du(root: Path) -> int:
    """Bytes of everything under ``root``, links counted as themselves, never followed, but the
    store's lock file (``spill_lock.LOCK_FILE``: a few bytes, outside the budget)."""
    return sum((Path(d) / f).lstat().st_size for d, _, names in os.walk(root) for f in names
               if (Path(d), f) != (root, LOCK_FILE))


def write_pairs(root: Path, fmt: BlockFormat, budget: int, first: int, pairs: int) -> SpillStore:
    """A store of ``fmt`` in ``root`` that puts ``pairs`` two-block files, blocks from ``first``,
    each file's mtime one second after the last (oldest first)."""
    store = SpillStore(root, fmt, ram_bytes=0, disk_bytes=budget, max_blocks_per_file=2)
    for k in range(first, first + 2 * pairs, 2):
        store.put(hashes_of([k, k + 1]), make_blocks([k, k + 1]), "ns")
        (path,) = [p for p in files_in(root) if spill_format.read_header(p).block_hashes[0] == hashes_of([k])[0]]
        os.utime(path, ns=(10**18 + k * 10**9, 10**18 + k * 10**9))
    return store


def pair_bytes(tmp_path: Path) -> int:
    return write_pairs(tmp_path / "probe", FMT, DISK, 0, 1).stats()["disk_bytes"]


def store_files(store: SpillStore) -> list[str]:
    return [f.path.name for f in store._disk._files.values()]


def test_files_of_another_block_format_count_against_the_disk_budget(tmp_path: Path) -> None:
    """Regression (security review secrev20 S5): after a kv_format change a restarted store
    skipped the old files and counted them against nothing, so the spill directory held the
    old deployment's budget and the new one's (1.90x ``spill_disk_bytes`` in the review). They
    now count and go first, oldest first, before any file the store serves."""
    budget = 4 * pair_bytes(tmp_path)
    root = tmp_path / "spill"
    write_pairs(root, FMT, budget, 0, 4).close()  # its process ended: the lock with it
    old = [p.name for p in sorted(files_in(root), key=lambda p: p.stat().st_mtime_ns)]
    store = SpillStore(root, OTHER, ram_bytes=0, disk_bytes=budget, max_blocks_per_file=2)
    assert du(root) == budget
    store.put(hashes_of([100, 101]), make_blocks([100, 101]), "ns")
    assert du(root) == budget  # the oldest old file made room
    assert sorted(p.name for p in files_in(root)) == sorted(old[1:] + store_files(store))
    for k in (102, 104, 106):
        store.put(hashes_of([k, k + 1]), make_blocks([k, k + 1]), "ns")
        assert du(root) == budget
    stats = store.stats()
    assert (stats["skipped_files"], stats["removed_unindexed_files"], stats["evicted_files"]) == (4, 4, 0)
    assert (stats["files"], stats["unindexed_bytes"], stats["disk_bytes"]) == (4, 0, budget)
    assert store.contains(hashes_of(range(100, 108))) == ["spill_disk"] * 8
    metrics = SpillMetrics("spill_node_0", store.stats, BLOCK).registry
    removed = {"node": "spill_node_0", "kind": "unindexed"}
    assert metrics.get_sample_value("kvstrata:spill_removed_files_total", removed) == 4
    assert metrics.get_sample_value("kvstrata:spill_unserved_bytes", removed) == 0


def test_a_file_unreadable_at_restart_counts_and_goes_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose header cannot be read at a restart stays unindexed (issue 18 fault 5) but
    counts against the budget, and is the first file deleted when the budget needs room."""
    budget = 2 * pair_bytes(tmp_path)
    write_pairs(tmp_path / "spill", FMT, budget, 0, 1).close()  # its process ended: the lock with it
    (path,) = files_in(tmp_path / "spill")
    fail_opens_of(monkeypatch, path, 5, times=10**6)  # EIO
    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=0, disk_bytes=budget, max_blocks_per_file=2)
    store.put(hashes_of([10, 11]), make_blocks([10, 11]), "ns")
    assert path.exists()  # the budget holds both
    store.put(hashes_of([12, 13]), make_blocks([12, 13]), "ns")
    assert (path.exists(), du(tmp_path / "spill")) == (False, budget)
    stats = store.stats()
    assert (stats["io_errors"], stats["removed_unindexed_files"], stats["evicted_files"]) == (1, 1, 0)
    assert store.contains(hashes_of(range(10, 14))) == ["spill_disk"] * 4


def junk_files(root: Path, count: int) -> list[str]:
    """``count`` 100-byte garbage group files, oldest first (quarantined at a restart)."""
    root.mkdir(parents=True, exist_ok=True)
    names = [f"junk{i:02d}{spill_format.FILE_SUFFIX}" for i in range(count)]
    for i, name in enumerate(names):
        (root / name).write_bytes(b"x" * 100)
        os.utime(root / name, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))
    return names


def test_the_quarantine_keeps_its_newest_files_within_a_share_of_the_budget(tmp_path: Path) -> None:
    """Regression (security review secrev20 S5): quarantined files were never deleted, so
    the quarantine grew without bound. It keeps its newest ``QUARANTINE_MAX_FILES`` files,
    within ``QUARANTINE_BUDGET_SHARE`` of the disk budget, at every restart too."""
    root = tmp_path / "spill"
    names = junk_files(root, 20)
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    quarantine = root / spill_format.QUARANTINE_DIR
    assert sorted(os.listdir(quarantine)) == names[4:]  # the 16 newest
    stats = store.stats()
    assert (stats["quarantined_files"], stats["removed_quarantined_files"], stats["quarantined_bytes"]) == (
        20, 4, 1600)
    store.close()  # a restart: the old process is gone, its lock with it
    small = SpillStore(root, FMT, ram_bytes=0, disk_bytes=int(500 / spill_unserved.QUARANTINE_BUDGET_SHARE))
    assert sorted(os.listdir(quarantine)) == names[15:]  # 5 x 100 B
    assert (small.stats()["removed_quarantined_files"], small.stats()["quarantined_bytes"]) == (11, 500)


def test_nothing_outside_the_spill_directory_is_deleted(tmp_path: Path) -> None:
    """Links in the spill directory go, never what they point at (never followed, not even to
    read a header: review 30e F1, they count as unindexed names); a quarantine folder that is
    a link is not used; a directory under a group file's name is neither counted nor touched."""
    outside = tmp_path / "outside"
    write_pairs(outside, OTHER, DISK, 0, 1).close()  # its process ended: the lock with it
    (target,) = files_in(outside)
    garbage = outside / ("garbage" + spill_format.FILE_SUFFIX)
    garbage.write_bytes(b"y" * 100)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    root = tmp_path / "spill"
    root.mkdir()
    (root / ("other" + spill_format.FILE_SUFFIX)).symlink_to(target)  # a link: unindexed
    (root / ("bad" + spill_format.FILE_SUFFIX)).symlink_to(garbage)  # a link: unindexed
    (root / ("dir" + spill_format.FILE_SUFFIX)).mkdir()
    (root / ("dir" + spill_format.FILE_SUFFIX) / "kept").write_bytes(b"z")
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=1)  # room for nothing
    stats = store.stats()
    assert (stats["removed_unindexed_files"], stats["removed_quarantined_files"]) == (2, 0)
    assert listed(root) == ["dir" + spill_format.FILE_SUFFIX]
    assert (root / ("dir" + spill_format.FILE_SUFFIX) / "kept").read_bytes() == b"z"
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    # a quarantine folder that links elsewhere is neither moved into nor emptied
    (root / spill_format.QUARANTINE_DIR).symlink_to(outside)
    (root / ("bad" + spill_format.FILE_SUFFIX)).symlink_to(garbage)
    store.close()  # a restart: the old process is gone, its lock with it
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=1)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert (store.stats()["quarantined_files"], store.stats()["removed_unindexed_files"]) == (0, 1)
    assert not (root / ("bad" + spill_format.FILE_SUFFIX)).is_symlink()  # the link went, as unindexed


def corrupt_file_of(store: SpillStore, root: Path, namespace: str, indices: list[int], header: bool = False) -> str:
    """Put ``indices`` under ``namespace`` into their own group file (RAM budget 0), damage it
    (every block's payload, or ``header``: its header) and read it, so the store quarantines
    it; returns its name."""
    before = set(files_in(root))
    store.put(hashes_of(indices), make_blocks(indices), namespace, [[i] * 4 for i in indices])
    (path,) = set(files_in(root)) - before
    data = bytearray(path.read_bytes())
    for at in [30] if header else [len(data) - (k + 1) * BLOCK + 7 for k in range(len(indices))]:
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(hashes_of(indices)).hashes == []
    assert (root / spill_format.QUARANTINE_DIR / path.name).exists()
    return path.name


def holding(root: Path, text: bytes) -> list[str]:
    """Names of the files under ``root`` (quarantine included) whose bytes contain ``text``."""
    return sorted(p.name for p in root.rglob("*") if p.is_file() and text in p.read_bytes())


def test_a_flush_deletes_the_quarantined_files(tmp_path: Path) -> None:
    """Regression (review 26b F5): a flush (admin Flush) deleted the group files but kept the
    quarantine folder, whose files' headers hold the prompts' token ids and namespace: the
    review's repro found ``tenant:secret`` on disk after flush and after its namespace drop."""
    root = tmp_path / "spill"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    corrupt_file_of(store, root, "tenant:secret", [0, 1, 2, 3])
    corrupt_file_of(store, root, "tenant:secret", [4, 5], header=True)
    store.put(hashes_of([6]), make_blocks([6]), "tenant:secret")
    assert len(holding(root, b"tenant:secret")) == 3
    assert store.flush() == 1
    assert holding(root, b"tenant:secret") == [] and os.listdir(root / spill_format.QUARANTINE_DIR) == []
    stats = store.stats()
    assert (stats["quarantined_files"], stats["removed_quarantined_files"], stats["quarantined_bytes"]) == (2, 2, 0)
    assert du(root) == 0


def test_a_dropped_namespace_takes_its_unserved_files_with_it(tmp_path: Path) -> None:
    """Regression (review 26b F5): dropping a deleted tenant's namespace deleted only the files
    the store served; its quarantined files and the unindexed ones (another block format) kept
    its prompts' token ids until the disk budget needed room. Now each unserved file whose
    verified header names the namespace (salted too) goes with it; another tenant's stay, and
    so does a file whose header is corrupt (it names no one: the age limit or a flush)."""
    root = tmp_path / "spill"
    old = SpillStore(root, OTHER, ram_bytes=0, disk_bytes=DISK)  # the block format before a change
    old.put(hashes_of([50]), make_blocks([50]), "tenant:a#salt=s")
    old.put(hashes_of([51]), make_blocks([51]), "tenant:b")
    old.close()  # a restart: the old process is gone, its lock with it
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert store.stats()["skipped_files"] == 2
    a_bad = corrupt_file_of(store, root, "tenant:a", [0, 1])
    b_bad = corrupt_file_of(store, root, "tenant:b", [2, 3])
    garbled = corrupt_file_of(store, root, "tenant:a", [4, 5], header=True)
    store.put(hashes_of([6, 7]), make_blocks([6, 7]), "tenant:a")
    assert len(holding(root, b"tenant:a")) == 4
    assert store.drop_namespace("tenant:a") == 2
    quarantine = root / spill_format.QUARANTINE_DIR
    assert sorted(os.listdir(quarantine)) == sorted([b_bad, garbled])
    assert a_bad not in os.listdir(quarantine)
    assert [spill_format.read_header(p).namespace for p in files_in(root)] == ["tenant:b"]
    assert holding(root, b"tenant:a") == [garbled]  # its header does not verify: not attributed
    stats = store.stats()
    assert (stats["removed_quarantined_files"], stats["removed_unindexed_files"]) == (1, 1)
    (b_old,) = files_in(root)
    assert (stats["quarantined_bytes"], stats["unindexed_bytes"], stats["disk_bytes"]) == (
        du(quarantine), b_old.stat().st_size, 0)


def test_quarantined_files_are_kept_at_most_their_age_limit(tmp_path: Path) -> None:
    """F5: a quarantined file whose header names no one is deleted ``QUARANTINE_MAX_AGE_S`` after
    it was moved aside (its mtime is set then, so a restart keeps counting from there)."""
    root = tmp_path / "spill"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    before = time.time_ns()
    name = corrupt_file_of(store, root, "tenant:a", [0, 1], header=True)
    moved_at = (root / spill_format.QUARANTINE_DIR / name).stat().st_mtime_ns
    assert before <= moved_at <= time.time_ns()
    limit = int(spill_unserved.QUARANTINE_MAX_AGE_S * 1e9)
    assert store.expire_quarantine(moved_at + limit) == 0
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.stats()["quarantined_bytes"] > 0
    assert restarted.expire_quarantine(moved_at + limit - 1) == 0
    assert restarted.expire_quarantine(moved_at + limit + 1) == 1
    assert os.listdir(root / spill_format.QUARANTINE_DIR) == []
    stats = restarted.stats()
    assert (stats["removed_quarantined_files"], stats["quarantined_bytes"]) == (1, 0)
