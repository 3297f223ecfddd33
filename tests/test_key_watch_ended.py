"""Review R1 (session 36) of the key watch (``services.gateway_key_watch``,
``NodeStreams.key_streams`` / ``end_revoked``), over a real ``NodeStreams`` fed through its real
event inbox (a PUSH socket, as a node sends) and a real scheduler's tenant store:

- F1: a stream whose end already came (``finished``: its usage released in full; or an error,
  its node's ABORTED) is no longer listed nor ended for its key: its unread output and its own
  end stay (the old code dropped them and put UNAUTHENTICATED in their place).
- F2: the streams of a deleted tenant that the watch ends end ABORTED, as its nodes'
  ``end_tenant`` ends them (the old code: UNAUTHENTICATED); a rotated-away key's stay
  UNAUTHENTICATED.
- F3: the 2 s stop of a revoked stream's reader (``REVOKED_READ_S``) does not count the
  gateway's own loop stall (the old code stopped a reader that could not run during one).
- A watch started after its streams shut down starts no task (the old code ran one for good).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from services import data_plane
from services.auth import Authenticator
from services.gateway_key_watch import REVOKED_MESSAGE, KeyWatch
from services.gateway_streams import NodeStreams
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.keys import parse_key_id
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor

KEY_ID = "0123456789ab"


def started(rid: str) -> dict[str, Any]:
    return {"type": "started", "request_id": rid, "node_id": "n0", "prompt_tokens": 3}


def delta(i: int) -> dict[str, Any]:
    return {"type": "delta", "token_ids": [1000 + i], "text": f" w{i}"}


FINISHED = {"type": "finished", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2,
            "cached_tokens": {}, "ttft_ms": 1.0, "tpot_ms": 1.0, "preempted": False}
ABORTED = {"type": "error", "code": "ABORTED", "message": "tenant deleted"}


async def until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not in time"
        await asyncio.sleep(0.01)


def with_streams(body: Callable[[NodeStreams, Any], Any]) -> None:
    """Run ``body(streams, send)``: a started ``NodeStreams`` (node "n0"), ``send(items)`` pushing
    ``[[request id, event], ...]`` to its event inbox as a node does."""

    async def run() -> None:
        ctx = zmq.Context()
        node_inbox = ctx.socket(zmq.PULL)
        port = node_inbox.bind_to_random_port("tcp://127.0.0.1")
        streams = NodeStreams({"n0": None}, {"n0": f"tcp://127.0.0.1:{port}"}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        push = ctx.socket(zmq.PUSH)
        push.connect(streams.subscriber)

        def send(items: list[list[Any]]) -> None:
            for message in data_plane.event_messages(items):
                push.send(message)

        try:
            await body(streams, send)
        finally:
            streams.shutdown()
            push.close(0)
            node_inbox.close(0)
            ctx.term()

    asyncio.run(run())


def _drain(queue: Any) -> list[tuple[str, Any]]:
    got = []
    while not queue.empty():
        event = queue.get_nowait()
        got.append((event["type"], event.get("code")))
    return got


def test_streams_already_ended_are_not_ended_for_their_key() -> None:
    """F1. "fin" finished on its node (its events unread by its client), "abo" was ended ABORTED
    by its node, "run" runs. ``key_streams`` lists "run" alone, ``end_revoked`` of the other two
    answers False and leaves their events as they came (old: their deltas and their end were
    replaced by UNAUTHENTICATED, the finished stream's usage already released). A stream whose
    end comes with its held events before ``bind`` keeps that end too."""

    async def body(streams: NodeStreams, send: Any) -> None:
        seen: dict[str, list[str]] = {}
        queues = {}
        for rid in ("t/fin", "t/abo", "t/run"):
            seen[rid] = []
            queues[rid] = streams.open(rid, lambda e, rid=rid: seen[rid].append(e.get("code") or e["type"]),
                                       key_id=KEY_ID)
            streams.bind(rid, "n0")
        send([["t/fin", started("t/fin")], ["t/fin", delta(0)], ["t/fin", delta(1)], ["t/fin", FINISHED],
              ["t/abo", started("t/abo")], ["t/abo", ABORTED], ["t/run", started("t/run")], ["t/run", delta(0)]])
        await until(lambda: len(seen["t/fin"]) == 4 and len(seen["t/abo"]) == 2 and len(seen["t/run"]) == 2)
        openings = {entry[0]: entry[-1] for entry in streams.key_streams()}
        assert sorted(openings) == ["t/run"]
        for rid in ("t/fin", "t/abo"):
            assert not streams.end_revoked(rid, streams._queues[rid], REVOKED_MESSAGE)
        assert _drain(queues["t/fin"]) == [("started", None), ("delta", None), ("finished", None)]
        assert _drain(queues["t/abo"]) == [("started", None), ("error", "ABORTED")]
        assert seen["t/fin"] == ["started", "delta", "delta", "finished"] and seen["t/abo"] == ["started", "ABORTED"]
        assert streams.end_revoked("t/run", openings["t/run"], REVOKED_MESSAGE)
        assert _drain(queues["t/run"])[-1] == ("error", "UNAUTHENTICATED")

        # revoked while being admitted (ended at ``bind``), its whole output and end came first
        late = streams.open("t/late", key_id=KEY_ID)
        assert streams.end_revoked("t/late", streams.key_streams()[0][-1], REVOKED_MESSAGE)
        send([["t/late", started("t/late")], ["t/late", delta(0)], ["t/late", FINISHED]])
        await until(lambda: late.qsize() == 3)
        streams.bind("t/late", "n0")
        assert _drain(late) == [("started", None), ("delta", None), ("finished", None)]

    with_streams(body)


def test_a_revoked_readers_stop_does_not_count_the_gateways_own_stall() -> None:
    """F3. A stream ended for its key whose reader (waiting its turn on the loop) could not
    take its error because the gateway's loop stalled 2.5 s is not stopped (old: stopped as a
    client that does not read: an HTTP stream cut without its error). A reader that leaves the
    error 2 s with the loop running is stopped, with the error's code."""

    async def body(streams: NodeStreams, send: Any) -> None:
        stopped: list[tuple[str, str]] = []
        for rid in ("t/stall", "t/slow"):
            streams.open(rid, lambda e: None, lambda m, c="RESOURCE_EXHAUSTED", rid=rid: stopped.append((rid, c)),
                         key_id=KEY_ID)
            streams.bind(rid, "n0")
        send([["t/stall", started("t/stall")], ["t/slow", started("t/slow")]])
        await until(lambda: all(not streams._queues[r].buffer.empty() for r in ("t/stall", "t/slow")))
        await asyncio.sleep(0.3)  # the loop-lag monitor runs
        opened = {entry[0]: entry[-1] for entry in streams.key_streams()}
        assert streams.end_revoked("t/stall", opened["t/stall"], REVOKED_MESSAGE)
        time.sleep(2.5)  # noqa: ASYNC251 - the gateway's loop stalls (a GC pause, a large sync parse)
        await asyncio.sleep(0.3)  # the monitor sees the stall
        streams.expire_idle()
        assert stopped == []
        assert _drain(streams._queues["t/stall"].buffer)[-1] == ("error", "UNAUTHENTICATED")  # its reader runs

        assert streams.end_revoked("t/slow", opened["t/slow"], REVOKED_MESSAGE)
        t0 = time.monotonic()
        while not stopped and time.monotonic() - t0 < 6.0:
            await asyncio.sleep(0.1)  # the loop runs; the reader takes nothing
        assert stopped == [("t/slow", "UNAUTHENTICATED")] and time.monotonic() - t0 < 3.5, stopped

    with_streams(body)


