"""Admission and routing of agent session turns (plain GlobalScheduler, no Ray started).

Session turns carry chat messages that the node renders, so admission sees their size only
through the gateway's estimate, and an interactive tenant's sibling sub-agents are spread over
the nodes (issue 21)."""

from __future__ import annotations

from typing import Any

from cache_node.sampling_params import SamplingParams
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_routing import MAX_PROMPT_ESTIMATE, prompt_size
from services.node_request import NodeRequest
from tenants.model import TenantSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Outbox:
    """Stands in for the data plane's command sender: keeps what the scheduler sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, inbox: str, message: dict[str, Any]) -> None:
        self.sent.append((inbox, message))


def scheduler(tmp_path, policy: str, nodes: tuple[str, ...] = ("n0",)) -> tuple[GlobalScheduler, dict[str, str]]:
    gs = GlobalScheduler(str(tmp_path), {n: 8 for n in nodes}, queue_limit=1000, scheduler=policy, clock=Clock())
    gs.commands, gs.node_inboxes = Outbox(), {n: f"inbox-{n}" for n in nodes}
    ids = {}
    for name, cls in (("chat", "interactive"), ("noisy", "batch")):
        tenant, key = gs.register_tenant(TenantSpec(name, cls, ttft_slo_ms=2000.0))
        gs.authenticate(key)
        ids[name] = tenant.tenant_id
    for node in gs.nodes.values():
        node.prefill.set(300.0)  # tokens/s: one CPU core
        node.step_s.update(0.2)
    return gs, ids


def turn(tenant: str, request_id: str, session: str, estimate: str | None) -> NodeRequest:
    extra = {} if estimate is None else {"prompt_tokens_estimate": estimate}
    return NodeRequest(request_id=request_id, tenant=tenant, cache_namespace="ns", sampling=SamplingParams(),
                       messages=({"role": "user", "content": "read this"},), session_id=session, extra=extra)


def test_session_turns_reach_admission_with_their_estimated_size(tmp_path) -> None:
    """Regression: chat session turns reached admission as 0-token prompts (the node renders
    their messages), so two 500-token interactive reads on one node were both admitted though
    the second could not start its prefill before ~1.7 s and finish before ~3.4 s."""
    gs, ids = scheduler(tmp_path, "kvstrata")
    first = gs.admit_and_submit(turn(ids["chat"], "r1", "s1", "500"), "gw", [])
    assert first.code == "OK"  # 500 / 300 + 0.1 s ~ 1.77 s < 2 s
    second = gs.admit_and_submit(turn(ids["chat"], "r2", "s2", "500"), "gw", [])
    assert second.code == "RESOURCE_EXHAUSTED" and second.reason == "ttft_estimate"
    assert second.retry_after_s > 1.0  # ~3.43 s estimated against 2 s
    assert [m["req"]["request_id"] for _, m in gs.commands.sent] == ["r1"]
    gs.clock.t += 2.0  # the first read's prefill has drained
    assert gs.admit_and_submit(turn(ids["chat"], "r3", "s2", "500"), "gw", []).code == "OK"


def test_prompt_size_takes_token_ids_else_a_bounded_estimate() -> None:
    base = turn("t", "r", "", None)
    assert prompt_size(NodeRequest("r", "t", "ns", SamplingParams(), token_ids=(1, 2, 3))) == 3
    assert prompt_size(base) == 0
    for bad in ("abc", "", "1.5", "-40"):
        assert prompt_size(turn("t", "r", "", bad)) == 0
    assert prompt_size(turn("t", "r", "", str(10 * MAX_PROMPT_ESTIMATE))) == MAX_PROMPT_ESTIMATE


def test_interactive_sessions_spread_over_nodes(tmp_path) -> None:
    """Regression: new sessions went to the node with the fewest requests in flight, so while
    batch work sat on one node an interactive lead's sub-agents all landed on the other, and
    their reads queued behind each other there."""
    gs, ids = scheduler(tmp_path, "kvstrata", ("n0", "n1"))
    gs.nodes["n0"].in_flight.update({"batch-0", "batch-1", "batch-2"})  # n0 holds batch work
    nodes = [gs.admit(ids["chat"], f"sub{i}", session_id=f"sub{i}", prompt_tokens=70).node_id for i in range(3)]
    assert nodes == ["n1", "n0", "n1"]  # before: n1, n1, n1 (fewest requests in flight)


def test_fcfs_routes_by_requests_in_flight_only(tmp_path) -> None:
    gs, ids = scheduler(tmp_path, "fcfs", ("n0", "n1"))
    gs.nodes["n0"].in_flight.update({"x", "y"})
    nodes = [gs.admit(ids["chat"], f"sub{i}", session_id=f"sub{i}", prompt_tokens=70).node_id for i in range(2)]
    assert nodes == ["n1", "n1"]  # n1: 0 then 1 in flight, n0: 2


def test_gateway_estimate_bounds_what_the_node_renders() -> None:
    """The gateway's estimate of a chat turn (``estimate_message_tokens``) against the tokens
    the node's own rendering adds: exact for a first turn, at most the template's default
    system prompt over for a continuation, never under."""
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir
    from services.chat import ChatTemplater, estimate_message_tokens

    templater = ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    first = [{"role": "user", "content": "Plan three searches about the Barents Sea."}]
    assert estimate_message_tokens(templater, first) == len(templater.first_turn(first))
    history = templater.first_turn(first) + templater.encode("1. ice 2. fish 3. oil") + [templater.eos_token_id]
    new = [{"role": "user", "content": "Read: The Barents Sea is a marginal sea of the Arctic Ocean. " * 8}]
    added = len(templater.continuation(first + [{"role": "assistant", "content": "1. ice 2. fish 3. oil"}],
                                       history, new)) - len(history)
    estimate = estimate_message_tokens(templater, new)
    assert added <= estimate <= added + 40
    assert estimate_message_tokens(None, new) == sum(len(m["content"]) for m in new) // 4 + 1


def test_a_first_turn_that_ran_nothing_leaves_no_session_route(tmp_path) -> None:
    """Regression: a session's first turn that the node refused (e.g. a token id outside the
    vocabulary) left its route in ``session_nodes`` forever (the node never opened the
    session, so never reported it ended): unique session ids grew the map without bound. A
    first turn that ran keeps its route; a later turn that ran nothing keeps it too."""
    gs, ids = scheduler(tmp_path, "fcfs", nodes=("n0", "n1"))
    chat = ids["chat"]
    for i in range(50):
        assert gs.admit(chat, f"r{i}", session_id=f"s{i}", prompt_tokens=1).code == "OK"
        gs.release(f"r{i}", None)  # refused by the node: nothing ran
    assert gs.session_nodes == {} and gs.stats()["sessions"] == 0
    assert gs.admit(chat, "a1", session_id="kept", prompt_tokens=8).code == "OK"
    gs.release("a1", {"prompt_tokens": 8, "completion_tokens": 2, "finish_reason": "length",
                      "prefill_tokens_per_s": 500.0})  # its finished event
    node = gs.session_nodes["kept"][1]
    assert gs.admit(chat, "a2", session_id="kept", prompt_tokens=12).code == "OK"
    gs.release("a2", None)  # a later turn that ran nothing: the history is still on its node
    assert gs.session_nodes["kept"] == (chat, node)


def test_deleting_a_tenant_ends_its_work_on_every_node(tmp_path) -> None:
    """The scheduler tells every node to end a deleted tenant's requests and sessions
    (``end_tenant``) and forgets its session routes; another tenant's stay."""
    gs, ids = scheduler(tmp_path, "fcfs", nodes=("n0", "n1"))
    for tenant, sid in (("chat", "c1"), ("noisy", "n1")):
        assert gs.admit(ids[tenant], f"r-{sid}", session_id=sid, prompt_tokens=8).code == "OK"
        gs.release(f"r-{sid}", {"prompt_tokens": 8, "finish_reason": "stop", "prefill_tokens_per_s": 500.0})
    gs.delete_tenant("noisy")
    assert set(gs.session_nodes) == {"c1"}
    assert sorted(gs.commands.sent) == [(f"inbox-{n}", {"op": "end_tenant", "tenant": ids["noisy"]})
                                        for n in ("n0", "n1")]
