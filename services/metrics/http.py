"""The OpenAI-compatible HTTP edge's connection guard as Prometheus series, read at scrape time.

``HttpConnectionsCollector`` exports what ``services.openai_api.connections.ConnectionGuard``
counts: connections open (all, and those without a valid API key yet), and every connection
the edge refused at accept or closed early, by reason. Operators see from these whether the
caps (``http_*`` settings, docs/architecture.md) are refusing real clients or shedding a flood.

Reasons (the fixed set ``connections.CLOSE_REASONS``, each exported from 0 so that a rate
sees its first event): ``refused_address``, ``refused_network``, ``refused_total``,
``refused_unauthenticated`` (at accept: a client network's cap, its wider network's, every
slot, the keyless share), ``shed`` (closed for a new connection), ``handshake_failed``,
``handshake_ended``, ``handshake_timeout``, ``head_timeout``, ``body_timeout``,
``head_too_large``, ``pipeline_too_large``, ``pipeline_too_deep``, ``send_stalled`` (its client
fell ``http_send_stall_timeout_s`` behind the minimum read rate). And ``http_accept_failures``:
failed ``accept()`` calls on the listening socket (``connections.AcceptErrorLog``; out of file
descriptors or memory: clients wait in the kernel's backlog meanwhile).

Regression: a reason was exported only once it had been counted, so its series appeared at 1
and ``rate``/``increase`` missed its first event (a single ``send_stalled`` read as none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX
from services.openai_api.connections import CLOSE_REASONS


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
        stats = dict(guard.stats)
        for reason in CLOSE_REASONS:
            ended.add_metric([reason], stats.pop(reason, 0))
        for reason, count in sorted(stats.items()):  # (none: every reason is listed)
            ended.add_metric([reason], count)
        yield ended
        yield CounterMetricFamily(f"{PREFIX}http_accept_failures", "Failed accept() calls on the HTTP API's listening "
                                  "socket (EMFILE, ENFILE, ENOBUFS, ENOMEM: the gateway is out of file descriptors or "
                                  "memory; asyncio retries each second).", getattr(guard, "accept_failures", 0))
