"""A shared namespace of many tenants still spills, cheaply, and a holder's weight stays finite
(``cache_node.tiers.fair_lru``; review R3 of 7c45dde, s36: F4, F6).

Regressions: F4, a cache node's spill put carried every tenant's weight of the namespace's
holder (``HolderWeights.tenants``), and a spill node refuses more than ``MAX_PUT_TENANTS``
(1024): a shared namespace of 1025 tenants could never spill (every put refused, every block
dropped), and a put of 1024 weights cost ~22 ms instead of ~0.5. Now a put carries at most
``PUT_TENANTS`` of them, the next ones in turn (``HolderWeights.put_weight``), and the spill
node's sum reaches every tenant's once their turns came. F6, two finite weights near the
largest float summed to inf: a holder weighing inf holds 0 per weight whatever it holds, so two
such holders fell back to plain LRU against each other. Now a holder weighs at most
``MAX_HOLDER_WEIGHT``.
"""

from __future__ import annotations

import math
from pathlib import Path

from cache_node.tiers.fair_lru import MAX_PUT_TENANTS, HolderWeights, check_put_weight
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import BLOCK, FMT, hashes_of, make_blocks
from tests.test_tier_engine import PARAMS, prompt_of, tiered

TEAM = "ns:team"
TENANTS = 1500  # past MAX_PUT_TENANTS


def team_weights() -> HolderWeights:
    """A cache node's weights: ``TENANTS`` tenants of weight 1 (one of weight 2) share TEAM."""
    weights = HolderWeights()
    for i in range(TENANTS):
        weights.set(TEAM, 2.0 if i == 7 else 1.0, f"t{i}")
    return weights


def test_a_namespace_of_more_tenants_than_a_put_may_carry_spills_and_weighs_them_all(tmp_path: Path) -> None:
    """Puts of TEAM's blocks from a cache node knowing 1500 tenants: each is stored, carries
    few weights, and after enough puts the spill store weighs the team as all 1500 together."""
    from cache_node.tiers.fair_lru import PUT_TENANTS

    assert TENANTS > MAX_PUT_TENANTS >= PUT_TENANTS
    weights = team_weights()
    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=200 * BLOCK, disk_bytes=0)
    turns = math.ceil(TENANTS / PUT_TENANTS)
    for n in range(turns):
        weight = weights.put_weight(TEAM)
        assert isinstance(weight, dict) and len(weight) == PUT_TENANTS and check_put_weight(weight) == weight
        assert store.put(hashes_of([n]), make_blocks([n]), TEAM, [[n, 1, 2, 3]], weight) == 1
    assert store.weights.of(TEAM) == TENANTS + 1.0
    assert store.weights.tenants(TEAM) == weights.tenants(TEAM)
    # a holder of few tenants: every one of them, every put; none known: its own weight
    few = HolderWeights()
    few.set("ns:pair", 3.0, "A")
    few.set("ns:pair", 1.0, "B")
    assert few.put_weight("ns:pair") == few.put_weight("ns:pair") == {"A": 3.0, "B": 1.0}
    few.set("tenant:c", 4.0)
    assert few.put_weight("tenant:c") == 4.0 and few.put_weight("tenant:unknown") == 1.0
    store.close()


