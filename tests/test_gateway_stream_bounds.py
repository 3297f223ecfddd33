"""What a client that does not read its streams may make the gateway hold (security review B),
on the real ``NodeStreams`` and ``InferenceServicer`` over real ZeroMQ sockets (a scheduler
socket answering admissions and a plain node inbox stand in for the actors): a stream holds
O(1) messages, at most ``max_undelivered_bytes`` of them (past it: RESOURCE_EXHAUSTED and an
abort on its node), and a tenant at most ``max_streams_per_tenant`` calls open, counted until
its client has taken their end."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import zmq

from kvstrata.v1 import inference_pb2
from services import data_plane, gateway_server
from services.data_plane_auth import DataPlaneKeys
from services.gateway import InferenceServicer, input_from_pb
from services.gateway_stream_bounds import UNBOUND_STREAMS_HELD, StreamLimits, event_bytes
from services.gateway_streams import NodeStreams
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.grpc_context import GrpcContext, Refused

STARTED = {"type": "started", "request_id": "r", "node_id": "n0", "prompt_tokens": 3}
FINISHED = {"type": "finished", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2,
            "cached_tokens": {}, "ttft_ms": 1.0, "tpot_ms": 1.0, "preempted": False}


def delta(i: int) -> dict[str, Any]:
    return {"type": "delta", "token_ids": [1000 + i], "text": f" w{i}"}


ADMITTED = {"node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0, "spill_blocks": 0,
            "reason": "", "continues_session": False}


class Plane:
    """A ``NodeStreams`` (``streams``); its scheduler socket answers every admission with
    ``reply`` (default: admitted to "n0") and records its id (``admitted``); "n0" is a plain
    inbox (``inbox``)."""

    async def start(self, reply: dict[str, Any] | None = None, **streams_kwargs: Any) -> Plane:
        self.reply = reply if reply is not None else {"adm": ADMITTED}
        self.ctx = data_plane.context(asyncio_=True)
        sched = self.ctx.socket(zmq.ROUTER)
        self.sched_address = data_plane.bind_random(sched, "127.0.0.1")
        self.inbox = self.ctx.socket(zmq.PULL)
        self.node_address = data_plane.bind_random(self.inbox, "127.0.0.1")
        self.admitted: list[str] = []
        self.task = asyncio.get_running_loop().create_task(self._answer(sched))
        self.streams = NodeStreams({"n0": None}, {"n0": self.node_address}, self.sched_address, **streams_kwargs)
        self.push = data_plane.PushSockets()
        return self

    async def _answer(self, sock: Any) -> None:
        while True:
            peer, payload = await sock.recv_multipart()
            msg = data_plane.unpack(payload)
            self.admitted.append(msg["req"]["request_id"])
            await sock.send_multipart([peer, data_plane.pack({"id": msg["id"], **self.reply})])

    async def send(self, items: list[list[Any]], routed: Any) -> None:
        """Push ``items`` as one node message; wait until ``routed()`` holds."""
        self.push.send(self.streams.subscriber, items)
        for _ in range(500):
            if routed():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the events were never routed")

    async def aborts(self) -> list[dict[str, Any]]:
        got = []
        while await self.inbox.poll(300):
            got.append(data_plane.unpack(await self.inbox.recv()))
        return got

    def close(self) -> None:
        self.task.cancel()
        self.push.close()
        self.streams.shutdown()
        self.ctx.destroy(linger=0)


def test_a_never_read_stream_holds_three_messages_whatever_its_length() -> None:
    """Regression (security review B): each stream was an unbounded queue of every event
    (~400 bytes a delta); a never-read stream of N tokens held N + 2 events. Now consecutive
    deltas coalesce: 2000 deltas in 20 node messages are 3 messages (started, one delta with
    every token id and the whole text in order, finished), and nothing is kept after the end."""

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        seen: list[str] = []
        buffer = plane.streams.open("r", lambda event: seen.append(event["type"]))
        plane.streams.bind("r", "n0")
        await plane.send([["r", STARTED]], lambda: buffer.qsize() == 1)
        for k in range(20):
            await plane.send([["r", delta(100 * k + i)] for i in range(100)], lambda k=k: len(seen) == 101 + 100 * k)
        await plane.send([["r", FINISHED], ["r", delta(9999)]], lambda: len(seen) == 2003)
        assert seen.count("delta") == 2001  # ``on_event`` still sees every event as it arrives
        assert buffer.qsize() == 3
        text_bytes = 4 * (2000 + sum(len(f" w{i}") for i in range(2000)))  # 4 a token id and a character
        assert plane.streams.undelivered() == (1, 3, text_bytes + event_bytes(STARTED) + event_bytes(FINISHED))
        assert buffer.get_nowait() == STARTED
        whole = buffer.get_nowait()
        assert whole == {"type": "delta", "token_ids": [1000 + i for i in range(2000)],
                         "text": "".join(f" w{i}" for i in range(2000))}
        assert await buffer.get() == FINISHED
        assert buffer.empty() and plane.streams.undelivered() == (1, 0, 0)
        plane.close()

    asyncio.run(run())


def test_a_reader_that_keeps_up_gets_each_event_as_it_came() -> None:
    """Coalescing changes nothing for a reader that keeps up: each delta is delivered alone,
    unchanged, as soon as it is routed (a waiting ``get`` wakes on it)."""

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        buffer = plane.streams.open("r")
        plane.streams.bind("r", "n0")
        for i in range(5):
            waiting = asyncio.ensure_future(buffer.get())
            await asyncio.sleep(0)
            plane.push.send(plane.streams.subscriber, [["r", delta(i)]])
            assert await asyncio.wait_for(waiting, 5) == delta(i)
        assert buffer.empty()
        plane.close()

    asyncio.run(run())


def test_a_stream_past_its_byte_bound_ends_resource_exhausted_and_is_aborted_on_its_node() -> None:
    """Regression (security review B): nothing bounded what a stream held undelivered. Now a
    stream over ``max_undelivered_bytes`` drops its pending deltas, ends with
    RESOURCE_EXHAUSTED (``on_event`` sees it, so ``_attempt`` releases the request), and its
    request is aborted on its node: at once when bound, at ``bind`` when it overflowed before."""

    async def run() -> None:
        plane = await Plane().start(max_undelivered_bytes=400)
        await plane.streams.start()
        seen: list[dict[str, Any]] = []
        bound = plane.streams.open("a", seen.append)
        plane.streams.bind("a", "n0")
        early = plane.streams.open("b")  # its node not known yet
        # 4 bytes per token id and per character: " wNN" 4 chars + 1 id = 20 bytes a delta
        items = [[rid, delta(10 + i)] for i in range(21) for rid in ("a", "b")]
        await plane.send([["a", STARTED], *items], lambda: plane.streams.overflows == 2)
        assert [e["code"] for e in seen if e["type"] == "error"] == ["RESOURCE_EXHAUSTED"]
        assert bound.get_nowait() == STARTED
        error = bound.get_nowait()
        assert (error["type"], error["code"]) == ("error", "RESOURCE_EXHAUSTED") and "420 bytes" in error["message"]
        assert bound.empty() and early.get_nowait()["code"] == "RESOURCE_EXHAUSTED"
        assert await plane.aborts() == [{"op": "abort", "id": "a"}]
        plane.streams.bind("b", "n0")
        assert await plane.aborts() == [{"op": "abort", "id": "b"}]
        await plane.send([["a", delta(1)], ["a", FINISHED]], lambda: seen[-1] == FINISHED)  # the node's end
        assert plane.streams.undelivered() == (2, 0, 0) and plane.streams.overflows == 2
        plane.close()

    asyncio.run(run())


def test_a_stream_takes_one_started_event_and_counts_every_event_it_holds() -> None:
    """Regression (review 25a C): only deltas counted toward ``max_undelivered_bytes`` and
    every ``started`` event was kept: the serving node's 200,000 of them (1 KiB ``node_id``
    each) held 484 MiB for a client that did not read, counted as 0 bytes. Now a stream takes
    one (each other one is dropped before ``on_event`` and counted in ``bad_messages``, however
    long after the first), and what it holds counts every held event (``event_bytes``)."""

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        seen: list[dict[str, Any]] = []
        buffer = plane.streams.open("r", seen.append)
        plane.streams.bind("r", "n0")
        flood = [{**STARTED, "node_id": f"{i:06d}" + "n" * 1018} for i in range(10_000)]
        for k in range(0, len(flood), 500):
            plane.push.send(plane.streams.subscriber, [["r", event] for event in flood[k:k + 500]])
        await plane.send([["r", delta(1)]], lambda: len(seen) == 2)
        assert plane.streams.bad_messages == 9_999 and [e["type"] for e in seen] == ["started", "delta"]
        assert buffer.qsize() == 2 and plane.streams.overflows == 0
        assert plane.streams.undelivered() == (1, 2, event_bytes(flood[0]) + event_bytes(delta(1)))
        assert event_bytes(flood[0]) > 4 * 1024
        assert buffer.get_nowait() == flood[0]  # taken: a later one is still a second one
        await plane.send([["r", flood[1]], ["r", FINISHED]], lambda: seen[-1] == FINISHED)
        assert plane.streams.bad_messages == 10_000 and [e["type"] for e in seen].count("started") == 1
        assert plane.streams.undelivered() == (1, 2, event_bytes(delta(1)) + event_bytes(FINISHED))
        plane.close()

    asyncio.run(run())


def test_a_started_event_past_the_byte_bound_ends_the_stream() -> None:
    """A ``started`` event counts what it holds: one of 4 KiB and more (its 1 KiB ``node_id``)
    ends a stream whose bound is 4,000 bytes RESOURCE_EXHAUSTED, aborted on its node."""

    async def run() -> None:
        plane = await Plane().start(max_undelivered_bytes=4000)
        await plane.streams.start()
        buffer = plane.streams.open("r")
        plane.streams.bind("r", "n0")
        await plane.send([["r", {**STARTED, "node_id": "n" * 1024}]], lambda: plane.streams.overflows == 1)
        assert buffer.get_nowait()["type"] == "started" and buffer.get_nowait()["code"] == "RESOURCE_EXHAUSTED"
        assert await plane.aborts() == [{"op": "abort", "id": "r"}]
        plane.close()

    asyncio.run(run())


class KeyedPlane:
    """A ``NodeStreams`` with CURVE keys, each of nodes n0 and n1 its own (as the launcher), and
    a PUSH socket of each node's key to its event inbox (``send``)."""

    async def start(self, max_undelivered_bytes: int) -> KeyedPlane:
        self.keys = DataPlaneKeys.generate(("n0", "n1"))
        self.streams = NodeStreams({"n0": None, "n1": None}, {}, "tcp://127.0.0.1:9",
                                   security=self.keys.security("gateway"), max_undelivered_bytes=max_undelivered_bytes)
        await self.streams.start()
        self.ctx = zmq.Context()
        self.push = {}
        for node in ("n0", "n1"):
            sock = self.push[node] = self.ctx.socket(zmq.PUSH)
            self.keys.security("node", node_id=node).connect_to(sock, "gateway")
            sock.connect(self.streams.subscriber)
        return self

    async def send(self, node: str, items: list[list[Any]], routed: Any) -> None:
        self.push[node].send(data_plane.pack(items))
        for _ in range(500):
            if routed():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the events were never routed")

    def held(self) -> dict[str | None, int]:
        return dict(self.streams._unbound_bytes)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.streams.shutdown()


