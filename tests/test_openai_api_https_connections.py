"""HTTPS connections under the HTTP API's connection bounds (``services.openai_api.connections``):
counted from their accept, TLS handshake included, and closed when the handshake outlasts the
head deadline; a failed handshake leaves no count behind.

Regression (HTTPS handshakes escaped the connection caps): uvicorn served HTTPS through
``loop.create_server(ssl=...)``, whose SSL layer runs the handshake before the guarded protocol's
``connection_made``, so TCP connections that never finished it were not counted (``guard.open``
stayed 0 while they were held) and each held a file descriptor for asyncio's 60 s handshake
timeout, whatever ``http_head_timeout_s`` said.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from fastapi import FastAPI

from services.openai_api.connections import ConnectionLimits
from services.openai_api.server import HttpServer
from services.tls import ClientTls, ServerTls
from tests.tls_certs import TlsMaterial, make_ca, make_tls_material

pytestmark = pytest.mark.timeout(60)

GET = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
# the first bytes of a TLS record carrying a ClientHello (handshake, TLS 1.0 record, 512 bytes),
# and a few of its body: the server waits for the rest
PARTIAL_CLIENT_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(16)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app


async def _serving(certs: TlsMaterial, limits: ConnectionLimits, body: Callable[[HttpServer, int], Awaitable[Any]],
                   mutual: bool = False) -> Any:
    tls = ServerTls(str(certs.server.cert), str(certs.server.key), str(certs.ca) if mutual else "")
    server = HttpServer(_app(), limits=limits, tls=tls)
    port = await server.start("127.0.0.1", 0)
    try:
        return await body(server, port)
    finally:
        await server.stop()


async def _https_status(port: int, client: ClientTls) -> int:
    async with httpx2.AsyncClient(verify=client.ssl_context(), timeout=5) as http:
        return (await http.get(f"https://localhost:{port}/health")).status_code


async def _closed_after(reader: asyncio.StreamReader, start: float) -> float:
    """Seconds from ``start`` until the server closed the connection."""
    try:
        while await reader.read(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait (letting the server's loop run) until ``check()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_connections_in_their_handshake_count_against_the_cap_and_end_at_the_head_deadline(
        certs: TlsMaterial, protocol: str) -> None:
    """5 TCP connections to the https port (cap 5 per address) that send nothing or half a
    ClientHello are counted at once (before: 0); a 6th connection, an https client's too, is
    closed at accept; the 5 are closed 1 s (the head deadline) after they opened, not after
    asyncio's 60 s, and uncounted; then an https client is served and the count is 0 again."""
    limits = ConnectionLimits(head_timeout_s=1.0, max_connections_per_address=5)

    async def body(server: HttpServer, port: int) -> None:
        assert server.guard is not None
        held, watchers = [], []
        for i in range(5):
            start = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 2:
                writer.write(PARTIAL_CLIENT_HELLO)
            held.append(writer)
            watchers.append(asyncio.create_task(_closed_after(reader, start)))
        await _until(lambda: server.guard.open == 5, f"5 handshakes counted, got {server.guard.open}")
        assert server.guard.per_address == {"127.0.0.1": 5}

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(_closed_after(reader, time.monotonic()), 5) < 0.5  # refused at accept
        writer.close()
        with pytest.raises(httpx2.TransportError):
            await _https_status(port, ClientTls(str(certs.ca)))
        assert server.guard.stats["refused_address"] == 2

        lived = await asyncio.wait_for(asyncio.gather(*watchers), 10)
        assert min(lived) >= 0.5 and max(lived) < 4.0, lived
        await _until(lambda: server.guard.open == 0, f"all uncounted, got {server.guard.open}")
        assert server.guard.per_address == {} and server.guard.unauthenticated == {}
        assert dict(server.guard.stats) == {"refused_address": 2, "handshake_timeout": 5}

        assert await _https_status(port, ClientTls(str(certs.ca))) == 200
        await _until(lambda: server.guard.open == 0, "the served client's connection uncounted")
        for w in held:
            w.close()

    asyncio.run(_serving(certs, limits, body))


