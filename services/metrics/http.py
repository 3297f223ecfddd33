"""The OpenAI-compatible HTTP edge's connection guard as Prometheus series, read at scrape time.

``HttpConnectionsCollector`` exports what ``services.openai_api.connections.ConnectionGuard``
counts: connections open (all, and those without a valid API key yet), and every connection
the edge refused at accept or closed early, by reason. Operators see from these whether the
caps (``http_*`` settings, docs/architecture.md) are refusing real clients or shedding a flood.

Reasons (a fixed set, from the guard's and the protocol's code): ``refused_address``,
``refused_network``, ``refused_total``, ``refused_unauthenticated`` (at accept: a client
network's cap, its wider network's, every slot, the keyless share), ``shed`` (closed for a new
connection), ``handshake_failed``, ``handshake_ended``, ``handshake_timeout``, ``head_timeout``,
``body_timeout``, ``head_too_large``, ``pipeline_too_large``, ``pipeline_too_deep``,
``send_stalled``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX


class HttpConnectionsCollector(Collector):
    """Collects ``guard_of()``'s counts at each scrape; nothing while it returns None (no
    HTTP API, or it stopped)."""

    def __init__(self, guard_of: Callable[[], Any]) -> None:
        self.guard_of = guard_of

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        guard = self.guard_of()
        if guard is None:
            return
        yield GaugeMetricFamily(f"{PREFIX}http_connections_open", "HTTP API connections open now.", guard.open)
        yield GaugeMetricFamily(f"{PREFIX}http_connections_unauthenticated",
                                "Of those, connections that sent no valid API key yet.", len(guard.unauthenticated))
        ended = CounterMetricFamily(f"{PREFIX}http_connections_refused_or_closed",
                                    "HTTP API connections refused at accept or closed early, by reason.",
                                    labels=["reason"])
        for reason, count in sorted(dict(guard.stats).items()):
            ended.add_metric([reason], count)
        yield ended