def test_events_before_bind_are_held_bounded_per_node() -> None:
    """Regression (review 25a C): the events a request's node sent before ``bind`` (they may
    overtake the scheduler's reply) were all kept, without a bound. Now they are held per
    sender as a stream holds them (deltas coalesce, one ``started``), at most
    ``max_undelivered_bytes`` a request and ``UNBOUND_STREAMS_HELD`` times that a node; past
    it they are dropped and counted. Another node's flood cannot crowd out a request's own
    node; a stream whose own node's events were dropped ends UNAVAILABLE at ``bind`` (never
    silently missing tokens); nothing stays held after ``bind`` or ``close``."""

    async def run() -> None:
        plane = await KeyedPlane().start(max_undelivered_bytes=4000)
        streams = plane.streams
        rids = [f"r{i}" for i in range(6)]
        buffers = {rid: streams.open(rid) for rid in rids}
        piece = {"type": "delta", "token_ids": [7], "text": "x" * 99}  # 400 bytes
        # n1 floods every unbound request: 4,000 bytes a request, 16,000 for n1 in all
        await plane.send("n1", [[rid, piece] for rid in rids for _ in range(20)],
                         lambda: streams.bad_messages == 120 - 40)
        assert plane.held() == {"n1": 16_000} == {"n1": UNBOUND_STREAMS_HELD * 4000}
        # n0's own events for r0 are held in full whatever n1 sent, coalesced
        tokens = [[rid, delta(i)] for rid in ("r0",) for i in range(50)]
        await plane.send("n0", [["r0", STARTED], ["r0", STARTED], *tokens, ["r0", FINISHED]],
                         lambda: plane.held().get("n0", 0) > 0)
        assert streams.bad_messages == 81  # the second started
        streams.bind("r0", "n0")  # n1's held events for r0 dropped and counted
        assert streams.bad_messages == 82 and buffers["r0"].get_nowait() == STARTED
        assert buffers["r0"].get_nowait() == {"type": "delta", "token_ids": [1000 + i for i in range(50)],
                                              "text": "".join(f" w{i}" for i in range(50))}
        assert buffers["r0"].get_nowait() == FINISHED and buffers["r0"].empty()
        # n0 sends r1 more than a request may hold before bind: its stream ends UNAVAILABLE
        await plane.send("n0", [["r1", STARTED], *[["r1", piece]] * 20], lambda: streams.bad_messages == 82 + 11)
        streams.bind("r1", "n0")
        got = [buffers["r1"].get_nowait() for _ in range(buffers["r1"].qsize())]
        assert [e["type"] for e in got] == ["started", "delta", "error"] and got[-1]["code"] == "UNAVAILABLE"
        assert len(got[1]["token_ids"]) == 9 and "were lost" in got[-1]["message"]
        for rid in rids:
            streams.close(rid)
        assert streams._unbound == {} and plane.held() == {}
        plane.close()

    asyncio.run(run())


