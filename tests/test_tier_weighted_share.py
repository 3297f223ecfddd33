"""Weighted fair shares of the tiers below the device (``cache_node.tiers.fair_lru``).

Regression: the host tier, the spill-put backlog and the spill RAM and disk tiers evicted the
holder holding the most, whatever its tenant's ``weight``: a weight-4 tenant kept no more of a
full tier than a weight-1 one, while the schedulers (``scheduling.vtc``) served it 4x the
tokens. Eviction now takes the holder holding the most per unit of weight (held / weight).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.base import TenantShare
from cache_node.tiers.fair_lru import MAX_HOLDER_WEIGHTS, FairLRU, HolderWeights, check_weight
from cache_node.tiers.host import BlockMeta, HostTier
from cache_node.tiers.manager import TierConfig
from services.gateway import salted_namespace


def fill(lru: FairLRU[str, int], capacity: int, rounds: int, holders: str = "AB") -> None:
    """Each holder in turn puts one new entry; past ``capacity`` the victims go."""
    for n in range(rounds):
        for holder in holders:
            lru.put(f"{holder}{n}", n, holder)
            for key in lru.victims(len(lru) - capacity):
                lru.pop(key)


def test_two_holders_of_weights_3_and_1_fill_a_tier_3_to_1() -> None:
    weights = HolderWeights()
    weights.set("A", 3)
    lru: FairLRU[str, int] = FairLRU(weights)
    fill(lru, capacity=40, rounds=200)
    assert lru.held() == {"A": 30, "B": 10}
    # each keeps its most recent entries
    assert sorted(k for k in lru if lru.holder(k) == "B") == sorted(f"B{n}" for n in range(190, 200))


def test_fractional_weights_split_a_tier_in_their_ratio() -> None:
    weights = HolderWeights()
    weights.set("A", 0.5)
    weights.set("B", 1.5)
    weights.set("C", 2.0)
    lru: FairLRU[str, int] = FairLRU(weights)
    fill(lru, capacity=40, rounds=100, holders="ABC")
    assert lru.held() == {"A": 5, "B": 15, "C": 20}


def test_all_weights_1_evict_as_the_unweighted_store() -> None:
    """The order of ``test_tier_fair_share``'s first test, with every weight set to 1."""
    weights = HolderWeights()
    weights.set("A", 1)
    weights.set("B", 1.0)
    lru: FairLRU[str, int] = FairLRU(weights)
    for i in range(2):
        lru.put(f"b{i}", i, "B")
    for i in range(5):
        lru.put(f"a{i}", i, "A")
    lru.touch("a0")
    assert lru.victims(5) == ["a1", "a2", "a3", "b0", "a4"]
    fill(lru, capacity=10, rounds=50)
    assert lru.held() == {"A": 5, "B": 5}


def test_an_incoming_batch_is_refused_past_its_weighted_share() -> None:
    weights = HolderWeights()
    weights.set("B", 3)
    lru: FairLRU[str, int] = FairLRU(weights)
    for i in range(6):
        lru.put(f"b{i}", i, "B")
    # 8 slots, 2 free, A (weight 1) brings 6: B's 6 of weight 3 is 2 per weight, so A gets 2
    plan = lru.plan(4, {"A": 6})
    assert plan.keys == [] and plan.refused == {"A": 4}
    # B (weight 3) brings 6 more into a tier where A holds 4: A keeps 2 (2 per weight each)
    lru2: FairLRU[str, int] = FairLRU(weights)
    for i in range(4):
        lru2.put(f"a{i}", i, "A")
    plan = lru2.plan(2, {"B": 6})
    assert plan.keys == ["a0", "a1"] and plan.refused == {}


