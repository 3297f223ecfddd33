"""Prometheus metrics of the gateway (``requests``), cache nodes (``node``) and spill nodes
(``spill``), each actor with its own registry served over HTTP (``server``)."""

from services.metrics.node import NodeMetrics
from services.metrics.requests import PREFIX, GatewayMetrics, RequestTracker
from services.metrics.server import MetricsEndpoint, MetricsServer
from services.metrics.spill import SpillMetrics

__all__ = ["PREFIX", "GatewayMetrics", "MetricsEndpoint", "MetricsServer", "NodeMetrics", "RequestTracker",
           "SpillMetrics"]
