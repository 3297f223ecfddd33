"""The parts of ending a stream whose API key was removed (``services.gateway_key_watch``,
``NodeStreams.end_revoked``), over real ZeroMQ sockets and a real scheduler's tenant store: a
stream still being admitted ends at its ``bind`` (never released before its admission is
answered), a reader that does not take its error is stopped after ``REVOKED_READ_S``, and the
watch ends the streams of the removed key alone. tests/test_stream_key_revoked.py runs the
whole path (real node, gRPC and HTTP clients)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio

from services import data_plane, key_ids
from services.actor_calls import BoundedActor
from services.auth import Authenticator
from services.gateway_key_watch import REVOKED_MESSAGE, KeyWatch
from services.gateway_streams import REVOKED_READ_S, NodeStreams
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.keys import parse_key_id
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _streams(clock: Any = None) -> tuple[NodeStreams, Any, Any]:
    """Started ``NodeStreams`` for node "n0", whose command inbox (a PULL socket) is returned
    with its context; the scheduler's socket is bound and never answers (nothing is admitted)."""
    ctx = zmq.asyncio.Context()
    inbox, sched = ctx.socket(zmq.PULL), ctx.socket(zmq.ROUTER)
    node_port, sched_port = inbox.bind_to_random_port("tcp://127.0.0.1"), sched.bind_to_random_port("tcp://127.0.0.1")
    kwargs = {} if clock is None else {"clock": clock}
    streams = NodeStreams({"n0": None}, {"n0": f"tcp://127.0.0.1:{node_port}"}, f"tcp://127.0.0.1:{sched_port}",
                          **kwargs)
    await streams.start()
    return streams, inbox, ctx


def test_a_revoked_streams_end_waits_for_its_admission_and_its_reader_is_stopped() -> None:
    """A stream ended for its key while its admission is on its way: nothing is seen (no
    release, which could reach the scheduler before the admission) until ``bind``, which ends
    it UNAUTHENTICATED and aborts it on its node. A bound one ends at once; its reader, taking
    nothing for ``REVOKED_READ_S`` (stuck writing to its client), is stopped through
    ``on_idle(message, "UNAUTHENTICATED")``, once, not counted as an idle end. A stream of the
    same id opened again is not the one ended."""
    clock = _Clock()

    async def run() -> None:
        streams, inbox, ctx = await _streams(clock)
        seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        stopped: list[tuple[str, str]] = []
        queues = {rid: streams.open(rid, seen[rid].append, lambda m, c="RESOURCE_EXHAUSTED": stopped.append((m, c)),
                                    key_id="0123456789ab") for rid in ("a", "b")}
        opened = {rid: opening for rid, _, _, opening in streams.key_streams()}

        assert streams.end_revoked("a", opened["a"], REVOKED_MESSAGE)  # being admitted
        assert not streams.end_revoked("a", opened["a"], REVOKED_MESSAGE)  # once
        assert seen["a"] == [] and queues["a"].empty()
        assert [rid for rid, *_ in streams.key_streams()] == ["b"]
        streams.bind("a", "n0")  # its admission came: ended now
        assert [e["code"] for e in seen["a"]] == ["UNAUTHENTICATED"]
        assert queues["a"].get_nowait()["message"] == REVOKED_MESSAGE
        assert data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) == {"op": "abort", "id": "a"}

        streams.bind("b", "n0")
        assert streams.end_revoked("b", opened["b"], REVOKED_MESSAGE)
        assert [e["code"] for e in seen["b"]] == ["UNAUTHENTICATED"]
        assert data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) == {"op": "abort", "id": "b"}
        clock.now += REVOKED_READ_S - 0.1
        streams.expire_idle()
        assert stopped == []
        clock.now += 0.2  # b's reader took nothing since
        assert streams.expire_idle() == [] and streams.idle_ends == 0
        assert stopped == [(REVOKED_MESSAGE, "UNAUTHENTICATED")]
        streams.expire_idle()
        assert len(stopped) == 1

        streams.close("a")
        streams.open("a", key_id="0123456789ab")  # the id again: another stream
        assert not streams.end_revoked("a", opened["a"], REVOKED_MESSAGE)
        streams.shutdown()
        ctx.destroy(linger=0)

    asyncio.run(run())


