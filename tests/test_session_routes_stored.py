"""The scheduler's session routes are stored in the tenant store (``Sessions.flush_sessions``),
so a new scheduler process refuses the next turn of a session whose history no node holds any
more (``lose_stored_sessions``): after ``kvstrata down``/``up``, and after a crash of the
scheduler together with the session's node. Review 26b F2: such a turn was admitted as the
session's first and answered from its new tokens alone, with OK. The same on a real stack:
tests/test_services_restart.py."""

from __future__ import annotations

import asyncio
import sqlite3
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


def test_the_actor_stores_a_dropped_route_and_an_unmarked_session_at_once(tmp_path: Path) -> None:
    """Review 26e F3: a route dropped (closed, its first turn failed, expired on its node, lost)
    and a lost mark removed (the client closed the session) waited for the 5-s flush while an
    opened route was stored at once, so a crash of the scheduler in those seconds brought the
    sessions the client had closed back as lost: with every node alive, 4 closed sessions of a
    tenant with ``max_sessions_per_tenant`` 4 were refused, and so was its next new session
    (RESOURCE_EXHAUSTED too_many_sessions), for up to ``session_ttl_s``. Now each is stored at
    once, in a worker thread."""
    async def serving() -> str:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=4)
        ann = GlobalScheduler.register_tenant(sched, TenantSpec("ann", "standard"))[0].tenant_id
        await sched.open_data_plane()
        try:
            def rows(table: str) -> list[tuple[str, ...]]:
                with sched.store._lock:
                    return sched.store._conn.execute(
                        f"SELECT tenant_id, session_id FROM {table} ORDER BY session_id").fetchall()

            async def stored(table: str, want: list[str]) -> None:
                t0 = time.monotonic()
                while rows(table) != [(ann, sid) for sid in want]:
                    assert time.monotonic() - t0 < USAGE_FLUSH_S / 2, f"{table}: {rows(table)}"
                    await asyncio.sleep(0.01)

            turn(sched, ann, "r1", "closed")
            turn(sched, ann, "r2", "failed", usage={"prompt_tokens": 30, "finish_reason": "error"})
            turn(sched, ann, "r3", "expired")
            turn(sched, ann, "r4", "lost")
            await stored("open_sessions", ["closed", "expired", "lost"])
            assert sched.close_session("closed", ann) == ("n0", [])
            await stored("open_sessions", ["expired", "lost"])
            sched.sessions_ended("n0", ["expired"])
            await stored("open_sessions", ["lost"])
            sched.node_down("n0", "its data-plane connection closed")
            sched.node_up("n0", "tcp://127.0.0.1:9100", pid=0)  # a new process: "lost" is lost
            await stored("open_sessions", [])
            await stored("lost_sessions", ["lost"])
            assert sched.close_session("lost", ann) == ("", [])
            await stored("lost_sessions", [])
            for i in range(4):  # the tenant's whole cap, opened and closed
                turn(sched, ann, f"c{i}", f"c{i}")
            await stored("open_sessions", [f"c{i}" for i in range(4)])
            for i in range(4):
                sched.close_session(f"c{i}", ann)
            await stored("open_sessions", [])
            return ann
        finally:  # then killed: no flush_durable
            sched.close_data_plane()
            sched.store.close()

    ann = asyncio.run(serving())
    restarted = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=4)
    assert restarted.lost_of(ann) == {}
    for sid in ("closed", "failed", "expired", "lost", "c0", "fresh"):
        assert not refused(restarted, ann, sid)
    restarted.store.close()


class FailingStore:
    """A tenant store whose session writes fail ("database or disk is full") while ``full``;
    ``during`` runs inside each write, before it fails or is applied."""

    def __init__(self, store: Any) -> None:
        self.store, self.full, self.during = store, True, lambda: None

    def save_sessions(self, *args: Any, **kwargs: Any) -> None:
        self.during()
        if self.full:
            raise sqlite3.OperationalError("database or disk is full")
        self.store.save_sessions(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def open_rows(sched: GlobalScheduler) -> list[tuple[str, ...]]:
    return sched.store._conn.execute("SELECT session_id FROM open_sessions ORDER BY session_id").fetchall()


def test_sessions_opened_and_closed_while_the_store_fails_leave_nothing_pending(
        tmp_path: Path, wall: list[float]) -> None:
    """Review 26e F4: while the store failed (disk full), each session opened and closed left a
    pending change for good: 20,000 sessions, 20,000 changes (the scheduler's memory grew
    without bound). A route opened and dropped with no write of it stored leaves nothing; a
    stored route's removal and an open route's use stay pending, and are stored once the store
    works again."""
    sched = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=4)
    ann = sched.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    turn(sched, ann, "s0", "stored-then-closed")
    turn(sched, ann, "s1", "stored-and-open")
    sched.flush_sessions()
    sched.store = store = FailingStore(sched.store)
    sched.close_session("stored-then-closed", ann)
    turn(sched, ann, "s2", "stored-and-open")  # a use: its later last use stays pending
    turn(sched, ann, "s3", "opened-during")
    for i in range(5000):
        turn(sched, ann, f"r{i}", f"x{i}")
        if i % 3:  # some of them while a failed write was being made
            store.during = lambda i=i: sched.close_session(f"x{i}", ann)
            with pytest.raises(sqlite3.OperationalError):
                sched.flush_sessions()
            store.during = lambda: None
        else:
            sched.close_session(f"x{i}", ann)
    assert len(sched.open_changes) == 3  # before: 5,003
    assert dict(sched.open_changes.changes) == {(ann, "stored-then-closed"): None, (ann, "stored-and-open"): wall[0],
                                                (ann, "opened-during"): wall[0]}
    assert len(sched.lost_changes) == 0 and sched.open_changes.discarded == 0
    store.full = False
    assert sched.flush_sessions() == 3
    assert open_rows(sched) == [("opened-during",), ("stored-and-open",)]
    sched.store = store.store
    sched.store.close()


