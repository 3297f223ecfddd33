"""A request that ends takes what is left of its tokens out of the admission backlog
(review 28b F3, F4).

``FluidBacklog`` keeps each admitted request's undrained tokens (drained in arrival order
within its (class, tenant)); ``GlobalScheduler.release`` (any end: finished, cancelled, refused
on its node, an ``n`` > 1 body's choices rolled back) removes that request's remainder. Before,
only the clock drained them: a tenant dropping each request right after admission, or one
client's ``n`` > 1 bodies refused at a later choice, kept other tenants refused on an idle node.
Plain ``GlobalScheduler`` for the scheduler-level tests, no Ray started.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.scheduling.admission import FluidBacklog
from tenants.model import TenantSpec
from tests.test_admission_fairness import _scheduler


def _consistent(q: FluidBacklog) -> None:
    """Each entry is the sum of its requests' parts; every id names the entry holding it."""
    assert set(q.parts) == set(q.by_tenant)
    for key, tokens in q.by_tenant.items():
        assert tokens == pytest.approx(math.fsum(q.parts[key].values()), abs=1e-5)
        assert all(part > 0 for part in q.parts[key].values())
    held = {rid: key for key, parts in q.parts.items() for rid in parts if isinstance(rid, str)}
    assert held == q.holder
    assert set(q.weights) == {tenant for _, tenant in q.by_tenant}


def test_release_takes_out_exactly_the_requests_undrained_part() -> None:
    q = FluidBacklog()
    q.add(0, "a", 100.0, 4.0, "r1")
    q.add(0, "a", 200.0, 4.0, "r2")
    q.add(0, "a", 300.0, 4.0, "r3")
    q.add(1, "b", 50.0, 2.0, "s1")
    q.drain(now_s=0.15, tokens_per_s=1000.0)  # 150 of a's: r1 whole, 50 of r2 (arrival order)
    assert q.by_tenant == pytest.approx({(0, "a"): 450.0, (1, "b"): 50.0})
    assert q.release("r1") == 0.0  # drained: nothing left of it
    assert q.release("r3") == pytest.approx(300.0)  # not started: all of it
    assert q.by_tenant == pytest.approx({(0, "a"): 150.0, (1, "b"): 50.0})
    assert q.release("r3") == 0.0 and q.release("never") == 0.0  # twice, unknown: nothing
    assert q.release("r2") == pytest.approx(150.0)
    assert q.by_tenant == pytest.approx({(1, "b"): 50.0}) and q.weights == {"b": 2.0}
    _consistent(q)
    q.add(1, "b", 0.0, 2.0, "s2")  # nothing uncached: no part
    assert "s2" not in q.holder
    q.add(1, "b", 30.0, 2.0)  # no id: only the drain takes it
    assert q.release("s1") == pytest.approx(50.0)
    assert q.by_tenant == pytest.approx({(1, "b"): 30.0})
    _consistent(q)
    q.drain(now_s=1.0, tokens_per_s=1000.0)
    assert q.by_tenant == {} and q.parts == {} and q.holder == {} and q.weights == {}


def test_an_id_added_again_keeps_its_place_and_moves_whole_to_another_entry() -> None:
    q = FluidBacklog()
    q.add(0, "a", 100.0, 4.0, "r1")
    q.add(0, "a", 100.0, 4.0, "r2")
    q.add(0, "a", 50.0, 4.0, "r1")
    assert list(q.parts[(0, "a")].items()) == [("r1", 150.0), ("r2", 100.0)]
    q.add(1, "a", 10.0, 4.0, "r1")  # another class: r1's 150 moves with it
    assert q.by_tenant == pytest.approx({(0, "a"): 100.0, (1, "a"): 160.0})
    assert q.holder == {"r1": (1, "a"), "r2": (0, "a")}
    assert q.release("r1") == pytest.approx(160.0)
    _consistent(q)


_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.sampled_from("abc"), st.floats(0.0, 5000.0),
              st.sampled_from([1.0, 2.0, 4.0]), st.integers(0, 12)),
    st.tuples(st.just("drain"), st.floats(0.0, 3.0), st.floats(1.0, 5000.0)),
    st.tuples(st.just("release"), st.integers(0, 12)),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.booleans())
def test_backlog_conserves_tokens_and_stays_consistent(ops: list[tuple], class_order: bool) -> None:
    """Whatever the order of adds, drains and releases: added = pending + drained + released,
    entries are the sums of their parts, and nothing is kept for a request with nothing left."""
    q = FluidBacklog(class_order=class_order)
    added = drained = released = 0.0
    now = 0.0
    for op in ops:
        if op[0] == "add":
            _, rank, tenant, tokens, weight, rid = op
            q.add(rank, tenant, tokens, weight, f"r{rid}" if rid else "")  # id 0: none
            added += tokens
        elif op[0] == "drain":
            before = sum(q.by_tenant.values())
            now += op[1]
            q.drain(now, op[2])
            drained += before - sum(q.by_tenant.values())
            assert drained <= added + 1e-6
        else:
            released += q.release(f"r{op[1]}")
        _consistent(q)
        assert sum(q.by_tenant.values()) + drained + released == pytest.approx(added, abs=1e-3)
    q.drain(now + 1e6, 1e6)
    assert q.by_tenant == {} and q.parts == {} and q.holder == {}


