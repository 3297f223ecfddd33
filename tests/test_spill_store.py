"""SpillStore (plain class, no Ray): tiers, budgets, grouping, events, restart."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import numpy as np
import pytest

from cache_node.tiers import spill_format
from cache_node.tiers.spill_format import BlockFormat, read_header
from cache_node.tiers.spill_lock import LOCK_FILE
from cache_node.tiers.spill_store import SpillEvent, SpillStore

FMT = BlockFormat(shape=(2, 2, 4, 1, 2), dtype="float32", kv_format="fp32")
BLOCK = FMT.block_nbytes  # 128 bytes
DISK = 10**9


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def hashes_of(indices: range | list[int]) -> list[bytes]:
    return [block_hash(i) for i in indices]


def make_blocks(indices: range | list[int]) -> np.ndarray:
    """Block i holds i * 1000 + 0..31, so every block's bytes differ."""
    base = np.arange(32, dtype=np.float32).reshape(FMT.shape)
    return np.stack([base + i * 1000 for i in indices])


def files_in(root: Path) -> list[Path]:
    return sorted(root.glob("*.kvs"))


def listed(root: Path) -> list[str]:
    """``os.listdir(root)`` but the store's lock file (``spill_lock.LOCK_FILE``), sorted."""
    return sorted(name for name in os.listdir(root) if name != LOCK_FILE)


def test_ram_round_trip_is_byte_exact(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=10 * BLOCK, disk_bytes=DISK)
    assert store.put(hashes_of(range(3)), make_blocks(range(3)), "ns") == 3
    hits = store.get(hashes_of([2, 0, 1]))
    assert hits.hashes == hashes_of([2, 0, 1])
    assert hits.tiers == ["spill_ram"] * 3
    assert hits.blocks.tobytes() == make_blocks([2, 0, 1]).tobytes()
    assert files_in(tmp_path) == []
    assert store.stats()["ram_bytes"] == 3 * BLOCK


def test_disk_round_trip_is_byte_exact(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(5)), make_blocks(range(5)), "ns")
    hits = store.get(hashes_of([4, 9, 0]))
    assert hits.hashes == hashes_of([4, 0])
    assert hits.tiers == ["spill_disk", "spill_disk"]
    assert hits.blocks.tobytes() == make_blocks([4, 0]).tobytes()
    stats = store.stats()
    assert (stats["hits_spill_disk"], stats["misses"], stats["blocks_spill_disk"]) == (2, 1, 5)


def test_ram_budget_demotes_lru_blocks_to_disk(tmp_path: Path) -> None:
    store = SpillStore(
        tmp_path, FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK, demote_low_watermark=0.5
    )
    store.put(hashes_of(range(4)), make_blocks(range(4)), "ns")
    store.get(hashes_of([0]))  # block 0 becomes most recent
    store.put(hashes_of([4]), make_blocks([4]), "ns")  # 5 > 4 blocks: demote down to 2
    assert store.contains(hashes_of(range(5))) == [
        "spill_ram", "spill_disk", "spill_disk", "spill_disk", "spill_ram"
    ]  # fmt: skip
    assert len(files_in(tmp_path)) == 1
    assert read_header(files_in(tmp_path)[0]).block_hashes == tuple(hashes_of([1, 2, 3]))
    hits = store.get(hashes_of(range(5)))
    assert hits.blocks.tobytes() == make_blocks(range(5)).tobytes()


def group_file_bytes(tmp_path: Path, num_blocks: int) -> int:
    probe = SpillStore(tmp_path / "probe", FMT, ram_bytes=0, disk_bytes=DISK)
    probe.put(hashes_of(range(num_blocks)), make_blocks(range(num_blocks)), "ns")
    return probe.stats()["disk_bytes"]


def test_disk_budget_evicts_least_recently_used_file(tmp_path: Path) -> None:
    pair_bytes = group_file_bytes(tmp_path, 2)
    root = tmp_path / "store"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=2 * pair_bytes, max_blocks_per_file=2)
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "ns")  # file A
    store.put(hashes_of([2, 3]), make_blocks([2, 3]), "ns")  # file B
    store.get(hashes_of([1]))  # A is now more recent than B
    store.put(hashes_of([4, 5]), make_blocks([4, 5]), "ns")  # file C evicts B
    assert store.contains(hashes_of(range(6))) == [
        "spill_disk", "spill_disk", None, None, "spill_disk", "spill_disk"
    ]  # fmt: skip
    stats = store.stats()
    assert (stats["files"], stats["disk_bytes"], stats["evicted_files"]) == (2, 2 * pair_bytes, 1)
    assert len(files_in(root)) == 2


