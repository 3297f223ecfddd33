"""A shared namespace's weight in the tiers' fair shares (``cache_node.tiers.fair_lru``; s36 fault 3).

Tenants whose specs name one ``cache_namespace`` share one holder (its blocks, counted together).
Regression: that holder took the weight of the latest request (cache node) or spill put (spill
node) naming it, so with tenants A (weight 3) and B (weight 1) sharing "team" beside C (weight 1)
in its own namespace, the team's share of a full tier flipped with whoever sent last: after one
of B's requests or puts, C took half of the tier instead of a fifth (A lost its share to C), and
after one of A's, B's blocks counted at A's weight. Now the holder weighs its tenants' weights
together (3 + 1: the tier splits 4:1 whoever sent last), each tenant's the latest known of it
(a spec update replaces it; a tenant whose spec names another namespace leaves the old one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cache_node.tiers.fair_lru import MAX_PUT_TENANTS, FairLRU, HolderWeights
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import BLOCK, FMT, hashes_of, make_blocks

TEAM, OWN_C = "ns:team", "tenant:C"
WEIGHT = {"A": 3.0, "B": 1.0, "C": 1.0}
HOLDER = {"A": TEAM, "B": TEAM, "C": OWN_C}


def test_a_shared_namespace_weighs_its_tenants_together_whoever_sent_last() -> None:
    """The cache node's tiers (host tier, spill-put backlog): each request notes its tenant's
    weight for its namespace's holder. A and C fill 40 slots, then B and C go on: the team
    (3 + 1) ends at 32:8 (old: 20:20, the team weighing B's 1 once B's requests were the
    latest: A's share went to C)."""
    weights = HolderWeights()
    lru: FairLRU[str, int] = FairLRU(weights)
    for n in range(120):
        for tenant in ("AC" if n < 60 else "BC"):
            weights.set(HOLDER[tenant], WEIGHT[tenant], tenant)
            lru.put(f"{tenant}{n}", n, HOLDER[tenant])
            for key in lru.victims(len(lru) - 40):
                lru.pop(key)
    assert weights.of(TEAM) == 4.0 and weights.of(OWN_C) == 1.0
    assert lru.held() == {TEAM: 32, OWN_C: 8}


def test_a_spill_node_sums_the_tenants_its_cache_nodes_tell_of(tmp_path: Path) -> None:
    """Two cache nodes: one ran A's requests, the other B's; their puts of the team's blocks
    carry the weights they know (``HolderWeights.tenants``): the spill store weighs the team 4
    against C's 1. A and C fill a RAM of 20 blocks, then B and C go on: 16:4 (old: 10:10; the
    disk budget 0 drops what RAM evicts)."""
    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=20 * BLOCK, disk_bytes=0, demote_low_watermark=1.0)
    for n in range(80):
        for tenant in ("AC" if n < 40 else "BC"):
            store.put(hashes_of([2 * n + (tenant == "C")]), make_blocks([n]), HOLDER[tenant],
                      [[n, 1, 2, 3]], {tenant: WEIGHT[tenant]})
    assert store.weights.of(TEAM) == 4.0
    held = {TEAM: 0, OWN_C: 0}
    for n in range(80):
        for tenant in ("AC" if n < 40 else "BC"):
            if store.contains(hashes_of([2 * n + (tenant == "C")])) != [None]:
                held[HOLDER[tenant]] += 1
    assert held == {TEAM: 16, OWN_C: 4}
    # a put from a node that knows none of the team's tenants (a float) changes nothing
    store.put(hashes_of([999]), make_blocks([0]), TEAM, [[0, 1, 2, 3]], 1.0)
    assert store.weights.of(TEAM) == 4.0
    store.close()


def test_a_spec_update_or_a_move_to_another_namespace_replaces_the_tenants_weight() -> None:
    weights = HolderWeights()
    weights.set(TEAM, 3, "A")
    weights.set(TEAM, 1, "B")
    weights.set(TEAM, 3, "A")  # a later request of A's: counted once
    assert weights.of(TEAM) == 4.0 and weights.tenants(TEAM) == {"A": 3.0, "B": 1.0}
    weights.set(TEAM, 0.5, "A")  # A's spec now says weight 0.5
    assert weights.of(TEAM) == 1.5
    weights.set("ns:other", 0.5, "A")  # A's spec now names another namespace
    assert weights.of(TEAM) == 1.0 and weights.of("ns:other") == 0.5 and weights.tenants(TEAM) == {"B": 1.0}
    weights.forget(TEAM)  # a deleted tenant's namespace
    assert weights.of(TEAM) == 1.0 and weights.tenants(TEAM) == {}


def test_a_tenant_not_heard_of_lapses_while_others_use_the_namespace() -> None:
    """A tenant deleted (or idle) for ``ttl_s`` no longer weighs for a namespace others still
    use; the latest tenant's weight always counts (an idle tenant's own namespace keeps it)."""
    now = [0.0]
    weights = HolderWeights(ttl_s=600, clock=lambda: now[0])
    weights.set(TEAM, 5, "gone")
    weights.set(OWN_C, 4, "C")
    now[0] = 300
    weights.set(TEAM, 1, "B")
    assert weights.of(TEAM) == 6.0
    now[0] = 650
    assert weights.of(TEAM) == 1.0 and weights.tenants(TEAM) == {"B": 1.0}
    now[0] = 10**6
    assert weights.of(TEAM) == 1.0 and weights.of(OWN_C) == 4.0


@pytest.mark.parametrize("bad", [{}, {"A": 0}, {"A": float("nan")}, {"A": True}, {"A": "3"}, {3: 1.0}, {"": 1.0},
                                 {"x" * 257: 1.0}, {f"t{i}": 1.0 for i in range(MAX_PUT_TENANTS + 1)}, [("A", 1.0)]])
def test_a_puts_tenant_weights_are_checked_before_anything_is_stored(tmp_path: Path, bad: object) -> None:
    """A spill put's weights come off the network: anything but 1 to ``MAX_PUT_TENANTS``
    tenant ids (text of 1 to 256 characters) with positive finite weights is refused, nothing
    stored, no weight changed."""
    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=20 * BLOCK, disk_bytes=0)
    store.put(hashes_of([1]), make_blocks([1]), TEAM, [[1, 1, 2, 3]], {"A": 3.0})
    with pytest.raises(ValueError, match="weight"):
        store.put(hashes_of([2]), make_blocks([2]), TEAM, [[2, 1, 2, 3]], bad)  # type: ignore[arg-type]
    assert store.contains(hashes_of([2])) == [None] and store.weights.tenants(TEAM) == {"A": 3.0}
    store.close()
