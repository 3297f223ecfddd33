"""What one HTTP connection can make the gateway hold while it is sending (review 27a): requests
pipelined behind a response (F1), responses whose client never reads them (F2: keyless, F3: a
whole response), and the path a 404 echoes. Real ``HttpServer``s on loopback, with small limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.connections import ConnectionLimits
from services.openai_api.context import BodyLimits
from services.openai_api.errors import MAX_SHOWN_PATH
from services.openai_api.server import HttpServer
from services.tls import ServerTls
from tests.test_openai_api_network_caps import GET, KEYED
from tests.test_openai_api_network_caps import _app as _caps_app
from tests.tls_certs import make_tls_material

BIG = b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n"
BIG_BYTES = 4 << 20  # past the kernel's buffers on loopback (~2 MB each way)
PARSERS = ("httptools", "h11")


def _app() -> FastAPI:
    """The connection-cap tests' app (``/health``, ``/keyed``) with a big response and an
    endless stream."""
    app = _caps_app()

    @app.get("/big")
    async def big() -> Response:
        return Response(b"x" * BIG_BYTES)

    @app.get("/stream")
    async def stream(request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            while True:
                yield b"data: " + b"x" * (1 << 20) + b"\n\n"
                await asyncio.sleep(0)  # (a sent chunk need not suspend once the client is gone)
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


async def _serving(limits: ConnectionLimits, body: Callable[[HttpServer, int], Awaitable[Any]],
                   app: FastAPI | None = None, http: str = "auto", tls: ServerTls | None = None) -> Any:
    server = HttpServer(app or _app(), limits=limits, http=http, tls=tls)
    port = await server.start("127.0.0.1", 0)
    try:
        return await body(server, port)
    finally:
        await server.stop()


async def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # a client that reads nothing: its window fills at once
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _ask(port: int, request: bytes = GET) -> tuple[bytes, float]:
    """A new connection's answer to ``request`` (its status line) and how long it took."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    return line.strip(), time.monotonic() - start


