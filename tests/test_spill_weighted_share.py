"""Weighted fair shares of the spill tiers: a tenant's weight travels with its puts.

Regression: the spill RAM and disk tiers evicted the holder holding the most whatever its
tenant's ``weight``; a spill put carried no weight at all. Now a cache node sends its latest
known weight of the namespace's holder with each put (``TransferWorker``), the spill store
checks it as untrusted input (a positive finite number, as a tenant spec's) and evicts the
holder holding the most per unit of weight in both tiers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.base import TenantShare
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import BLOCK, FMT
from tests.test_tier_engine import store_for, tiered


def blocks_of(holder: str, start: int, n: int) -> tuple[list[bytes], np.ndarray]:
    tag = {"a": 1, "b": 2}[holder]
    hashes = [bytes([tag]) + i.to_bytes(4, "little") + bytes(27) for i in range(start, start + n)]
    return hashes, np.full((n, *FMT.shape), tag, dtype=np.float32)


def held_by(store: SpillStore, tier: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for block_hash, where in store.held():
        if where == tier:
            holder = {1: "a", 2: "b"}[block_hash[0]]
            out[holder] = out.get(holder, 0) + 1
    return out


def test_spill_ram_splits_3_to_1_by_the_weights_that_come_with_the_puts(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=16 * BLOCK, disk_bytes=0, demote_low_watermark=1.0)
    for k in range(20):
        for holder, weight in (("a", 3.0), ("b", 1.0)):
            hashes, blocks = blocks_of(holder, 4 * k, 4)
            store.put(hashes, blocks, f"tenant:{holder}", weight=weight)
    assert held_by(store, "spill_ram") == {"a": 12, "b": 4}
    assert store.weights.known() == {"tenant:a": 3.0}


def test_spill_disk_evicts_files_by_bytes_per_weight(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=1 << 30, max_blocks_per_file=4)
    store.put(*blocks_of("a", 0, 4), "tenant:a", weight=3.0)
    file_bytes = store.stats()["disk_bytes"]
    store.close()  # a restart: the old process is gone, its lock with it
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=8 * file_bytes, max_blocks_per_file=4)
    assert store.weights.known() == {}  # rebuilt from disk: weight 1 until the next put
    for k in range(1, 12):
        for holder, weight in (("a", 3.0), ("b", 1.0)):
            store.put(*blocks_of(holder, 4 * k, 4), f"tenant:{holder}", weight=weight)
    assert store.stats()["files"] == 8
    assert held_by(store, "spill_disk") == {"a": 24, "b": 8}  # 6 files and 2


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -2.0, "3", None, True])
def test_a_put_with_a_weight_out_of_bounds_is_refused_and_stores_nothing(tmp_path: Path, bad: object) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=16 * BLOCK, disk_bytes=0)
    store.put(*blocks_of("a", 0, 2), "tenant:a", weight=2.0)
    with pytest.raises(ValueError, match=r"weight must be a positive finite number \(a tenant's weight\), got"):
        store.put(*blocks_of("a", 2, 2), "tenant:a", weight=bad)  # type: ignore[arg-type]
    assert held_by(store, "spill_ram") == {"a": 2} and store.weights.of("tenant:a") == 2.0
    assert store.take_events()[-1].block_hash == blocks_of("a", 1, 1)[0][0]  # no event for the refused put


def test_a_dropped_tenant_forgets_its_weight(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=16 * BLOCK, disk_bytes=0)
    store.put(*blocks_of("a", 0, 2), "tenant:a#salt=x", weight=4.0)
    assert store.weights.known() == {"tenant:a": 4.0}
    assert store.drop_namespace("tenant:a") == 2 and store.weights.known() == {}


def test_the_cache_node_sends_its_latest_known_weight_with_each_put(tiny: LoadedModel, tmp_path: Path) -> None:
    """Through the engine's transfer worker into an in-process spill store: each put carries
    the weight the node learnt from the tenant's requests (1 for a tenant it has none for)."""
    eng = tiered(tiny)
    eng = tiered(tiny, spill=store_for(eng, tmp_path), host_bytes=0)
    store = eng.tiers.spill
    assert isinstance(store, SpillStore)
    eng.scheduler.policy.set_tenant("a", TenantShare(weight=2.5))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.generate([[(5 * i) % 400 + 3 for i in range(40)]], params, tenant="a", cache_namespace="tenant:a")
    eng.generate([[(3 * i) % 400 + 3 for i in range(40)]], params, tenant="b", cache_namespace="tenant:b")
    assert eng.demote_all() == 4
    eng.wait_for_transfers()
    assert store.stats()["blocks_spill_ram"] == 4
    assert store.weights.known() == {"tenant:a": 2.5}
