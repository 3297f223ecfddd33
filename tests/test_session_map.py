"""The GlobalScheduler's session -> node map follows the nodes' sessions (real model, plain
classes, the node's session sink wired straight to the scheduler as the actor wires it)."""

from __future__ import annotations

import asyncio
import time

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_checks import REJECT_REASONS
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)
TTL_S = 2.0
TENANTS = ("t1", "t2", "a", "b")  # the tenants these tests admit requests of


def run_turn(sched: GlobalScheduler, node: CacheNode, session_id: str) -> None:
    rid = f"r-{session_id}"
    adm = sched.admit("t1", rid, session_id=session_id)
    assert (adm.code, adm.node_id) == ("OK", "n0")
    req = NodeRequest(request_id=rid, tenant="t1", cache_namespace="ns", token_ids=PROMPT,
                      session_id=session_id, sampling=SamplingParams(max_tokens=2, ignore_eos=True))

    async def run() -> list[dict]:
        return [e async for e in node.generate(req)]

    finished = asyncio.run(run())[-1]
    assert finished["type"] == "finished"
    sched.release(rid, finished)  # as the gateway does


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sessions_the_node_expires_leave_the_scheduler_map(tmp_path) -> None:
    """Issue 18 fault 9: sessions the node expired stayed in the scheduler's session map
    forever (it grew without bound). Now the node reports each expiry and the map holds
    exactly the sessions the node still has."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8}), *TENANTS)
    node = CacheNode("n0", NodeConfig(kv_pool_bytes=16 << 20, host_bytes=0), num_threads=1, session_ttl_s=TTL_S)
    node.session_sink = sched.sessions_ended
    try:
        for sid in ("a", "b"):
            run_turn(sched, node, sid)
            # a turn puts its session in both maps (it can only leave them a ttl after the turn)
            assert sid in sched.session_nodes and sid in node.engine.sessions.sessions
        # no wall-clock ordering between turns is assumed (a loaded machine may take longer
        # than a ttl over one turn): each phase waits for the node's sweep, then compares
        wait_until(lambda: not {"a", "b"} & set(sched.session_nodes), 20)
        assert node.engine.sessions.sessions == {}  # the map emptied only after the node did
        run_turn(sched, node, "c")
        assert sorted(sched.session_nodes) == sorted(node.engine.sessions.sessions) == ["c"]
        wait_until(lambda: not sched.session_nodes, 20)
        assert node.engine.sessions.sessions == {}
        assert sched.stats()["sessions"] == 0
    finally:
        node.shutdown()


def test_sessions_ended_ignores_other_nodes_sessions(tmp_path) -> None:
    """A report names its node: an equal session id routed to another node stays."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8}), *TENANTS)
    sched.session_nodes.update({"s": ("t1", "n1"), "u": ("t1", "n0")})
    sched.sessions_ended("n0", ["s", "u", "never-seen"])
    assert sched.session_nodes == {"s": ("t1", "n1")}


def test_a_late_release_of_a_first_turn_keeps_the_route_its_retry_set(tmp_path) -> None:
    """Regression (security review): a session's first turn cancelled before it ran, retried
    at once; the cancelled turn's release (by Ray) landed after the retry's admission (by
    ZeroMQ) and dropped the session's route, so the next turn went to another node and
    answered without the history the retry left on the first."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), *TENANTS)
    first = sched.admit("t1", "t1/r1#a", session_id="t1/chat")
    retry = sched.admit("t1", "t1/r1#b", session_id="t1/chat")
    assert retry.node_id == first.node_id
    sched.release("t1/r1#a", None)  # nothing ran
    assert sched.session_nodes["t1/chat"] == ("t1", first.node_id)
    sched.release("t1/r1#b", {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}})
    sched.nodes[first.node_id].in_flight.update({"x", "y"})  # its node is busier now
    assert sched.admit("t1", "t1/r2#c", session_id="t1/chat").node_id == first.node_id
    sched.release("t1/r2#c", None)
    assert not sched.requests
    alone = sched.admit("t1", "t1/r3#d", session_id="t1/other")  # a first turn alone that ran nothing
    sched.release("t1/r3#d", None)
    assert "t1/other" not in sched.session_nodes and alone.code == "OK"


def test_a_turn_continues_its_session_only_once_a_turn_of_it_finished_there(tmp_path) -> None:
    """``Admission.continues_session`` (the node refuses such a turn when the session is gone,
    never computing it without its history) holds only once a turn of the session finished
    on its node: a first turn's retry, or a turn beside a first turn still running, opens it."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), *TENANTS)
    assert not sched.admit("t1", "t1/a#1", session_id="t1/s").continues_session
    assert not sched.admit("t1", "t1/a#2", session_id="t1/s").continues_session  # the first still runs
    sched.release("t1/a#1", None)  # cancelled before it ran
    sched.release("t1/a#2", finished)
    assert sched.admit("t1", "t1/b#1", session_id="t1/s").continues_session
    sched.release("t1/b#1", {"prompt_tokens": 40, "completion_tokens": 2, "cached_tokens": {}})  # cancelled
    assert sched.admit("t1", "t1/c#1", session_id="t1/s").continues_session  # its history stays
    sched.release("t1/c#1", finished)
    assert sched.close_session("t1/s", "t1") is not None
    assert not sched.admit("t1", "t1/d#1", session_id="t1/s").continues_session  # opened anew
    sched.release("t1/d#1", finished)
    node = sched.session_nodes["t1/s"][1]
    sched.node_down(node, "test")
    sched.node_up(node, "inbox", pid=0)  # a new process: the history is gone
    assert not sched.kept_sessions and not sched.session_nodes


