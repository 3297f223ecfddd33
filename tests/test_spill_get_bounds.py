"""A spill node's entry points bound what one call may ask (review 30b F2): at most
``MAX_CALL_BLOCKS`` hashes a call (a cache node's batch), refused with a ValueError naming
``hashes`` before the store's lock is taken, and a ``get`` takes output memory for the blocks it
holds only.

Regression: ``SpillStore.get`` allocated ``(len(hashes), *block_shape)`` under the lock every
put and get waits on before looking anything up, with no bound on the count: 20,000 absent
hashes reserved 13.7 GiB on a live spill node, 60,000 raised MemoryError.
"""

from __future__ import annotations

import hashlib
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import MAX_CALL_BLOCKS, SpillStore
from services.spill_node import SpillNode

SMALL = BlockFormat(shape=(2, 2, 4, 1, 2), dtype="float32", kv_format="fp32")  # 128 bytes a block
BIG = BlockFormat(shape=(4, 2, 16, 4, 64), dtype="float32", kv_format="fp32")  # 128 KiB a block


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"bound-{i}".encode()).digest()


def blocks(fmt: BlockFormat, indices: list[int]) -> np.ndarray:
    base = np.arange(int(np.prod(fmt.shape)), dtype=np.float32).reshape(fmt.shape)
    return np.stack([base + i for i in indices])


def test_the_bound_is_a_cache_nodes_batch() -> None:
    """A cache node's calls fit: its put and get batches are at most the bound."""
    config = TierConfig()
    assert config.spill_get_batch_blocks <= MAX_CALL_BLOCKS and config.spill_put_batch_blocks <= MAX_CALL_BLOCKS


@pytest.mark.parametrize("call", ["get", "contains", "match_prefix", "put"])
def test_a_call_naming_more_hashes_than_a_batch_is_refused_without_the_lock(tmp_path: Path, call: str) -> None:
    """20,000 hashes (the review's call) are refused, ValueError naming ``hashes`` and the bound,
    while another thread holds the store's lock (the refusal never waits for it); nothing is
    counted or stored. ``MAX_CALL_BLOCKS`` hashes are served."""
    store = SpillStore(tmp_path, SMALL, ram_bytes=1 << 20, disk_bytes=1 << 24)
    many = [block_hash(i) for i in range(20_000)]
    args: dict[str, tuple] = {"get": (many,), "contains": (many,), "match_prefix": (many,),
                              "put": (many, np.zeros((len(many), *SMALL.shape), np.float32), "ns")}
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        with pytest.raises(ValueError, match=rf"hashes names 20000 blocks: at most {MAX_CALL_BLOCKS} per call"):
            getattr(store, call)(*args[call])
    finally:
        release.set()
        holder.join(10)
    stats = store.stats()
    assert (stats["misses"], stats["blocks_spill_ram"]) == (0, 0)
    fits = many[:MAX_CALL_BLOCKS]
    if call == "put":
        assert store.put(fits, blocks(SMALL, list(range(MAX_CALL_BLOCKS))), "ns") == MAX_CALL_BLOCKS
    else:
        assert store.get(fits).hashes == [] and store.contains(fits) == [None] * MAX_CALL_BLOCKS
        assert store.match_prefix(fits) == 0