def test_pinned_room_counts_per_weight() -> None:
    weights = HolderWeights()
    weights.set("A", 2)
    lru: FairLRU[str, int] = FairLRU(weights)
    for i in range(3):
        lru.put(f"a{i}", i, "A")
        lru.put(f"b{i}", i, "B")
    # A: 3 held + 4 pinned = 7, 3.5 per weight; B: 3
    assert lru.plan(2, pinned={"A": 4}).keys == ["a0", "b0"]


def test_a_lowered_weight_applies_from_the_next_eviction() -> None:
    weights = HolderWeights()
    weights.set("A", 3)
    lru: FairLRU[str, int] = FairLRU(weights)
    fill(lru, capacity=40, rounds=100)
    assert lru.held() == {"A": 30, "B": 10}
    weights.set("A", 1)  # nothing is evicted by the change itself
    assert lru.held() == {"A": 30, "B": 10}
    assert lru.victims(3) == ["A70", "A71", "A72"]  # A is over its share now
    fill(lru, capacity=40, rounds=40)  # B's inserts take A's room until both hold 20
    assert lru.held() == {"A": 20, "B": 20}


def test_a_holder_with_unknown_weight_counts_as_1() -> None:
    weights = HolderWeights()
    assert weights.of("never-seen") == 1.0
    weights.set("A", 4)
    weights.forget("A")
    assert weights.of("A") == 1.0 and weights.known() == {}
    weights.set("B", 2)
    weights.set("B", 1)  # back to the default: nothing is remembered
    assert weights.known() == {}


def test_weights_are_bounded_least_recently_set_forgotten_first() -> None:
    weights = HolderWeights(max_holders=2)
    for holder, w in (("A", 2), ("B", 3), ("A", 5), ("C", 4)):
        weights.set(holder, w)
    assert weights.known() == {"A": 5.0, "C": 4.0}
    assert HolderWeights().max_holders == MAX_HOLDER_WEIGHTS
    with pytest.raises(ValueError, match="max_holders"):
        HolderWeights(0)


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, math.inf, -math.inf, True, "2", None, [2]])
def test_a_weight_outside_the_tenant_spec_bounds_is_refused(bad: object) -> None:
    weights = HolderWeights()
    with pytest.raises(ValueError, match=r"weight must be a positive finite number \(a tenant's weight\), got"):
        weights.set("A", bad)
    assert weights.of("A") == 1.0
    with pytest.raises(ValueError):
        check_weight(bad)
    assert check_weight(3) == 3.0 and check_weight(1e-3) == 1e-3


OPS = st.lists(st.tuples(st.sampled_from("ptvxw"), st.integers(0, 11), st.sampled_from("ABC")), max_size=80)


@settings(max_examples=200, deadline=None)
@given(OPS, st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]), min_size=3, max_size=3))
def test_no_holder_is_evicted_while_another_holds_more_per_weight(
    ops: list[tuple[str, int, str]], initial: list[float]
) -> None:
    """Against a plain model (one list of keys per holder in LRU order): each pick is the head
    of a holder whose holding per weight is the largest at that moment, and of those the one
    whose head is oldest; weights change between ops ("w")."""
    weights = HolderWeights()
    for holder, w in zip("ABC", initial):
        weights.set(holder, w)
    lru: FairLRU[int, int] = FairLRU(weights)
    order: dict[str, list[int]] = {}
    age: dict[int, int] = {}  # key -> its recency (larger: more recently used)
    for clock, (op, key, holder) in enumerate(ops):
        if op == "p" and key not in lru:
            lru.put(key, key, holder)
            order.setdefault(holder, []).append(key)
            age[key] = clock
        elif op == "t" and key in lru:
            lru.touch(key)
            owner = lru.holder(key)
            order[owner].remove(key)
            order[owner].append(key)
            age[key] = clock
        elif op == "x" and key in lru:
            assert lru.pop(key) == key
            order[next(h for h, keys in order.items() if key in keys)].remove(key)
        elif op == "w":
            weights.set(holder, [0.25, 0.5, 1.0, 2.0, 3.0][key % 5])
        elif op == "v":
            need = key % 6
            picks = lru.victims(need)
            assert len(picks) == min(need, len(lru))
            left = {h: list(keys) for h, keys in order.items() if keys}
            for pick in picks:
                owner = next(h for h, keys in left.items() if keys[0] == pick)
                share = {h: len(keys) / weights.of(h) for h, keys in left.items()}
                assert share[owner] == max(share.values()), (pick, share)
                tied = [h for h in left if share[h] == share[owner]]
                assert age[pick] == min(age[left[h][0]] for h in tied)
                left[owner].pop(0)
                left = {h: keys for h, keys in left.items() if keys}
    assert lru.held() == {h: len(keys) for h, keys in order.items() if keys}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("AB"), st.integers(1, 4)), min_size=1, max_size=200),
       st.sampled_from([1.0, 2.0, 3.0, 4.0]))