def test_an_engine_spills_a_namespace_shared_by_more_tenants_than_a_put_may_carry(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The cache node's own put path (``TransferWorker``): its requests told it of 1500 tenants
    naming TEAM; demoting a prompt's TEAM blocks to a real spill store stores every one (old:
    every put refused, ``spill_put_errors``, nothing stored)."""
    probe = tiered(tiny)
    store = SpillStore(tmp_path / "spill", BlockFormat(*probe.spill_block_spec()), 1 << 20, 1 << 24)
    eng = tiered(tiny, spill=store, auto_prefetch=False)
    for i in range(TENANTS):
        eng.tiers.note_weight(TEAM, 1.0, f"t{i}")
    eng.generate([prompt_of(160, 3)], PARAMS, cache_namespace=TEAM)
    eng.demote_all(to_spill=True)
    assert eng.wait_for_transfers()
    stats = eng.stats()
    assert stats.get("spill_put_errors", 0) == 0 and stats["spill_put_blocks"] == 10
    assert store.stats()["blocks_spill_ram"] + store.stats()["blocks_spill_disk"] == 10
    assert 1.0 < store.weights.of(TEAM) <= TENANTS
    store.close()


def test_a_holders_weight_stays_finite_and_its_fair_share_holds(tmp_path: Path) -> None:
    """Two holders whose tenants' weights sum past the largest float weigh the same finite
    ``MAX_HOLDER_WEIGHT``: the one that streams evicts its own blocks, not the other's few
    (old: both weighed inf, held 0 per weight, and the oldest blocks, the other's, went)."""
    from cache_node.tiers.fair_lru import MAX_HOLDER_WEIGHT

    big = {"a": 1.7e308, "b": 1.7e308}
    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=10 * BLOCK, disk_bytes=0, demote_low_watermark=1.0)
    store.put(hashes_of([0, 1, 2]), make_blocks([0, 1, 2]), "ns:quiet", [[n, 1, 2, 3] for n in range(3)],
              {"q": 1.7e308, "r": 1.7e308})
    for n in range(10, 40):
        store.put(hashes_of([n]), make_blocks([n]), "ns:loud", [[n, 1, 2, 3]], big)
    assert store.weights.of("ns:loud") == store.weights.of("ns:quiet") == MAX_HOLDER_WEIGHT
    assert math.isfinite(MAX_HOLDER_WEIGHT)
    assert store.contains(hashes_of([0, 1, 2])) == ["spill_ram"] * 3  # under its share: kept
    weights = HolderWeights()
    weights.set("ns:x", 1.7e308, "a")
    weights.set("ns:x", 1.7e308, "b")
    assert weights.of("ns:x") == MAX_HOLDER_WEIGHT
    store.close()


def test_a_refreshed_weight_keeps_the_cached_sum_and_lapses_still_count() -> None:
    """A put's or request's weight equal to the one known refreshes the entry without summing
    the holder anew (what makes a put of a many-tenant holder cheap), and every lapse still
    counts at its time: the refreshed entry is newest, the entry that was newest lapses after
    its own TTL."""
    now = [0.0]
    weights = HolderWeights(ttl_s=10, clock=lambda: now[0])
    weights.set(TEAM, 5, "A")
    now[0] = 1.0
    weights.set(TEAM, 1, "B")
    assert weights.of(TEAM) == 6.0
    now[0] = 9.0
    weights.set(TEAM, 5, "A")  # a refresh: A newest now, B (set at 1) lapses at 11
    assert weights.of(TEAM) == 6.0
    now[0] = 10.5
    assert weights.of(TEAM) == 6.0 and weights.put_weight(TEAM) == {"A": 5.0, "B": 1.0}
    now[0] = 11.5
    assert weights.of(TEAM) == 5.0 and weights.put_weight(TEAM) == {"A": 5.0}
    weights.set(TEAM, 2, "A")  # a changed weight counts at once
    assert weights.of(TEAM) == 2.0


def test_tenants_set_at_one_clock_value_still_lapse() -> None:
    """Regression (review s36 R4 N1): every entry whose set time tied the newest counted as
    newest, so with a coarse clock the cached sum never ended and a silent tenant never lapsed
    (nor left the puts' weights)."""
    t = [0.0]
    weights = HolderWeights(ttl_s=600.0, clock=lambda: t[0])
    weights.merge("ns", {"a": 3.0, "b": 1.0, "c": 2.0})  # one spill put's merge, one clock value
    assert weights.of("ns") == 6.0
    for k in range(1, 8):  # only b keeps sending (refreshes: the same weight)
        t[0] = 200.0 * k
        weights.merge("ns", {"b": 1.0})
        assert weights.of("ns") == (6.0 if t[0] < 600.0 else 1.0), t[0]
    assert weights.put_weight("ns") == {"b": 1.0} and weights.tenants("ns") == {"b": 1.0}
