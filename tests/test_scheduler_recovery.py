"""A restarted global scheduler rebuilding its state from the nodes' reports, on the plain class
(``services.global_scheduler_recovery``; the kill -9 on a real cluster is
tests/test_scheduler_restart.py). Reports are untrusted: each check is exercised."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cache_node.sessions import SessionTable
from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_recovery import BadReport, RecoveryPeers
from tenants.model import TenantSpec
from tests.known_tenants import know_tenants

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
GW = "tcp://127.0.0.1:7001"
FINISHED = {"prompt_tokens": 40, "completion_tokens": 8, "cached_tokens": {"device": 32}, "prefill_tokens_per_s": 900.0}


def report(**fields: Any) -> dict[str, Any]:
    """A healthy node's ``recovery_report``: session t1/s kept, its turn t1/r2 running; t1/r1
    (no session) running; three blocks."""
    base = {"healthy": True, "failure": "", "pid": 41, "restarts": 0, "data_address": "tcp://127.0.0.1:9100",
            "metrics_address": "127.0.0.1:9300", "blocks": [(H1, "device"), (H2, "host")],
            "sessions": [("t1/s", "t1", True)],
            "requests": [("t1/r1#a", "t1", "", GW), ("t1/r2#b", "t1", "t1/s", GW)]}
    return base | fields


@pytest.fixture
def sched(tmp_path: Path) -> GlobalSchedulerService:
    s = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4},
                                            holders=IndexHolders(spill_blocks={"spill_node_0": 100})), "t1", "t2")
    s.recovered_requests = {}
    return s


def test_a_report_rebuilds_routes_requests_blocks_and_the_node(sched: GlobalSchedulerService) -> None:
    """The node is routed to with its inbox and identity; its blocks are indexed per tier; its
    session's next turn goes back to it and continues the history; its requests count in
    flight and their release (from the gateway, as usual) records their usage."""
    sched.node_down("n0", "not answered yet")
    sched.apply_node_report("n0", report())
    sched.apply_spill_report("spill_node_0", [(H3, "spill_disk")])
    assert (sched.down, sched.node_inboxes, sched.node_pids) == ({}, {"n0": "tcp://127.0.0.1:9100"}, {"n0": (41, 0)})
    assert sched.metrics_port_of("n0") == 9300
    assert sched.index.holders(H1) == {("n0", "device")} and sched.index.holders(H2) == {("n0", "host")}
    assert sched.index.holders(H3) == {("spill_node_0", "spill_disk")}
    assert sched.nodes["n0"].in_flight == {"t1/r1#a", "t1/r2#b"} and sched.request_gateways["t1/r2#b"] == GW
    assert sched.session_nodes == {"t1/s": ("t1", "n0")} and sched.sessions_per_tenant["t1"] == 1
    sched.release("t1/r2#b", FINISHED)
    turn = sched.admit("t1", "t1/r3", session_id="t1/s")
    assert (turn.code, turn.node_id, turn.continues_session) == ("OK", "n0", True)
    assert sched.usage.snapshot("t1").completion_tokens == 8


def first_turn_sessions(*session_ids: str) -> list[tuple[str, str, bool]]:
    """The ``sessions`` a real node reports while the first turn of each of ``session_ids`` runs
    (``CacheNode._held_now`` over a ``SessionTable`` whose ``attach`` created the session)."""
    table = SessionTable(kv_manager=None)
    for sid in session_ids:
        table.attach(SimpleNamespace(session_id=sid, tenant=sid.partition("/")[0], request_id=f"{sid}#first",
                                     cache_namespace="default"))
    return [(s.session_id, s.tenant, bool(s.token_ids)) for s in table.sessions.values()]


def test_a_first_turn_in_flight_opens_its_session_and_its_failure_drops_it(sched: GlobalSchedulerService) -> None:
    """A session whose first turn runs (no kept history) is routed to the node running it, as
    at admission; if that turn ends without finishing, the route goes, as ``release`` does for
    any first turn.

    Regression (review 24r F1): the node reports that session (kept False) and its turn; the
    session was routed first, the turn rebuilt as not the one that opened it, and after its
    failure the route stayed for good."""
    assert first_turn_sessions("t1/s") == [("t1/s", "t1", False)]  # what a node reports, as here
    sched.apply_node_report("n1", report(sessions=first_turn_sessions("t1/s"), requests=[("t1/r#a", "t1", "t1/s", GW)]))
    assert sched.requests["t1/r#a"] == ("t1", "n1", "t1/s", "t1/s") and sched.session_nodes["t1/s"] == ("t1", "n1")
    sched.release("t1/r#a", {"finish_reason": "abort"})
    assert sched.session_nodes == {} and sched.sessions_per_tenant["t1"] == 0
    sched.apply_node_report("n0", report(sessions=[], requests=[("t1/q#a", "t1", "t1/new", GW)]))
    assert sched.requests["t1/q#a"] == ("t1", "n0", "t1/new", "t1/new")
    sched.release("t1/q#a", {"finish_reason": "abort"})
    assert "t1/new" not in sched.session_nodes


def test_a_first_turn_in_flight_that_finishes_keeps_its_session(sched: GlobalSchedulerService) -> None:
    """The same turn finishing on its node keeps the route, and the next turn continues it."""
    sched.apply_node_report("n1", report(sessions=first_turn_sessions("t1/s"), requests=[("t1/r#a", "t1", "t1/s", GW)]))
    sched.release("t1/r#a", FINISHED)
    turn = sched.admit("t1", "t1/r2#a", session_id="t1/s")
    assert (turn.code, turn.node_id, turn.continues_session) == ("OK", "n1", True)


def test_failed_first_turns_after_a_restart_leave_the_session_quota_free(tmp_path: Path) -> None:
    """Regression (review 24r F1): with ``max_sessions_per_tenant`` 3, three first turns in flight
    at the restart that then failed refused the tenant's next new session too_many_sessions
    for the scheduler's lifetime. A session reported with no turn of it in flight and no turn
    finished holds no history: it is not routed at all."""
    sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4}, max_sessions_per_tenant=3), "t1")
    sids = [f"t1/s{i}" for i in range(3)]
    sched.apply_node_report("n0", report(sessions=first_turn_sessions(*sids, "t1/idle"),
                                         requests=[(f"{sid}#a", "t1", sid, GW) for sid in sids]))
    assert set(sched.session_nodes) == set(sids)  # t1/idle: no turn in flight, none finished
    for sid in sids:
        sched.release(f"{sid}#a", {"finish_reason": "abort", "completion_tokens": 0})
    assert sched.session_nodes == {} and sched.sessions_per_tenant["t1"] == 0
    assert sched.admit("t1", "t1/new#a", session_id="t1/new").code == "OK"


def test_an_unhealthy_report_takes_the_node_down(sched: GlobalSchedulerService) -> None:
    sched.apply_node_report("n1", {"healthy": False, "failure": "cache node n1: step loop failed"})
    assert sched.down == {"n1": "cache node n1: step loop failed"}


@pytest.mark.parametrize("bad", [
    {"data_address": "ipc:///tmp/x"},
    {"data_address": ""},
    {"pid": -1},
    {"pid": "41"},
    {"blocks": [(H1, "spill_ram")]},  # a cache node holds no spill tier
    {"blocks": [("ab", "device")]},
    {"blocks": [(b"\x01" * 65, "device")]},
    {"blocks": "nope"},
    {"sessions": [("t2/s", "t1", True)]},  # another tenant's id
    {"sessions": [("t1/", "t1", True)]},
    {"sessions": [("t1/s", "t1", 1)]},
    {"sessions": [("t1/s", "t1")]},
    {"requests": [("t1/r#a", "t1", "", "inproc://x")]},
    {"requests": [("t1/r#a", "t1/x", "", GW)]},
    {"requests": [("t1/" + "r" * 3000, "t1", "", GW)]},
    {"requests": [(f"t1/r{i}", "t1", "", GW) for i in range(4 + 2 * 256 + 1)]},  # past what admission lets in
])
def test_a_bad_report_is_refused_whole(sched: GlobalSchedulerService, bad: dict[str, Any]) -> None:
    """Every field is checked before anything is applied (a report is untrusted input)."""
    with pytest.raises(BadReport):
        sched.apply_node_report("n0", report(**bad))
    assert not sched.requests and not sched.session_nodes and len(sched.index) == 0 and not sched.node_inboxes


def test_sessions_of_unknown_tenants_and_past_the_limit_are_left_out(tmp_path: Path) -> None:
    """A session of a tenant not in the store, one claimed by two nodes (routed to neither,
    lost: ``_claim``), those past ``max_sessions_per_tenant`` (lost ones included) and a turn
    of the claimed one are not routed (counted in ``bad_messages``)."""
    sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4}, max_sessions_per_tenant=2), "t1")
    sched.apply_node_report("n1", report(sessions=[("t1/a", "t1", True)], requests=[]))
    sessions = [("t1/a", "t1", True), ("gone/x", "gone", True), ("t1/b", "t1", True), ("t1/c", "t1", True)]
    sched.apply_node_report("n0", report(sessions=sessions, requests=[("t1/r#a", "t1", "t1/a", GW)]))
    assert sched.session_nodes == {"t1/b": ("t1", "n0")} and set(sched.lost_of("t1")) == {"t1/a"}
    assert "t1/r#a" not in sched.requests  # a turn of a session two nodes claim
    assert sched.bad_messages == 4


def test_a_session_two_nodes_claim_is_routed_to_neither(tmp_path: Path) -> None:
    """Regression (review 24r F2a): the first report won, so a node answering first took
    another node's session: its tenant's next turns went to it as continuations. Now a second
    claim takes the route from the first (its turn in flight detached), the session is lost
    (its next turn refused ABORTED until closed, never run on either node's word), and a third
    claim is refused too."""
    sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4, "n2": 4}), "t1", "t2")
    sched.apply_node_report("n1", report(data_address="tcp://127.0.0.1:9101", sessions=[("t2/chat", "t2", True)],
                                         requests=[("t2/lie#a", "t2", "t2/chat", GW)]))
    sched.apply_node_report("n0", report(sessions=[("t2/chat", "t2", True)], requests=[("t2/t#a", "t2", "t2/chat", GW)]))
    sched.apply_node_report("n2", report(data_address="tcp://127.0.0.1:9102", sessions=[("t2/chat", "t2", True)],
                                         requests=[]))
    assert sched.session_nodes == {} and sched.sessions_per_tenant["t2"] == 0 and set(sched.lost_of("t2")) == {"t2/chat"}
    assert sched.requests == {"t2/lie#a": ("t2", "n1", "", "")}  # n0's turn left out, n1's detached
    turn = sched.admit("t2", "t2/next#a", session_id="t2/chat")
    assert (turn.code, turn.reason) == ("ABORTED", "session_lost")
    assert sched.bad_messages == 3  # n0's session and turn, n2's session


def test_made_up_sessions_expire_unless_a_turn_confirms_them(tmp_path: Path) -> None:
    """Regression (review 24r F2b): a report's made-up sessions filled a tenant's
    ``max_sessions_per_tenant`` for good (only ``sessions_ended`` from that node dropped them),
    so each new session of the tenant was refused. A route rebuilt from a report now lasts
    ``session_ttl_s`` (as the node's idle session does) unless a turn of it is admitted or its
    gateway says it waits for one (``reconcile_gateway``)."""
    now = [1000.0]
    sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4}, max_sessions_per_tenant=4,
                                                session_ttl_s=900.0, clock=lambda: now[0]), "t1", "t2")
    made_up = [(f"t2/x{i}", "t2", True) for i in range(2)]
    sched.apply_node_report("n1", report(data_address="tcp://127.0.0.1:9101", requests=[("t2/r#a", "t2", "t2/s", GW)],
                                         sessions=[*made_up, ("t2/real", "t2", True), ("t2/s", "t2", True)]))
    assert sched.admit("t2", "t2/new#a", session_id="t2/new").reason == "too_many_sessions"
    assert sched.admit("t2", "t2/turn#a", session_id="t2/real").continues_session  # confirms t2/real
    sched.reconcile_gateway(GW, ["t2/r#a"])  # confirms t2/s
    now[0] += 899.0
    assert sched.admit("t2", "t2/new#a", session_id="t2/new").reason == "too_many_sessions"
    now[0] += 1.0
    assert sched.admit("t2", "t2/new#a", session_id="t2/new").code == "OK"
    assert set(sched.session_nodes) == {"t2/real", "t2/s", "t2/new"} and sched.sessions_per_tenant["t2"] == 3
    assert sched.unconfirmed_sessions == {}


def test_reconcile_releases_the_rebuilt_requests_a_gateway_no_longer_waits_for(sched: GlobalSchedulerService) -> None:
    """Their release was lost while the scheduler was down: without this they counted in flight
    for ever (the queue limit, load routing). A request admitted since is never touched."""
    sched.apply_node_report("n0", report(requests=[("t1/r1#a", "t1", "", GW), ("t1/r2#a", "t1", "", GW),
                                                   ("t2/r#a", "t2", "", "tcp://127.0.0.1:7002")]))
    assert sched.admit("t1", "t1/new").code == "OK"
    assert sched.reconcile_gateway(GW, ["t1/r2#a", "t1/new"]) == ["t1/r1#a"]
    assert set(sched.requests) == {"t1/r2#a", "t2/r#a", "t1/new"}
    assert sched.reconcile_gateway(GW, []) == []  # once only
    assert sched.forget_unattached({GW}) == ["tcp://127.0.0.1:7002"]
    assert set(sched.requests) == {"t1/r2#a", "t1/new"}


def test_one_report_queues_no_more_than_its_nodes_share(tmp_path: Path) -> None:
    """Regression (review 24r F3): a report was bounded per node by what admission lets in
    overall (capacity + 2 * queue_limit), so one node reporting that many requests (a made-up
    gateway inbox) filled the global queue: every tenant was refused ``queue_full`` for
    ``GATEWAY_REATTACH_S``. A node's rebuilt requests are now at most its capacity and its
    share of ``queue_limit`` by capacity (n1: 4 + 8 * 4 // 12 = 6); the rest are left out."""
    sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 4}, queue_limit=8), "t1", "t2")
    flood = [(f"t2/r{i}#a", "t2", "", "tcp://10.9.9.9:1") for i in range(4 + 2 * 8)]
    sched.apply_node_report("n1", report(data_address="tcp://127.0.0.1:9101", sessions=[], requests=flood))
    assert sched.nodes["n1"].in_flight == {f"t2/r{i}#a" for i in range(6)} and sched._queued() == 2
    assert sched.request_share("n1") == 6 and sched.request_share("n0") == 8 + 5
    assert sched.admit("t1", "t1/x#a").code == "OK" and sched.admit("t2", "t2/x#a").code == "OK"


