"""``/metrics`` serves a bounded number of connections and closes idle and trickling ones
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
    monkeypatch.setattr(metrics_server, "CONNECTION_DEADLINE_S", 0.5)
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


def test_trickling_peers_are_cut_at_their_deadline_and_scrapes_served(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review s34 B F2: the timeout was per read, so ``MAX_CONNECTIONS`` peers each sending a
    header byte more often than it held every slot for ever, and every scrape was refused. Each
    connection has ``CONNECTION_DEADLINE_S`` in all now: the tricklers are cut there (their
    sends then fail) and a scrape is served."""
    monkeypatch.setattr(metrics_server, "CONNECTION_DEADLINE_S", 1.0)
    registry = CollectorRegistry()
    Counter("probe", "A probe.", registry=registry).inc()
    srv = MetricsServer(registry, MetricsEndpoint("127.0.0.1", 0))
    host, port = srv.address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(metrics_server.MAX_CONNECTIONS)]
    cut: set[int] = set()
    try:
        for s in socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        began = time.monotonic()
        while time.monotonic() - began < 2.5:  # one header byte each per 0.1 s: never idle for a read
            for i, s in enumerate(socks):
                if i not in cut:
                    try:
                        s.sendall(b"X")
                    except OSError:  # reset: the server closed it
                        cut.add(i)
            time.sleep(0.1)
        assert "probe_total 1.0" in _scrape(srv.address)  # a slot is free: the tricklers were cut
        for s in socks:  # each was closed by the server (EOF or a reset), none still held
            s.settimeout(2)
            try:
                data = s.recv(1024)
            except ConnectionResetError:
                continue
            assert data == b"", data  # (a socket still held would time out here)
    finally:
        for s in socks:
            s.close()
        srv.close()
