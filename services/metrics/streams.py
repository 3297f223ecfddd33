"""The gateway's streams ended because their clients did not read them, as Prometheus series
read at scrape time (``services.gateway_streams.NodeStreams``' counts).

``streams_ended_unread_total{reason}``: ``undelivered_bytes`` (a stream held more than
``max_undelivered_bytes`` not taken by its client) and ``idle`` (its client took none of its
events for ``stream_idle_timeout_s``). Each such stream ends RESOURCE_EXHAUSTED and its request
is aborted on its node; gRPC and HTTP alike. Both reasons are exported from 0.

``node_event_messages_dropped_total{node}``: a cache node's event messages the gateway dropped
unread because it sent them faster than they are routed (``NodeStreams.behind_drops``, past
``max_queued_bytes_per_node``: ``services.gateway_event_turns``); that node's streams ended
UNAVAILABLE. A node appears once it has a drop ("" without per-node keys: any node).

Regression: these were counted (``NodeStreams.overflows``, ``idle_ends``) but exported nowhere,
so an operator could not tell that clients were being cut for not reading.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX


class UnreadStreamsCollector(Collector):
    """Collects ``streams_of()``'s counts at each scrape (a ``NodeStreams``)."""

    def __init__(self, streams_of: Callable[[], Any]) -> None:
        self.streams_of = streams_of

    def collect(self) -> Iterator[CounterMetricFamily]:
        streams = self.streams_of()
        if streams is None:
            return
        ended = CounterMetricFamily(f"{PREFIX}streams_ended_unread",
                                    "Streams ended RESOURCE_EXHAUSTED (their requests aborted) because their clients "
                                    "did not read them, by reason: undelivered_bytes (past max_undelivered_bytes), "
                                    "idle (nothing taken for stream_idle_timeout_s).", labels=["reason"])
        ended.add_metric(["undelivered_bytes"], streams.overflows)
        ended.add_metric(["idle"], streams.idle_ends)
        yield ended
        dropped = CounterMetricFamily(f"{PREFIX}node_event_messages_dropped",
                                      "Event messages of a cache node dropped unread at this gateway: the node sent "
                                      "them faster than they are routed (its streams ended UNAVAILABLE).",
                                      labels=["node"])
        for node, count in sorted(streams.behind_drops.items(), key=lambda kv: kv[0] or ""):
            dropped.add_metric([node or ""], count)
        yield dropped
