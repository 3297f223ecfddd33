"""Fair share after an idle gap: a tenant arriving at an idle node banks no credit (s37 F1).

Regression (s37 review, F1): ``VirtualTokenCounters.lift`` raised a newly backlogged tenant's
counter only to the other backlogged tenants' counters, so a tenant arriving while no other
tenant was waiting or running kept its old counter (0 for a new tenant). Once a second tenant
arrived, the first was served alone until its counter caught up with all the service the
second had had since the node started: its requests' first tokens came AAABBB instead of
interleaved (and under block pressure the second's running requests were the victims, the
largest counters). VTC (Sheng et al., OSDI'24, Algorithm 2) lifts such a tenant to the counter
of the last tenant to leave the queue.

Regression (s37 review r3): kvstrata serves SLO classes in order and VTC only within a class,
so a batch tenant's counter stays low while interactive work runs; with one ``last_left`` for
the node, a batch tenant leaving last set the virtual time a new interactive tenant was lifted
to, below its interactive peer's counter: the new one was served alone again (CCCAAA). Each
class now keeps its own virtual time.
"""

from __future__ import annotations

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.base import TenantShare
from cache_node.scheduling.fair_share import VirtualTokenCounters

PROMPT, OUT, N = 16, 2, 3


def prompt(tag: int, i: int) -> list[int]:
    return [(11 * i + j + tag) % 500 + 1 for j in range(PROMPT)]


def engine_of(lm: LoadedModel, policy: str) -> LLMEngine:
    return LLMEngine(
        lm.model,
        EngineConfig(block_size=16, kv_pool_bytes=1 << 20, max_num_batched_tokens=64,
                     max_num_seqs=2, scheduling_policy=policy),
        lm.model_id, lm.eos_token_ids,
    )


def queue_phase_two(engine: LLMEngine, params: SamplingParams, tenants: tuple[tuple[str, int], ...]) -> None:
    """``N`` requests of each ``(tenant, prompt tag)``, the tenants in that order."""
    for tenant, tag in tenants:
        for i in range(N):
            engine.add_request(prompt(tag, i), params, request_id=f"{tenant}{i}", tenant=tenant)


def first_tokens(engine: LLMEngine) -> str:
    """Runs the engine dry; the tenants (a request id's first letter) in the order of their
    requests' first tokens."""
    order: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in order:
                order.append(out.request_id)
    return "".join(r[0] for r in order)


def classes_engine(lm: LoadedModel) -> tuple[LLMEngine, SamplingParams, list[str]]:
    """A ``kvstrata`` engine with interactive ``a`` and ``c`` and batch ``b``: ``a``'s 6
    requests and ``b``'s one (8 tokens out) queued, stepped until ``a``'s have all left.
    Returns the engine, the requests' parameters and the ids that left, in order."""
    engine = engine_of(lm, "kvstrata")
    for tenant, slo_class in (("a", "interactive"), ("b", "batch"), ("c", "interactive")):
        engine.scheduler.policy.set_tenant(tenant, TenantShare(slo_class))
    params = SamplingParams(max_tokens=OUT, ignore_eos=True, temperature=0.0)
    for i in range(6):
        engine.add_request(prompt(5, i), params, request_id=f"warm-a{i}", tenant="a")
    engine.add_request(prompt(9, 0), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0),
                       request_id="warm-b", tenant="b")
    left: list[str] = []
    while not all(f"warm-a{i}" in left for i in range(6)):
        left += [out.request_id for out in engine.step() if out.finished]
    return engine, params, left


def first_token_order(lm: LoadedModel, policy: str) -> tuple[str, dict[str, float]]:
    """Tenant ``b`` runs ``N`` requests alone until the node is idle; then ``a`` (never seen)
    queues ``N`` requests, ``b`` ``N`` more. Returns the tenants of phase 2's requests in the
    order of their first tokens, and the counters right after the arrivals."""
    engine = engine_of(lm, policy)
    params = SamplingParams(max_tokens=OUT, ignore_eos=True, temperature=0.0)
    for i in range(N):
        engine.add_request(prompt(5, i), params, request_id=f"warm{i}", tenant="b")
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(engine.scheduler.active_tenants.values())  # the node is idle
    queue_phase_two(engine, params, (("a", 3), ("b", 7)))
    vtc = engine.scheduler.policy.vtc  # type: ignore[attr-defined]
    counters = {t: vtc.counter(t) for t in "ab"}
    return first_tokens(engine), counters


@pytest.mark.parametrize("policy", ["kvstrata", "vtc"])
def test_a_tenant_arriving_at_an_idle_node_is_lifted_to_the_last_leavers_counter(
    tiny: LoadedModel, policy: str
) -> None:
    order, counters = first_token_order(tiny, policy)
    served_b = N * (PROMPT + OUT - 1)  # uncached prefill + the decode steps (the last token's too)
    assert order == "ab" * N, order  # before: "aaabbb"
    assert counters == {"a": served_b, "b": served_b}  # before: a 0.0, b's service its credit