def test_put_of_128_blocks_is_grouped_into_few_files(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(128)), make_blocks(range(128)), "ns")
    files = files_in(tmp_path)
    assert len(files) == 2  # 128 blocks / 64 per file; the brief's bound is <= 4
    assert sorted(len(read_header(f).block_hashes) for f in files) == [64, 64]


def test_put_is_idempotent_and_does_not_rewrite(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=2 * BLOCK, disk_bytes=DISK)
    assert store.put(hashes_of(range(4)), make_blocks(range(4)), "ns") == 4
    before = {f.name: f.stat().st_mtime_ns for f in files_in(tmp_path)}
    store.take_events()
    assert store.put(hashes_of(range(4)), make_blocks(range(4)), "ns") == 0
    assert {f.name: f.stat().st_mtime_ns for f in files_in(tmp_path)} == before
    assert store.take_events() == []


def test_namespace_is_recorded_per_file(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=3 * BLOCK, disk_bytes=DISK, demote_low_watermark=0)
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "tenant-a")
    store.put(hashes_of([2, 3]), make_blocks([2, 3]), "tenant-b")  # makes room: demotes a's 2
    store.put(hashes_of([4, 5]), make_blocks([4, 5]), "tenant-c")  # and b's
    by_namespace = {
        read_header(f).namespace: read_header(f).block_hashes for f in files_in(tmp_path)
    }
    assert by_namespace == {
        "tenant-a": tuple(hashes_of([0, 1])),
        "tenant-b": tuple(hashes_of([2, 3])),
    }


def test_match_prefix_counts_leading_hits(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=2 * BLOCK, disk_bytes=DISK)
    store.put(hashes_of([0, 1, 3]), make_blocks([0, 1, 3]), "ns")
    assert store.match_prefix(hashes_of([0, 1, 2, 3])) == 2
    assert store.match_prefix(hashes_of([0, 1])) == 2
    assert store.match_prefix(hashes_of([5])) == 0


def test_take_events_reports_changes_in_order(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK, demote_low_watermark=0)
    h0, h1 = hashes_of([0, 1])
    store.put([h0], make_blocks([0]), "ns")
    # room first, down to the watermark (0): h0 is demoted, and h1, its holder's newest, is
    # picked next, so it goes straight to disk (it never passes through RAM)
    store.put([h1], make_blocks([1]), "ns")
    assert store.take_events() == [
        SpillEvent("stored", h0, "spill_ram"),
        SpillEvent("removed", h0, "spill_ram"),
        SpillEvent("stored", h0, "spill_disk"),
        SpillEvent("stored", h1, "spill_disk"),
    ]
    assert store.take_events() == []
    store.flush()
    assert sorted(store.take_events()) == sorted(
        [SpillEvent("removed", h0, "spill_disk"), SpillEvent("removed", h1, "spill_disk")]
    )


def test_flush_then_get_is_all_miss(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=2 * BLOCK, disk_bytes=DISK)
    store.put(hashes_of(range(6)), make_blocks(range(6)), "ns")
    assert store.flush() == 6
    hits = store.get(hashes_of(range(6)))
    assert (hits.hashes, hits.tiers, hits.blocks.shape) == ([], [], (0, *FMT.shape))
    assert listed(tmp_path) == []
    stats = store.stats()
    assert (stats["ram_bytes"], stats["disk_bytes"], stats["files"]) == (0, 0, 0)


def test_put_rejects_bad_input(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK)
    with pytest.raises(ValueError, match="32 bytes"):
        store.put([b"short"], make_blocks([0]), "ns")
    with pytest.raises(ValueError, match="blocks must be"):
        store.put(hashes_of([0, 1]), make_blocks([0]), "ns")
    with pytest.raises(ValueError, match="blocks must be"):
        store.put(hashes_of([0]), make_blocks([0]).astype(np.float16), "ns")
    with pytest.raises(ValueError, match="budgets"):
        SpillStore(tmp_path, FMT, ram_bytes=-1, disk_bytes=DISK)


def test_caller_buffer_reuse_does_not_change_stored_blocks(tmp_path: Path) -> None:
    """Fault: the store keeping a view of the caller's buffer, which the caller then reuses."""
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK)
    blocks = make_blocks([0])
    store.put(hashes_of([0]), blocks, "ns")
    blocks[:] = -1
    assert store.get(hashes_of([0])).blocks.tobytes() == make_blocks([0]).tobytes()


def test_zero_disk_budget_drops_demoted_blocks(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=0, demote_low_watermark=0)
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "ns")
    assert store.contains(hashes_of([0, 1])) == [None, None]
    assert listed(tmp_path) == []


