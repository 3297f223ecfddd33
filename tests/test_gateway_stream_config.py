"""The gateway's stream bounds as settings, and the idle-reader deadline (secrev18 B residue).

``max_streams_per_tenant``, ``max_undelivered_bytes`` and ``stream_idle_timeout_s`` are
``ServiceConfig`` fields that reach the servicer and its data plane (``StreamLimits``). A
stream whose reader has taken nothing for ``stream_idle_timeout_s`` without waiting for events
(stuck writing to a client that reads nothing) is ended RESOURCE_EXHAUSTED on the one path of
the byte bound (``NodeStreams._end_unread``: an abort on its node, the request released),
counted in ``idle_ends``, and the task writing it to its client is stopped, which frees its
tenant's stream: over gRPC (``Generate``; also on a real gRPC server and client) and HTTP
(``_ClosingStream``), while its request runs or after its end arrived unread. A client that
reads slowly but steadily is never ended. Real ``NodeStreams`` over real ZeroMQ sockets
(``tests.test_gateway_stream_bounds.Plane``) with a fake clock: nothing sleeps for long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pydantic
import pytest

from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services import gateway_server
from services.config import ServiceConfig, load_config
from services.gateway import InferenceServicer, StreamWriter, input_from_pb
from services.gateway_stream_bounds import StreamLimits
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.app import _ClosingStream, _stream
from services.openai_api.responses import Generation
from services.openai_api.stream_shape import StreamShape
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.grpc_context import GrpcContext
from tests.test_gateway_stream_bounds import FINISHED, STARTED, Auth, Plane, delta


async def until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never came to hold")


class Clock:
    """A settable monotonic clock (s)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_the_stream_bounds_are_service_settings_with_bounds(tmp_path: Path) -> None:
    """Regression (secrev18 B residue): the two bounds were constructor arguments only and
    there was no idle timeout: a deployment could set none of them. Now a YAML config sets
    all three (``StreamLimits.of``), the defaults match ``StreamLimits``', and values out of
    range are refused naming the field. Regression (s41 review r4): ``silent_stream_s``
    (``NodeStreams.end_silent``) was a constructor argument only; now a setting too."""
    assert StreamLimits.of(ServiceConfig()) == StreamLimits() == StreamLimits(256, 1 << 20, 300.0)
    path = tmp_path / "kvstrata.yaml"
    path.write_text("max_streams_per_tenant: 8\nmax_undelivered_bytes: 65536\nstream_idle_timeout_s: 30\n"
                    "silent_stream_s: 45\n")
    assert StreamLimits.of(load_config(path)) == StreamLimits(8, 65536, 30.0, silent_stream_s=45.0)
    assert ServiceConfig().silent_stream_s == StreamLimits().silent_stream_s == 30.0
    for field, value in [("max_streams_per_tenant", 0), ("max_undelivered_bytes", 100),
                         ("max_undelivered_bytes", 1 << 31), ("stream_idle_timeout_s", 0.5),
                         ("stream_idle_timeout_s", 1e6), ("silent_stream_s", 0.5), ("silent_stream_s", 1e6)]:
        with pytest.raises(pydantic.ValidationError, match=field):
            ServiceConfig.model_validate({field: value})
    with pytest.raises(ValueError, match="idle_timeout_s"):
        StreamLimits(idle_timeout_s=0)
    with pytest.raises(ValueError, match="silent_stream_s"):  # (s41: it was not a setting)
        StreamLimits(silent_stream_s=0)