class Auth:
    def __init__(self) -> None:
        self.tenant_of: dict[int, Tenant] = {}

    async def tenant(self, context: Any) -> Tenant:
        context = getattr(context, "_context", context)  # (a gRPC call's, wrapped by gateway._GrpcPaths)
        return self.tenant_of[id(context)]


def test_a_tenant_holds_at_most_its_cap_of_streams_until_its_client_reads_their_end() -> None:
    """Regression (security review B): the scheduler releases a request when its end arrives
    at the gateway, and nothing counted the calls a tenant kept open there: a client that
    never read opened wave after wave. Now a tenant's calls are counted until the client has
    taken their last event: with a cap of 2, a third call is refused RESOURCE_EXHAUSTED while
    two finished but unread calls are open (their requests released at the scheduler), another
    tenant's call still runs, and the tenant's next call passes once one stream is read out."""

    async def run() -> None:
        plane = await Plane().start()
        released: list[str] = []
        scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: released.append(request_id)))
        auth = Auth()
        servicer = InferenceServicer(scheduler, auth, {"n0": None}, {"n0": {**NODE_INFO, "data_address": plane.node_address}},
                                     None, plane.sched_address, limits=StreamLimits(max_streams_per_tenant=2))
        plane.streams = servicer.streams
        await servicer.streams.start()
        ann, bob = Tenant("a1", TenantSpec(name="ann"), 0.0), Tenant("b1", TenantSpec(name="bob"), 0.0)
        pb = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                           sampling=inference_pb2.SamplingParams(max_tokens=2))

        def call(tenant: Tenant) -> Any:
            context = GrpcContext()
            auth.tenant_of[id(context)] = tenant
            calls.append(context)
            return servicer.generate(context, lambda: input_from_pb(pb))

        async def started(stream: Any) -> dict[str, Any]:
            first = asyncio.ensure_future(stream.__anext__())
            for _ in range(500):
                if len(plane.admitted) > len(served):
                    break
                await asyncio.sleep(0.01)
            rid = plane.admitted[len(served)]
            served.append(rid)
            await plane.send([[rid, {**STARTED, "request_id": rid}], [rid, delta(1)], [rid, FINISHED]],
                             lambda: rid in released)
            return await asyncio.wait_for(first, 5)

        calls: list[GrpcContext] = []
        served: list[str] = []
        ann1, ann2 = call(ann), call(ann)
        assert (await started(ann1))["type"] == (await started(ann2))["type"] == "started"
        assert released == served and servicer.open_streams == {"a1": 2}  # finished, released, unread
        with pytest.raises(Refused) as refused:
            await call(ann).__anext__()
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams_per_tenant" in str(refused.value)
        bob1 = call(bob)
        assert (await started(bob1))["type"] == "started"
        assert [e["type"] async for e in ann1] == ["delta", "finished"]  # ann's client reads one out
        assert servicer.open_streams == {"a1": 1, "b1": 1} and servicer.streams_refused == 1
        ann3 = call(ann)
        assert (await started(ann3))["type"] == "started"
        for stream in (ann2, bob1, ann3):
            await stream.aclose()
        assert servicer.open_streams == {} and servicer.streams.undelivered() == (0, 0, 0)
        plane.close()

    asyncio.run(run())