def test_a_sessions_turn_is_never_routed_without_its_history_after_its_node_went_down(tmp_path) -> None:
    """Regression (hangs/data-loss review): a node marked down (one missed health poll was
    enough) lost its sessions' routes; the next turn of one went by load to another node as a
    first turn and was answered from its new tokens alone, silently, while the node still
    held the history. Now the turn waits for the node (UNAVAILABLE), goes on there when the
    same process is back, and is refused ABORTED once the history is known lost (a new
    process), until the session is closed; every gateway's monitor may report the same
    rejoin."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), *TENANTS)
    first = sched.admit("t1", "t1/a", session_id="t1/s")
    sched.release("t1/a", finished)
    node = first.node_id
    sched.node_down(node, "did not answer within 15 s")
    waiting = sched.admit("t1", "t1/b", session_id="t1/s")
    assert (waiting.code, waiting.reason) == ("UNAVAILABLE", "session_node_down") and waiting.retry_after_s > 0
    assert sched.admit("t1", "t1/x", session_id="t1/other").node_id != node  # new sessions go elsewhere
    sched.release("t1/x", finished)
    sched.node_up(node, "inbox", pid=41, previous_pid=41)  # the same process is back
    back = sched.admit("t1", "t1/c", session_id="t1/s")
    assert (back.code, back.node_id, back.continues_session) == ("OK", node, True)
    sched.release("t1/c", finished)

    sched.node_down(node, "its data-plane connection closed")
    sched.node_up(node, "inbox2", pid=57, previous_pid=41)  # restarted: its KV is gone
    sched.node_up(node, "inbox2", pid=57, previous_pid=41)  # another gateway's monitor: no-op
    for _ in range(2):
        lost = sched.admit("t1", "t1/d", session_id="t1/s")
        assert (lost.code, lost.reason) == ("ABORTED", "session_lost") and "CloseSession" in lost.message
    assert sched.admit("t2", "t2/d", session_id="t2/s").code == "OK"  # another tenant's id: its own
    assert sched.close_session("t1/s", "t2") is None  # not another tenant's to close
    assert sched.close_session("t1/s", "t1") == ("", [])  # closed: nothing to free on a node
    again = sched.admit("t1", "t1/e", session_id="t1/s")
    assert again.code == "OK" and not again.continues_session  # opened anew, knowingly
    assert set(REJECT_REASONS) >= {"session_node_down", "session_lost"}

    # a stale report of an older process (a gateway that learnt late) changes nothing; a
    # new process with a pid seen before is told by Ray's restart count
    sched.release("t1/e", finished)
    home = sched.session_nodes["t1/s"][1]
    sched.node_up(home, "inbox-r3", pid=70, previous_pid=70, restarts=3, previous_restarts=3)
    sched.node_up(home, "inbox-r2", pid=65, previous_pid=65, restarts=2, previous_restarts=2)
    assert sched.node_inboxes[home] == "inbox-r3"
    assert sched.admit("t1", "t1/l", session_id="t1/s").continues_session
    sched.release("t1/l", finished)
    sched.node_down(home, "its data-plane connection closed")
    sched.node_up(home, "inbox-r4", pid=70, previous_pid=70, restarts=4, previous_restarts=3)  # same pid
    assert sched.admit("t1", "t1/m", session_id="t1/s").reason == "session_lost"
    assert sched.close_session("t1/s", "t1") == ("", [])

    # a first turn still in flight when its node restarted: no history was lost (regression,
    # diff review: its retry was refused session_lost)
    at = sched.admit("t1", "t1/f", session_id="t1/new").node_id
    sched.node_down(at, "its data-plane connection closed")
    sched.node_up(at, "inbox3", pid=0)  # a new process
    assert sched.admit("t1", "t1/h", session_id="t1/new").reason == "session_lost"  # the turn may have finished
    sched.release("t1/f", None)  # it did not
    assert sched.admit("t1", "t1/g", session_id="t1/new").code == "OK"


def test_a_tenant_opens_at_most_max_sessions_per_tenant(tmp_path) -> None:
    """Regression (security review): every new session id kept its history, a route here and
    its messages on a node until its TTL, without bound (4000 sessions of one tenant: 29 MiB
    on the node and every per-step scan over them). Past ``max_sessions_per_tenant`` a new
    session is RESOURCE_EXHAUSTED; the tenant's open sessions go on, other tenants are not
    counted, and a closed or expired one makes room."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8}, max_sessions_per_tenant=2), *TENANTS)
    for k, sid in enumerate(["a/1", "a/2"]):
        assert sched.admit("a", f"a/r{k}", session_id=sid).code == "OK"
        sched.release(f"a/r{k}", finished)
    refused = sched.admit("a", "a/r3", session_id="a/3")
    assert (refused.code, refused.reason) == ("RESOURCE_EXHAUSTED", "too_many_sessions")
    assert "max_sessions_per_tenant" in refused.message
    assert sched.admit("a", "a/r4", session_id="a/1").code == "OK"  # an open one goes on
    assert sched.admit("a", "a/r5").code == "OK"  # as do requests without a session
    assert sched.admit("b", "b/r1", session_id="b/1").code == "OK"  # another tenant's own count
    sched.close_session("a/2", "a")
    assert sched.admit("a", "a/r6", session_id="a/3").code == "OK"
    sched.sessions_ended(sched.session_nodes["a/1"][1], ["a/1"])  # expired on its node
    assert sched.sessions_per_tenant["a"] == 1


