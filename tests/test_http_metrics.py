"""The HTTP edge's connection guard is exported to Prometheus (``services.metrics.http``):
connections open, keyless ones, and every refusal or early close by reason, read from the
guard at scrape time. Regression: the guard counted refusals, sheds and timeouts
(``ConnectionGuard.stats``) but nothing exported them, so an operator could not tell a flood
being shed from real clients being refused. Real uvicorn server, real sockets."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics import GatewayMetrics
from services.openai_api.connections import ConnectionLimits
from services.openai_api.server import HttpServer
from tests.test_openai_api_network_caps import GET, PARTIAL_HEAD, _app, _open, _settle, _status


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


def test_nothing_is_exported_without_an_http_api() -> None:
    metrics = GatewayMetrics()
    metrics.watch_http(lambda: None)
    assert not any(name.startswith("kvstrata:http_") for name, _ in samples(metrics))
