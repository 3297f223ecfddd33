"""Serving one actor's metrics: ``/metrics`` over HTTP with prometheus_client's own server.

Every kvstrata process (the gateway, each cache node, each spill node) keeps its own
``CollectorRegistry`` (never the library's global one, which a second actor in the same worker
process would share) and serves it with ``prometheus_client.start_http_server`` on a daemon
thread. Port 0 asks the OS for a free port; the bound address goes back to the launcher, which
``kvstrata up`` prints and the admin ``Stats`` JSON carries (``metrics_address``).
"""

from __future__ import annotations

from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry

ALL_INTERFACES = ("0.0.0.0", "::", "")
NODE_IP = "node_ip"
"""``MetricsEndpoint.host`` meaning the IP of the Ray node the actor runs on (a cluster)."""


@dataclass(frozen=True)
class MetricsEndpoint:
    """Where an actor serves ``/metrics``: ``host`` to bind (an address, or ``NODE_IP``: the
    actor's Ray node IP, for a Prometheus on another machine of the cluster), ``port`` (0: any
    free port)."""

    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {self.port}")


class MetricsServer:
    """``/metrics`` of one registry, served until ``close``.

    Raises:
        OSError: ``endpoint`` cannot be bound (its port is taken).
    """

    def __init__(self, registry: CollectorRegistry, endpoint: MetricsEndpoint) -> None:
        self._httpd: WSGIServer
        host = _node_ip() if endpoint.host == NODE_IP else endpoint.host
        self._httpd, _ = prometheus_client.start_http_server(endpoint.port, addr=host, registry=registry)
        self.port: int = self._httpd.server_port
        self.address = f"{_node_ip() if host in ALL_INTERFACES else host}:{self.port}"
        """``host:port`` a scraper reaches it at (this node's IP when bound to every interface)."""

    def close(self) -> None:
        """Stop serving and free the port."""
        self._httpd.shutdown()
        self._httpd.server_close()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
