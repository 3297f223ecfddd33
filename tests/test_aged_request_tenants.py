"""An aged waiting request (passed over ``aging_steps`` times for want of blocks) holds the
queue only against tenants at or above its tenant's share of the pool
(``WaitingAdmission._passes_aged``).

Regression (s41 tenancy, noisy neighbour): the aged request ended admission for every tenant.
A tenant whose long prompts filled a node's pool made its own next prompt age, and another
tenant's short requests of the same class, which fit, waited behind it until the flooder's
running requests ended (here 275 steps).
"""

from __future__ import annotations

from cache_node.scheduling import make_policy
from tests.slo_sim import STANDARD, Sim

AGING_STEPS = 8


def sim() -> Sim:
    """64 blocks of 16 tokens, tenants ``a`` and ``b`` of one class and weight."""
    policy = make_policy("kvstrata")
    policy.aging_steps = AGING_STEPS
    return Sim(policy, num_blocks=64, budget=256, max_seqs=16, tenants={"a": STANDARD, "b": STANDARD})


def test_another_tenants_request_that_fits_starts_past_the_flooders_aged_one() -> None:
    """Tenant ``a``'s two 400-token prompts, each growing to 800 tokens (50 blocks), cannot
    both fit: ``a1`` is preempted, waits first in line (a preempted request keeps its place)
    and ages, not fitting the 31 free blocks. ``b``'s 20-token request fits them: it starts at
    once (on the old code 275 steps later, when ``a0`` ended), and ``a1`` still runs after."""
    s = sim()
    for i in range(2):
        s.add(f"a{i}", "a", 400, max_tokens=400)
    while s.sched.num_preemptions == 0:
        s.step()
    for _ in range(AGING_STEPS + 4):
        s.step()
    assert [seq.request_id for seq in s.sched.running] == ["a0"]
    assert [(seq.request_id, seq.num_preemptions) for seq in s.sched.waiting] == [("a1", 1)]
    assert s.kv.pool.num_free_blocks() == 31
    s.add("b0", "b", 20, max_tokens=1)
    step = s.steps
    s.step()
    assert s.first_token_step.get("b0") == step
    s.run()
    assert s.finished_step == {"b0": step, "a0": 401, "a1": 690}


def test_a_tenant_holding_more_than_the_aged_ones_waits_behind_it() -> None:
    """The aged request still keeps its place against a tenant at or above its tenant's hold,
    so another tenant's stream of short requests cannot starve it: ``b``'s request waits
    while ``b`` holds more running blocks than ``a`` (none), and starts only beside ``a``'s,
    once blocks freed let that one fit."""
    s = sim()
    s.add("b-long", "b", 400, max_tokens=40)
    s.add("b-long2", "b", 400, max_tokens=300)
    s.step()
    s.add("a0", "a", 400, max_tokens=1)
    for _ in range(AGING_STEPS + 2):
        s.step()
    assert [seq.request_id for seq in s.sched.waiting] == ["a0"]
    s.add("b-short", "b", 20, max_tokens=1)
    while "b-short" not in s.started_order:
        assert s.sched.has_work()
        s.step()
    assert s.started_order.index("a0") < s.started_order.index("b-short")  # a0 first (same step)
    assert s.finished_step["b-long"] < s.first_token_step["b-short"]  # once b-long freed its blocks


def test_tenants_in_rotation_below_the_hold_do_not_take_the_blocks_the_aged_one_waits_for() -> None:
    """Ten tenants in rotation each send a 40-token request (30 out) a step and each hold fewer
    blocks than ``a``, whose one running decode ``a0`` holds ~13 of the 128 blocks; ``a``'s
    1600-token ``a1`` (101 blocks) waits for the blocks the others hold, not for ``a0``'s.
    Past ``a1`` only requests whose blocks are spare start (the free ones plus ``a0``'s cover
    ``a1``'s need and theirs), so the pool drains for ``a1``: it starts at step 148 (108 steps
    after it arrived) beside ``a0``, which is never preempted.

    Regression (s41 review r3 of e6c3505): each of the others, being below ``a``'s hold, passed
    ``a1``; they kept the pool full, preempted ``a0`` 39 times by their growth (its recomputes
    raised ``a``'s VTC counter, sending ``a1`` behind all of theirs), and ``a1`` started at
    step 1753. Before e6c3505 (nothing passed an aged request) it started at step 106."""
    policy = make_policy("kvstrata")
    policy.aging_steps = AGING_STEPS
    tenants = {"a": STANDARD, **{f"b{i}": STANDARD for i in range(10)}}
    s = Sim(policy, num_blocks=128, budget=256, max_seqs=32, tenants=tenants)
    s.add("a0", "a", 160, max_tokens=400)
    s.step()
    for i in range(300):
        if s.steps == 40:
            s.add("a1", "a", 1600, max_tokens=1)
        s.add(f"b{i}", f"b{i % 10}", 40, max_tokens=30)
        s.step()
        if "a1" in s.first_token_step:
            break
    assert s.first_token_step.get("a1") == 148
    assert s.seqs["a0"].num_preemptions == 0 and "a0" not in s.finished_step
