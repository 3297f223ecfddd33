"""Per-tenant fairness of the tiers below the device (``cache_node.tiers.fair_lru``).

Regression: the host tier, the spill RAM tier and the spill disk tier were one LRU over every
tenant, so a tenant streaming new prefixes (or new ``cache_salt``s) pushed every other
tenant's cached KV out of host RAM and deleted their spill files. Eviction now takes the least
recently used entry of the tenant holding the most first.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.fair_lru import FairLRU, holder_of
from cache_node.tiers.host import BlockMeta, HostTier
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from services.gateway import salted_namespace

SHAPE = (2, 2, 16, 4, 4, 2)  # (L, 2, num_blocks, block_size, H_kv, d)
BLOCK_BYTES = 2 * 2 * 4 * 4 * 2 * 4


def pool_view() -> torch.Tensor:
    base = torch.arange(int(np.prod(SHAPE)), dtype=torch.float32).reshape(SHAPE)
    return base + 1000 * torch.arange(SHAPE[2]).view(1, 1, -1, 1, 1, 1)


def meta(i: int, namespace: str) -> BlockMeta:
    return BlockMeta(bytes([i]) * 32, (i,), namespace)


def holders(host: HostTier) -> Counter[str]:
    return Counter(holder_of(e.namespace) for e in host.entries.values())


# ---- FairLRU ----------------------------------------------------------------------------


def test_victims_come_from_the_largest_holder_lru_first() -> None:
    lru: FairLRU[str, int] = FairLRU()
    for i in range(2):
        lru.put(f"b{i}", i, "B")
    for i in range(5):
        lru.put(f"a{i}", i, "A")
    lru.touch("a0")
    # A holds 5, B 2: A gives its LRU entries (a0 was touched) until it is down to B's 2,
    # then the tie goes to the holder whose LRU entry is oldest (B's b0)
    assert lru.victims(5) == ["a1", "a2", "a3", "b0", "a4"]
    assert len(lru) == 7  # nothing removed


def test_incoming_units_count_as_their_holders_newest() -> None:
    lru: FairLRU[str, int] = FairLRU()
    for i in range(6):
        lru.put(f"b{i}", i, "B")
    # 8 slots, 2 free, A brings 6: the max-min fair split is 4 and 4
    plan = lru.plan(4, {"A": 6})
    assert plan.keys == ["b0", "b1"] and plan.refused == {"A": 2}
    lru.put_lru("old", 0, "B")
    assert lru.victims(1) == ["old"]


def test_byte_sizes() -> None:
    lru: FairLRU[str, int] = FairLRU()
    lru.put("big", 0, "A", size=100)
    lru.put("s1", 0, "B", size=10)
    lru.put("s2", 0, "B", size=10)
    assert lru.victims(20) == ["big"] and lru.held() == {"A": 100, "B": 20}


def test_a_salt_never_makes_a_new_holder() -> None:
    for ns in ("tenant:7f3a", "shared-docs"):
        assert holder_of(salted_namespace(ns, "per-request-salt#x")) == ns == holder_of(ns)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ptvx"), st.integers(0, 11), st.sampled_from("ABC")),
                max_size=60))
def test_victims_match_a_reference_model(ops: list[tuple[str, int, str]]) -> None:
    """Against a plain model (one list of (key, holder) per holder in LRU order): each pick
    is the head of a holder holding at least as much as any other at that moment."""
    lru: FairLRU[int, int] = FairLRU()
    order: dict[str, list[int]] = {}
    for op, key, holder in ops:
        if op == "p" and key not in lru:
            lru.put(key, key, holder)
            order.setdefault(holder, []).append(key)
        elif op == "t" and key in lru:
            lru.touch(key)
            owner = lru.holder(key)
            order[owner].remove(key)
            order[owner].append(key)
        elif op == "x" and key in lru:
            assert lru.pop(key) == key
            order[next(h for h, keys in order.items() if key in keys)].remove(key)
        elif op == "v":
            need = key % 5
            picks = lru.victims(need)
            assert len(picks) == min(need, len(lru))
            left = {h: list(keys) for h, keys in order.items() if keys}
            for pick in picks:
                most = max(len(keys) for keys in left.values())
                owner = next(h for h, keys in left.items() if keys and keys[0] == pick)
                assert len(left[owner]) == most
                left[owner].pop(0)
                left = {h: keys for h, keys in left.items() if keys}
    assert lru.held() == {h: len(keys) for h, keys in order.items() if keys}


# ---- host tier ----------------------------------------------------------------------------


def test_a_flooding_tenant_displaces_its_own_host_blocks_not_anothers() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    src = pool_view()
    host.put([meta(i, "tenant:b") for i in range(4)], src, list(range(4)))
    for batch in range(3):  # A streams new blocks, under a new salt each time
        ns = salted_namespace("tenant:a", f"salt{batch}")
        ids = [20 + 6 * batch + k for k in range(6)]
        victims = host.put([meta(i, ns) for i in ids], src, [k % 16 for k in ids])
        assert {holder_of(m.namespace) for m in victims.metas} <= {"tenant:a"}
        assert holders(host) == {"tenant:b": 4, "tenant:a": 4}
    for i in range(4):  # B's blocks and bytes are all still there
        entry = host.lookup(meta(i, "tenant:b").block_hash, (i,))
        assert entry is not None and torch.equal(host.data[:, :, entry.slot], src[:, :, i])


def test_an_over_share_tenant_is_cut_to_an_equal_share_when_another_arrives() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    src = pool_view()
    host.put([meta(i, "tenant:b") for i in range(6)], src, list(range(6)))
    victims = host.put([meta(10 + i, "tenant:a") for i in range(6)], src, list(range(6, 12)))
    assert holders(host) == {"tenant:b": 4, "tenant:a": 4}
    # A's two oldest incoming never went in (victims straight from the pool view, first);
    # B's two least recently used left
    assert [m.block_hash[0] for m in victims.metas] == [10, 11, 0, 1]
    alone = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    alone.put([meta(i, "tenant:a") for i in range(8)], src, list(range(8)))
    assert holders(alone) == {"tenant:a": 8}  # alone, a tenant may use the whole tier


def test_a_tenants_reservations_count_as_its_holding() -> None:
    """Regression: host slots reserved for SentenceKV sentences belonged to no tenant, and a
    reservation evicted every tenant's LRU entries alike: tenant A's running requests pushed
    tenant B's host blocks out whatever A held."""
    host = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    src = pool_view()
    host.put([meta(i, "tenant:b") for i in range(4)], src, list(range(4)))
    host.put([meta(10 + i, "tenant:a") for i in range(4)], src, list(range(4, 8)))
    first, victims = host.reserve(2, "tenant:a")
    assert first is not None and {holder_of(m.namespace) for m in victims.metas} == {"tenant:a"}
    second, victims = host.reserve(2, "tenant:a")  # A: 2 entries + 2 reserved -> 4 reserved
    assert second is not None and {holder_of(m.namespace) for m in victims.metas} == {"tenant:a"}
    assert host.reserved_by == {"tenant:a": 4} and holders(host) == {"tenant:b": 4}
    assert not host.can_reserve(1, "tenant:a")  # it would hold 5 of 8: B keeps its share
    slots, victims = host.reserve(1, "tenant:a")
    assert slots is None and not victims.metas and holders(host) == {"tenant:b": 4}
    # a third tenant holding nothing may take B's largest share down to its own
    assert host.can_reserve(2, "tenant:c") and not host.can_reserve(3, "tenant:c")
    host.release_slots(first + second, "tenant:a")
    assert host.reserved_by == {} and host.num_reserved == 0
    assert host.can_reserve(4, "tenant:a")  # free slots again


