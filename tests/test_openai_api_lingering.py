"""A whole response that fits in the kernel's send buffer, on a connection the server closes
(``Connection: close``; likewise uvicorn's keep-alive timeout): the connection stays counted,
under the minimum read rate, until its client has taken it (``lingering.Lingering``). Real
``HttpServer`` on loopback; the client is a raw socket with a 4 KiB receive buffer (the
server's kernel then queues ~2.8 MB for it)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from starlette.responses import Response

from services.openai_api.connections import ConnectionLimits
from services.openai_api.server import HttpServer
from tests.test_openai_api_network_caps import _app as _caps_app
from tests.test_openai_api_send_bounds import _connect, _until

MID_BYTES = 1 << 20  # within the kernel's send queue on loopback (~2.8 MB for a 4 KiB receiver)
MID = b"GET /mid HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


def _app() -> FastAPI:
    app = _caps_app()

    @app.get("/mid")
    async def mid() -> Response:
        return Response(b"x" * MID_BYTES)

    return app


async def _serving(limits: ConnectionLimits, body) -> None:  # type: ignore[no-untyped-def]
    server = HttpServer(_app(), limits=limits)
    port = await server.start("127.0.0.1", 0)
    try:
        await body(server, port)
    finally:
        await server.stop()


def test_an_unread_response_in_the_kernel_stays_counted_and_is_reset() -> None:
    """Regression: a response small enough for the kernel's send buffer left every count once
    uvicorn closed its connection (here at once: ``Connection: close``): ``guard.open`` was 0,
    no cap or rate saw it, while the kernel held its 1 MiB for as long as the client held the
    socket. Now the connection stays counted while its client takes nothing, and is reset at
    ``send_stall_timeout_s`` (counted ``send_stalled``), the kernel's queue dropped."""
    limits = ConnectionLimits(send_stall_timeout_s=1.0)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        loop = asyncio.get_running_loop()
        sock = await _connect(port, rcvbuf=4096)
        start = time.monotonic()
        await loop.sock_sendall(sock, MID)
        assert await _until(lambda: guard.lingering, 5), dict(guard.stats)  # uvicorn closed it
        await asyncio.sleep(0.5)
        assert guard.open == 1 and guard.lingering and guard.unauthenticated
        assert await _until(lambda: guard.open == 0, 3), dict(guard.stats)
        assert 1.0 <= time.monotonic() - start < 3.0
        assert guard.stats["send_stalled"] == 1 and not guard.lingering and not guard.unauthenticated
        with pytest.raises(ConnectionResetError):  # reset: the kernel's queue dropped
            while await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5):
                pass
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_reader_gets_the_whole_response_and_its_end() -> None:
    """A client that reads the kernel-held response after a pause (0.5 s, within the 2 s
    deadline) gets all of it and then the end of the stream (the FIN follows the data, as
    the close sent it); the connection leaves the counts once the kernel's queue is empty,
    counted as nothing."""
    limits = ConnectionLimits(send_stall_timeout_s=2.0)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        loop = asyncio.get_running_loop()
        sock = await _connect(port, rcvbuf=4096)
        await loop.sock_sendall(sock, MID)
        assert await _until(lambda: guard.lingering, 5)
        await asyncio.sleep(0.5)
        got = bytearray()
        while data := await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5):
            got += data
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"x" * 1000)
        assert len(got.split(b"\r\n\r\n", 1)[1]) == MID_BYTES
        assert await _until(lambda: guard.open == 0, 3) and not guard.lingering
        assert not guard.stats, dict(guard.stats)
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_lingering_keyless_connection_is_shed_for_a_newcomer() -> None:
    """A closed connection whose client holds its kernel-held response up still takes its
    slot in the keyless share, so it is what a newcomer sheds (``sheddable``), reset at once."""
    limits = ConnectionLimits(max_connections=2, unauthenticated_share=0.5, send_stall_timeout_s=30.0)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None and guard.max_unauthenticated == 1
        loop = asyncio.get_running_loop()
        sock = await _connect(port, rcvbuf=4096)
        await loop.sock_sendall(sock, MID)
        assert await _until(lambda: guard.lingering, 5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.readline(), 5) == b"HTTP/1.1 200 OK\r\n"
        assert guard.stats["shed"] == 1 and not guard.lingering and guard.open == 1
        writer.close()
        sock.close()

    asyncio.run(asyncio.wait_for(_serving(limits, body), 30))


def test_a_reader_gets_the_whole_response_across_a_stop() -> None:
    """Regression (review of c1f4966): ``HttpServer.stop`` (every gateway stop and in-process
    restart) reset lingering connections (``SO_LINGER`` 0), so a client reading a 1 MiB
    response at ~256 KiB/s (64x the minimum rate) got ``ConnectionResetError`` after ~170 KiB;
    before c1f4966 the kernel went on delivering after the close. Now the stop releases them
    (closed normally): the client gets every byte and then the end of the stream, and the
    guard counts nothing (neither ``send_stalled`` nor ``shed``)."""
    async def run() -> None:
        server = HttpServer(_app(), limits=ConnectionLimits(send_stall_timeout_s=60.0))
        port = await server.start("127.0.0.1", 0)
        guard = server.guard
        assert guard is not None
        loop = asyncio.get_running_loop()
        sock = await _connect(port, rcvbuf=4096)
        got = bytearray()

        async def read() -> None:
            while data := await asyncio.wait_for(loop.sock_recv(sock, 4096), 10):
                got.extend(data)
                await asyncio.sleep(4096 / (256 * 1024))

        try:
            await loop.sock_sendall(sock, MID)
            reading = asyncio.create_task(read())
            assert await _until(lambda: guard.lingering, 5), dict(guard.stats)
            await asyncio.sleep(0.5)
            assert guard.lingering and not reading.done()  # stopped mid-download
        finally:
            await server.stop()
        assert not guard.lingering and guard.open == 0 and not guard.stats, dict(guard.stats)
        try:
            await reading  # ConnectionResetError on the old code
        finally:
            sock.close()
        assert got.startswith(b"HTTP/1.1 200")
        assert len(got.split(b"\r\n\r\n", 1)[1]) == MID_BYTES

    asyncio.run(asyncio.wait_for(run(), 30))