def test_a_full_tier_keeps_each_active_holder_near_its_weighted_share(
    puts: list[tuple[str, int]], weight_a: float
) -> None:
    """Puts of random batches into a full tier of 24: once both holders have put enough, each
    holds its weighted share of the tier within one batch (the max-min fair split)."""
    weights = HolderWeights()
    weights.set("A", weight_a)
    lru: FairLRU[str, int] = FairLRU(weights)
    capacity, n = 24, 0
    for holder, batch in puts:
        plan = lru.plan(len(lru) + batch - capacity, {holder: batch})
        for key in plan.keys:
            lru.pop(key)
        for _ in range(batch - plan.refused.get(holder, 0)):
            n += 1
            lru.put(f"{holder}{n}", n, holder)
        assert len(lru) <= capacity
    held = lru.held()
    if sum(b for h, b in puts if h == "A") >= capacity and sum(b for h, b in puts if h == "B") >= capacity:
        fair_a = capacity * weight_a / (weight_a + 1)
        assert abs(held.get("A", 0) - fair_a) <= 4 and len(lru) == capacity


# ---- host tier reservations -------------------------------------------------------------------


def test_a_reservation_takes_room_per_weight() -> None:
    """A weight-3 tenant may reserve host slots until it holds 3 per slot a weight-1 tenant
    keeps (its own entries going first); unweighted, until it holds as many."""
    weights = HolderWeights()
    weights.set("tenant:a", 3)
    shape, block = (1, 2, 8, 1, 1, 1), 2 * 4  # (L, 2, num_blocks, block_size, H_kv, d) float32
    src = torch.zeros(shape)

    def tier(w: HolderWeights | None) -> HostTier:
        host = HostTier(shape, torch.float32, budget_bytes=8 * block, weights=w)
        host.put([BlockMeta(bytes([i]) * 32, (i,), "tenant:b") for i in range(4)], src, list(range(4)))
        host.put([BlockMeta(bytes([9 + i]) * 32, (i,), "tenant:a") for i in range(2)], src, [4, 5])
        return host

    host = tier(weights)
    assert not host.can_reserve(7, "tenant:a")  # 7 reserved of weight 3 vs b's 2 left: over
    slots, victims = host.reserve(6, "tenant:a")  # 6 of weight 3 (2 a unit) vs b's 2
    assert slots is not None and [m.block_hash[0] for m in victims.metas] == [0, 1, 9, 10]
    assert host.entries.held() == {"tenant:b": 2} and host.reserved_by == {"tenant:a": 6}
    unweighted = tier(None)
    assert not unweighted.can_reserve(5, "tenant:a") and unweighted.can_reserve(4, "tenant:a")


# ---- host tier through the engine -----------------------------------------------------------

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama float32 block (block_size 16)


