"""The scheduler's session routes are stored in the tenant store (``Sessions.flush_sessions``),
so a new scheduler process refuses the next turn of a session whose history no node holds any
more (``lose_stored_sessions``): after ``kvstrata down``/``up``, and after a crash of the
scheduler together with the session's node. Review 26b F2: such a turn was admitted as the
session's first and answered from its new tokens alone, with OK. The same on a real stack:
tests/test_services_restart.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import services.global_scheduler_admission as admission
import services.global_scheduler_sessions as sessions
from services.global_scheduler import SESSION_LOST, GlobalScheduler
from services.global_scheduler_admission import USAGE_FLUSH_S, GlobalSchedulerService
from services.global_scheduler_recovery import RecoveryPeers
from tenants.model import TenantSpec

FINISHED = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
TTL_S = 900.0


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The schedulers' wall clock (the stored times), moved by the test."""
    now = [1_000_000.0]
    monkeypatch.setattr(sessions.time, "time", lambda: now[0])
    return now


def turn(sched: GlobalScheduler, tenant_id: str, rid: str, session_id: str, usage: Any = FINISHED) -> None:
    """A turn admitted and, unless ``usage`` is ``...``, released with ``usage``."""
    assert sched.admit(tenant_id, rid, session_id=session_id).code == "OK"
    if usage is not ...:
        sched.release(rid, usage)


def refused(sched: GlobalScheduler, tenant_id: str, session_id: str) -> bool:
    adm = sched.admit(tenant_id, f"{session_id}#probe", session_id=session_id)
    if adm.code == "OK":
        sched.release(f"{session_id}#probe", None)
        return False
    assert (adm.code, adm.reason, adm.message) == ("ABORTED", "session_lost", SESSION_LOST)
    return True


def test_after_down_and_up_a_sessions_next_turn_is_refused_not_run_without_its_history(
        tmp_path: Path, wall: list[float]) -> None:
    """``kvstrata down`` stores the routes (``flush_durable``) and kills every node; the new
    scheduler of ``up`` marks each stored route lost: a session with a finished turn, and one
    whose first turn was running at the stop (it may have finished and been answered), are
    refused until closed. A closed session, and one whose first turn failed (no history), open
    anew; a closed lost session opens anew too. The marks are stored in turn: a second restart
    still refuses. Past ``session_ttl_s`` (+ ``STORE_LAG_S``) after its last use a session would
    have expired on its node: it opens anew."""
    first = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    ann = first.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    turn(first, ann, "r1", "kept")
    turn(first, ann, "r2", "kept")
    turn(first, ann, "r3", "running", usage=...)  # its first turn runs at the stop
    turn(first, ann, "r4", "closed")
    assert first.close_session("closed", ann) is not None
    turn(first, ann, "r5", "failed", usage={"prompt_tokens": 30, "finish_reason": "error"})
    assert set(first.session_nodes) == {"kept", "running"}
    assert first.flush_sessions() > 0  # stop_services: flush_durable, then every actor killed
    first.store.close()

    wall[0] += 60.0
    second = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)  # `kvstrata up`
    assert refused(second, ann, "kept") and refused(second, ann, "running")  # before: OK, no history
    assert not refused(second, ann, "closed") and not refused(second, ann, "failed")
    assert second.close_session("kept", ann) == ("", [])  # the client closes it and starts again
    assert not refused(second, ann, "kept")
    turn(second, ann, "r6", "kept")  # its new first turn
    second.flush_sessions()
    second.store.close()

    wall[0] += 60.0
    third = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    assert refused(third, ann, "running")  # its mark was stored
    assert refused(third, ann, "kept")  # reopened in the second: lost again with it
    third.store.close()

    wall[0] += TTL_S + sessions.STORE_LAG_S  # idle that long since their last use: expired anyway
    fourth = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    assert not fourth.lost_sessions and not refused(fourth, ann, "running") and not refused(fourth, ann, "kept")
    fourth.store.close()


def test_a_stored_route_counts_from_its_last_use_and_goes_with_its_tenant(tmp_path: Path, wall: list[float]) -> None:
    """A session's stored last use is its last turn's (its node's TTL counts from there), not
    its first: used 800 s after it opened, it is still refused 800 s later. A deleted tenant's
    stored routes go with it (nothing of it is restored)."""
    first = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    ann = first.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    bob = first.register_tenant(TenantSpec("bob", "standard"))[0].tenant_id
    turn(first, ann, "r1", "long")
    turn(first, bob, "b1", "gone")
    first.flush_sessions()
    wall[0] += 800.0
    turn(first, ann, "r2", "long")
    first.delete_tenant("bob")
    first.flush_sessions()
    first.store.close()

    wall[0] += 800.0  # 1600 s after it opened, 800 s after its last turn
    second = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    assert refused(second, ann, "long")
    assert set(second.lost_sessions) == {ann}
    assert second.store._conn.execute("SELECT COUNT(*) FROM open_sessions WHERE tenant_id = ?",
                                      (bob,)).fetchone() == (0,)
    second.store.close()