def tokens_of(indices: range | list[int]) -> list[list[int]]:
    """Block i's 4 token ids (FMT's block_size is 4)."""
    return [[i * 10 + k for k in range(4)] for i in indices]


def test_block_whose_stored_tokens_differ_is_not_served(tmp_path: Path) -> None:
    """issue 18 fault 6: a spill hit checks the block's token ids, as the device and host tiers
    do; a block stored under the asked hash with other tokens is a counted miss, in RAM, on
    disk and after a restart (tokens come back from the group file's header)."""
    store = SpillStore(tmp_path, FMT, ram_bytes=2 * BLOCK, disk_bytes=DISK, demote_low_watermark=0.5)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "ns", token_ids=tokens_of(range(4)))
    assert store.contains(hashes_of(range(4))) == ["spill_disk"] * 3 + ["spill_ram"]
    asked = tokens_of(range(4))
    asked[1] = asked[1][::-1]  # disk block, same tokens in another order
    asked[3] = [9, 9, 9, 9]  # RAM block
    hits = store.get(hashes_of(range(4)), token_ids=asked)
    assert hits.hashes == hashes_of([0, 2])
    assert hits.blocks.tobytes() == make_blocks([0, 2]).tobytes()
    stats = store.stats()
    assert (stats["token_mismatches"], stats["misses"], stats["hits_spill_disk"]) == (2, 2, 2)
    right = store.get(hashes_of(range(4)), token_ids=tokens_of(range(4)))
    assert right.blocks.tobytes() == make_blocks(range(4)).tobytes()
    store.demote_to_disk()
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.get(hashes_of([3]), token_ids=[[9, 9, 9, 9]]).hashes == []
    assert restarted.get(hashes_of([3]), token_ids=tokens_of([3])).hashes == hashes_of([3])
    assert restarted.stats()["token_mismatches"] == 1


def test_block_stored_without_tokens_is_not_served_to_a_token_checked_get(tmp_path: Path) -> None:
    """issue 18 fault 6: unknown tokens never pass a token check."""
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK, demote_low_watermark=0)
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "ns")  # both on disk, no tokens
    assert store.get(hashes_of([0, 1]), token_ids=tokens_of([0, 1])).hashes == []
    assert store.get(hashes_of([0, 1])).hashes == hashes_of([0, 1])  # unchecked get
    with pytest.raises(ValueError, match="token_ids"):
        store.get(hashes_of([0, 1]), token_ids=tokens_of([0]))