def test_a_get_takes_memory_for_its_hits_only(tmp_path: Path) -> None:
    """128 KiB blocks: a get of 256 absent hashes allocates no block (before: 32 MiB, untouched),
    and one of 256 hashes of which 2 are held allocates about 2 blocks."""
    store = SpillStore(tmp_path, BIG, ram_bytes=1 << 24, disk_bytes=1 << 26)
    store.put([block_hash(0), block_hash(1)], blocks(BIG, [0, 1]), "ns")
    absent = [block_hash(i) for i in range(100, 100 + MAX_CALL_BLOCKS)]
    tracemalloc.start()
    try:
        assert store.get(absent).blocks.shape == (0, *BIG.shape)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < BIG.block_nbytes, peak
        tracemalloc.reset_peak()
        hits = store.get([*absent[:127], block_hash(1), *absent[127:254], block_hash(0)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hits.hashes == [block_hash(1), block_hash(0)] and hits.tiers == ["spill_ram"] * 2
    assert hits.blocks.tobytes() == blocks(BIG, [1, 0]).tobytes()
    assert 2 * BIG.block_nbytes <= peak < 3 * BIG.block_nbytes, peak
    assert store.stats()["misses"] == 2 * MAX_CALL_BLOCKS - 2


def test_a_get_of_ram_disk_absent_and_mismatched_blocks_keeps_request_order(tmp_path: Path) -> None:
    """Hits come in request order across both tiers, each with its bytes; an absent hash and one
    asked with other token ids are misses; a hash asked twice is served twice."""
    store = SpillStore(tmp_path, SMALL, ram_bytes=1 << 20, disk_bytes=1 << 24)
    tokens = [[i] * 4 for i in range(4)]
    store.put([block_hash(i) for i in range(2)], blocks(SMALL, [0, 1]), "ns", tokens[:2])
    store.demote_to_disk()
    store.put([block_hash(i) for i in range(2, 4)], blocks(SMALL, [2, 3]), "ns", tokens[2:])
    order = [3, 9, 0, 2, 1, 0]
    asked = [tokens[i] if i < 4 else [9] * 4 for i in order]
    asked[3] = [7] * 4  # block 2 asked with other tokens
    hits = store.get([block_hash(i) for i in order], asked)
    assert hits.hashes == [block_hash(i) for i in (3, 0, 1, 0)]
    assert hits.tiers == ["spill_ram", "spill_disk", "spill_disk", "spill_disk"]
    assert hits.blocks.tobytes() == blocks(SMALL, [3, 0, 1, 0]).tobytes()
    stats = store.stats()
    assert (stats["hits_spill_ram"], stats["hits_spill_disk"], stats["misses"], stats["token_mismatches"]) == (1, 3, 2, 1)


def test_the_spill_nodes_entry_points_refuse_unbounded_input(tmp_path: Path) -> None:
    """Through the node (what Ray calls): a get, contains and match_prefix of 60,000 hashes, a
    put of blocks that are not an array and a drop of a namespace that is not text or is longer
    than a file header holds are ValueErrors; the node serves afterwards."""
    node = SpillNode(tmp_path / "spill", SMALL, 1 << 20, 1 << 24, node_id="s0")
    many = [block_hash(i) for i in range(60_000)]
    for call in (node.get, node.contains, node.match_prefix):
        with pytest.raises(ValueError, match="hashes names 60000 blocks"):
            call(many)
    with pytest.raises(ValueError, match="blocks must be"):
        node.put([block_hash(0)], [[0.0]], "ns")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace must be a string"):
        node.drop_namespace(["tenant:a"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a namespace of"):
        node.drop_namespace("tenant:" + "x" * (1 << 20))
    assert node.put([block_hash(0)], blocks(SMALL, [0]), "ns") == 1
    assert node.get([block_hash(0)]).hashes == [block_hash(0)]
    assert node.drop_namespace("ns") == 1


def test_a_cache_node_cannot_be_configured_past_what_a_spill_node_takes() -> None:
    """Session 30: spill nodes refuse calls of more than ``MAX_CALL_BLOCKS`` hashes, so a cache
    node configured with larger put/get batches would have every spill put and get refused;
    its tier configuration now refuses such batches up front."""
    TierConfig(spill_put_batch_blocks=MAX_CALL_BLOCKS, spill_get_batch_blocks=MAX_CALL_BLOCKS)
    for field in ("spill_put_batch_blocks", "spill_get_batch_blocks"):
        with pytest.raises(ValueError, match=f"must be <= {MAX_CALL_BLOCKS}"):
            TierConfig(**{field: MAX_CALL_BLOCKS + 1})
