"""The HTTP edge's connection guard is exported to Prometheus (``services.metrics.http``):
connections open, keyless ones, and every refusal or early close by reason (each from 0), read
from the guard at scrape time; and the streams the gateway ended unread, by reason
(``services.metrics.streams``). Regression: the guard counted refusals, sheds and timeouts
(``ConnectionGuard.stats``) but nothing exported them, so an operator could not tell a flood
being shed from real clients being refused. Real uvicorn server, real sockets."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import GatewayMetrics
from services.openai_api.connections import CLOSE_REASONS, ConnectionLimits
from services.openai_api.server import HttpServer
from tests.test_gateway_stream_bounds import STARTED, Plane, delta
from tests.test_gateway_stream_config import Clock
from tests.test_openai_api_network_caps import GET, PARTIAL_HEAD, _app, _open, _settle, _status
from tests.test_openai_api_send_bounds import BIG, _connect, _until
from tests.test_openai_api_send_bounds import _app as _send_app


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels) -> value, as a scrape of the gateway's registry reads them."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_refusals_and_open_connections_are_exported() -> None:
    """24 partial keyless requests from one /24 with a cap of 10: 10 open, 14 refused at accept
    by the network cap; a client of another network is served; after all close, 0 open."""
    limits = ConnectionLimits(max_connections=100, max_connections_per_address=4, max_connections_per_network=10)
    metrics = GatewayMetrics()
    server = HttpServer(_app(), limits=limits)
    metrics.watch_http(lambda: server.guard)

    async def body() -> None:
        port = await server.start("127.0.0.1", 0)
        try:
            held = [await _open(port, f"127.0.0.{2 + i % 8}", PARTIAL_HEAD) for i in range(24)]
            await _settle()
            seen = samples(metrics)
            assert seen[("kvstrata:http_connections_open", ())] == 10
            assert seen[("kvstrata:http_connections_unauthenticated", ())] == 10
            assert seen[("kvstrata:http_connections_refused_or_closed_total", (("reason", "refused_network"),))] == 14
            reader, writer = await _open(port, "127.0.1.9", GET)
            assert await _status(reader) == b"HTTP/1.1 200 OK"
            for _, w in [*held, (reader, writer)]:
                w.close()
            await _settle()
            assert samples(metrics)[("kvstrata:http_connections_open", ())] == 0
        finally:
            await server.stop()

    asyncio.run(body())


def test_failed_accepts_are_exported_and_the_waiting_client_is_served_after() -> None:
    """The gateway's process out of file descriptors (its soft limit lowered to what it holds,
    real EMFILE): a connecting client's accept fails, ``http_accept_failures_total`` counts it
    (0 before), and once descriptors are free again asyncio's retry accepts the client, which
    is served. Regression: failed accepts were only logged, no series counted them."""
    metrics = GatewayMetrics()
    server = HttpServer(_app())
    metrics.watch_http(lambda: server.guard)
    failures = ("kvstrata:http_accept_failures_total", ())

    async def body() -> None:
        loop = asyncio.get_running_loop()
        port = await server.start("127.0.0.1", 0)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        client = socket.socket()
        client.setblocking(False)
        fillers: list[int] = []
        try:
            assert samples(metrics)[failures] == 0
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 8, hard))
            try:
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
            await loop.sock_connect(client, ("127.0.0.1", port))  # (the kernel's backlog takes it)
            await asyncio.sleep(0.3)
            for fd in fillers:
                os.close(fd)
            fillers.clear()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert samples(metrics)[failures] >= 1
            await loop.sock_sendall(client, GET)
            reply = await asyncio.wait_for(loop.sock_recv(client, 4096), 5)  # (asyncio retries after 1 s)
            assert reply.startswith(b"HTTP/1.1 200 OK")
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            client.close()
            await server.stop()

    asyncio.run(body())


def test_nothing_is_exported_without_an_http_api() -> None:
    metrics = GatewayMetrics()
    metrics.watch_http(lambda: None)
    assert not any(name.startswith("kvstrata:http_") for name, _ in samples(metrics))


def test_every_close_reason_is_exported_from_zero_and_counted_when_it_happens() -> None:
    """Every reason of ``CLOSE_REASONS`` is exported at 0 before it happens (regression: a
    reason's series appeared at 1 with its first event, which ``rate``/``increase`` cannot
    see), and a client that reads nothing (``send_stalled``) and one that pipelines too deep
    (``pipeline_too_deep``) each count once. Real uvicorn server, real sockets."""
    limits = ConnectionLimits(send_stall_timeout_s=0.3, max_pipelined_requests=1)
    metrics = GatewayMetrics()
    server = HttpServer(_send_app(), limits=limits)
    metrics.watch_http(lambda: server.guard)
    ended = "kvstrata:http_connections_refused_or_closed_total"

    async def body() -> None:
        port = await server.start("127.0.0.1", 0)
        try:
            seen = samples(metrics)
            assert {labels[0][1]: v for (name, labels), v in seen.items() if name == ended} == dict.fromkeys(
                CLOSE_REASONS, 0.0)
            unread = await _connect(port, rcvbuf=4096)
            await asyncio.get_running_loop().sock_sendall(unread, BIG)
            flood = await _connect(port)
            await asyncio.get_running_loop().sock_sendall(flood, BIG * 64)
            assert await _until(lambda: samples(metrics)[(ended, (("reason", "send_stalled"),))] == 1, 10)
            seen = samples(metrics)
            assert seen[(ended, (("reason", "pipeline_too_deep"),))] == 1
            assert sum(v for (name, _), v in seen.items() if name == ended) == 2
            unread.close()
            flood.close()
        finally:
            await server.stop()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_streams_ended_unread_are_exported_by_reason() -> None:
    """Regression: the streams the gateway ended because their clients did not read them were
    counted (``NodeStreams.overflows``, ``idle_ends``) but exported nowhere. A real
    ``NodeStreams`` over ZeroMQ: one stream passes ``max_undelivered_bytes`` and is then
    ended idle too; the scrape reads 1 and 1 (0 and 0 before)."""
    metrics = GatewayMetrics()

    async def body() -> None:
        clock = Clock()
        plane = await Plane().start(max_undelivered_bytes=400, stream_idle_timeout_s=10.0, clock=clock)
        await plane.streams.start()
        metrics.watch_streams(lambda: plane.streams)
        name = "kvstrata:streams_ended_unread_total"
        try:
            assert [samples(metrics)[(name, (("reason", r),))] for r in ("undelivered_bytes", "idle")] == [0, 0]
            plane.streams.open("a", None, lambda _message: None)
            plane.streams.bind("a", "n0")
            await plane.send([["a", STARTED], *[["a", delta(10 + i)] for i in range(21)]],
                             lambda: plane.streams.overflows == 1)
            clock.now_s += 10.0
            assert plane.streams.expire_idle() == ["a"]
            assert [samples(metrics)[(name, (("reason", r),))] for r in ("undelivered_bytes", "idle")] == [1, 1]
        finally:
            plane.close()

    asyncio.run(asyncio.wait_for(body(), 30))
