"""A request's ``priority`` (vLLM's extra parameter, lower served earlier) on the bare scheduler:
it reorders only its own tenant's waiting requests, within the queue positions that tenant holds,
under every scheduling policy (issue 20). Deterministic: simulated clock, no model. And the
field on the data plane's wire, checked as the node reads it."""

from __future__ import annotations

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import SCHEDULING_POLICIES
from cache_node.scheduling.base import order_by_priority
from cache_node.sequence import Sequence
from services import data_plane
from services.node_request import NodeRequest
from tests.slo_sim import Sim

# (request id, tenant, priority) in arrival order: the tenants alternate
QUEUE = [("a0", "A", 0), ("b0", "B", 0), ("a1", "A", -5), ("b1", "B", 3), ("a2", "A", -5), ("b2", "B", -1)]


def seq(rid: str, tenant: str, priority: int) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=1), tenant=tenant, priority=priority)


def test_priority_reorders_within_the_tenants_own_positions() -> None:
    """Each tenant's requests are sorted by priority (stable: a1 before a2, both -5) into the
    positions that tenant held; B keeps positions 1, 3, 5 whatever A asks for."""
    ordered = order_by_priority([seq(*q) for q in QUEUE])
    assert [s.request_id for s in ordered] == ["a1", "b2", "a2", "b0", "a0", "b1"]


def test_no_priorities_leave_the_order_untouched() -> None:
    queue = [seq(rid, tenant, 0) for rid, tenant, _ in QUEUE]
    assert order_by_priority(queue) is queue


def served_order(policy: str, priorities: bool) -> list[str]:
    """The order in which one running slot serves QUEUE (all queued before the first step)."""
    sim = Sim(policy, max_seqs=1)
    for n, (rid, tenant, priority) in enumerate(QUEUE):
        s = Sequence(rid, [10_000 * (n + 1) + i for i in range(8)], SamplingParams(max_tokens=1, ignore_eos=True),
                     extra_keys=(tenant,), tenant=tenant, arrival_time_s=sim.t,
                     priority=priority if priorities else 0)
        sim.seqs[rid] = s
        sim.sched.add(s)
    sim.run()
    return sim.started_order


def test_fcfs_serves_the_exact_priority_order() -> None:
    """Regression: a post-processed order alone let the request a priority displaced keep its
    early position, so A took three turns before B's first (a1, a2, a0, b2, ...)."""
    assert served_order("fcfs", priorities=True) == ["a1", "b2", "a2", "b0", "a0", "b1"]


@pytest.mark.parametrize("policy", sorted(SCHEDULING_POLICIES))
def test_every_policy_keeps_the_tenants_turns(policy: str) -> None:
    """Under every policy the tenants are served in the turns they get without priorities, and
    each tenant's own requests in priority order (stable within equal priority)."""
    plain, ranked = served_order(policy, priorities=False), served_order(policy, priorities=True)
    tenant = {rid: t for rid, t, _ in QUEUE}
    priority = {rid: p for rid, _, p in QUEUE}
    assert [tenant[r] for r in ranked] == [tenant[r] for r in plain]
    for t in ("A", "B"):
        own = [r for r in plain if tenant[r] == t]
        assert [r for r in ranked if tenant[r] == t] == sorted(own, key=priority.__getitem__)


def wire_request(**fields: object) -> dict:
    req = NodeRequest(request_id="r", tenant="t", cache_namespace="ns", token_ids=(1, 2),
                      sampling=SamplingParams(max_tokens=2, stop=("END",)), priority=-3)
    return {**data_plane.unpack(data_plane.pack(data_plane.request_to_wire(req))), **fields}


def test_priority_and_stop_strings_cross_the_data_plane() -> None:
    req = data_plane.request_from_wire(wire_request())
    assert req.priority == -3 and req.sampling.stop == ("END",)
    started = {"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 2, "priority": -3}
    assert data_plane.event_items([["r", started]]) == [("r", started)]


@pytest.mark.parametrize(("fields", "error"), [
    ({"priority": 1001}, ValueError), ({"priority": -1001}, ValueError), ({"priority": True}, TypeError),
    ({"priority": 1.0}, TypeError), ({"sampling": {"max_tokens": 2, "stop": ["a"] * 5}}, ValueError),
    ({"sampling": {"max_tokens": 2, "stop": [7]}}, TypeError),  # each sampling field its exact type
])
def test_bad_priorities_and_stops_on_the_wire_are_refused(fields: dict, error: type) -> None:
    """The data plane checks what it reads (a node drops and counts such a message)."""
    with pytest.raises(error, match="priority|stop"):
        data_plane.request_from_wire(wire_request(**fields))