def test_a_first_turn_that_did_not_finish_leaves_no_route_and_no_kept_session(tmp_path) -> None:
    """A review of the session counter: a first turn cancelled after it started (the gateway's
    partial usage) or failed kept its route, though the node keeps no session whose first
    turn ends so; the route never expired, and the tenant's ``max_sessions_per_tenant`` ran
    out for good. A first turn ended by a drain (a finished event with reason "abort") marked
    its session kept, so every later turn was refused ABORTED. Now neither leaves a route."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}, max_sessions_per_tenant=2), *TENANTS)
    partial = {"prompt_tokens": 12, "cached_tokens": {}, "completion_tokens": 3}
    drained = {"finish_reason": "abort", "prompt_tokens": 12, "completion_tokens": 1, "cached_tokens": {},
               "prefill_tokens_per_s": 900.0}
    for k, usage in enumerate([partial, drained, partial, drained]):
        assert sched.admit("t1", f"t1/r{k}", session_id=f"t1/s{k}").code == "OK"
        sched.release(f"t1/r{k}", usage)
    assert not sched.session_nodes and not sched.kept_sessions and not sched.sessions_per_tenant
    assert not sched.admit("t1", "t1/again", session_id="t1/s1").continues_session
    later = {**drained, "finish_reason": "length"}
    sched.release("t1/again", later)
    assert sched.admit("t1", "t1/turn2", session_id="t1/s1").continues_session
    sched.release("t1/turn2", drained)  # a later turn drained: its session keeps the history
    assert "t1/s1" in sched.kept_sessions and sched.sessions_per_tenant["t1"] == 1


def test_a_session_closed_while_its_node_was_down_is_closed_there_when_it_is_back(tmp_path) -> None:
    """Regression (diff review): CloseSession while the session's node was taken for down
    answered and dropped the route, but never told the node: the same process, back, held
    the session's KV until its TTL. Now the close goes to the node at its ``node_up``, unless
    a new process came back (nothing left to close)."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sent: list[tuple[str, dict]] = []
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}), *TENANTS)
    sched.commands = type("Sender", (), {"send": lambda self, to, msg: sent.append((to, msg)) or True})()
    for sid in ("t1/a", "t1/b"):
        sched.admit("t1", f"{sid}-turn", session_id=sid)
        sched.release(f"{sid}-turn", finished)
    sched.node_down("n0", "did not answer within 15 s")
    assert sched.close_session("t1/a", "t1") == ("", [])  # nothing to ask a node that is down
    sched.node_up("n0", "inbox", pid=9, previous_pid=9)  # the same process is back
    assert sent == [("inbox", {"op": "close_session", "session": "t1/a", "tenant": "t1", "turns": []})]
    sched.node_down("n0", "did not answer within 15 s")
    assert sched.close_session("t1/b", "t1") == ("", [])
    sched.node_up("n0", "inbox2", pid=10, previous_pid=9)  # a new process: nothing left to close
    assert len(sent) == 1 and not sched.closed_while_down