def test_a_tenant_alone_may_reserve_the_whole_host_tier() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    src = pool_view()
    host.put([meta(i, "tenant:a") for i in range(6)], src, list(range(6)))
    slots, victims = host.reserve(8, "tenant:a")
    assert slots is not None and len(victims.metas) == 6 and host.reserved_by == {"tenant:a": 8}


# ---- spill store: RAM and disk -------------------------------------------------------------


def spill_blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 2, 2, 4, 4, 2)).astype(np.float32)


def test_spill_ram_and_disk_evict_the_flooding_tenant_first(tmp_path: Path) -> None:
    fmt = BlockFormat((2, 2, 4, 4, 2), "float32", "fp32")
    nbytes = fmt.block_nbytes
    store = SpillStore(tmp_path, fmt, ram_bytes=8 * nbytes, disk_bytes=40 * nbytes,
                       max_blocks_per_file=4, demote_low_watermark=0.5)
    victim = [bytes([200, i]) * 16 for i in range(4)]
    victim_blocks = spill_blocks(4, 0)
    store.put(victim, victim_blocks, "tenant:b", [[i] for i in range(4)])
    for batch in range(20):  # A writes 160 blocks, 4x the disk budget, salts changing
        hashes = [bytes([batch, k]) * 16 for k in range(8)]
        store.put(hashes, spill_blocks(8, batch + 1), salted_namespace("tenant:a", str(batch)),
                  [[k] for k in range(8)])
    stats = store.stats()
    assert stats["evicted_files"] > 0 and stats["disk_bytes"] <= 40 * nbytes
    hits = store.get(victim, [[i] for i in range(4)])
    assert hits.hashes == victim  # every block of B still served, from RAM or disk
    assert np.array_equal(hits.blocks, victim_blocks)