def test_the_watch_ends_the_streams_of_removed_keys_alone(tmp_path: Path) -> None:
    """ann's and bob's streams are open; ann's key is rotated away at the scheduler (another
    gateway). A check (a directory refresh) ends ann's stream alone; ann's stream under her new
    key and bob's stay. Ids the directory reports removed (``on_keys_gone``) end theirs at once."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})

    async def run() -> None:
        streams, _, ctx = await _streams()
        auth = Authenticator(LocalActor(sched))
        watch = KeyWatch(streams, auth, interval_s=60.0)
        assert auth.on_keys_gone == watch.keys_gone
        watch.start()  # (its first check finds no stream open)
        _, ann_key = await sched.register_tenant(TenantSpec("ann"))
        _, bob_key = await sched.register_tenant(TenantSpec("bob"))
        assert await auth.directory.refresh()
        for rid, key in (("ann-1", ann_key), ("bob-1", bob_key)):
            streams.open(rid, key_id=parse_key_id(key) or "")
            streams.bind(rid, "n0")
        new_key = await sched.rotate_tenant_key("ann")
        streams.open("ann-2", key_id=parse_key_id(new_key) or "")
        streams.bind("ann-2", "n0")

        assert await watch.check() == 1
        assert sorted(rid for rid, *_ in streams.key_streams()) == ["ann-2", "bob-1"]
        assert await watch.check() == 0

        await sched.delete_tenant("bob")
        watch.keys_gone({parse_key_id(bob_key) or ""})  # as a refresh reports it: a check at once
        for _ in range(200):
            if watch.ended == 2:
                break
            await asyncio.sleep(0.01)
        assert [rid for rid, *_ in streams.key_streams()] == ["ann-2"]
        assert watch.ended == 2
        streams.shutdown()
        ctx.destroy(linger=0)

    try:
        asyncio.run(run())
    finally:
        sched.store.close()


def _silent(sched: GlobalSchedulerService) -> BoundedActor:
    """The scheduler's handle as a gateway holds it once its monitor found it silent: calls
    fail ``ActorSilent`` unsent (the key directory's refresh: ``UNREACHABLE``)."""
    handle = BoundedActor(LocalActor(sched), 30.0)
    handle.silent = lambda: "the global scheduler has not answered its health checks for 10 s"
    return handle


def test_one_failed_refresh_past_the_bound_ends_nothing_two_end_the_stream(tmp_path: Path) -> None:
    """ann's stream was opened (its key confirmed) 100 s ago, past ``staleness_max_s`` (30 s),
    and the scheduler does not answer. One check (one failed refresh: a restart, a timeout)
    ends nothing; the second in a row ends the stream UNAVAILABLE. Regression (review r1 F4,
    session 37): the two-failures rule was untested (``>= 1`` passed every test)."""
    sched, clock = GlobalSchedulerService(str(tmp_path), {"n0": 1}), _Clock()

    async def run() -> None:
        streams, _, ctx = await _streams(clock)
        auth = Authenticator(LocalActor(sched))
        watch = KeyWatch(streams, auth, interval_s=60.0, staleness_max_s=30.0)
        _, ann_key = await sched.register_tenant(TenantSpec("ann"))
        streams.open("ann-1", key_id=parse_key_id(ann_key) or "")
        streams.bind("ann-1", "n0")
        clock.now += 100.0
        auth.directory.scheduler = _silent(sched)
        assert await watch.check() == 0
        assert watch.unconfirmed == 0 and [rid for rid, *_ in streams.key_streams()] == ["ann-1"]
        assert await watch.check() == 0  # (UNAVAILABLE ends are counted in ``unconfirmed``)
        assert watch.unconfirmed == 1 and streams.key_streams() == []
        streams.shutdown()
        ctx.destroy(linger=0)

    try:
        asyncio.run(run())
    finally:
        sched.store.close()


def test_an_unusable_directory_is_no_outage_and_keys_are_asked_about_alone(tmp_path: Path, monkeypatch) -> None:
    """The store holds more key ids than a directory may (``_MAX_DIRECTORY_IDS``, 2**18; 3 here)
    and the scheduler answers. ann's stream, opened 100 s ago, runs on through checks past
    ``staleness_max_s``: its key id is confirmed by ``key_ids_exist``; once ann's key is rotated
    away the next check ends it UNAUTHENTICATED. Before that, bob's stream under a scheduler
    without ``key_ids_exist`` (nor a usable directory) is left alone. Regression (review r1 F1,
    session 37): every refresh was refused as too large, counted as the scheduler not
    answering, and every stream ended UNAVAILABLE after ``staleness_max_s`` (here the
    second check)."""
    sched, clock = GlobalSchedulerService(str(tmp_path), {"n0": 1}), _Clock()
    monkeypatch.setattr(key_ids, "_MAX_DIRECTORY_IDS", 3)

    async def run() -> None:
        streams, _, ctx = await _streams(clock)
        auth = Authenticator(LocalActor(sched))
        watch = KeyWatch(streams, auth, interval_s=60.0, staleness_max_s=30.0)
        _, ann_key = await sched.register_tenant(TenantSpec("ann"))
        for i in range(4):
            await sched.register_tenant(TenantSpec(f"t{i}"))
        streams.open("ann-1", key_id=parse_key_id(ann_key) or "")
        streams.bind("ann-1", "n0")
        for _ in range(3):
            clock.now += 100.0
            assert await watch.check() == 0
        assert watch.unconfirmed == 0 and not auth.directory.loaded
        assert [rid for rid, *_ in streams.key_streams()] == ["ann-1"]

        auth.directory.scheduler = SimpleNamespace(key_ids_since=auth.directory.scheduler.key_ids_since)
        for _ in range(3):  # it answers, but cannot tell: left alone
            clock.now += 100.0
            assert await watch.check() == 0
        assert watch.unconfirmed == 0 and [rid for rid, *_ in streams.key_streams()] == ["ann-1"]

        auth.directory.scheduler = LocalActor(sched)
        await sched.rotate_tenant_key("ann")
        assert await watch.check() == 1 and watch.unconfirmed == 0
        assert streams.key_streams() == []
        streams.shutdown()
        ctx.destroy(linger=0)

    try:
        asyncio.run(run())
    finally:
        sched.store.close()


def test_a_too_large_directory_is_read_once_then_keys_are_asked_about_alone(
    tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    """The store holds more key ids than a directory may (3 here): the first refresh's full read
    finds that, and for ``_TOO_MANY_RETRY_S`` no refresh asks ``key_ids_since`` again, while
    ``which_exist`` still answers through ``key_ids_exist``; one warning, which does not call
    the reply malformed. Regression (s37 review r4, F4): every refresh read the whole store again
    (~272k ids, 117-248 ms under the store's lock) and logged "malformed key directory reply"."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    monkeypatch.setattr(key_ids, "_MAX_DIRECTORY_IDS", 3)
    full_reads: list[tuple[str, int]] = []

    async def key_ids_since(epoch: str, version: int) -> Any:
        full_reads.append((epoch, version))
        return await sched.key_ids_since(epoch, version)

    async def run() -> None:
        _, ann_key = await sched.register_tenant(TenantSpec("ann"))
        for i in range(4):
            await sched.register_tenant(TenantSpec(f"t{i}"))
        ann = parse_key_id(ann_key) or ""
        directory = key_ids.KeyDirectory(
            LocalActor(SimpleNamespace(key_ids_since=key_ids_since, key_ids_exist=sched.key_ids_exist)),
            refreshes_per_s=1000.0)
        for _ in range(5):
            assert await directory.which_exist({ann, "0" * 12}) == (key_ids.APPLIED, {ann})
            assert await directory.exists("1" * 12) is None
        assert full_reads == [("", -1)]  # before: 10, each a full read
        assert not directory.loaded
        warnings = [r.getMessage() for r in caplog.records if r.name == "services.key_ids"]
        assert len(warnings) == 1 and "malformed" not in warnings[0], warnings

    try:
        asyncio.run(run())
    finally:
        sched.store.close()


def test_key_ids_exist_reads_the_store_off_the_schedulers_loop(tmp_path: Path) -> None:
    """``key_ids_exist`` takes the store's lock, held by a full ``key_ids_since`` read for up to
    hundreds of ms: it must run in a worker thread, as ``key_ids_since`` does, not on the
    scheduler's event loop. Regression (s37 review r4, F4): a sync method, it blocked the loop
    114-146 ms behind another gateway's full read."""
    import inspect
    import threading

    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    threads: list[threading.Thread] = []
    existing = sched.store.existing_key_ids

    def spy(ids: list[str]) -> Any:
        threads.append(threading.current_thread())
        return existing(ids)

    sched.store.existing_key_ids = spy  # type: ignore[method-assign]

    async def run() -> tuple[str, ...]:
        _, key = await sched.register_tenant(TenantSpec("ann"))
        return await sched.key_ids_exist([parse_key_id(key) or ""])

    try:
        assert inspect.iscoroutinefunction(sched.key_ids_exist)
        assert len(asyncio.run(run())) == 1
        assert threads and threads[0] is not threading.main_thread()
    finally:
        sched.store.close()
