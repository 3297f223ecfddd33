"""The gateway's end of the data plane (``services.gateway_streams.NodeStreams``) over real ZeroMQ
sockets, with a scheduler socket and node handles standing in for the Ray actors: admissions
are matched to their replies, a scheduler failure reaches the caller, events reach their
stream's queue, aborts reach the node's inbox, and a node found down ends its streams (those
open on it and any bound to it later) until it rejoins at a new address."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest


def request(rid: str) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                       sampling=SamplingParams(max_tokens=2))


async def _scheduler(sock, answer) -> None:
    """Answer admissions: ``answer(message)`` -> reply fields; replies go out in reverse
    order of arrival, two at a time, so matching by id is exercised."""
    while True:
        held = []
        for _ in range(2):
            peer, payload = await sock.recv_multipart()
            held.append((peer, data_plane.unpack(payload)))
        for peer, msg in reversed(held):
            await sock.send_multipart([peer, data_plane.pack({"id": msg["id"], **answer(msg)})])


def _answer(msg):
    req = data_plane.request_from_wire(msg["req"])
    if req.request_id.startswith("bad"):
        return {"error": "KeyError: 'n9'"}
    return {"adm": {"node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0,
                    "spill_blocks": 0, "reason": "", "continues_session": False}}


async def _admissions_are_matched(streams: NodeStreams) -> tuple[asyncio.Queue, asyncio.Queue]:
    a, b = streams.open("a"), streams.open("b")
    adm_a, adm_b = await asyncio.gather(streams.admit(request("a"), [b"h"]),
                                        streams.admit(request("b"), []))
    assert (adm_a.code, adm_a.node_id, adm_b.node_id) == ("OK", "n0", "n0")
    with pytest.raises(RuntimeError, match="n9"):
        await asyncio.gather(streams.admit(request("bad"), []), streams.admit(request("c"), []))
    return a, b


async def _events_and_aborts_arrive(streams: NodeStreams, inbox, a, b) -> None:
    # a node's step: one message for both streams, to this gateway's inbox
    push = data_plane.PushSockets()
    push.send(streams.subscriber, [["a", {"type": "delta", "token_ids": [7], "text": ""}],
                                   ["b", {"type": "delta", "token_ids": [8], "text": ""}],
                                   ["gone", {"type": "delta", "token_ids": [9], "text": ""}]])
    assert (await asyncio.wait_for(a.get(), 5))["token_ids"] == [7]
    assert (await asyncio.wait_for(b.get(), 5))["token_ids"] == [8]
    push.close()
    streams.abort("n0", "a")
    assert data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) == {"op": "abort", "id": "a"}


async def _node_down_then_rejoins(streams: NodeStreams, ctx, a, b) -> None:
    streams.bind("a", "n0")
    streams.close("b")
    streams.fail_node("n0", "cache node n0 died")
    event = a.get_nowait()
    assert (event["type"], event["code"]) == ("error", "UNAVAILABLE") and "cache node n0 is down" in event["message"]
    assert "died" not in event["message"] and streams.down["n0"] == "cache node n0 died"  # the reason: operators
    assert b.empty()
    c = streams.open("c")
    streams.bind("c", "n0")  # bound to a node down already: ends at once
    assert c.get_nowait()["code"] == "UNAVAILABLE"

    # the node rejoins at a new address: aborts go there, new streams are not failed
    inbox2 = ctx.socket(zmq.PULL)
    streams.reconnect("n0", data_plane.bind_random(inbox2, "127.0.0.1"))
    d = streams.open("d")
    streams.bind("d", "n0")
    assert d.empty() and streams.down == {}
    streams.abort("n0", "d")
    assert data_plane.unpack(await asyncio.wait_for(inbox2.recv(), 5)) == {"op": "abort", "id": "d"}

    # regression: a request on its way to n0 while n0 failed and rejoined is lost there; its
    # stream, bound after the rejoin, ends at once instead of waiting forever
    e = streams.open("e")
    streams.fail_node("n0", "cache node n0 did not answer")
    streams.reconnect("n0", streams.node_inboxes["n0"])
    streams.bind("e", "n0")
    assert e.get_nowait()["code"] == "UNAVAILABLE" and streams.down == {}
    f = streams.open("f")  # opened after the failure: not failed
    streams.bind("f", "n0")
    assert f.empty()

    # the node's process dies: its connection closes, and the gateway hears of it at once
    lost: asyncio.Queue[str] = asyncio.Queue()
    streams.on_disconnect = lost.put_nowait
    inbox2.close(linger=0)
    assert await asyncio.wait_for(lost.get(), 5) == "n0"


async def _plane():  # type: ignore[no-untyped-def]
    """A started ``NodeStreams`` whose scheduler socket answers ``_answer`` and whose node "n0"
    is a plain inbox: (context, node inbox, scheduler task, streams)."""
    ctx = data_plane.context(asyncio_=True)
    sched = ctx.socket(zmq.ROUTER)
    sched_address = data_plane.bind_random(sched, "127.0.0.1")
    inbox = ctx.socket(zmq.PULL)
    node_address = data_plane.bind_random(inbox, "127.0.0.1")
    server = asyncio.get_running_loop().create_task(_scheduler(sched, _answer))
    streams = NodeStreams({"n0": None}, {"n0": node_address}, sched_address)
    await streams.start()
    return ctx, inbox, server, streams


def test_admissions_events_aborts_and_a_dead_node() -> None:
    async def run():
        ctx, inbox, server, streams = await _plane()
        a, b = await _admissions_are_matched(streams)
        await _events_and_aborts_arrive(streams, inbox, a, b)
        await _node_down_then_rejoins(streams, ctx, a, b)
        server.cancel()
        streams.shutdown()
        ctx.destroy(linger=0)

    asyncio.run(run())


async def _opened(streams: NodeStreams, *request_ids: str) -> None:
    """Wait until the streams of ``request_ids`` are open: events that arrive before are
    dropped (a request's events never come before its node has it)."""
    for _ in range(500):
        if all(rid in streams._queues for rid in request_ids):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"streams {request_ids} never opened")