def test_disk_eviction_keeps_each_tenants_share_across_a_restart(tmp_path: Path) -> None:
    fmt = BlockFormat((2, 2, 4, 4, 2), "float32", "fp32")
    store = SpillStore(tmp_path, fmt, ram_bytes=0, disk_bytes=1 << 30, max_blocks_per_file=4)
    store.put([bytes([1, i]) * 16 for i in range(4)], spill_blocks(4, 1), "tenant:b")
    for batch in range(5):
        store.put([bytes([2, batch * 4 + k]) * 16 for k in range(4)], spill_blocks(4, 2), "tenant:a")
    file_bytes = store.stats()["disk_bytes"] // 6
    store.close()  # a restart: the old process is gone, its lock with it
    again = SpillStore(tmp_path, fmt, ram_bytes=0, disk_bytes=4 * file_bytes, max_blocks_per_file=4)
    # the rebuilt index knows each file's tenant from its header: A's files went
    assert again.match_prefix([bytes([1, i]) * 16 for i in range(4)]) == 4
    assert again.stats()["files"] == 4


# ---- engine: a tenant's cached prefix outlives another's flood ----------------------------


def test_a_tenants_prefix_survives_another_tenants_flood_through_the_engine(tiny: LoadedModel) -> None:
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama float32 block
    cfg = EngineConfig(block_size=16, kv_pool_bytes=64 * block_bytes, max_num_batched_tokens=64,
                       max_num_seqs=8)
    eng = LLMEngine(tiny.model, cfg, tiny.model_id, tiny.eos_token_ids,
                    tier_config=TierConfig(host_bytes=12 * block_bytes))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    b_prompt = [(5 * i) % 400 + 3 for i in range(100)]  # 6 full blocks
    cold = eng.generate([b_prompt], params, cache_namespace="tenant:b")[0]
    assert eng.demote_all() == 6
    for k in range(4):  # A: 4 prompts of 6 full blocks, each salted anew, demoted to host
        a_prompt = [(11 * i + k) % 400 + 7 for i in range(100)]
        eng.generate([a_prompt], params, cache_namespace=salted_namespace("tenant:a", f"s{k}"))
        eng.demote_all()
    again = eng.generate([b_prompt], params, cache_namespace="tenant:b")[0]
    eng.check_integrity()
    assert again.num_cached_tokens_by_tier["host"] == 96  # its whole prefix, from host
    assert again.output_token_ids == cold.output_token_ids