def test_a_first_turn_still_on_its_way_when_its_session_closes_never_opens_it(tmp_path) -> None:
    """Regression: a session's first turn was admitted and still on the data plane when
    CloseSession reached its node; the node found nothing (the client got NOT_FOUND for the
    session it had opened), then the turn arrived and opened the session there with no route
    to it: no turn could reach it, no close could free it, and it held its KV until its TTL.
    Now the close names the session's turns in flight and the node refuses each when it
    arrives (ABORTED), the close answers 0 (closed, nothing held yet), nothing is held, and a
    turn sent after the close opens the session anew with its route; another tenant's
    session is untouched."""
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 8}), *TENANTS)
    node = CacheNode("n0", NodeConfig(kv_pool_bytes=16 << 20, host_bytes=0), num_threads=1)
    node.session_sink = sched.sessions_ended

    def turn(rid: str, tenant: str, session_id: str) -> list[dict]:
        req = NodeRequest(request_id=rid, tenant=tenant, cache_namespace="ns", token_ids=PROMPT,
                          session_id=session_id, sampling=SamplingParams(max_tokens=2, ignore_eos=True))

        async def run() -> list[dict]:
            return [e async for e in node.generate(req)]

        return asyncio.run(run())

    try:
        assert sched.admit("t2", "t2/r#1", session_id="t2/s").code == "OK"  # another tenant's session
        sched.release("t2/r#1", turn("t2/r#1", "t2", "t2/s")[-1])
        held = asyncio.run(node.integrity_stats())["used_blocks"]
        assert held > 0
        assert sched.admit("t1", "t1/r#1", session_id="t1/s").node_id == "n0"  # its submit is on the wire
        closing = sched.close_session("t1/s", "t1")
        assert closing == ("n0", ["t1/r#1"])
        assert asyncio.run(node.close_session("t1/s", "t1", closing[1])) == 0  # closed, not NOT_FOUND
        late = turn("t1/r#1", "t1", "t1/s")  # the turn reaches the node after the close
        assert late == [{"type": "error", "code": "ABORTED", "message": "the session was closed"}]
        sched.release("t1/r#1", None)
        assert "t1/s" not in node.engine.sessions.sessions and "t1/s" not in sched.session_nodes
        assert asyncio.run(node.integrity_stats())["used_blocks"] == held  # t2/s's history alone
        assert sched.close_session("t1/s", "t1") is None  # NOT_FOUND now: nothing is left to close

        assert sched.admit("t1", "t1/r#2", session_id="t1/s").code == "OK"  # sent after the close
        sched.release("t1/r#2", turn("t1/r#2", "t1", "t1/s")[-1])
        assert sched.session_nodes["t1/s"] == ("t1", "n0") and "t1/s" in node.engine.sessions.sessions
        closing = sched.close_session("t1/s", "t1")
        assert closing == ("n0", []) and asyncio.run(node.close_session("t1/s", "t1", closing[1])) > 0
        assert sorted(node.engine.sessions.sessions) == ["t2/s"] and sched.session_nodes == {"t2/s": ("t2", "n0")}
        node.engine.check_integrity()
    finally:
        node.shutdown()


def test_a_closed_sessions_turns_in_flight_leave_the_session_opened_anew_alone(tmp_path) -> None:
    """Regression: a turn of a closed session released after the session was opened anew under
    its id (a turn sent after the close) acted on the new session: a first turn that did not
    finish dropped the new session's route (its node held it unreachable until its TTL), and
    one that finished marked the new session kept before its own first turn finished (a turn
    beside it was sent as ``continues_session``). Now the close detaches its turns in flight."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4}), *TENANTS)
    node = sched.admit("t1", "t1/a#1", session_id="t1/s").node_id
    sched.admit("t1", "t1/a#2", session_id="t1/s")  # a second turn beside the first
    assert sched.close_session("t1/s", "t1") == (node, ["t1/a#1", "t1/a#2"])
    assert sched.admit("t1", "t1/b#1", session_id="t1/s").node_id == node  # opened anew
    sched.release("t1/a#1", finished)  # finished on the node before the close reached it
    assert not sched.admit("t1", "t1/b#2", session_id="t1/s").continues_session
    sched.release("t1/b#2", None)
    sched.release("t1/b#1", finished)
    sched.release("t1/a#2", None)  # refused there (the session was closed)
    assert sched.session_nodes["t1/s"] == ("t1", node) and sched.kept_sessions == {"t1/s"}
    assert sched.sessions_per_tenant["t1"] == 1 and not sched.requests