def test_a_write_of_a_route_that_fails_or_succeeds_while_the_route_is_dropped(
        tmp_path: Path, wall: list[float]) -> None:
    """The route is dropped while the write that stores it is made: a failed write leaves
    nothing pending (the route was never stored), a successful one leaves its removal, and a
    route reopened meanwhile is stored after either; never a stored row of a closed session
    (a crash would bring it back as lost) or a missing row of an open one."""
    sched = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S)
    ann = sched.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    sched.store = store = FailingStore(sched.store)
    turn(sched, ann, "r1", "a")
    turn(sched, ann, "r2", "b")
    store.during = lambda: (sched.close_session("a", ann), sched.close_session("b", ann), turn(sched, ann, "r3", "b"))
    with pytest.raises(sqlite3.OperationalError):
        sched.flush_sessions()
    assert dict(sched.open_changes.changes) == {(ann, "b"): wall[0]} and sched.open_changes.unstored == {(ann, "b")}
    sched.close_session("b", ann)  # never stored: nothing left
    assert len(sched.open_changes) == 0

    turn(sched, ann, "r4", "c")
    turn(sched, ann, "r5", "d")
    store.full = False
    store.during = lambda: (sched.close_session("c", ann), sched.close_session("d", ann), turn(sched, ann, "r6", "d"))
    sched.flush_sessions()  # stores c and d as they were taken
    assert open_rows(sched) == [("c",), ("d",)]
    store.during = lambda: None
    assert dict(sched.open_changes.changes) == {(ann, "c"): None, (ann, "d"): wall[0]}
    sched.flush_sessions()
    assert open_rows(sched) == [("d",)]
    sched.close_session("d", ann)
    sched.flush_sessions()
    assert open_rows(sched) == []
    sched.store = store.store
    sched.store.close()


def test_pending_removals_past_the_session_cap_while_the_store_fails_are_discarded_oldest_first(
        tmp_path: Path, wall: list[float]) -> None:
    """Review 26e F4: the pending removals of one tenant's stored rows are bounded by its
    ``max_sessions_per_tenant`` while the store fails (more rows than that are stored only by a
    previous process with a larger cap). Past it the oldest are discarded: those rows stay, so
    the next process marks those sessions lost (refused until closed: the safe side); a
    route's write and a lost mark are never discarded; a mark made and removed while the store
    fails leaves nothing."""
    first = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=8)
    ann = first.register_tenant(TenantSpec("ann", "standard"))[0].tenant_id
    for i in range(8):
        turn(first, ann, f"r{i}", f"s{i}")
    first.flush_sessions()
    first.store.close()

    wall[0] += 10.0
    second = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=4)
    assert set(second.lost_of(ann)) == {f"s{i}" for i in range(8)}  # `kvstrata up`: every one lost
    second.store = store = FailingStore(second.store)
    with pytest.raises(sqlite3.OperationalError):
        second.flush_sessions()
    assert list(second.open_changes.changes) == [(ann, f"s{i}") for i in range(4, 8)]
    assert second.open_changes.discarded == 4 and len(second.lost_changes) == 8
    assert second.close_session("s7", ann) == ("", [])  # its mark was never stored: nothing left
    assert len(second.open_changes) == 4 and len(second.lost_changes) == 7
    store.full = False
    second.flush_sessions()
    assert open_rows(second) == [("s0",), ("s1",), ("s2",), ("s3",)]
    second.store = store.store
    second.store.close()

    wall[0] += 10.0
    third = GlobalScheduler(str(tmp_path), {"n0": 8}, session_ttl_s=TTL_S, max_sessions_per_tenant=4)
    assert set(third.lost_of(ann)) == {f"s{i}" for i in range(7)}  # s0-s3 stayed lost, rows or not
    third.store.close()