class Inboxes:
    """A command channel (``attach_nodes``) that keeps ``(address, message)`` of each send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send(self, address: str, msg: dict[str, Any]) -> bool:
        self.sent.append((address, msg))
        return True


def test_reconcile_aborts_on_their_nodes_the_requests_it_releases(sched: GlobalSchedulerService) -> None:
    """Regression (review 24r F4): a rebuilt request the gateway no longer waits for (its submit
    reached the node, its admission failed at the crash) was released here and ran on to
    ``max_tokens`` on its node, uncounted. Now its node is told to abort it, as
    ``gateway_gone`` aborts a gone gateway's; one released normally before is left alone."""
    sched.attach_nodes({}, sender=(inboxes := Inboxes()))
    sched.apply_node_report("n0", report(sessions=[], requests=[("t1/orphan#a", "t1", "", GW),
                                                                ("t1/done#a", "t1", "", GW),
                                                                ("t1/kept#a", "t1", "", GW)]))
    sched.apply_node_report("n1", report(data_address="tcp://127.0.0.1:9101", sessions=[],
                                         requests=[("t2/orphan#a", "t2", "", GW)]))
    sched.release("t1/done#a", FINISHED)  # its release came before the gateway attached again
    assert sched.reconcile_gateway(GW, ["t1/kept#a"]) == ["t1/orphan#a", "t2/orphan#a"]
    assert inboxes.sent == [("tcp://127.0.0.1:9100", {"op": "abort", "id": "t1/orphan#a"}),
                            ("tcp://127.0.0.1:9101", {"op": "abort", "id": "t2/orphan#a"})]
    assert set(sched.requests) == {"t1/kept#a"} and sched.nodes["n0"].in_flight == {"t1/kept#a"}