def test_lift_takes_the_last_leaver_when_no_other_tenant_is_backlogged() -> None:
    vtc = VirtualTokenCounters()
    vtc.charge("x", 30, weight=2.0)  # 15
    vtc.charge("y", 40, weight=1.0)  # 40
    vtc.leave("y")
    vtc.leave("x")  # the last to leave: the virtual time is 15, not the largest counter
    vtc.lift("new", [])
    assert vtc.counter("new") == 15.0
    vtc.lift("y", [])  # a counter ahead of the virtual time keeps its lead
    assert vtc.counter("y") == 40.0
    vtc.lift("z", ["new", "y"])  # others backlogged: their smallest counter, as before
    assert vtc.counter("z") == 15.0


def test_kvstrata_lifts_a_new_tenant_to_its_own_classs_virtual_time(tiny: LoadedModel) -> None:
    """Interactive ``a`` (6 requests) and batch ``b`` (1 request, 8 tokens out) share an idle
    node; class order serves ``a`` first, so ``a``'s counter ends far above ``b``'s, and ``b``
    leaves last. Then a new interactive tenant ``c`` queues 3 requests and ``a`` 3 more: ``c``
    is lifted to the interactive class's virtual time (``a``'s counter), and the two take
    turns. Before: lifted to ``b``'s batch counter, ``c`` was served alone ("cccaaa")."""
    engine, params, left = classes_engine(tiny)
    while engine.has_unfinished_requests():
        left += [out.request_id for out in engine.step() if out.finished]
    vtc = engine.scheduler.policy.vtc  # type: ignore[attr-defined]
    served_a = 6 * (PROMPT + OUT - 1)
    assert left[-1] == "warm-b" and (vtc.counter("a"), vtc.counter("b")) == (served_a, PROMPT + 8 - 1)
    queue_phase_two(engine, params, (("c", 3), ("a", 7)))
    lifted_c = vtc.counter("c")
    assert first_tokens(engine) == "ca" * N  # before: "cccaaa"
    assert lifted_c == served_a  # before: 23.0, b's counter


def test_each_group_keeps_its_own_virtual_time() -> None:
    vtc = VirtualTokenCounters()
    vtc.charge("i", 100, weight=1.0)
    vtc.charge("b", 20, weight=1.0)
    vtc.leave("i", group=0)
    vtc.leave("b", group=2)  # the last to leave, but of another group
    vtc.lift("new-i", [], group=0)
    vtc.lift("new-b", [], group=2)
    vtc.lift("new-s", [], group=1)  # a group none has left yet: 0
    assert [vtc.counter(t) for t in ("new-i", "new-b", "new-s")] == [100.0, 20.0, 0.0]


def test_a_tenant_promoted_while_backlogged_joins_its_new_classs_virtual_time(tiny: LoadedModel) -> None:
    """Regression (s37 review r4, F5): batch ``b`` (one request, 8 tokens out) is promoted to
    interactive while queued, after interactive ``a``'s 6 requests left (interactive virtual
    time: ``a``'s counter). ``b`` must be moved to that virtual time, not keep its batch counter
    and then, leaving, make it the interactive class's: a new interactive ``c`` and ``a`` then
    take turns. Before: ``b`` kept 23.0 (its batch counter), ``c`` was lifted to it and served
    alone ("cccaaa")."""
    engine, params, left = classes_engine(tiny)
    policy = engine.scheduler.policy
    assert "warm-b" not in left
    vtc = policy.vtc  # type: ignore[attr-defined]
    served_a = 6 * (PROMPT + OUT - 1)
    assert vtc.counter("a") == served_a and vtc.counter("b") < served_a
    policy.set_tenant("b", TenantShare("interactive"))  # b's class changes while b is backlogged
    assert vtc.counter("b") == served_a  # a left last: the interactive virtual time
    while engine.has_unfinished_requests():
        left += [out.request_id for out in engine.step() if out.finished]
    queue_phase_two(engine, params, (("c", 3), ("a", 7)))
    lifted_c = vtc.counter("c")
    assert first_tokens(engine) == "ca" * N  # before: "cccaaa"
    assert lifted_c >= served_a  # before: 23.0, b's batch counter


def test_move_lowers_a_demoted_counter_to_its_new_groups_virtual_time() -> None:
    """A demoted tenant's counter from a faster class is lowered to the new class's floor, or
    it would wait behind every batch tenant until they caught up with its interactive service."""
    vtc = VirtualTokenCounters()
    vtc.charge("i", 500, weight=1.0)
    vtc.charge("b", 20, weight=1.0)
    vtc.charge("b2", 30, weight=1.0)
    vtc.move("i", ["b", "b2"], group=2)
    assert vtc.counter("i") == 20.0
    vtc.leave("b", group=2)
    vtc.move("b2", [], group=0)  # none of group 0 backlogged, none left it yet: 0.0
    assert vtc.counter("b2") == 0.0