def test_a_tenant_dropping_its_admitted_requests_leaves_no_backlog(tmp_path) -> None:
    """Review 28b F3 through the real admit / release path: an interactive tenant sends an
    800-token prompt every 0.05 s and drops it once admitted; a standard tenant sends one each
    second. Before, each dropped prompt stayed in the backlog until the clock (1,000 tokens/s)
    drained it: 16,000 tokens a second queued, the standard tenant refused once they passed its
    10 s limit, and the dropping tenant's own requests refused too. Now every request of both
    is admitted, and the victim has nothing ahead of it."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("aint", "interactive"), TenantSpec("vstd", "standard")])
    node = gs.nodes["n0"]
    codes, victim, ahead = [], [], []
    for tick in range(200):  # 10 s
        clock.t += 0.05
        adm = gs.admit(ids["aint"], f"a{tick}", prompt_tokens=800)
        codes.append(adm.code)
        gs.release(f"a{tick}", None)  # the client went away: cancelled, nothing ran
        if tick % 20 == 0:
            ahead.append(node.backlog.ahead(1, ids["vstd"], 1500.0, 2.0))
            victim.append(gs.admit(ids["vstd"], f"v{tick}", prompt_tokens=1500).code)
            gs.release(f"v{tick}", {"prompt_tokens": 1500, "completion_tokens": 1})
    assert codes == ["OK"] * 200 and victim == ["OK"] * 10
    assert ahead == [0.0] * 10
    assert node.backlog.by_tenant == {} and node.backlog.holder == {}
    assert gs.usage_of(ids["aint"]).rejected == gs.usage_of(ids["vstd"]).rejected == 0


def test_a_finished_requests_undrained_tokens_do_not_refuse_its_tenants_next(tmp_path) -> None:
    """Review 28b F3's second repro: a tenant's long prompts one after another on an idle node
    whose measured prefill speed is below what it really does. The first finished in 0.3 s of
    its modelled 2.7 s; the model still held 710 of its tokens, so the next was refused with a
    ~5 s estimate. Now the finished request's remainder goes with it."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("aint", "interactive")])
    gs.nodes["n0"].prefill.set(300.0)
    for i in range(5):
        adm = gs.admit(ids["aint"], f"r{i}", prompt_tokens=800)
        assert (adm.code, adm.reason) == ("OK", "")
        clock.t += 0.3
        gs.release(f"r{i}", {"prompt_tokens": 800, "completion_tokens": 4, "prefill_tokens_per_s": 300.0,
                             "step_s": 0.05, "finish_reason": "length"})
        clock.t += 0.05
    assert gs.nodes["n0"].backlog.by_tenant == {}


def test_an_n_body_rolled_back_leaves_no_backlog(tmp_path) -> None:
    """Review 28b F4: one client sends bodies with ``n`` 16 and a 560-token prompt, over and
    over; each body's choices are admitted one by one until one is refused (the second: 1.12 s
    estimated, over the interactive 1 s), and the admitted ones are aborted and released, as
    ``services.openai_api.choices`` rolls a body back. Before, every admitted choice's prompt
    stayed in the backlog: the client was served nothing, yet a standard tenant's requests were
    refused once the interactive backlog passed 10 s. Now the rollback leaves nothing."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("aint", "interactive"), TenantSpec("vstd", "standard")])
    node = gs.nodes["n0"]
    victim, left = [], []
    for body in range(200):  # a body every 0.05 s, 10 s
        clock.t += 0.05
        admitted = []
        for choice in range(16):
            rid = f"{choice}_b{body}"
            if gs.admit(ids["aint"], rid, prompt_tokens=560, routing_key=f"b{body}").code != "OK":
                break
            admitted.append(rid)
        assert 0 < len(admitted) < 16
        for rid in admitted:  # all or nothing: roll back
            gs.release(rid, None)
        left.append(sum(node.backlog.by_tenant.values()))
        if body % 20 == 0:
            victim.append(gs.admit(ids["vstd"], f"v{body}", prompt_tokens=1500).code)
            gs.release(f"v{body}", None)
    assert victim == ["OK"] * 10
    assert left == [0.0] * 200 and node.backlog.holder == {} and node.in_flight == set()
    assert gs.usage_of(ids["vstd"]).rejected == 0
