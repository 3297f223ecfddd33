"""Admission within a class follows the node's weighted fair order (review 28b F1).

The kvstrata node serves a class interleaved across tenants by VTC, weighted; admission's fluid
backlog is kept per (class, tenant) and a request counts its own tenant's backlog plus, of each
other tenant of its class, the weighted share served meanwhile (``FluidBacklog.ahead``).
Plain ``GlobalScheduler`` for the scheduler-level tests, no Ray started.
"""

from __future__ import annotations

import pytest

from cache_node.scheduling.admission import FluidBacklog
from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec


def test_a_same_class_flood_delays_its_own_tenant_and_others_only_by_their_share() -> None:
    q = FluidBacklog()
    for _ in range(8):  # a flooder's eight 1,300-token prompts, interactive, weight 4
        q.add(0, "atk", 1300.0, 4.0)
    q.add(2, "bulk", 50_000.0, 1.0)  # a worse class never counts
    # the victim's 60-token request: the node interleaves it with the flood, 60 of each
    assert q.ahead(0, "vic", 60.0, 4.0) == pytest.approx(60.0)
    # the flooder's own next request waits behind its whole backlog
    assert q.ahead(0, "atk", 1300.0, 4.0) == pytest.approx(10_400.0)
    # weights shift the share: 60 * 4 / 1 of the flood before a weight-1 victim, 60 * 4 / 8 at 8
    assert q.ahead(0, "vic", 60.0, 1.0) == pytest.approx(240.0)
    assert q.ahead(0, "vic", 60.0, 8.0) == pytest.approx(30.0)
    # a better class counts whole, and at most a tenant's backlog counts
    assert q.ahead(2, "other", 10.0, 1.0) == pytest.approx(10_400.0 + 10.0)
    assert q.ahead(0, "vic", 1e9, 4.0) == pytest.approx(10_400.0)
    # one FCFS pool: everything is ahead
    fcfs = FluidBacklog(class_order=False)
    fcfs.add(0, "atk", 1000.0, 4.0)
    fcfs.add(2, "bulk", 500.0, 1.0)
    assert fcfs.ahead(0, "vic", 60.0, 4.0) == 1500.0


def test_the_backlog_drains_by_class_then_by_weight_and_drops_drained_tenants() -> None:
    q = FluidBacklog()
    q.add(1, "a", 1000.0, 4.0)
    q.add(1, "b", 1000.0, 1.0)
    q.add(0, "i", 100.0, 4.0)
    q.add(0, "none", 0.0, 4.0)  # nothing uncached: no entry
    assert q.by_tenant == {(1, "a"): 1000.0, (1, "b"): 1000.0, (0, "i"): 100.0}
    q.drain(now_s=0.6, tokens_per_s=1000.0)  # 600: the interactive 100, then 400 : 100
    assert q.by_tenant == pytest.approx({(1, "a"): 600.0, (1, "b"): 900.0})
    assert q.by_rank == pytest.approx({1: 1500.0})
    q.drain(now_s=1.8, tokens_per_s=1000.0)  # 1200: a's 600 (b gets 150 meanwhile), b 450 more
    assert q.by_tenant == pytest.approx({(1, "b"): 300.0}) and q.weights == {"b": 1.0}
    q.drain(now_s=3.0, tokens_per_s=1000.0)
    assert q.by_tenant == {} and q.weights == {}  # bounded: drained tenants are forgotten


def test_weighted_drain_matches_what_each_tenant_is_served() -> None:
    q = FluidBacklog()
    q.add(0, "a", 300.0, 2.0)
    q.add(0, "b", 1000.0, 1.0)
    q.add(0, "c", 1000.0, 1.0)
    q.drain(now_s=1.0, tokens_per_s=800.0)  # level 200: a 400 > 300 runs dry at 150; then 250 each
    assert q.by_tenant == pytest.approx({(0, "b"): 750.0, (0, "c"): 750.0})
    assert q.weights == {"b": 1.0, "c": 1.0}