def test_create_server_hands_the_limits_to_the_servicer_and_its_data_plane() -> None:
    """The gateway builds its servicer and data plane with the configured limits (the launcher
    passes ``StreamLimits.of(config)`` through ``GatewayActor``)."""

    async def run() -> None:
        server, _port, _health, inference, monitor = await gateway_server.create_server(
            None, {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9", stream_limits=StreamLimits(3, 5000, 7.0, silent_stream_s=9.0))
        try:
            assert inference.max_streams_per_tenant == 3
            assert inference.streams.max_undelivered_bytes == 5000
            assert inference.streams.stream_idle_timeout_s == 7.0
            assert inference.streams.silent_stream_s == 9.0
        finally:
            monitor.stop()
            await server.stop(0)
            inference.streams.shutdown()

    asyncio.run(run())


def test_a_stream_whose_client_takes_nothing_is_ended_after_the_idle_timeout() -> None:
    """Regression (secrev18 B residue): a bound stream whose events sat untaken was never
    ended. Now, at ``stream_idle_timeout_s`` (10 s here) without a take: a running request's
    stream ends RESOURCE_EXHAUSTED (pending deltas dropped, ``on_event`` sees the error), is
    aborted on its node, counted in ``idle_ends``, and its ``on_idle`` called, once; a stream
    whose end arrived unread is ended the same way (its end replaced by the error; its
    request, finished, is not aborted); a stream
    not bound yet (its reader waits for its admission, not its client) is left alone."""

    async def run() -> None:
        clock = Clock()
        plane = await Plane().start(stream_idle_timeout_s=10.0, clock=clock)
        await plane.streams.start()
        seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
        idle: list[tuple[str, str]] = []
        buffers = {rid: plane.streams.open(rid, seen[rid].append, lambda m, rid=rid: idle.append((rid, m)))
                   for rid in ("a", "b")}
        unbound = plane.streams.open("c")
        plane.streams.bind("a", "n0")
        plane.streams.bind("b", "n0")
        await plane.send([["a", STARTED], ["a", delta(1)], ["b", STARTED], ["b", delta(2)], ["b", FINISHED],
                          ["c", STARTED]], lambda: len(seen["b"]) == 3 and unbound.qsize() == 1)
        clock.now_s += 9.9
        assert plane.streams.expire_idle() == [] and await plane.aborts() == []
        clock.now_s += 0.2
        assert plane.streams.expire_idle() == ["a", "b"]
        assert [rid for rid, _ in idle] == ["a", "b"] and "stream_idle_timeout_s 10" in idle[0][1]
        assert plane.streams.idle_ends == 2 and plane.streams.overflows == 0
        for rid in ("a", "b"):
            assert seen[rid][-1] == {"type": "error", "code": "RESOURCE_EXHAUSTED", "message": idle[0 if rid == "a" else 1][1]}
            assert buffers[rid].get_nowait() == STARTED
            assert buffers[rid].get_nowait() == seen[rid][-1] and buffers[rid].empty()
        assert await plane.aborts() == [{"op": "abort", "id": "a"}]  # "b" finished: nothing runs
        clock.now_s += 100.0
        assert plane.streams.expire_idle() == [] and plane.streams.idle_ends == 2 and len(idle) == 2
        assert unbound.qsize() == 1  # unbound: never expired
        plane.close()

    asyncio.run(run())


def test_a_stream_ended_for_its_bytes_and_never_read_is_ended_idle_too() -> None:
    """Regression (secrev18 B residue): a stream ended by ``max_undelivered_bytes`` keeps
    its error for its reader; one that never read held it (and its tenant's stream) forever.
    Now the idle timeout ends it too (``on_idle``: its writer is stopped), without a second
    abort on its node."""

    async def run() -> None:
        clock = Clock()
        plane = await Plane().start(max_undelivered_bytes=400, stream_idle_timeout_s=10.0, clock=clock)
        await plane.streams.start()
        idle: list[str] = []
        buffer = plane.streams.open("a", None, idle.append)
        plane.streams.bind("a", "n0")
        await plane.send([["a", STARTED], *[["a", delta(10 + i)] for i in range(21)]],
                         lambda: plane.streams.overflows == 1)
        assert await plane.aborts() == [{"op": "abort", "id": "a"}]
        clock.now_s += 10.0
        assert plane.streams.expire_idle() == ["a"] and len(idle) == 1 and plane.streams.idle_ends == 1
        assert await plane.aborts() == []
        assert buffer.get_nowait() == STARTED and buffer.get_nowait()["message"] == idle[0]
        plane.close()

    asyncio.run(run())


def test_a_client_that_reads_slowly_but_steadily_is_never_ended() -> None:
    """A reader that takes what waits every 9 s of a 10 s timeout, the next event arriving as
    it takes (it never catches up), is never ended over 40 takes (360 s); nor is a reader
    waiting for its node's next event, for any time."""

    async def run() -> None:
        clock = Clock()
        plane = await Plane().start(stream_idle_timeout_s=10.0, clock=clock)
        await plane.streams.start()
        seen: list[dict[str, Any]] = []
        buffer = plane.streams.open("r", seen.append)
        plane.streams.bind("r", "n0")
        await plane.send([["r", STARTED]], lambda: buffer.qsize() == 1)
        for i in range(40):
            clock.now_s += 9.0
            assert plane.streams.expire_idle() == []
            buffer.get_nowait()  # what waited 9 s; the next arrives now
            await plane.send([["r", delta(i)]], lambda i=i: len(seen) == 2 + i)
        assert buffer.get_nowait() == delta(39)
        waiting = asyncio.ensure_future(buffer.get())  # the reader waits for the node: no deadline runs
        await asyncio.sleep(0)
        clock.now_s += 1000.0
        assert plane.streams.expire_idle() == [] and plane.streams.idle_ends == 0
        waiting.cancel()
        plane.close()

    asyncio.run(run())


class StalledClient(GrpcContext):
    """A gRPC call context whose client takes ``takes`` messages, then none (its writes hang,
    as under HTTP/2 flow control); each take advances ``clock`` by ``step_s`` and runs the
    idle sweep (``expire``) while the next event waits."""

    def __init__(self, takes: int, clock: Clock | None = None, step_s: float = 0.0) -> None:
        super().__init__()
        self.takes, self.clock, self.step_s = takes, clock, step_s
        self.written: list[Any] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.expire: Any = None

    async def write(self, message: Any) -> None:
        if len(self.written) >= self.takes:
            await asyncio.Event().wait()  # never taken
        self.written.append(message)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class Gateway:
    """An ``InferenceServicer`` (``limits``) on a ``Plane``, with a fake clock; its scheduler
    records releases."""

    async def start(self, limits: StreamLimits) -> Gateway:
        self.plane = await Plane().start()
        self.released: list[str] = []
        scheduler = SimpleNamespace(release=SimpleNamespace(remote=lambda request_id, usage=None: self.released.append(request_id)))
        self.auth = Auth()
        self.servicer = InferenceServicer(scheduler, self.auth, {"n0": None},
                                          {"n0": {**NODE_INFO, "data_address": self.plane.node_address}},
                                          None, self.plane.sched_address, limits=limits)
        self.clock = Clock()
        self.servicer.streams.clock = self.clock
        self.plane.streams = self.servicer.streams
        await self.servicer.streams.start()
        self.ann = Tenant("a1", TenantSpec(name="ann"), 0.0)
        return self

    def context(self, context: Any) -> Any:
        self.auth.tenant_of[id(context)] = self.ann
        return context

    async def admitted(self, n: int) -> str:
        for _ in range(500):
            if len(self.plane.admitted) >= n:
                return self.plane.admitted[n - 1]
            await asyncio.sleep(0.01)
        raise AssertionError("never admitted")

    def requests(self, status: str) -> float:
        value = self.servicer.metrics.registry.get_sample_value(
            "kvstrata:requests_total", {"tenant": "ann", "status": status})
        return value or 0.0


PB = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                   sampling=inference_pb2.SamplingParams(max_tokens=50))


@pytest.mark.parametrize("pending", ["delta", "delta+finished", "nothing"])
def test_a_grpc_call_whose_client_stops_reading_ends_resource_exhausted_and_frees_its_slot(pending: str) -> None:
    """Regression (secrev18 B residue): a Generate call whose client stopped reading (its
    writes held by flow control) kept its request decoding on its node, its buffer and its
    tenant's stream until the client went; its finished end, unread, kept the stream too, as
    did a writer stuck on an event with nothing more pending at the gateway. Now
    at the idle timeout its request is aborted on its node and released, the call ends with
    status RESOURCE_EXHAUSTED (counted so), and the tenant's stream is free: with a cap of 1,
    its next call is admitted."""

    async def run() -> None:
        gw = await Gateway().start(StreamLimits(max_streams_per_tenant=1, idle_timeout_s=10.0))
        client = gw.context(StalledClient(takes=1))
        call = asyncio.ensure_future(gw.servicer.Generate(PB, client))
        rid = await gw.admitted(1)
        tail = {"delta": [[rid, delta(2)]], "delta+finished": [[rid, delta(2)], [rid, FINISHED]], "nothing": []}[pending]
        ended = pending == "delta+finished"
        await gw.plane.send([[rid, {**STARTED, "request_id": rid}], [rid, delta(1)]],  # delta 1 is being written
                            lambda: len(client.written) == 1 and gw.servicer.streams.undelivered()[1] == 0)
        if tail:
            await gw.plane.send(tail, lambda: gw.servicer.streams.undelivered()[1] == len(tail))
        assert (rid in gw.released) == ended
        assert gw.servicer.open_streams == {"a1": 1}
        gw.clock.now_s += 9.0
        assert gw.servicer.streams.expire_idle() == []
        gw.clock.now_s += 2.0
        assert gw.servicer.streams.expire_idle() == [rid]
        await asyncio.wait_for(call, 5)  # returned: gRPC sends the status set
        assert client.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "stream_idle_timeout_s 10" in client.details
        assert gw.servicer.open_streams == {} and gw.released == [rid]
        assert await gw.plane.aborts() == ([] if ended else [{"op": "abort", "id": rid}])
        assert gw.servicer.streams.idle_ends == 1 and gw.servicer.streams.undelivered() == (0, 0, 0)
        assert gw.requests("RESOURCE_EXHAUSTED") == 1 and gw.requests("CANCELLED") == 0
        again = asyncio.ensure_future(gw.servicer.Generate(PB, gw.context(StalledClient(takes=1))))
        assert await gw.admitted(2) != rid  # the tenant's one stream is free again
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
        gw.plane.close()

    asyncio.run(run())


class SlowClient(GrpcContext):
    """A gRPC call context whose client takes each message when the test permits it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[Any] = []
        self.permits: asyncio.Queue[None] = asyncio.Queue()
        self.code: grpc.StatusCode | None = None

    async def write(self, message: Any) -> None:
        self.written.append(message)
        await self.permits.get()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code


def test_a_grpc_client_that_reads_slowly_but_steadily_gets_its_whole_stream() -> None:
    """A client that takes one message every 9 s of a 10 s timeout, the next event waiting
    in the buffer all that time, over 30 deltas (270 s), is never ended: it gets every event
    and the call ends OK."""

    async def run() -> None:
        gw = await Gateway().start(StreamLimits(idle_timeout_s=10.0))
        client = gw.context(SlowClient())
        call = asyncio.ensure_future(gw.servicer.Generate(PB, client))
        rid = await gw.admitted(1)
        await gw.plane.send([[rid, {**STARTED, "request_id": rid}]], lambda: len(client.written) == 1)
        for i in range(30):
            await gw.plane.send([[rid, delta(i)]], lambda: gw.servicer.streams.undelivered()[1] == 1)
            gw.clock.now_s += 9.0  # it waits 9 s for the client to take the message before it
            assert gw.servicer.streams.expire_idle() == []
            client.permits.put_nowait(None)
            await until(lambda i=i: len(client.written) == 2 + i)
        await gw.plane.send([[rid, FINISHED]], lambda: gw.servicer.streams.undelivered()[1] == 1)
        for _ in range(2):
            client.permits.put_nowait(None)
        await asyncio.wait_for(call, 5)
        assert client.code is None and len(client.written) == 32
        assert [m.WhichOneof("event") for m in client.written[:2]] == ["started", "delta"]
        assert gw.servicer.streams.idle_ends == 0 and gw.requests("OK") == 1 and gw.servicer.open_streams == {}
        gw.plane.close()

    asyncio.run(run())


def test_an_http_stream_whose_client_stops_reading_is_ended_and_frees_its_slot() -> None:
    """Regression (secrev18 B residue): the same over the OpenAI API: an SSE response whose
    client stopped reading (its ``send`` held) held its request, buffer and tenant's stream.
    Now at the idle timeout the request is aborted on its node, the response task (Starlette's
    streaming response, with its disconnect watch) ends unfinished without an error, its body
    is closed, and the tenant's stream is free."""

    async def run() -> None:
        gw = await Gateway().start(StreamLimits(max_streams_per_tenant=1, idle_timeout_s=10.0))
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if message.get("body") and any(m.get("body") for m in sent):  # it takes the first chunk only
                await asyncio.Event().wait()
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays connected
            return {}

        async def respond() -> None:  # the HTTP edge's task (``OpenAIEdge.complete``)
            writer = StreamWriter()
            events = gw.servicer.generate(gw.context(GrpcContext()), lambda: input_from_pb(PB), writer)
            started = await anext(events)
            # a chat: its first chunk (the role) goes out before any delta
            response = _ClosingStream(_stream(Generation(events, started, True, "m"), StreamShape()),
                                      media_type="text/event-stream", writer=writer)
            await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

        task = asyncio.ensure_future(respond())
        rid = await gw.admitted(1)
        await gw.plane.send([[rid, {**STARTED, "request_id": rid}], [rid, delta(1)]],
                            lambda: len(sent) == 2)
        await gw.plane.send([[rid, delta(2)]], lambda: gw.servicer.streams.undelivered()[1] == 1)
        gw.clock.now_s += 11.0
        assert gw.servicer.streams.expire_idle() == [rid]
        await asyncio.wait_for(task, 5)  # ended, not cancelled
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        assert gw.servicer.open_streams == {} and gw.released == [rid]
        assert await gw.plane.aborts() == [{"op": "abort", "id": rid}]
        assert gw.servicer.streams.idle_ends == 1 and gw.requests("RESOURCE_EXHAUSTED") == 1
        gw.plane.close()

    asyncio.run(run())


class AnyAuth:
    """Every call is ``tenant``'s."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant_of = tenant

    async def tenant(self, _context: Any) -> Tenant:
        return self.tenant_of


async def expire_when_stuck(gw: Gateway, rid: str, trickle: bool) -> None:
    """Every 50 ms, 11 s pass (the idle timeout is 10 s) and the sweep runs, until it ends
    ``rid``: once its writer is held by the transport (``trickle``: a delta more each time, as
    a write that went into a buffer with room returns and only the next one waits)."""
    for i in range(200):
        gw.clock.now_s += 11.0
        if gw.servicer.streams.expire_idle() == [rid]:
            return
        if trickle:
            gw.plane.push.send(gw.servicer.streams.subscriber, [[rid, delta(1000 + i)]])
        await asyncio.sleep(0.05)
    raise AssertionError("the stream's writer was never held")


def test_a_real_grpc_client_that_stops_reading_gets_resource_exhausted() -> None:
    """End to end over a real gRPC server and client: the client reads the ``started`` message
    and then nothing while 16 MiB of deltas arrive (gRPC takes some MiB of writes, then holds
    the gateway's next write until the client reads). At the idle timeout the call is ended:
    when the client reads again it gets what was in flight, then status RESOURCE_EXHAUSTED;
    the request was aborted on its node and the tenant's stream is free."""

    async def run() -> None:
        gw = await Gateway().start(StreamLimits(max_undelivered_bytes=1 << 30, idle_timeout_s=10.0))
        gw.servicer.auth = AnyAuth(gw.ann)  # type: ignore[assignment]
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(gw.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",  # the deltas held coalesce (up to 16 MiB)
                                            options=[("grpc.max_receive_message_length", 64 << 20)])
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(PB)
        try:
            rid = await gw.admitted(1)
            await gw.plane.send([[rid, {**STARTED, "request_id": rid}]], lambda: True)
            assert (await call.read()).WhichOneof("event") == "started"
            text = "x" * (64 << 10)
            for i in range(256):
                gw.plane.push.send(gw.servicer.streams.subscriber, [[rid, {**delta(i), "text": text}]])
            await expire_when_stuck(gw, rid, trickle=False)
            await until(lambda: gw.servicer.open_streams == {})
            assert await gw.plane.aborts() == [{"op": "abort", "id": rid}]
            deltas = 0
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (message := await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
                    deltas += message.WhichOneof("event") == "delta"
            assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "stream_idle_timeout_s 10" in (ended.value.details() or "")
            assert gw.servicer.streams.idle_ends == 1
        finally:
            call.cancel()
            await channel.close()
            await server.stop(0)
            gw.plane.close()

    asyncio.run(run())


class _Records(logging.Handler):
    """The log records at ``level`` or above that reach the logger it is added to."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_real_http_client_that_stops_reading_has_its_stream_ended(protocol: str) -> None:
    """End to end over the real HTTP server (uvicorn): a client posts a streamed completion,
    reads the first bytes and then nothing (a 4 KiB receive buffer) while 16 MiB of deltas
    arrive, then more, whose writes uvicorn holds (its buffer full). At the idle timeout the request is aborted
    on its node, the tenant's stream is free, and the server closes the connection after what it
    held: the response ends unfinished (no finish reason, no ``[DONE]``). Nothing is logged as an
    error: the end is the gateway's, counted in ``idle_ends`` (regression: uvicorn logged
    "ASGI callable returned without completing response" at ERROR for each such stream)."""

    async def run() -> None:
        gw = await Gateway().start(StreamLimits(max_undelivered_bytes=1 << 30, idle_timeout_s=10.0))
        gw.servicer.auth = AnyAuth(gw.ann)  # type: ignore[assignment]
        edge = OpenAIEdge(gw.servicer, "tiny", lambda text: [1, 2, 3], lambda: 1)
        http = HttpServer(create_app(edge))
        port = await http.start("127.0.0.1", 0)
        errors = _Records(logging.ERROR)
        logging.getLogger("uvicorn.error").addHandler(errors)  # uvicorn's loggers do not reach the root
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True}).encode()
            await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                          b"content-length: %d\r\n\r\n%s" % (len(body), body))
            rid = await gw.admitted(1)
            await gw.plane.send([[rid, {**STARTED, "request_id": rid}]], lambda: True)
            assert (await asyncio.wait_for(loop.sock_recv(sock, 1024), 5)).startswith(b"HTTP/1.1 200")
            text = "x" * (64 << 10)
            for i in range(256):
                gw.plane.push.send(gw.servicer.streams.subscriber, [[rid, {**delta(i), "text": text}]])
            await expire_when_stuck(gw, rid, trickle=True)
            await until(lambda: gw.servicer.open_streams == {})
            assert await gw.plane.aborts() == [{"op": "abort", "id": rid}] and gw.released == [rid]
            received = []
            while chunk := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5):  # then EOF: closed
                received.append(chunk)
            tail = b"".join(received)[-200:]  # what uvicorn held went out; the response is unfinished
            assert b"[DONE]" not in tail and b"finish_reason\":\"" not in tail
            assert tail.endswith(b"}\n\n\r\n")  # a whole chunk, then no last (empty) chunk
            assert [r.getMessage() for r in errors.records] == []
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)
            sock.close()
            await http.stop()
            gw.plane.close()

    asyncio.run(run())
