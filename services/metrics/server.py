"""Serving one actor's metrics: ``/metrics`` over HTTP with prometheus_client's own server.

Every kvstrata process (the gateway, each cache node, each spill node) keeps its own
``CollectorRegistry`` (never the library's global one, which a second actor in the same worker
process would share) and serves it with prometheus_client's WSGI app (``make_wsgi_app``) on a
daemon thread. Port 0 asks the OS for a free port; the bound address goes back to the launcher,
which ``kvstrata up`` prints and the admin ``Stats`` JSON carries (``metrics_address``).

The server is bounded: at most ``MAX_CONNECTIONS`` connections are served at once (one thread
each; a connection past that is closed at once), and each connection has ``CONNECTION_DEADLINE_S``
in all to send its request and take the reply (every read and write waits at most what is left
of it), then it is closed. Regression (security review G): ``start_http_server`` gave every
connection its own thread with no cap and no read timeout, so idle half-sent requests grew the
threads of the process (200 connections, 200 threads) of a cache node, gateway or spill node.
Regression (review s34 B F2): the timeout was per read, so 16 peers sending a header byte every
few seconds held every slot for ever and no scrape was served.

A scrape costs the server O(1): the registry is rendered at most once per
``MetricsEndpoint.render_interval_s`` (config ``metrics_render_interval_s``), one render at a
time, and every scrape in between gets the cached bytes (``services.metrics.exposition``).
"""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry

from services.metrics.exposition import DEFAULT_RENDER_INTERVAL_S, CachedExposition

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
"""Connections ``/metrics`` serves at once (a scraper needs one or two)."""
CONNECTION_DEADLINE_S = 10.0
"""A connection's whole life: its request read and its reply written within it (Prometheus'
default scrape timeout); past it the connection is closed."""

ALL_INTERFACES = ("0.0.0.0", "::", "")
NODE_IP = "node_ip"
"""``MetricsEndpoint.host`` meaning the IP of the Ray node the actor runs on (a cluster)."""


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where an actor serves ``/metrics``: ``host`` to bind (an address, or ``NODE_IP``: the
    actor's Ray node IP, for a Prometheus on another machine of the cluster), ``port`` (0: any
    free port), ``render_interval_s`` (how long one render of the registry is served)."""

    host: str = "127.0.0.1"
    port: int = 0
    render_interval_s: float = DEFAULT_RENDER_INTERVAL_S

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {self.port}")
        if not self.render_interval_s > 0:
            raise ValueError(f"metrics render interval must be > 0 s, got {self.render_interval_s}")


class MetricsServer:
    """``/metrics`` of one registry, served until ``close``.

    Raises:
        OSError: ``endpoint`` cannot be bound (its port is taken).
    """

    def __init__(self, registry: CollectorRegistry, endpoint: MetricsEndpoint) -> None:
        host = _node_ip() if endpoint.host == NODE_IP else endpoint.host
        family, _, _, _, sockaddr = socket.getaddrinfo(host, endpoint.port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsHTTPServer", (_BoundedServer,), {"address_family": family})
        self.exposition = CachedExposition(registry, endpoint.render_interval_s)
        self._httpd: WSGIServer = make_server(sockaddr[0], endpoint.port, self.exposition.wsgi_app(),
                                              server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True).start()
        self.port: int = self._httpd.server_port
        self.address = f"{_node_ip() if host in ALL_INTERFACES else host}:{self.port}"
        """``host:port`` a scraper reaches it at (this node's IP when bound to every interface)."""

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_again(registry: CollectorRegistry, endpoint: MetricsEndpoint, previous_port: int = 0) -> MetricsServer:
    """A ``MetricsServer`` at ``endpoint``; with port 0 and the port a restarted actor served on
    before (``previous_port``), that port again while it is free (else any free port, logged),
    so the Prometheus targets ``kvstrata up`` wrote stay good across the actor's restarts.

    Regression (review 23b F4, cache and spill nodes): with the default port 0 a restarted node
    served ``/metrics`` on a new port and its target went stale, just when its metrics mattered.
    """
    if endpoint.port == 0 and 0 < previous_port <= 65535:
        try:
            return MetricsServer(registry, replace(endpoint, port=previous_port))
        except OSError as exc:
            log.warning("metrics: port %d of this actor's last start is taken (%s); serving on a new one",
                        previous_port, exc)
    return MetricsServer(registry, endpoint)


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``MAX_CONNECTIONS`` at once; past that a connection
    is closed without a thread."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client's timeout or reset is its own; no traceback per connection on stderr."""


class _QuietHandler(WSGIRequestHandler):
    """No access log; every read and write of the connection waits at most what is left of its
    ``CONNECTION_DEADLINE_S`` (``_Deadline``)."""

    timeout = CONNECTION_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        deadline = _Deadline(self.connection, time.monotonic() + CONNECTION_DEADLINE_S)
        self.rfile = io.BufferedReader(deadline)
        self.wfile = deadline

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Deadline(io.RawIOBase):
    """The connection's socket as a raw stream whose every ``recv`` and ``sendall`` waits at most
    until ``deadline`` (``time.monotonic``); past it, TimeoutError (the handler ends, the
    connection is closed)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the connection's {CONNECTION_DEADLINE_S:g} s passed")
        self.sock.settimeout(left)
        return left

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._left()
        return self.sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        self._left()
        self.sock.sendall(data)  # (its timeout bounds the whole call)
        return len(memoryview(data))


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