def weighted_engine(tiny: LoadedModel, host_blocks: int, weights: dict[str, float]) -> LLMEngine:
    cfg = EngineConfig(block_size=16, kv_pool_bytes=64 * BLOCK_BYTES, max_num_batched_tokens=64, max_num_seqs=8)
    eng = LLMEngine(tiny.model, cfg, tiny.model_id, tiny.eos_token_ids,
                    tier_config=TierConfig(host_bytes=host_blocks * BLOCK_BYTES))
    for tenant, weight in weights.items():  # as ``services.cache_node_requests`` sets them
        eng.scheduler.policy.set_tenant(tenant, TenantShare(weight=weight))
    return eng


def run_and_demote(eng: LLMEngine, tenant: str, k: int) -> list[int]:
    """One request of ``tenant`` (namespace ``tenant:<tenant>``) with a fresh 6-block prompt,
    its blocks then demoted to the host tier; returns its output tokens."""
    prompt = [(7 * i + 31 * k + (0 if tenant == "a" else 200)) % 400 + 3 for i in range(100)]
    out = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), tenant=tenant,
                       cache_namespace=f"tenant:{tenant}")[0]
    eng.demote_all()
    return out.output_token_ids


def host_holders(eng: LLMEngine) -> dict[str, int]:
    return eng.tiers.host.entries.held()


def test_two_tenants_of_weights_3_and_1_share_the_host_tier_3_to_1(tiny: LoadedModel) -> None:
    """Through the engine: tenant a (weight 3) and b (weight 1) each run 6-block prompts in
    turn; the 12-slot host tier ends at 9:3 (it was 6:6 before weights counted), and a's
    newest prompt is served whole from the host tier."""
    eng = weighted_engine(tiny, 12, {"a": 3.0, "b": 1.0})
    for k in range(3):
        run_and_demote(eng, "a", k)
        run_and_demote(eng, "b", k)
        eng.check_integrity()
    assert host_holders(eng) == {"tenant:a": 9, "tenant:b": 3}
    assert eng.tiers.weights.known() == {"tenant:a": 3.0}
    prompt = [(7 * i + 31 * 2) % 400 + 3 for i in range(100)]
    again = eng.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), tenant="a",
                         cache_namespace="tenant:a")[0]
    assert again.num_cached_tokens_by_tier["host"] == 96


def test_a_tenants_changed_weight_reaches_the_host_tier_with_its_next_request(tiny: LoadedModel) -> None:
    """The node learns a weight from the requests it runs: a's weight falls from 3 to 1 (the
    scheduler sends the new spec with a's next request); nothing is evicted at the change, and
    b's next prompts take a's room until both hold 6."""
    eng = weighted_engine(tiny, 12, {"a": 3.0, "b": 1.0})
    for k in range(2):
        run_and_demote(eng, "a", k)
        run_and_demote(eng, "b", k)
    assert host_holders(eng) == {"tenant:a": 9, "tenant:b": 3}
    eng.scheduler.policy.set_tenant("a", TenantShare(weight=1.0))
    run_and_demote(eng, "b", 5)  # b's request carries no news of a: a still weighs 3
    assert host_holders(eng) == {"tenant:a": 9, "tenant:b": 3}
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=1), tenant="a", cache_namespace="tenant:a")
    assert eng.tiers.weights.of("tenant:a") == 1.0 and host_holders(eng)["tenant:a"] == 9
    run_and_demote(eng, "b", 6)
    assert host_holders(eng) == {"tenant:a": 6, "tenant:b": 6}


def test_a_salted_or_unknown_tenant_weighs_as_its_holder(tiny: LoadedModel) -> None:
    """A tenant the node has no share for weighs 1; a salted namespace counts as its
    holder's, weight included."""
    eng = weighted_engine(tiny, 12, {"a": 3.0})
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=1), tenant="a",
                 cache_namespace=salted_namespace("tenant:a", "s1"))
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=1), tenant="stranger", cache_namespace="tenant:x")
    assert eng.tiers.weights.known() == {"tenant:a": 3.0} and eng.tiers.weights.of("tenant:x") == 1.0
