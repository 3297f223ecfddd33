"""The HTTP API's connection caps count client networks, and keyless connections cannot take
every slot (``services.openai_api.connections.ConnectionGuard``).

Regression (secrev19 H3): the caps counted each exact peer address, and the total was first
come, first served: 16 source addresses x 256 partial requests without a key held all 4,096
slots, and every other client got 503 at accept. Here, scaled down: 8 loopback addresses of one
/24 fill the per-network cap, 8 addresses of 8 networks cannot keep a newcomer out (the oldest
unfinished keyless connection is shed for it), and connections that presented a key keep
their slots.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request

from services.openai_api.connections import ConnectionLimits, client_networks
from services.openai_api.protocol import authenticated
from services.openai_api.server import HttpServer

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
KEYED = b"GET /keyed HTTP/1.1\r\nHost: x\r\n\r\n"


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/keyed")
    async def keyed(request: Request) -> dict[str, bool]:  # as the edge does once a key passes
        authenticated(request.scope)
        return {"ok": True}

    return app


async def _serving(limits: ConnectionLimits, body: Callable[[HttpServer, int], Awaitable[Any]]) -> Any:
    server = HttpServer(_app(), limits=limits)
    port = await server.start("127.0.0.1", 0)
    try:
        return await body(server, port)
    finally:
        await server.stop()


async def _open(port: int, source: str, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _status(reader: asyncio.StreamReader) -> bytes:
    return (await asyncio.wait_for(reader.readline(), 5)).strip()


async def _settle() -> None:
    await asyncio.sleep(0.2)  # the server takes in what the clients sent


def test_client_networks() -> None:
    """An IPv6 /64 is one client (one host's SLAAC share), an IPv4 address is one; the wider
    networks are an IPv6 /48 and an IPv4 /24; an IPv4-mapped address is its IPv4 address."""
    assert client_networks("2001:db8:1:2:aaaa::1") == ("2001:db8:1:2::/64", "2001:db8:1::/48")
    assert client_networks("2001:db8:1:2:ffff::9")[0] == client_networks("2001:db8:1:2::1")[0]
    assert client_networks("2001:db8:1:3::1")[0] != client_networks("2001:db8:1:2::1")[0]
    assert client_networks("10.1.2.3") == ("10.1.2.3", "10.1.2.0/24")
    assert client_networks("::ffff:10.1.2.3") == ("10.1.2.3", "10.1.2.0/24")
    assert client_networks("") == ("", "")


def test_one_network_cannot_take_more_than_its_cap() -> None:
    """8 addresses of 127.0.0.0/24, 3 partial requests each (per-address cap 4): the /24 holds
    10 (its cap), the other 14 are refused 503 at accept; a client of another /24 is served.
    Before: all 24 were held (each address under its cap)."""
    limits = ConnectionLimits(max_connections=100, max_connections_per_address=4, max_connections_per_network=10)

    async def body(server: HttpServer, port: int) -> None:
        held = [await _open(port, f"127.0.0.{2 + i % 8}", PARTIAL_HEAD) for i in range(24)]
        await _settle()
        assert server.guard is not None and server.guard.open == 10
        assert server.guard.stats["refused_network"] == 14
        assert server.guard.per_network == {"127.0.0.0/24": 10}
        for reader, _ in held[10:]:
            assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 503 ")
        reader, writer = await _open(port, "127.0.1.9", GET)
        assert await _status(reader) == b"HTTP/1.1 200 OK"
        for _, w in [*held, (reader, writer)]:
            w.close()

    asyncio.run(_serving(limits, body))


def test_keyless_partial_requests_from_many_networks_cannot_lock_others_out(protocol: str) -> None:
    """8 addresses in 8 networks open 4 partial requests each: all 32 slots' worth. Keyless
    connections hold at most half of them (16): each past that sheds the oldest unfinished one.
    A newcomer (still keyless) sheds one more and is served; so is a keyed client. Before: the
    32 held every slot and the newcomer was refused 503."""
    limits = ConnectionLimits(max_connections=32, max_connections_per_address=4)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None and guard.max_unauthenticated == 16
        held = [await _open(port, f"127.{1 + i % 8}.0.2", PARTIAL_HEAD) for i in range(32)]
        await _settle()
        assert guard.open == 16 and len(guard.unauthenticated) == 16 and guard.stats["shed"] == 16
        shed = held[0][0]
        assert (await asyncio.wait_for(shed.read(), 5)).startswith(b"HTTP/1.1 503 ")  # the oldest went
        reader, writer = await _open(port, "127.0.200.1", GET)
        assert await _status(reader) == b"HTTP/1.1 200 OK"
        keyed_reader, keyed_writer = await _open(port, "127.0.201.1", KEYED)
        assert await _status(keyed_reader) == b"HTTP/1.1 200 OK"
        assert guard.stats["shed"] == 18 and "refused_total" not in guard.stats
        for _, w in [*held, (reader, writer), (keyed_reader, keyed_writer)]:
            w.close()

    asyncio.run(_serving(limits, body))


def test_keyed_connections_keep_their_slots(protocol: str) -> None:
    """4 connections that made a keyed request, then began a next one and stalled, are never
    shed: 40 keyless partial requests after them shed only each other (at most 4 held), and
    the keyed ones' next requests are served. The total cap still binds: with all 8 slots keyed
    or answering, a newcomer is refused."""
    limits = ConnectionLimits(max_connections=8, max_connections_per_address=100)

    async def body(server: HttpServer, port: int) -> None:
        guard = server.guard
        assert guard is not None
        keyed = [await _open(port, "127.0.0.2", KEYED) for _ in range(4)]
        for reader, writer in keyed:
            assert await _status(reader) == b"HTTP/1.1 200 OK"
            await asyncio.wait_for(reader.readuntil(b'{"ok":true}'), 5)
            writer.write(b"GET /health HTTP/1.1\r\n")  # the next request's head, unfinished
        attackers = [await _open(port, f"127.{1 + i % 8}.0.3", PARTIAL_HEAD) for i in range(40)]
        await _settle()
        assert guard.open == 8 and len(guard.unauthenticated) == 4 and guard.stats["shed"] == 36
        for reader, writer in keyed:
            writer.write(b"Host: x\r\n\r\n")
            assert await _status(reader) == b"HTTP/1.1 200 OK"
        more_keyed = [await _open(port, "127.0.0.4", KEYED) for _ in range(4)]  # shed the 4 attackers
        for reader, _ in more_keyed:
            assert await _status(reader) == b"HTTP/1.1 200 OK"
        await _settle()
        assert guard.open == 8 and len(guard.unauthenticated) == 0
        refused, writer = await _open(port, "127.0.0.5", GET)
        assert await _status(refused) == b"HTTP/1.1 503 Service Unavailable"
        assert guard.stats["refused_total"] == 1
        for _, w in [*keyed, *attackers, *more_keyed, (refused, writer)]:
            w.close()

    asyncio.run(_serving(limits, body))


def test_keyless_connections_idle_between_requests_are_shed_too(protocol: str) -> None:
    """Regression (review of f7a24d1, R2): a keyless connection that finished a request and
    sat idle (kept alive) could not be shed; 8 such connections, each re-sending
    ``GET /health`` within the keep-alive, held the keyless share (8 of 16), and every new
    connection, a keyed client's included, was refused 503 at accept. Now the oldest idle one
    is shed for the newcomer."""
    async def body(server: HttpServer, port: int) -> None:
        held = []
        for i in range(8):
            reader, writer = await _open(port, f"127.0.{i % 2}.{10 + i}", GET)
            assert await _status(reader) == b"HTTP/1.1 200 OK"
            held.append(writer)
        await _settle()
        for source in ("127.0.9.9", "127.0.9.10"):
            reader, _ = await _open(port, source, KEYED)
            assert await _status(reader) == b"HTTP/1.1 200 OK"
        assert server.guard is not None and server.guard.stats["shed"] >= 1
        assert "refused_unauthenticated" not in server.guard.stats

    asyncio.run(_serving(ConnectionLimits(max_connections=16, unauthenticated_share=0.5), body))


def test_limits_from_settings() -> None:
    """``ConnectionLimits.of`` reads the per-network cap and the keyless share (ServiceConfig's
    defaults are the limits' defaults); the share is a fraction in (0, 1]."""
    from services.config import ServiceConfig

    base = {"http_head_timeout_s": 1, "http_body_timeout_s": 2, "http_max_connections": 30,
            "http_max_connections_per_address": 4, "http_send_stall_timeout_s": 3}
    assert ConnectionLimits.of(ServiceConfig()) == ConnectionLimits()
    got = ConnectionLimits.of(types.SimpleNamespace(**base, http_max_connections_per_network=9,
                                                    http_unauthenticated_share=0.25,
                                                    http_min_send_rate_bytes_per_s=100.0, http_send_buffer_bytes=8192))
    assert (got.max_connections_per_network, got.unauthenticated_share, got.send_stall_timeout_s) == (9, 0.25, 3)
    assert (got.min_send_rate_bytes_per_s, got.send_buffer_bytes) == (100.0, 8192)
    with pytest.raises(ValueError, match="unauthenticated_share"):
        ConnectionLimits(unauthenticated_share=1.5)
    with pytest.raises(ValueError, match="min_send_rate_bytes_per_s"):
        ConnectionLimits(min_send_rate_bytes_per_s=0)
    with pytest.raises(ValueError, match="send_buffer_bytes"):
        ConnectionLimits(send_buffer_bytes=-1)
