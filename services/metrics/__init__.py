"""Prometheus metrics of the gateway (``requests``), cache nodes (``node``) and spill nodes
(``spill``), each actor with its own registry served over HTTP (``server``).

No ``<name>_created`` series: prometheus_client exports one per counter and histogram child
by default (the time it was made), which doubled the series of every per-tenant metric
(trial 29k: 53 on the gateway) for a value no dashboard here reads."""

import prometheus_client

from services.metrics.node import NodeMetrics
from services.metrics.requests import PREFIX, GatewayMetrics, RequestTracker
from services.metrics.server import MetricsEndpoint, MetricsServer
from services.metrics.spill import SpillMetrics

prometheus_client.disable_created_metrics()

__all__ = ["PREFIX", "GatewayMetrics", "MetricsEndpoint", "MetricsServer", "NodeMetrics", "RequestTracker",
           "SpillMetrics"]