def test_failed_handshakes_leave_no_count(certs: TlsMaterial, tmp_path: Path) -> None:
    """Handshakes that fail (a client that distrusts the certificate, plain HTTP on the https
    port, a client without a certificate under mutual TLS, a client that hangs up mid-way) are
    counted while they run and released when they fail: the count is 0 after each, and a good
    client is still served. asyncio calls no ``connection_lost`` for some of them."""
    other_ca, _ = make_ca(tmp_path, "other")
    limits = ConnectionLimits(head_timeout_s=5.0, max_connections_per_address=3)

    async def failures(server: HttpServer, port: int, clients: list[ClientTls]) -> None:
        assert server.guard is not None
        for client in clients:
            with pytest.raises(httpx2.TransportError):
                await _https_status(port, client)
            await _until(lambda: server.guard.open == 0, f"{client} uncounted, got {server.guard.open}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)  # plain HTTP: not a ClientHello
        await asyncio.wait_for(_closed_after(reader, time.monotonic()), 5)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(PARTIAL_CLIENT_HELLO)
        await _until(lambda: server.guard.open == 1, "the hung-up handshake counted")
        writer.close()
        await _until(lambda: server.guard.open == 0 and server.guard.per_address == {},
                     f"failed handshakes uncounted, got {server.guard.open} {server.guard.per_address}")
        assert server.guard.unauthenticated == {}
        assert server.guard.stats["handshake_failed"] == len(clients) + 2, server.guard.stats

    async def plain(server: HttpServer, port: int) -> None:
        await failures(server, port, [ClientTls(str(other_ca))] * 4)  # more than the cap of 3
        assert await _https_status(port, ClientTls(str(certs.ca))) == 200

    async def mutual(server: HttpServer, port: int) -> None:
        await failures(server, port, [ClientTls(str(certs.ca))] * 4)
        member = ClientTls(str(certs.ca), str(certs.client.cert), str(certs.client.key))
        assert await _https_status(port, member) == 200

    asyncio.run(_serving(certs, limits, plain))
    asyncio.run(_serving(certs, limits, mutual, mutual=True))


def _request_with_the_last_handshake_bytes(port: int, ca: Path) -> bytes:
    """A TLS client that sends its Finished message and an HTTP request in one write (so the
    server decrypts the request while completing its handshake); returns the response's head."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context(cafile=str(ca)).wrap_bio(incoming, outgoing, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536) or b"")
        tls.write(GET)
        sock.sendall(outgoing.read())  # the client's Finished and the request
        reply = b""
        while b"\r\n\r\n" not in reply:
            try:
                reply += tls.read(65536)
            except ssl.SSLWantReadError:
                data = sock.recv(65536)
                assert data, f"closed after {reply!r}"
                incoming.write(data)
        return reply.split(b"\r\n", 1)[0]


def test_a_request_that_arrives_with_the_handshakes_end_is_served(certs: TlsMaterial, protocol: str) -> None:
    """Bytes decrypted while the handshake completes reach the protocol before uvicorn sees the
    connection: they are kept and parsed then (200), not lost or parsed without a transport."""
    async def body(server: HttpServer, port: int) -> bytes:
        return await asyncio.to_thread(_request_with_the_last_handshake_bytes, port, certs.ca)

    assert asyncio.run(_serving(certs, ConnectionLimits(), body)) == b"HTTP/1.1 200 OK"


def _partial_head_then_deaf(port: int, ca: Path) -> float:
    """A TLS client that completes the handshake, sends half a request head, then reads raw
    bytes only (it never answers the server's close_notify); returns the seconds from its
    connect until the server closed the TCP connection."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context(cafile=str(ca)).wrap_bio(incoming, outgoing, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        start = time.monotonic()
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536) or b"")
        tls.write(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        sock.sendall(outgoing.read())
        while sock.recv(65536):
            pass
        return time.monotonic() - start


def test_a_tls_connection_closed_at_its_deadline_does_not_wait_for_close_notify(certs: TlsMaterial) -> None:
    """A head deadline's close on a TLS connection ends with TLS's close_notify, which asyncio
    waits for from the peer up to ``ssl_shutdown_timeout`` (default 30 s, the socket held):
    bounded by the head deadline too, the connection is gone 2 deadlines after it opened (31 s
    before) and uncounted."""
    async def body(server: HttpServer, port: int) -> None:
        lived = await asyncio.to_thread(_partial_head_then_deaf, port, certs.ca)
        assert 0.5 <= lived < 4.0, lived
        assert server.guard is not None
        await _until(lambda: server.guard.open == 0, f"uncounted, got {server.guard.open}")
        assert dict(server.guard.stats) == {"head_timeout": 1}

    asyncio.run(_serving(certs, ConnectionLimits(head_timeout_s=1.0), body))