def test_the_grpc_server_bounds_the_streams_of_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (security review B): the gateway's gRPC server was built without
    ``grpc.max_concurrent_streams``, so one connection could hold any number of unread calls."""
    built: list[Any] = []

    def server(**kwargs: Any) -> Any:
        built.append(dict(kwargs["options"]))
        raise RuntimeError("built")

    monkeypatch.setattr(gateway_server.grpc.aio, "server", server)
    with pytest.raises(RuntimeError, match="built"):
        asyncio.run(gateway_server.create_server(None, {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9"))
    assert built[0]["grpc.max_concurrent_streams"] == gateway_server.MAX_CONCURRENT_STREAMS == 256



def test_a_reader_that_keeps_up_takes_a_steps_prompt_logprobs_delta_by_delta() -> None:
    """One step's prompt logprobs (4,096 prompt tokens, 20 alternatives each) arrive as 8 deltas
    in one node message, ~1.4 MB together against the stream's 1 MiB bound: a reader waiting on
    the stream takes each delta before the next is routed, so the stream never holds them all.
    Regression (review 28c F7): the whole message was routed before the reader ran, and a
    request within every API limit failed RESOURCE_EXHAUSTED ("the client did not read this
    stream", 429 on HTTP) after its prefill."""
    from services.node_request import prompt_logprobs_entry

    entry = prompt_logprobs_entry(7, -1.5, 3, [(1000 + j, -0.25 * j) for j in range(20)])
    steps = [{"type": "delta", "token_ids": [], "text": "", "prompt_logprobs": [entry] * 512} for _ in range(8)]
    assert sum(map(event_bytes, steps)) > StreamLimits().max_undelivered_bytes

    async def run() -> None:
        plane = await Plane().start()
        await plane.streams.start()
        buffer = plane.streams.open("r", prompt_logprobs=20)
        plane.streams.bind("r", "n0")
        got: list[dict[str, Any]] = []

        async def read() -> None:
            while not got or got[-1]["type"] not in ("finished", "error"):
                got.append(await buffer.get())

        reader = asyncio.ensure_future(read())
        await plane.send([["r", {**STARTED, "prompt_tokens": 4097}]], lambda: len(got) == 1)
        await plane.send([["r", step] for step in steps] + [["r", delta(1)], ["r", FINISHED]],
                         lambda: reader.done())
        assert [e["type"] for e in got] == ["started", *["delta"] * 9, "finished"], got[-1]
        assert sum(len(e.get("prompt_logprobs", ())) for e in got) == 4096
        plane.close()

    asyncio.run(run())
