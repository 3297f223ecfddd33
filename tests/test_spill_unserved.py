"""Spill files the store does not serve (unindexed, quarantined) count against its disk budget
and are deleted first, oldest first; nothing outside the spill directory is ever deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_node.tiers import spill_format, spill_unserved
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from services.metrics.spill import SpillMetrics
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, make_blocks
from tests.test_spill_store_faults import fail_opens_of

OTHER = BlockFormat(shape=FMT.shape, dtype="float32", kv_format="fq32")  # a kv_format change


def du(root: Path) -> int:
    """Bytes of everything under ``root``, links counted as themselves, never followed."""
    return sum((Path(d) / f).lstat().st_size for d, _, names in os.walk(root) for f in names)


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
    write_pairs(root, FMT, budget, 0, 4)
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
    write_pairs(tmp_path / "spill", FMT, budget, 0, 1)
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
    small = SpillStore(root, FMT, ram_bytes=0, disk_bytes=int(500 / spill_unserved.QUARANTINE_BUDGET_SHARE))
    assert sorted(os.listdir(quarantine)) == names[15:]  # 5 x 100 B
    assert (small.stats()["removed_quarantined_files"], small.stats()["quarantined_bytes"]) == (11, 500)


def test_nothing_outside_the_spill_directory_is_deleted(tmp_path: Path) -> None:
    """Links in the spill directory go, never what they point at; a quarantine folder that is
    a link is not used; a directory under a group file's name is neither counted nor touched."""
    outside = tmp_path / "outside"
    write_pairs(outside, OTHER, DISK, 0, 1)
    (target,) = files_in(outside)
    garbage = outside / ("garbage" + spill_format.FILE_SUFFIX)
    garbage.write_bytes(b"y" * 100)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    root = tmp_path / "spill"
    root.mkdir()
    (root / ("other" + spill_format.FILE_SUFFIX)).symlink_to(target)  # another format: unindexed
    (root / ("bad" + spill_format.FILE_SUFFIX)).symlink_to(garbage)  # corrupt: quarantined
    (root / ("dir" + spill_format.FILE_SUFFIX)).mkdir()
    (root / ("dir" + spill_format.FILE_SUFFIX) / "kept").write_bytes(b"z")
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=1)  # room for nothing
    stats = store.stats()
    assert (stats["removed_unindexed_files"], stats["removed_quarantined_files"]) == (1, 1)
    assert sorted(os.listdir(root)) == ["dir" + spill_format.FILE_SUFFIX, spill_format.QUARANTINE_DIR]
    assert (root / ("dir" + spill_format.FILE_SUFFIX) / "kept").read_bytes() == b"z"
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    # a quarantine folder that links elsewhere is neither moved into nor emptied
    os.rmdir(root / spill_format.QUARANTINE_DIR)
    (root / spill_format.QUARANTINE_DIR).symlink_to(outside)
    (root / ("bad" + spill_format.FILE_SUFFIX)).symlink_to(garbage)
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=1)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert (store.stats()["quarantined_files"], store.stats()["removed_unindexed_files"]) == (0, 1)
    assert not (root / ("bad" + spill_format.FILE_SUFFIX)).is_symlink()  # the link went, as unindexed