class _Context:
    """What ``_attempt`` calls on a gRPC servicer context."""

    async def send_initial_metadata(self, _metadata) -> None:  # type: ignore[no-untyped-def]
        return None

    async def abort(self, code, message):  # type: ignore[no-untyped-def]
        raise RuntimeError(f"{code}: {message}")

    def set_trailing_metadata(self, _metadata) -> None:  # type: ignore[no-untyped-def]
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:  # the key's id goes with the admission
        return ()


class _Track:
    def observe(self, _event) -> None:  # type: ignore[no-untyped-def]
        return None

    def rejected(self, _reason) -> None:  # type: ignore[no-untyped-def]
        return None


def test_a_stream_whose_client_stops_reading_is_released_when_its_request_ends() -> None:
    """Regression (hardening review): the gateway released a request at the scheduler only
    when its client had read up to the finished event; a client that stopped reading (flow
    control holding the stream at a ``yield``) kept its finished request in flight there for
    as long as it held the connection, and enough of them filled the queue for every tenant.
    Now the release goes out as the finished event arrives, once; closing the stream later
    neither releases again nor aborts the finished request on its node."""
    from types import SimpleNamespace

    from services.gateway import InferenceServicer

    async def run():
        ctx, inbox, server, streams = await _plane()
        released = []
        servicer = InferenceServicer.__new__(InferenceServicer)
        servicer.streams, servicer.nodes = streams, {"n0": None}
        servicer.scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: released.append((request_id, usage))))
        attempts = [servicer._attempt(_Context(), request(rid), [], rid, _Track()) for rid in ("r1", "r2")]
        firsts = [asyncio.ensure_future(a.__anext__()) for a in attempts]  # admitted in pairs
        await _opened(streams, "r1", "r2")
        push = data_plane.PushSockets()
        finished = {"type": "finished", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2,
                    "cached_tokens": {}, "ttft_ms": 1.0, "tpot_ms": 1.0, "preempted": False}
        for rid in ("r1", "r2"):
            push.send(streams.subscriber, [[rid, {"type": "started", "request_id": rid, "node_id": "n0",
                                                  "prompt_tokens": 3}],
                                           [rid, {"type": "delta", "token_ids": [7, 8], "text": ""}],
                                           [rid, finished]])
        assert [(await asyncio.wait_for(f, 5))["type"] for f in firsts] == ["started", "started"]
        for _ in range(100):  # the client reads no further
            if len(released) == 2:
                break
            await asyncio.sleep(0.02)
        got = list(released)
        for a in attempts:
            await a.aclose()  # the client goes away at last
        aborts = await inbox.poll(300)
        push.close()
        server.cancel()
        streams.shutdown()
        ctx.destroy(linger=0)
        return got, list(released), aborts

    early, final, aborts = asyncio.run(run())
    assert sorted(rid for rid, _ in early) == ["r1", "r2"]
    assert all(usage["completion_tokens"] == 2 for _, usage in early)
    assert final == early and not aborts


