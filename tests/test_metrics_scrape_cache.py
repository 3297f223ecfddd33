"""``/metrics`` renders its registry at most once per interval, one render at a time, and
serves those bytes to every scrape in it (``services.metrics.exposition``).

Regression (security review 23d, I): every scrape rendered the whole registry anew on the
actor's own threads, 16 at once, so an unauthenticated client scraping in a loop starved the
gateway's serving loop (or a cache node's step thread)."""

from __future__ import annotations

import gzip
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from services.config import ServiceConfig
from services.launcher import metrics_endpoint
from services.metrics import MetricsEndpoint, MetricsServer
from services.metrics.exposition import CachedExposition

PROMETHEUS_3_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
                       "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
                       "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
"""What a Prometheus 3 server sends by default."""


class _RenderCount:
    """A collector counting the registry's renders (each render collects every collector once)."""

    def __init__(self) -> None:
        self.renders = 0

    def collect(self) -> list:
        self.renders += 1
        return []


def _registry() -> tuple[CollectorRegistry, Counter, _RenderCount]:
    registry, count = CollectorRegistry(), _RenderCount()
    requests = Counter("probe_requests", "Requests.", ["tenant", "status"], registry=registry)
    latency = Histogram("probe_latency_seconds", "Latency, s.", ["tenant"], registry=registry)
    for i in range(50):
        requests.labels(f"t{i}", "OK").inc(i)
        latency.labels(f"t{i}").observe(0.01 * i)
    registry.register(count)
    return registry, requests, count


def _get(address: str, headers: dict[str, str] | None = None) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(f"http://{address}/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return dict(reply.headers.items()), reply.read()


def _scrape_concurrently(address: str, headers_of_client: list[dict[str, str]], scrapes_each: int) -> list:
    """Every client on its own thread, all starting together; (headers, body) of each scrape."""
    start, replies, lock = threading.Barrier(len(headers_of_client)), [], threading.Lock()

    def client(headers: dict[str, str]) -> None:
        start.wait()
        for _ in range(scrapes_each):
            reply = _get(address, headers)
            with lock:
                replies.append(reply)

    threads = [threading.Thread(target=client, args=(h,)) for h in headers_of_client]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return replies


def test_sixteen_concurrent_scrapers_cause_one_render_per_interval() -> None:
    """16 clients (half asking gzip) scrape 4 times each within one interval: one render, and
    every body (the gzip ones decompressed) is the same valid exposition."""
    registry, _, count = _registry()
    srv = MetricsServer(registry, MetricsEndpoint("127.0.0.1", 0, render_interval_s=60.0))
    try:
        clients = [{"Accept-Encoding": "gzip"} if i % 2 else {} for i in range(16)]
        replies = _scrape_concurrently(srv.address, clients, scrapes_each=4)
    finally:
        srv.close()
    assert len(replies) == 64
    assert count.renders == 1
    assert srv.exposition.renders == 1
    bodies = set()
    for headers, body in replies:
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        bodies.add(gzip.decompress(body) if headers.get("Content-Encoding") == "gzip" else body)
    assert len(bodies) == 1
    families = {f.name: f for f in text_string_to_metric_families(bodies.pop().decode())}
    samples = {(s.labels["tenant"], s.labels["status"]): s.value for s in families["probe_requests"].samples
               if s.name == "probe_requests_total"}
    assert samples == {(f"t{i}", "OK"): float(i) for i in range(50)}


def test_a_scrape_after_the_interval_renders_again() -> None:
    """Within an interval a scrape gets the cached bytes (an increment is not yet seen); the
    first scrape after it renders again and sees it."""
    registry, requests, count = _registry()
    now = [100.0]
    exposition = CachedExposition(registry, interval_s=1.0, clock=lambda: now[0])
    _, first = exposition.reply(None, None)
    requests.labels("t1", "OK").inc(5)
    now[0] = 100.99
    assert exposition.reply(None, None)[1] == first
    headers, zipped = exposition.reply(None, "gzip, deflate")
    assert ("Content-Encoding", "gzip") in headers and gzip.decompress(zipped) == first
    assert count.renders == 1
    now[0] = 101.0
    _, second = exposition.reply(None, None)
    assert count.renders == 2
    assert 'probe_requests_total{status="OK",tenant="t1"} 6.0' in second.decode()


def test_openmetrics_is_negotiated_and_odd_versions_add_no_render() -> None:
    """A Prometheus 3 ``Accept`` gets OpenMetrics (parsed by prometheus_client's OpenMetrics
    parser); 16 clients each naming another OpenMetrics version get the one cached 0.0.4 text
    body: no header a client picks adds a render."""
    registry, _, count = _registry()
    srv = MetricsServer(registry, MetricsEndpoint("127.0.0.1", 0, render_interval_s=60.0))
    try:
        headers, body = _get(srv.address, {"Accept": PROMETHEUS_3_ACCEPT})
        odd = [{"Accept": f"application/openmetrics-text; version=1.0.{i + 1}"} for i in range(16)]
        replies = _scrape_concurrently(srv.address, odd, scrapes_each=2)
        _, again = _get(srv.address, {"Accept": PROMETHEUS_3_ACCEPT})
    finally:
        srv.close()
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n") and again == body
    names = {f.name for f in parse_openmetrics(body.decode())}
    assert {"probe_requests", "probe_latency_seconds"} <= names
    assert {h["Content-Type"] for h, _ in replies} == {"text/plain; version=0.0.4; charset=utf-8"}
    assert count.renders == 2  # one OpenMetrics body, one text body


def test_other_methods_render_nothing() -> None:
    registry, _, count = _registry()
    srv = MetricsServer(registry, MetricsEndpoint("127.0.0.1", 0))
    try:
        request = urllib.request.Request(f"http://{srv.address}/metrics", data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405
    finally:
        srv.close()
    assert count.renders == 0


def test_the_interval_is_configured_with_the_other_metrics_settings() -> None:
    config = ServiceConfig(metrics_render_interval_s=2.5)
    endpoint = metrics_endpoint(config, 9400)
    assert endpoint == MetricsEndpoint("127.0.0.1", 9400, render_interval_s=2.5)
    with pytest.raises(ValueError, match="render interval"):
        MetricsEndpoint("127.0.0.1", 0, render_interval_s=0.0)
    with pytest.raises(ValueError):
        ServiceConfig(metrics_render_interval_s=0)
