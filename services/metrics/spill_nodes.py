"""The spill nodes a gateway knows not to serve, as Prometheus series read at scrape time.

``SpillNodesCollector`` exports ``NodeMonitor.spill_down`` (from the global scheduler's
``services.spill_watch``, refreshed at each of the gateway's health polls of it):
``spill_nodes_not_serving``, how many spill nodes do not serve now (0 when all do), and
``spill_node_not_serving{spill_node}``, 1 for each of them (waiting for its directory or its
``/metrics`` port, restarting, dead, not answering). A spill node that does not serve exports
no ``/metrics`` of its own, so these are where an alert on it reads (docs/architecture.md,
'Metrics', 'Failure handling').
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX


class SpillNodesCollector(Collector):
    """Collects ``spill_down_of()`` (spill node name -> why it does not serve) at each scrape."""

    def __init__(self, spill_down_of: Callable[[], dict[str, str]]) -> None:
        self.spill_down_of = spill_down_of

    def collect(self) -> Iterator[GaugeMetricFamily]:
        down = self.spill_down_of() or {}
        yield GaugeMetricFamily(f"{PREFIX}spill_nodes_not_serving",
                                "Spill nodes that do not serve now (waiting, restarting, dead, not answering).", len(down))
        each = GaugeMetricFamily(f"{PREFIX}spill_node_not_serving", "1 for each spill node that does not serve now.",
                                 labels=["spill_node"])
        for name in sorted(down):
            each.add_metric([name], 1)
        yield each