def test_extreme_weights_stay_finite() -> None:
    """A spec's weight is any positive finite number: 1e308 twice summed to inf, and the drain's
    inf * 0 made the backlog NaN (every later estimate on the node NaN). Weights are held within
    ``BACKLOG_WEIGHT_RANGE``."""
    q = FluidBacklog()
    q.add(0, "huge", 1000.0, 1e308)
    q.add(0, "huge2", 1000.0, 1e308)
    q.add(0, "tiny", 1000.0, 1e-300)
    assert q.ahead(0, "tiny", 10.0, 1e-300) == pytest.approx(3000.0)
    assert q.ahead(0, "new", 0.0, 1e308) == 0.0
    q.drain(now_s=1.0, tokens_per_s=1500.0)
    assert q.by_tenant == pytest.approx({(0, "huge"): 250.0, (0, "huge2"): 250.0, (0, "tiny"): 1000.0}, rel=1e-6)
    with pytest.raises(ValueError, match="weight must be positive"):
        q.add(0, "bad", 10.0, 0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _scheduler(tmp_path, specs: list[TenantSpec]) -> tuple[GlobalScheduler, dict[str, str], Clock]:
    clock = Clock()
    gs = GlobalScheduler(str(tmp_path), {"n0": 64}, queue_limit=1000, scheduler="kvstrata", clock=clock)
    ids = {}
    for spec in specs:
        tenant, key = gs.register_tenant(spec)
        gs.authenticate(key)
        ids[spec.name] = tenant.tenant_id
    gs.nodes["n0"].prefill.set(1000.0)
    gs.nodes["n0"].step_s.update(0.05)
    return gs, ids, clock


def test_a_same_class_flood_no_longer_gets_another_tenant_refused(tmp_path) -> None:
    """The review's attack through the real admission path: an interactive tenant keeps eight
    1,300-token prompts coming (each attempt every 0.05 s), another interactive tenant sends a
    60-token request each second. Before: the flood's backlog counted whole ahead of the
    victim, refused whenever it held more than ~0.9 s of prefill. Now the victim is admitted
    every time with a small estimate, and the flood is refused on its own backlog."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("aint", "interactive"), TenantSpec("vic", "interactive")])
    # the flood got in when the node was idle (each prompt misses 1 s alone: admitted then)
    assert gs.admit(ids["aint"], "a0", prompt_tokens=5000).code == "OK"
    victim, flood = [], []
    for tick in range(200):  # 10 s
        clock.t += 0.05
        flood.append(gs.admit(ids["aint"], f"a{tick + 1}", prompt_tokens=1300))
        if tick % 20 == 0:
            victim.append(gs.admit(ids["vic"], f"v{tick}", prompt_tokens=60))
    assert [a.code for a in victim] == ["OK"] * len(victim)
    assert all(a.code == "OK" or a.reason == "ttft_estimate" for a in flood)
    assert sum(a.code == "OK" for a in flood) <= 6  # the flood's own backlog holds it back
    assert gs.usage_of(ids["vic"]).rejected == 0


def test_weight_decides_how_much_of_a_same_class_flood_a_request_waits_for(tmp_path) -> None:
    """A 300-token request behind a 5,000-token backlog of a weight-4 tenant of its class:
    at weight 4 it waits for 300 of it (0.3 + 0.3 + 0.025 s: admitted); at weight 1 for
    1,200 of it and the first's 300 (1.5 + 0.3 + 0.025 s: refused, hinted the 0.825 s it
    misses by)."""
    gs, ids, _ = _scheduler(tmp_path, [TenantSpec("aint", "interactive"),
                                       TenantSpec("peer", "interactive"),
                                       TenantSpec("light", "interactive", weight=1.0)])
    assert gs.admit(ids["aint"], "a0", prompt_tokens=5000).code == "OK"
    assert gs.admit(ids["peer"], "p1", prompt_tokens=300).code == "OK"
    light = gs.admit(ids["light"], "l1", prompt_tokens=300)
    assert (light.code, light.reason) == ("RESOURCE_EXHAUSTED", "ttft_estimate")
    # ahead: the flood's 1,200, and of the peer's 300 all (300 < 1,200 * 4 / 1)
    assert light.retry_after_s == pytest.approx(1.5 + 0.3 + 0.025 - 1.0)