async def _until(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def _held_up(conn: Any) -> bool:
    """The server's writes on ``conn`` wait for its client (uvicorn's flow control paused)."""
    return bool(conn.flow is not None and conn.flow.write_paused)


def _queued(server: HttpServer) -> int:
    """Requests received and waiting on any one connection: httptools' pipeline, or for h11 the
    bytes it buffers past the request it serves, in requests of ``GET``'s size."""
    assert server.guard is not None
    most = 0
    for conn in list(server.guard.unauthenticated):
        if hasattr(conn, "pipeline"):
            most = max(most, len(conn.pipeline))  # type: ignore[attr-defined]
        else:
            most = max(most, len(conn.conn.trailing_data[0]) // len(GET))  # type: ignore[attr-defined]
    return most


@pytest.mark.parametrize("http", PARSERS)
def test_a_pipelined_flood_is_cut_and_another_client_is_answered(http: str) -> None:
    """Regression (review 27a, F1): httptools queued every pipelined request without bound,
    uvicorn resumed reading while they waited, and the head's byte count restarted for each:
    one keyless connection's 7.6 MiB of ``GET /health`` queued 320,000 requests (RSS 132 ->
    836 MiB) and another client's ``/health`` took up to 1.6 s. Here 2 MiB of them, read as
    they are answered: at most ``max_pipelined_requests`` ever wait (h11: at most
    ``max_head_bytes`` of them), the connection is closed, and another connection's ``/health``
    is answered within 0.5 s throughout."""
    limits = ConnectionLimits(max_pipelined_requests=4)
    flood_bytes = 2 << 20

    async def body(server: HttpServer, port: int) -> None:
        loop = asyncio.get_running_loop()
        flood = await _connect(port)

        async def send() -> None:
            try:
                for _ in range(flood_bytes // (len(GET) * 4096)):
                    await loop.sock_sendall(flood, GET * 4096)
            except OSError:  # closed by the server
                pass

        async def read() -> int:
            answered = 0
            try:
                while data := await loop.sock_recv(flood, 1 << 16):
                    answered += data.count(b"HTTP/1.1 200")
            except OSError:
                pass
            return answered

        sender, reader = loop.create_task(send()), loop.create_task(read())
        most, waits = 0, []
        while not reader.done():
            most = max(most, _queued(server))
            waits.append((await _ask(port))[1])
            most = max(most, _queued(server))
            await asyncio.wait({reader}, timeout=0.02)
        answered = reader.result()
        await asyncio.wait_for(sender, 5)
        flood.close()
        stats = server.guard.stats  # type: ignore[union-attr]
        assert stats["pipeline_too_deep"] + stats["pipeline_too_large"] == 1, dict(stats)
        assert answered < 1 + limits.max_pipelined_requests + 64 * 1024 // len(GET)
        if http == "httptools":
            assert most <= limits.max_pipelined_requests
        else:
            assert most * len(GET) <= limits.max_head_bytes + (256 << 10)  # + one read's bytes
        assert waits and max(waits) < 0.5, waits

    asyncio.run(asyncio.wait_for(_serving(limits, body, http=http), 30))


@pytest.mark.parametrize("http", PARSERS)
def test_a_few_pipelined_requests_are_all_answered(http: str) -> None:
    """``max_pipelined_requests`` requests pipelined at once are answered in order, and the
    connection reads its next request once they are (reading resumes when the queue is empty)."""
    limits = ConnectionLimits(max_pipelined_requests=4)

    async def body(server: HttpServer, port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET * 5)  # one served, 4 waiting
        for _ in range(5):
            assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 200 OK\r\n"
            await asyncio.wait_for(reader.readuntil(b'{"ok":true}'), 5)
        writer.write(GET)
        assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 200 OK\r\n"
        writer.close()
        assert not server.guard.stats, dict(server.guard.stats)  # type: ignore[union-attr]

    asyncio.run(_serving(limits, body, http=http))


def test_keyless_connections_that_never_read_are_shed_and_timed_out() -> None:
    """Regression (review 27a, F2): a keyless connection whose pipelined responses its client
    never read was "answering", so it was neither shed nor timed out: 8 of them held the keyless
    share for good and every new connection (a keyed client's too) got 503. Now one whose
    writes are held up by its client is shed for a newcomer, and each is aborted once it has
    taken nothing for ``send_stall_timeout_s``."""
    limits = ConnectionLimits(max_connections=8, unauthenticated_share=0.5, send_stall_timeout_s=1.5)

    async def body(server: HttpServer, port: int) -> None:
        loop = asyncio.get_running_loop()
        guard = server.guard
        assert guard is not None and guard.max_unauthenticated == 4
        holders = []
        for _ in range(4):
            sock = await _connect(port, rcvbuf=4096)
            await loop.sock_sendall(sock, BIG * 2)
            holders.append(sock)
        assert await _until(lambda: len(guard.unauthenticated) == 4 and all(
            _held_up(c) for c in guard.unauthenticated), 5)
        status, _ = await _ask(port, KEYED)  # the keyless share is full: one holder is shed
        assert status == b"HTTP/1.1 200 OK" and guard.stats["shed"] == 1
        assert await _until(lambda: guard.open == 0, 3 * limits.send_stall_timeout_s)
        assert guard.stats["send_stalled"] == 3 and not guard.unauthenticated, dict(guard.stats)
        for sock in holders:
            sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_connection_closing_after_an_unread_response_is_aborted() -> None:
    """A response whose connection uvicorn closes once it is written (``Connection: close``;
    likewise at its 5 s keep-alive timeout) is still aborted at the send-stall deadline: asyncio's
    ``close`` waits for the held bytes to be written, for as long as the client takes. Found
    on a live gateway (60 s deadline, past the keep-alive): two unread whole responses held
    their connections and 2.2 MB of Send-Q each for good."""
    limits = ConnectionLimits(send_stall_timeout_s=1.0)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        sock = await _connect(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, b"GET /big HTTP/1.1\r\nHost: x\r\n"
                                                            b"Connection: close\r\n\r\n")
        assert await _until(lambda: any(c._current.is_closing() and _held_up(c) for c in guard.unauthenticated), 5)
        assert await _until(lambda: guard.open == 0, 3 * limits.send_stall_timeout_s), dict(guard.stats)
        assert guard.stats["send_stalled"] == 1
        with pytest.raises(ConnectionResetError):
            while await asyncio.get_running_loop().sock_recv(sock, 1 << 20):
                pass
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_stream_whose_client_reads_nothing_is_cut_at_the_send_stall_deadline() -> None:
    """A streamed response is held to the same rule as a whole one: its client reads nothing,
    and the connection is aborted once ``send_stall_timeout_s`` has passed held up (before,
    a stream was exempt, left to its stream's ``stream_idle_timeout_s``, 300 s by default)."""
    limits = ConnectionLimits(send_stall_timeout_s=0.3)

    async def body(server: HttpServer, port: int) -> None:
        sock = await _connect(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        guard = server.guard
        assert guard is not None
        assert await _until(lambda: any(_held_up(c) for c in guard.unauthenticated), 5)
        assert await _until(lambda: guard.open == 0, 10 * limits.send_stall_timeout_s), dict(guard.stats)
        assert guard.stats["send_stalled"] == 1
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


async def _trickle(sock: socket.socket, bytes_per_s: float, until_s: float, step_s: float = 0.05) -> tuple[int, bool]:
    """Read from ``sock`` at ``bytes_per_s`` (a slice each ``step_s``) for ``until_s`` or until
    the server ends the connection; (bytes read, whether it was reset)."""
    loop = asyncio.get_running_loop()
    got, start, ahead = 0, time.monotonic(), 0.0
    while time.monotonic() - start < until_s:
        await asyncio.sleep(step_s)
        ahead += bytes_per_s * step_s
        while ahead >= 1:
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, int(ahead)), 1)
            except ConnectionResetError:
                return got, True
            except TimeoutError:
                break
            if not data:
                return got, False
            got, ahead = got + len(data), ahead - len(data)
    return got, False


@pytest.mark.parametrize("path", ["/big", "/stream"])
def test_a_trickle_reader_is_cut_below_the_minimum_rate(path: str) -> None:
    """Regression (a trickle reader): the send-stall deadline asked for only 64 KiB taken within
    each ``send_stall_timeout_s`` (restarted at each pause), and a stream was exempt; a client
    taking a little at a time held its connection and the response's bytes for as long as
    it liked (a 4 MiB response at 64 KiB per 60 s: over an hour). Here the rate is 1 MiB/s
    and the client takes ~256 KiB/s (4 times the old rule's 64 KiB in each 1 s) of a 4 MiB
    response, or of an endless stream: it falls 0.75 s behind per second held up, and is
    cut once 1 s behind (about 1.3 s held up), long before it could have read the response."""
    limits = ConnectionLimits(send_stall_timeout_s=1.0, min_send_rate_bytes_per_s=1 << 20)

    async def body(server: HttpServer, port: int) -> None:
        sock = await _connect(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        guard = server.guard
        assert guard is not None
        assert await _until(lambda: any(_held_up(c) for c in guard.unauthenticated), 5)
        start = time.monotonic()
        got, reset = await _trickle(sock, 256 << 10, 12.0)
        took = time.monotonic() - start
        assert reset and guard.stats["send_stalled"] == 1, (got, took, dict(guard.stats))
        assert await _until(lambda: guard.open == 0, 2)
        assert 1.0 <= took < 6.0 and got < BIG_BYTES // 2, (got, took)
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_reader_at_the_minimum_rate_gets_its_whole_response() -> None:
    """A client that holds the writes up but takes them faster than the minimum rate is never
    cut, however long the response takes: 4 MiB at ~3 MiB/s against a rate of 1 MiB/s and a
    deadline of 1 s (the whole response takes ~1.4 s held up). On the old code (progress
    read from the transport's buffer alone, which the kernel refills in bursts) a reader at
    1.5 MiB/s with a 0.3 s deadline was cut after 397 KB."""
    limits = ConnectionLimits(send_stall_timeout_s=1.0, min_send_rate_bytes_per_s=1 << 20)

    async def body(server: HttpServer, port: int) -> None:
        sock = await _connect(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(sock, b"GET /big HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        guard = server.guard
        assert guard is not None
        got, reset = await _trickle(sock, 3 << 20, 20.0)
        assert not reset and got > BIG_BYTES and "send_stalled" not in guard.stats, (got, dict(guard.stats))
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


class _Servicer:
    """The servicer parts the edge uses; every key is tenant "t"; ``generate`` answers
    ``TEXT_BYTES`` of text."""

    TEXT_BYTES = 3 << 20
    info: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        class auth:
            @staticmethod
            async def tenant(context: Any) -> object:
                return types.SimpleNamespace(tenant_id="t", spec=types.SimpleNamespace(max_context_tokens=0))

        self.auth = auth

    @staticmethod
    async def off_loop(tenant_id: str, work: Callable[[], object]) -> object:
        return work()

    async def generate(self, context: Any, parse: Callable[[], Any], writer: Any) -> AsyncIterator[dict]:
        call = parse()
        yield {"type": "started", "prompt_tokens": 3, "request_id": call.request_id}
        for _ in range(3):
            yield {"type": "delta", "token_ids": [7], "text": "x" * (self.TEXT_BYTES // 3)}
        yield {"type": "finished", "prompt_tokens": 3, "completion_tokens": 3, "finish_reason": "length"}


def _chat_request() -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


async def _answer(port: int, request: bytes) -> tuple[bytes, bytes]:
    """A new connection's whole answer to ``request``: (head, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return head, body


def test_an_unread_whole_response_is_bounded_and_freed() -> None:
    """Regression (review 27a, F3): a whole response its client never read was held, with its
    connection, for as long as the client kept the connection open, outside every per-tenant
    bound. Now its bytes count in its tenant's ``ResponseBudget`` until written out (another
    response that would pass it is a 429 with ``Retry-After``), and the connection is aborted
    after ``send_stall_timeout_s``, freeing them; then the tenant's responses are served again."""
    limits = ConnectionLimits(send_stall_timeout_s=1.0)
    edge = OpenAIEdge(_Servicer(), "m@0:f16", list, lambda: 1,  # type: ignore[arg-type]
                      body_limits=BodyLimits(response_bytes_per_tenant=4 << 20))

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        unread = await _connect(port, rcvbuf=4096)
        await asyncio.get_running_loop().sock_sendall(unread, _chat_request())
        assert await _until(lambda: edge.responses.per_tenant["t"] > _Servicer.TEXT_BYTES, 5)
        connections = server.server.server_state.connections  # type: ignore[union-attr]
        assert await _until(lambda: any(_held_up(c) for c in connections), 5)
        head, answer = await _answer(port, _chat_request())  # 2 x 3 MiB would pass 4 MiB
        assert head.startswith(b"HTTP/1.1 429") and b"retry-after: 1\r\n" in head.lower()
        assert json.loads(answer)["error"]["type"] == "rate_limit_error"
        assert await _until(lambda: not edge.responses.per_tenant, 3 * limits.send_stall_timeout_s)
        assert guard.stats["send_stalled"] == 1 and guard.open == 0, dict(guard.stats)
        with pytest.raises(ConnectionResetError):  # reset: the kernel's send queue dropped too
            while await asyncio.get_running_loop().sock_recv(unread, 1 << 20):
                pass
        unread.close()
        head, answer = await _answer(port, _chat_request())
        assert head.startswith(b"HTTP/1.1 200")
        assert len(json.loads(answer)["choices"][0]["message"]["content"]) == _Servicer.TEXT_BYTES
        assert await _until(lambda: not edge.responses.per_tenant, 2)
        edge.responses.check_integrity()

    asyncio.run(asyncio.wait_for(_serving(limits, body, app=create_app(edge)), 30))


def test_a_404_echoes_a_bounded_path() -> None:
    """Regression (review 27a, F2): a 404 echoed the whole path (up to ~64 KiB), so a few unread
    pipelined requests filled the server's buffers; it shows ``MAX_SHOWN_PATH`` characters."""
    edge = OpenAIEdge(_Servicer(), "m@0:f16", list, lambda: 1)  # type: ignore[arg-type]

    async def body(server: HttpServer, port: int) -> None:
        head, answer = await _answer(port, b"GET /" + b"a" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        message = json.loads(answer)["error"]["message"]
        assert head.startswith(b"HTTP/1.1 404")
        assert message == f"no such endpoint: /{'a' * (MAX_SHOWN_PATH - 1)}... (8001 characters)"

    asyncio.run(_serving(ConnectionLimits(), body, app=create_app(edge)))


def test_over_tls_the_pipeline_cap_and_the_send_stall_hold(tmp_path: Path) -> None:
    """The same bounds on HTTPS (the guarded protocol terminates TLS itself): a pipelined flood
    is cut at ``max_pipelined_requests``, and a client that never reads its responses is aborted
    after ``send_stall_timeout_s``."""
    certs = make_tls_material(tmp_path)
    limits = ConnectionLimits(max_pipelined_requests=4, send_stall_timeout_s=1.0)
    context = ssl.create_default_context(cafile=str(certs.ca))

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        reader, writer = await asyncio.open_connection(sock=await _connect(port), ssl=context,
                                                       server_hostname="localhost")
        writer.write(GET * 4096)
        with contextlib.suppress(ConnectionResetError):
            while await asyncio.wait_for(reader.read(1 << 16), 5):
                pass
        assert guard.stats["pipeline_too_deep"] == 1, dict(guard.stats)
        writer.close()
        sock = await _connect(port, rcvbuf=4096)
        reader, writer = await asyncio.open_connection(sock=sock, ssl=context, server_hostname="localhost",
                                                       limit=1 << 12)
        writer.write(BIG * 2)  # read into the stream's buffer up to its limit, then no more
        assert await _until(lambda: guard.stats["send_stalled"] == 1, 6 * limits.send_stall_timeout_s)
        assert await _until(lambda: guard.open == 0, 2), dict(guard.stats)
        writer.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body, tls=ServerTls(str(certs.server.cert),
                                                                        str(certs.server.key))), 30))