def test_a_stream_ended_by_the_gateways_verdict_on_its_node_is_aborted_there() -> None:
    """Regression (diff review): a stream the gateway ended because it took its node for down
    (``fail_node``: a missed health poll is enough) was not aborted on the node; the same
    process, back with its sessions, ran the turn to its end, and the session's history took
    a turn its client never got. Now the node is told to abort it (a dead one ignores it)."""
    from types import SimpleNamespace

    from services.gateway import InferenceServicer

    async def run():
        ctx, inbox, server, streams = await _plane()
        servicer = InferenceServicer.__new__(InferenceServicer)
        servicer.streams, servicer.nodes = streams, {"n0": None}
        servicer.scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: None))
        attempts = [servicer._attempt(_Context(), request(rid), [], rid, _Track()) for rid in ("r1", "r2")]
        firsts = [asyncio.ensure_future(a.__anext__()) for a in attempts]  # admitted in pairs
        await _opened(streams, "r1", "r2")
        push = data_plane.PushSockets()
        for rid in ("r1", "r2"):
            push.send(streams.subscriber, [[rid, {"type": "started", "request_id": rid, "node_id": "n0",
                                                  "prompt_tokens": 3}]])
        assert [(await asyncio.wait_for(f, 5))["type"] for f in firsts] == ["started", "started"]
        streams.fail_node("n0", "cache node n0 did not answer within 15 s")
        for a in attempts:
            with pytest.raises(RuntimeError, match="UNAVAILABLE"):
                await a.__anext__()
        aborts = [data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) for _ in attempts]
        push.close()
        server.cancel()
        streams.shutdown()
        ctx.destroy(linger=0)
        return aborts

    assert sorted(a["id"] for a in asyncio.run(run())) == ["r1", "r2"]


def test_a_tenants_cancelled_parses_still_take_one_worker_at_a_time() -> None:
    """Regression (diff review): ``off_loop``'s one-at-a-time-per-tenant held only while the
    caller waited; a tenant that sent big prompts and hung up had one worker thread per call
    running at once, and filled the pool every tenant's parses share."""
    import concurrent.futures
    import threading
    import time

    from services.gateway import TOKENIZER_THREADS, InferenceServicer

    running, peak, guard, gate = [0], [0], threading.Lock(), threading.Event()

    def slow() -> None:
        with guard:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(10)
        with guard:
            running[0] -= 1

    async def run() -> float:
        servicer = InferenceServicer.__new__(InferenceServicer)
        servicer._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS)
        for _ in range(2 * TOKENIZER_THREADS):  # tenant A: send, hang up, send again
            call = asyncio.ensure_future(servicer.off_loop("A", slow))
            await asyncio.sleep(0.02)
            call.cancel()
        t0 = time.monotonic()
        await asyncio.wait_for(servicer.off_loop("B", lambda: None), 5)  # tenant B is not held up
        waited = time.monotonic() - t0
        gate.set()
        servicer._tokenizer_pool.shutdown(wait=True)
        return waited

    waited = asyncio.run(run())
    assert peak[0] == 1, peak
    assert waited < 5
