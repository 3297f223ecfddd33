"""The HTTP API's bound on request-body bytes being read and parsed, per tenant and in all
(``services.openai_api.context.BodyBudget``), on the real ``HttpServer`` and ``OpenAIEdge``.

Regression (secrev19 H1): after the key check each body (up to 8 MiB) was read whole with
nothing counting it: one tenant's 64 connections, each withholding its body's last byte, grew
the gateway's RSS by 514 MB. Now a tenant's bodies being read hold at most ``per_tenant_bytes``
(429 past it) and all tenants' ``total_bytes`` (503), refused with ``Retry-After`` before the
body is read, and every hold is given back however its request ends.
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.context import BodyBudget, BodyLimits, CallAborted
from services.openai_api.server import HttpServer

BODY = json.dumps({"model": "m", "prompt": "a" * 3000, "max_tokens": 1}).encode()
LIMITS = BodyLimits(per_tenant_bytes=3 * len(BODY), total_bytes=4 * len(BODY), retry_after_ms=2500)


class _Servicer:
    """The servicer parts the edge uses: the key ``Bearer <tenant>`` is that tenant's (``bad``:
    none), a big body is parsed on a thread, and every parsed request is refused UNAVAILABLE
    (no node)."""

    class auth:  # stands in for the servicer's ``auth`` attribute
        @staticmethod
        async def tenant(context: Any) -> object:
            key = dict(context.invocation_metadata())["authorization"].removeprefix("Bearer ")
            if key == "bad":
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            return types.SimpleNamespace(tenant_id=key)

    @staticmethod
    async def off_loop(tenant_id: str, work: Callable[[], object]) -> object:
        return await asyncio.to_thread(work)

    @staticmethod
    async def generate(context: Any, parse: Any, writer: Any) -> AsyncIterator[object]:
        raise CallAborted(grpc.StatusCode.UNAVAILABLE, "no cache node is healthy")
        yield  # an async generator


def _head(tenant: str, length: int | None = len(BODY)) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenant}\r\n"
            f"Content-Type: application/json\r\n{size}\r\n\r\n").encode()


async def _serving(body: Callable[[OpenAIEdge, int], Awaitable[Any]]) -> Any:
    edge = OpenAIEdge(_Servicer(), "m@0:f16", list, lambda: 1, body_limits=LIMITS)  # type: ignore[arg-type]
    server = HttpServer(create_app(edge))
    port = await server.start("127.0.0.1", 0)
    try:
        return await body(edge, port)
    finally:
        await server.stop()


async def _send(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str]]:
    """(status line, headers) of the next response."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if line)
    return head[0].encode(), {k.lower(): v for k, v in headers.items()}


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


def test_a_tenants_bodies_in_flight_are_bounded_and_refused_429_before_they_are_read() -> None:
    """Three bodies of tenant a held unfinished fill its budget: its fourth request is answered
    429 with ``Retry-After`` and ``Connection: close`` from its head alone; tenant b still gets
    in until the gateway's budget (4 bodies) is full, then 503. Closing the held connections
    gives everything back. Before: every body was read, none refused."""

    async def body(edge: OpenAIEdge, port: int) -> None:
        budget = edge.bodies
        held = [await _send(port, _head("a") + BODY[:-1]) for _ in range(3)]
        await _until(lambda: budget.per_tenant["a"] == 3 * len(BODY))
        reader, writer = await _send(port, _head("a"))  # the body is never sent
        status, headers = await _answer(reader)
        assert status == b"HTTP/1.1 429 Too Many Requests"
        assert headers["retry-after"] == "3" and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5)  # the error body, then the server closes
        writer.close()
        held.append(await _send(port, _head("b") + BODY[:-1]))
        await _until(lambda: budget.total == 4 * len(BODY))
        reader, writer = await _send(port, _head("c"))
        assert (await _answer(reader))[0] == b"HTTP/1.1 503 Service Unavailable"
        writer.close()
        assert dict(budget.per_tenant) == {"a": 3 * len(BODY), "b": len(BODY)}
        for _, w in held:
            w.close()
        await _until(lambda: budget.total == 0)
        budget.check_integrity()
        assert dict(budget.per_tenant) == {}

    asyncio.run(_serving(body))


def test_every_ending_gives_the_bytes_back() -> None:
    """A parsed body (its request then refused 503 by the gateway), a body that is not JSON (400),
    a bad key (401, nothing held) and a big body parsed on a thread each leave the budget empty;
    then the tenant may fill it again."""
    big = json.dumps({"model": "m", "prompt": "a" * (300 << 10), "max_tokens": 1}).encode()

    async def body(edge: OpenAIEdge, port: int) -> None:
        budget = edge.bodies
        cases = [(_head("a") + BODY, b"HTTP/1.1 503 Service Unavailable"),
                 (_head("a") + b"x" * len(BODY), b"HTTP/1.1 400 Bad Request"),
                 (_head("bad") + BODY, b"HTTP/1.1 401 Unauthorized")]
        for request, expected in cases:
            reader, writer = await _send(port, request)
            assert (await _answer(reader))[0] == expected
            writer.close()
            assert budget.total == 0 and dict(budget.per_tenant) == {}
        edge.bodies = BodyBudget(BodyLimits(per_tenant_bytes=len(big), total_bytes=len(big)))
        for _ in range(2):
            reader, writer = await _send(port, _head("a", len(big)) + big)
            assert (await _answer(reader))[0] == b"HTTP/1.1 503 Service Unavailable"
            writer.close()
            assert edge.bodies.total == 0

    asyncio.run(_serving(body))


def test_a_chunked_body_is_counted_as_it_arrives() -> None:
    """A body without ``Content-Length`` holds the bytes received so far: past the tenant's
    budget (3 bodies) it is refused 429 mid-body, and what it held is given back."""
    chunk = b"%x\r\n%s\r\n" % (len(BODY), BODY)

    async def body(edge: OpenAIEdge, port: int) -> None:
        reader, writer = await _send(port, _head("a", None) + chunk * 2)
        await _until(lambda: edge.bodies.per_tenant["a"] >= 2 * len(BODY))
        writer.write(chunk * 2)
        status, headers = await _answer(reader)
        assert status == b"HTTP/1.1 429 Too Many Requests" and headers["connection"] == "close"
        writer.close()
        await _until(lambda: edge.bodies.total == 0)

    asyncio.run(_serving(body))


def test_body_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="per_tenant_bytes"):
        BodyLimits(per_tenant_bytes=0)


def test_body_limits_from_settings() -> None:
    """``BodyLimits.of`` reads ``http_max_body_bytes_per_tenant`` / ``_total`` (ServiceConfig's
    defaults are the limits' defaults: 4 and 32 bodies of the largest size)."""
    from services.config import ServiceConfig

    assert BodyLimits.of(ServiceConfig()) == BodyLimits() == BodyLimits(32 << 20, 256 << 20)
    got = BodyLimits.of(types.SimpleNamespace(http_max_body_bytes_per_tenant=5, http_max_body_bytes_total=7,
                                              http_max_response_bytes_per_tenant=9))
    assert (got.per_tenant_bytes, got.total_bytes, got.response_bytes_per_tenant) == (5, 7, 9)
    with pytest.raises(ValueError):
        ServiceConfig(http_max_body_bytes_per_tenant=1 << 20)  # less than one whole body