class GatewayHandle:
    """A gateway actor's handle as ``attach_gateway`` uses it: ``serves`` waits (the watch's
    long poll), ``counted_gone`` records what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, list[str]]] = []
        self.serves = SimpleNamespace(remote=self._serves)
        self.counted_gone = SimpleNamespace(remote=self._counted_gone)

    async def _serves(self, subscriber: str, wait_s: float) -> bool:
        await asyncio.Event().wait()
        return True

    async def _counted_gone(self, subscriber: str, request_ids: list[str]) -> bool:
        self.told.append((subscriber, request_ids))
        return True


def test_a_gateway_attaching_after_the_reattach_timeout_is_told_what_was_released(
        sched: GlobalSchedulerService) -> None:
    """Regression (review 24r A2): a gateway that attached after ``forget_unattached`` had
    counted it gone was never told its rebuilt requests were released (and aborted on their
    nodes without an event): their streams waited for their own deadlines. It is told once
    (``counted_gone``); a gateway never forgotten is told nothing."""
    sched.apply_node_report("n0", report())
    assert sched.forget_unattached(set()) == [GW] and not sched.requests
    late, other = GatewayHandle(), GatewayHandle()

    async def attach() -> None:
        await sched.attach_gateway("g1", "127.0.0.1:50051", GW, late)
        await sched.attach_gateway("g2", "127.0.0.1:50052", "tcp://127.0.0.1:7002", other)
        await sched.attach_gateway("g1", "127.0.0.1:50051", GW, late)  # its reattach: told once
        await asyncio.sleep(0.05)
        for task in list(sched._gateway_watches.values()):
            task.cancel()

    asyncio.run(attach())
    assert late.told == [(GW, ["t1/r1#a", "t1/r2#b"])] and other.told == []


def test_peers_refuse_a_timeout_that_is_no_deadline() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="report_timeout_s"):
            RecoveryPeers("ns", (), bad)


def test_requests_left_out_are_aborted_so_no_first_turn_runs_on_unrouted(tmp_path: Path) -> None:
    """Review 24s S1: requests past a node's share were left out but ran on; a first session
    turn among them finished with its history on n0 and no route here, so the session's next
    turn went to n1 by load and ran without its history (``continues_session`` False). Now
    every rebuilt request not counted is aborted on its node (its client retries)."""
    s = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1}, queue_limit=2), "t1")
    s.recovered_requests = {}
    s.attach_nodes({}, sender=(inboxes := Inboxes()))
    assert s.request_share("n0") == 2
    reqs = [("t1/a#1", "t1", "", GW), ("t1/b#1", "t1", "", GW), ("t1/first#1", "t1", "t1/s", GW)]
    s.apply_node_report("n0", report(sessions=first_turn_sessions("t1/s"), requests=reqs))
    assert inboxes.sent == [("tcp://127.0.0.1:9100", {"op": "abort", "id": "t1/first#1"})]
    assert "t1/s" not in s.session_nodes and s.nodes["n0"].in_flight == {"t1/a#1", "t1/b#1"}


def test_a_restored_lost_mark_keeps_a_reported_session_unrouted_and_a_close_clears_both(tmp_path: Path) -> None:
    """Review 24s S2: a lost session closed and reopened on another node in the seconds before
    a crash came back both marked lost (the close was not stored yet) and routed (that node's
    report): it counted twice against the cap, and after the client closed it a reopen was
    refused ``session_lost``. Now a marked session is not routed from a report, and a close
    clears a mark beside a route."""
    s = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 4, "n1": 4}, max_sessions_per_tenant=2), "t1")
    s.recovered_requests = {}
    s.mark_lost("t1", "t1/s")  # as restored from the store
    s.apply_node_report("n1", report(data_address="tcp://127.0.0.1:9101", sessions=[("t1/s", "t1", True)],
                                     requests=[]))
    assert "t1/s" not in s.session_nodes and s.admit("t1", "t1/new#1", session_id="t1/n").code == "OK"
    assert s.admit("t1", "t1/again#1", session_id="t1/s").reason == "session_lost"
    assert s.close_session("t1/s", "t1") == ("", [])  # the client closes it: reopened fresh
    assert s.admit("t1", "t1/reopen#1", session_id="t1/s").code == "OK"
    s.mark_lost("t1", "t1/s")  # a mark beside a route: the close clears both
    assert s.close_session("t1/s", "t1") is not None and "t1/s" not in s.lost_of("t1")


def test_flushes_prune_marks_past_their_ttl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 24s S3: a mark that aged out in memory kept its row until the next restart
    (100, 200, 300 rows with none left in memory). A flush now deletes rows past the TTL."""
    import services.global_scheduler_sessions as sessions

    wall = [1_000_000.0]
    monkeypatch.setattr(sessions.time, "time", lambda: wall[0])
    s = GlobalSchedulerService(str(tmp_path), {"n0": 4}, session_ttl_s=60.0)
    tenant_id = s.store.register(TenantSpec("ann"))[0].tenant_id  # stored: its marks' rows go in
    for i in range(3):
        s.mark_lost(tenant_id, f"s{i}")
    s.flush_sessions()
    wall[0] += 61.0
    s.mark_lost(tenant_id, "late")
    s.flush_sessions()
    rows = s.store._conn.execute("SELECT session_id FROM lost_sessions").fetchall()
    assert rows == [("late",)]