def test_files_of_an_older_format_version_are_ignored_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 18 fault 6: version-1 files carry no token ids and keys that named the model by
    its directory; a restarted store must not index them, nor quarantine them, nor delete them
    while its disk budget has room (past it they go first: tests/test_spill_unserved.py)."""
    monkeypatch.setattr(spill_format, "FORMAT_VERSION", 1)
    first = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    first.put(hashes_of(range(2)), make_blocks(range(2)), "ns")
    first.close()  # a restart: the old process is gone, its lock with it
    monkeypatch.undo()
    (old,) = files_in(tmp_path)
    before = old.read_bytes()
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(2))) == [None, None]
    stats = restarted.stats()
    assert (stats["skipped_files"], stats["quarantined_files"], stats["files"]) == (1, 0, 0)
    assert listed(tmp_path) == [old.name] and old.read_bytes() == before


@pytest.mark.parametrize("per_file", [4, 64])
def test_ram_tier_demotion_stays_within_its_budget(tmp_path: Path, per_file: int) -> None:
    """Regression (review 23a): ``put`` copied its blocks into RAM, then demoted 25% of the
    budget by stacking the whole batch into one more copy before writing: a 1 GiB RAM tier
    peaked at 1.44 GiB, and a spill node sized by ``spill_ram_bytes`` could be OOM-killed. Now
    a put makes room first and a demotion writes each file from the entries themselves: the
    traced peak, the caller's blocks apart, stays within the budget and a few blocks, with one
    file per 4 blocks or the default 64."""
    import tracemalloc

    fmt = BlockFormat(shape=(32, 1024), dtype="int16", kv_format="x")  # 64 KiB blocks
    budget = 64 * fmt.block_nbytes
    store = SpillStore(tmp_path / str(per_file), fmt, ram_bytes=budget, disk_bytes=DISK, max_blocks_per_file=per_file)
    blocks = np.ones((8, *fmt.shape), np.int16)  # the caller's, outside the trace
    tracemalloc.start()
    try:
        for k in range(24):  # 192 blocks in puts of 8: past the RAM budget twice
            store.put(hashes_of(range(8 * k, 8 * k + 8)), blocks, "ns")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert store.stats()["ram_bytes"] <= budget
    assert peak <= budget + 8 * fmt.block_nbytes, peak / budget  # 1.09x now, 1.60x before
    hits = store.get(hashes_of(range(192)))
    assert len(hits.hashes) == 192 and hits.blocks.tobytes() == np.ones((192, *fmt.shape), np.int16).tobytes()


def test_drop_namespace_deletes_its_ram_blocks_and_group_files(tmp_path: Path) -> None:
    """Review 23d, E: a deleted tenant's blocks stayed in spill RAM and in group files (whose
    headers hold the prompt token ids) for good, across restarts. ``drop_namespace`` drops the
    namespace's and its salted variants' blocks on both tiers and deletes their files; another
    namespace's blocks and files stay, and a restart indexes none of the dropped ones."""
    store = SpillStore(tmp_path, FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK, demote_low_watermark=0)
    tokens = [[i] * 4 for i in range(8)]
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "tenant:gone", tokens[0:2])
    store.put(hashes_of([2, 3]), make_blocks([2, 3]), "tenant:gone#salt=x", tokens[2:4])
    store.put(hashes_of([4, 5]), make_blocks([4, 5]), "tenant:kept", tokens[4:6])
    store.demote_to_disk()
    store.put(hashes_of([6]), make_blocks([6]), "tenant:gone", tokens[6:7])
    store.put(hashes_of([7]), make_blocks([7]), "tenant:kept", tokens[7:8])
    assert store.contains(hashes_of(range(8))) == ["spill_disk"] * 6 + ["spill_ram"] * 2
    assert sorted(read_header(f).namespace for f in files_in(tmp_path)) == [
        "tenant:gone", "tenant:gone#salt=x", "tenant:kept"]
    store.take_events()
    assert store.drop_namespace("tenant:gone") == 5
    assert store.contains(hashes_of(range(8))) == [None] * 4 + ["spill_disk"] * 2 + [None, "spill_ram"]
    assert [read_header(f).namespace for f in files_in(tmp_path)] == ["tenant:kept"]
    assert sorted(store.take_events()) == sorted(
        [SpillEvent("removed", h, "spill_disk") for h in hashes_of(range(4))]
        + [SpillEvent("removed", block_hash(6), "spill_ram")])
    assert store.get(hashes_of([4, 5, 7]), tokens[4:6] + tokens[7:8]).blocks.tobytes() == (
        make_blocks([4, 5, 7]).tobytes())
    stats = store.stats()
    assert (stats["blocks_spill_ram"], stats["blocks_spill_disk"], stats["files"]) == (1, 2, 1)
    assert stats["disk_bytes"] == sum(f.stat().st_size for f in files_in(tmp_path))
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(6))) == [None] * 4 + ["spill_disk"] * 2


@pytest.mark.parametrize(("namespace", "token_ids", "says"), [
    ("n" * (spill_format.MAX_LABEL_BYTES + 1), None, "a namespace of 16385 bytes"),
    ("ns", [list(range(4))] * 3 + [list(range(2_000))], "holds 2000 ids: at most 1024"),
    ("ns", [[0, 1, 2, 3.5]] * 4, "integers in [0, 2**31)"),
    ("ns", [[0, 1, 2, -1]] * 4, "integers in [0, 2**31)"),
    ("ns", [[0, 1, 2, 1 << 31]] * 4, "integers in [0, 2**31)"),
])
def test_a_put_with_a_bad_namespace_or_token_ids_stores_nothing(tmp_path: Path, namespace: str, token_ids,
                                                                 says: str) -> None:
    """Review 28a F3: a put's namespace and token ids were unchecked: a 20 KB namespace was kept
    in RAM and failed the later demotion inside another tenant's put (that put raised and stored
    nothing), and 4 blocks of 2,000,000 token ids each took 167 MiB outside the RAM budget. Now
    the put itself is refused, stores nothing, and other puts go on."""
    store = SpillStore(tmp_path, FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK)
    with pytest.raises(ValueError, match=re.escape(says)):
        store.put(hashes_of(range(4)), make_blocks(range(4)), namespace, token_ids)
    assert store.stats()["blocks_spill_ram"] == 0 and not files_in(tmp_path)
    assert store.put(hashes_of(range(10, 18)), make_blocks(range(10, 18)), "other",
                     [list(range(4))] * 8) == 8  # another tenant's put, past the RAM budget: demotes
    assert store.get(hashes_of(range(10, 18)), [list(range(4))] * 8) is not None