def test_the_watch_ends_a_deleted_tenants_streams_aborted(tmp_path: Path) -> None:
    """F2. ann's key is rotated away and bob is deleted at the scheduler (another gateway; no
    node here ends bob's stream first): the watch's check ends ann's old stream UNAUTHENTICATED
    and bob's ABORTED, as its nodes' ``end_tenant`` does (old: both UNAUTHENTICATED); carol's
    runs on. Ids a refresh reports removed (``keys_gone``) end a deleted tenant's ABORTED too."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})

    async def run() -> None:
        ctx = zmq.Context()
        node_inbox = ctx.socket(zmq.PULL)
        port = node_inbox.bind_to_random_port("tcp://127.0.0.1")
        streams = NodeStreams({"n0": None}, {"n0": f"tcp://127.0.0.1:{port}"}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        auth = Authenticator(LocalActor(sched))
        watch = KeyWatch(streams, auth, interval_s=60.0)
        tenants = {}
        for name in ("ann", "bob", "carol", "dave"):
            tenant, key = await sched.register_tenant(TenantSpec(name))
            tenants[name] = (tenant.tenant_id, key)
        assert await auth.directory.refresh()
        seen: dict[str, list[Any]] = {}
        for name, (tenant_id, key) in tenants.items():
            rid = f"{tenant_id}/{name}-1"
            seen[name] = []
            streams.open(rid, seen[name].append, key_id=parse_key_id(key) or "")
            streams.bind(rid, "n0")
        await sched.rotate_tenant_key("ann")
        await sched.delete_tenant("bob")

        assert await watch.check() == 2
        assert [e["code"] for e in seen["ann"]] == ["UNAUTHENTICATED"]
        assert [e["code"] for e in seen["bob"]] == ["ABORTED"], seen["bob"]
        assert seen["carol"] == [] and seen["dave"] == []

        watch.start()
        await sched.delete_tenant("dave")
        assert await auth.directory.refresh()  # a key check's refresh: ``keys_gone`` with dave's id
        await until(lambda: len(seen["dave"]) == 1)
        assert [e["code"] for e in seen["dave"]] == ["ABORTED"] and seen["carol"] == []
        assert watch.ended == 3 and getattr(watch, "aborted", None) == 2
        streams.shutdown()
        node_inbox.close(0)
        ctx.term()

    try:
        asyncio.run(run())
    finally:
        sched.store.close()


def test_a_watch_started_after_its_streams_shut_down_starts_nothing() -> None:
    """A watch whose ``NodeStreams`` shut down (the gateway stopping) starts no task when
    ``start`` is called after (a late ``Generate``); before the fix its task ran for good,
    nothing left to cancel it."""

    async def run() -> None:
        streams = NodeStreams({}, {}, "tcp://127.0.0.1:1", security=None)
        await streams.start()
        watch = KeyWatch(streams, Authenticator(LocalActor(object())), interval_s=60.0)
        watch.start()
        first = watch._task
        assert first is not None and not first.done()
        streams.shutdown()
        await asyncio.sleep(0)
        assert first.cancelled() or first.done()
        before = set(asyncio.all_tasks())
        watch.start()
        await asyncio.sleep(0)
        assert {t for t in asyncio.all_tasks() - before if not t.done()} == set()

    asyncio.run(run())
