"""The spill nodes a gateway knows not to serve, as Prometheus series read at scrape time.

``SpillNodesCollector`` exports ``NodeMonitor.spill_down`` (from the global scheduler's
``services.spill_watch``, refreshed at each of the gateway's health polls of it):
``spill_nodes_not_serving``, how many spill nodes do not serve now (0 when all do), and
``spill_node_not_serving{spill_node}``, 1 for each of them (waiting for its directory or its
``/metrics`` port, restarting, dead, not answering). A spill node that does not serve exports
no ``/metrics`` of its own, so these are where an alert on it reads (docs/architecture.md,
'Metrics', 'Failure handling'). ``spill_node_recreations_total{spill_node}``: how often the
scheduler's spill watch created that node again (``services.spill_recreate``) since the
scheduler's process started (a restarted scheduler counts from 0: a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX


class SpillNodesCollector(Collector):
    """Collects ``spill_down_of()`` (spill node name -> why it does not serve) at each scrape."""

    def __init__(self, spill_down_of: Callable[[], dict[str, str]],
                 recreations_of: Callable[[], dict[str, int]] = dict) -> None:
        self.spill_down_of, self.recreations_of = spill_down_of, recreations_of

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        down = self.spill_down_of() or {}
        yield GaugeMetricFamily(f"{PREFIX}spill_nodes_not_serving",
                                "Spill nodes that do not serve now (waiting, restarting, dead, not answering).", len(down))
        each = GaugeMetricFamily(f"{PREFIX}spill_node_not_serving", "1 for each spill node that does not serve now.",
                                 labels=["spill_node"])
        for name in sorted(down):
            each.add_metric([name], 1)
        yield each
        again = CounterMetricFamily(f"{PREFIX}spill_node_recreations", "Times the global scheduler created a spill "
                                    "node dead for good again, since its process started.", labels=["spill_node"])
        for name, count in sorted((self.recreations_of() or {}).items()):
            again.add_metric([name], count)
        yield again