def test_a_restarted_scheduler_loses_the_stored_sessions_no_node_reports(
        tmp_path: Path, wall: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash of the scheduler, and while Ray restarts it, one of the two nodes restarts too
    (its sessions' histories gone; it reports none), the other reports its session. The
    session the report names is routed there again and continues; the other is refused
    ABORTED ``session_lost`` (before: its next turn ran as its first, with OK). The new
    scheduler marks it only after the reports (``recovering``): a session a report names is
    never marked."""
    first = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=TTL_S)
    ann = GlobalScheduler.register_tenant(first, TenantSpec("ann", "standard"))[0].tenant_id
    a, b = f"{ann}/a", f"{ann}/b"  # as the gateway scopes them
    turn(first, ann, "r1", a, usage=...)
    turn(first, ann, "r2", b, usage=...)
    first.release("r1", FINISHED)
    first.release("r2", FINISHED)
    nodes = {first.session_nodes[sid][1]: sid for sid in (a, b)}
    assert set(nodes) == {"n0", "n1"}  # by load, one on each
    first.flush_sessions()  # the actor stores a route at once (test_the_actor_stores_...)
    first.store.close()  # killed

    def node_report(pid: int, restarts: int, sessions: list[tuple[str, str, bool]]) -> dict[str, Any]:
        return {"healthy": True, "failure": "", "pid": pid, "restarts": restarts,
                "data_address": f"tcp://127.0.0.1:{9100 + pid}", "blocks": [], "sessions": sessions, "requests": []}

    monkeypatch.setattr(admission, "actor_restarts", lambda: 1)  # Ray restarted the actor
    monkeypatch.setattr(GlobalSchedulerService, "recover", lambda self, peers: (
        self.apply_node_report("n0", node_report(41, 0, [(nodes["n0"], ann, True)])),
        self.apply_node_report("n1", node_report(77, 1, []))))  # n1 restarted meanwhile: nothing held

    async def restarted() -> None:
        second = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=TTL_S,
                                        peers=RecoveryPeers("kvstrata-test"))
        try:
            assert second.session_nodes == {nodes["n0"]: (ann, "n0")}
            adm = second.admit(ann, "r3", session_id=nodes["n0"])
            assert (adm.code, adm.node_id, adm.continues_session) == ("OK", "n0", True)
            assert refused(second, ann, nodes["n1"])
        finally:
            second.close_data_plane()
            second.store.close()

    asyncio.run(restarted())


def test_the_actor_stores_a_new_route_and_a_lost_mark_at_once(tmp_path: Path) -> None:
    """The actor stores a route as its session opens, and a mark as its session is lost, in a
    worker thread, not at the next periodic flush (``USAGE_FLUSH_S``): a crash of the scheduler
    and of the session's node in those seconds would lose the route, and the session's next
    turn would run as its first."""
    async def serving() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
        ann = GlobalScheduler.register_tenant(sched, TenantSpec("ann", "standard"))[0].tenant_id
        await sched.open_data_plane()
        try:
            def rows(table: str) -> list[tuple[str, ...]]:
                with sched.store._lock:
                    return sched.store._conn.execute(f"SELECT tenant_id, session_id FROM {table}").fetchall()

            async def stored(table: str, want: list[tuple[str, ...]]) -> float:
                t0 = time.monotonic()
                while rows(table) != want:
                    assert time.monotonic() - t0 < USAGE_FLUSH_S / 2, f"{table}: {rows(table)}"
                    await asyncio.sleep(0.01)
                return time.monotonic() - t0

            assert sched.admit(ann, "r1", session_id="s1").code == "OK"
            assert await stored("open_sessions", [(ann, "s1")]) < USAGE_FLUSH_S / 2
            sched.release("r1", FINISHED)
            sched.node_down("n0", "its data-plane connection closed")
            sched.node_up("n0", "tcp://127.0.0.1:9100", pid=0)  # a new process: s1 is lost
            await stored("lost_sessions", [(ann, "s1")])
            await stored("open_sessions", [])
        finally:
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(serving())
