"""``/metrics`` serves a bounded number of connections and closes idle ones
(``services.metrics.server``)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.metrics import MetricsEndpoint, MetricsServer
from services.metrics import server as metrics_server


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        return reply.read().decode()


def test_idle_half_sent_connections_hold_bounded_threads_and_time_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (security review G): every connection got a thread with no cap and no read
    timeout, so 200 idle half-sent requests held 200 threads of the serving process."""
    monkeypatch.setattr(metrics_server._QuietHandler, "timeout", 0.5)
    registry = CollectorRegistry()
    Counter("probe", "A probe.", registry=registry).inc()
    srv = MetricsServer(registry, MetricsEndpoint("127.0.0.1", 0))
    try:
        assert "probe_total 1.0" in _scrape(srv.address)
        host, port = srv.address.rsplit(":", 1)
        before = threading.active_count()
        socks = []
        for _ in range(60):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # never finished
            socks.append(s)
        time.sleep(0.2)
        assert threading.active_count() <= before + metrics_server.MAX_CONNECTIONS
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert threading.active_count() <= before  # the idle ones were closed
        assert "probe_total 1.0" in _scrape(srv.address)  # and it serves again
        for s in socks:
            s.close()
    finally:
        srv.close()
