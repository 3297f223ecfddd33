"""Request-path metrics, observed where every request passes: the gateway.

``GatewayMetrics`` owns the gateway's registry; ``track(tenant)`` gives one request's
``RequestTracker``, fed the request's node events in order (``observe``) and told how it ended
(``finish``), by the gRPC ``Generate`` and by any other front end (the OpenAI-compatible HTTP
API) in the same way. Names and histogram buckets follow vLLM's
(``vllm/v1/metrics/loggers.py``: ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds``, ``prompt_tokens``,
``generation_tokens``, ``request_success``) under the ``kvstrata:`` prefix, with a ``tenant``
label (the tenant's name).

Definitions (what each series counts; the counts differ by design):

- requests: every request past its key check, counted once when it ends, by gRPC status
  name: OK (its node's ``finished`` event came, whatever the finish reason), CANCELLED (its
  client went away, before or after its first token), or the refusal's or failure's code.
  An HTTP completion the edge refuses before the gateway's path (``refused_at_edge``: a bad
  body, model or size, a body budget) counts too, with the status the gRPC API gives the same
  refusal, and one whose key check failed under tenant ``""`` (UNAUTHENTICATED; gRPC calls
  refused for their key by the call gate are not counted).
- TTFT: gateway arrival (``track``) to the first generated token's event at the gateway, s;
  observed once per request that got a token event, whatever its end: a request cancelled or
  refused before its first token is in ``requests`` but not here, one cancelled after it is
  in both. So the TTFT count (and ``ttft_slo_requests``) is at most ``requests`` summed over
  status and may exceed ``requests{status="OK"}``.
- inter-token latency: the gap between two successive token events of a request (one per
  engine step, as vLLM observes one per iteration), s.
- e2e latency: arrival to the ``finished`` event, s: requests that ended OK only, as
  ``request_success`` counts them.
- TTFT SLO attainment: ``ttft_slo_met_total / ttft_slo_requests_total`` over the requests
  that produced a first token, each against its tenant's ``ttft_slo_ms``.
- floor attainment: ``token_rate_floor_met_total / token_rate_floor_requests_total`` over
  finished requests with >= 2 tokens whose tenant has a floor (``min_tokens_per_s`` > 0): met
  when the request's decode rate, ``(tokens - 1) / (last token - first token)``, reaches it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from services.metrics.http import HttpConnectionsCollector
    from services.metrics.streams import UnreadStreamsCollector

PREFIX = "kvstrata:"

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's ``time_to_first_token_seconds`` buckets."""
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
"""vLLM's ``inter_token_latency_seconds`` buckets."""
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's request latency buckets (``e2e_request_latency_seconds``)."""


class GatewayMetrics:
    """The gateway's metrics, in its own ``registry``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg, t = self.registry, ["tenant"]
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Gateway arrival to the first token event, s; one observation per request that got a "
                              "token, whatever its end (cancelled after its first token included; cancelled or "
                              "refused before it not), so its count is at most requests_total summed over status.",
                              t, buckets=TTFT_BUCKETS_S, registry=reg)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Time between successive token events of a request (TPOT), s.", t,
                             buckets=ITL_BUCKETS_S, registry=reg)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Gateway arrival to the finished event, s; requests that ended OK only.", t,
                             buckets=E2E_BUCKETS_S, registry=reg)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of started requests.", t, registry=reg)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens.", t, registry=reg)
        self.requests = Counter(f"{PREFIX}requests",
                                "Requests past their key check, counted once when they end, by gRPC status name "
                                "(OK: finished on the node, any finish reason; CANCELLED: the client went away, "
                                "before or after its first token; else the refusal's or failure's code), HTTP "
                                "refusals at the edge included (a failed key check: tenant \"\").",
                                ["tenant", "status"], registry=reg)
        self.success = Counter(f"{PREFIX}request_success", "Requests that ended OK, by finish reason.",
                               ["tenant", "finished_reason"], registry=reg)
        self.rejections = Counter(f"{PREFIX}admission_rejections", "Requests the admission refused, by reason.",
                                  ["tenant", "reason"], registry=reg)
        self.slo_requests = Counter(f"{PREFIX}ttft_slo_requests",
                                    "Requests with a first token (the time_to_first_token_seconds count).", t,
                                    registry=reg)
        self.slo_met = Counter(f"{PREFIX}ttft_slo_met", "Requests whose TTFT met the tenant's SLO.", t, registry=reg)
        self.floor_requests = Counter(f"{PREFIX}token_rate_floor_requests",
                                      "Finished requests (>= 2 tokens) of tenants with a token-rate floor.",
                                      t, registry=reg)
        self.floor_met = Counter(f"{PREFIX}token_rate_floor_met", "Of those, requests that decoded at the floor.",
                                 t, registry=reg)
        self.ttft_slo_s = Gauge(f"{PREFIX}tenant_ttft_slo_seconds", "The tenant's TTFT SLO, s.", t, registry=reg)
        self.floor_tokens_per_s = Gauge(f"{PREFIX}tenant_token_rate_floor", "The tenant's token-rate floor, "
                                        "tokens/s (0: none).", t, registry=reg)
        self._series: dict[str, SimpleNamespace] = {}  # tenant name -> its TENANT_SERIES children
        self._forgotten_ids: OrderedDict[str, None] = OrderedDict()  # the newest FORGOTTEN_IDS_KEPT
        self._http: HttpConnectionsCollector | None = None  # ``watch_http``
        self._streams: UnreadStreamsCollector | None = None  # ``watch_streams``
        self._spill: Any = None  # ``watch_spill``: a ``SpillNodesCollector``

    def watch_http(self, guard_of: Callable[[], Any]) -> None:
        """Export the HTTP API's connection guard (``guard_of()``, None while it serves none)
        at each scrape (``services.metrics.http``); a later call replaces the earlier source."""
        if self._http is None:
            # (a local import: services.metrics.http imports PREFIX from here)
            from services.metrics.http import HttpConnectionsCollector

            self._http = HttpConnectionsCollector(guard_of)
            self.registry.register(self._http)
        self._http.guard_of = guard_of

    def watch_streams(self, streams_of: Callable[[], Any]) -> None:
        """Export the streams ended unread by ``streams_of()`` (a ``NodeStreams``) at each
        scrape (``services.metrics.streams``); a later call replaces the earlier source."""
        if self._streams is None:
            from services.metrics.streams import UnreadStreamsCollector

            self._streams = UnreadStreamsCollector(streams_of)
            self.registry.register(self._streams)
        self._streams.streams_of = streams_of

    def watch_spill(self, spill_down_of: Callable[[], dict[str, str]],
                    recreations_of: Callable[[], dict[str, int]] | None = None) -> None:
        """Export the spill nodes that do not serve (``spill_down_of()``: ``NodeMonitor.spill_down``)
        and how often each was created again (``recreations_of()``: ``NodeMonitor.spill_recreations``)
        at each scrape (``services.metrics.spill_nodes``); a later call replaces the earlier sources."""
        if self._spill is None:
            # (a local import: services.metrics.spill_nodes imports PREFIX from here)
            from services.metrics.spill_nodes import SpillNodesCollector

            self._spill = SpillNodesCollector(spill_down_of)
            self.registry.register(self._spill)
        self._spill.spill_down_of = spill_down_of
        self._spill.recreations_of = recreations_of or dict

    def refused_at_edge(self, tenant: Any | None, status: str) -> None:
        """A request the HTTP edge refused before it reached the gateway's request path (whose
        ``track`` counts every other), counted once in ``requests`` with the gRPC status name
        the gRPC API gives the same refusal: ``tenant``'s (a ``tenants.model.Tenant``), or, when
        its key check failed or was never reached (None), tenant ``""``."""
        if tenant is None:
            self.requests.labels("", status).inc()
        else:
            self.track(tenant).finish(status)

    def track(self, tenant: Any) -> RequestTracker:
        """A tracker for one request of ``tenant`` (a ``tenants.model.Tenant``) arriving now;
        one that records nothing when ``forget_tenant`` forgot that tenant (its id)."""
        spec = tenant.spec
        if tenant.tenant_id in self._forgotten_ids:
            return RequestTracker(self, _FORGOTTEN, spec.name, spec.ttft_slo_ms / 1000.0, spec.min_tokens_per_s)
        series = self._series.get(spec.name)
        if series is None:  # the tenant's children, resolved once (``labels`` takes a lock)
            series = self._series[spec.name] = SimpleNamespace(tenant_id=tenant.tenant_id, forgotten=False, **{
                name: getattr(self, name).labels(spec.name) for name in TENANT_SERIES})
        series.ttft_slo_s.set(spec.ttft_slo_ms / 1000.0)  # the tenant's current targets
        series.floor_tokens_per_s.set(spec.min_tokens_per_s)
        return RequestTracker(self, series, spec.name, spec.ttft_slo_ms / 1000.0, spec.min_tokens_per_s)

    def forget_tenant(self, name: str, tenant_id: str = "") -> None:
        """Stop exporting tenant ``name`` (deleted): every child of every metric labelled with
        it (each ``status``, ``reason`` and ``finished_reason`` too) goes, and so does its
        ``_series`` entry.

        Its requests still in flight record nothing from now on (their trackers' series is
        marked forgotten; ``finish`` and ``rejected`` create no child), nor does a request of
        that tenant tracked later: its id (``tenant_id``, and the id its series was made for)
        is remembered, the newest ``FORGOTTEN_IDS_KEPT`` of them, so the series stay gone.
        That bound is the documented limit: a request of a deleted tenant tracked after that
        many later deletions would export its series again (the scheduler refuses such a
        request at admission, so none lives that long). A new tenant of the same name (a new
        id) gets new series.

        Regression (security review 23d, F): no series was ever removed, so a deleted
        tenant's name, request counts and latencies were exported until the gateway
        restarted, and the series grew with every tenant ever served."""
        series = self._series.pop(name, None)
        for forgotten in {tenant_id, getattr(series, "tenant_id", "")} - {""}:
            self._forgotten_ids[forgotten] = None
            self._forgotten_ids.move_to_end(forgotten)
        while len(self._forgotten_ids) > FORGOTTEN_IDS_KEPT:
            self._forgotten_ids.popitem(last=False)
        if series is not None:
            series.forgotten = True
        for metric in TENANT_SERIES + TENANT_LABELLED:
            getattr(self, metric).remove_by_labels({"tenant": name})


TENANT_SERIES = ("ttft", "itl", "e2e", "prompt_tokens", "generation_tokens", "slo_requests", "slo_met",
                 "floor_requests", "floor_met", "ttft_slo_s", "floor_tokens_per_s")
"""``GatewayMetrics`` attributes labelled by tenant alone (attainment counters start at 0)."""
TENANT_LABELLED = ("requests", "success", "rejections")
"""``GatewayMetrics`` attributes labelled by tenant and one more label (a child per value)."""
FORGOTTEN_IDS_KEPT = 4096
"""Ids of forgotten (deleted) tenants ``GatewayMetrics`` remembers, the newest."""


class _Nowhere:
    """A metric child that records nothing."""

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


_FORGOTTEN = SimpleNamespace(tenant_id="", forgotten=True, **{name: _Nowhere() for name in TENANT_SERIES})
"""The series of a forgotten tenant's request tracked after ``forget_tenant``."""


class RequestTracker:
    """One request's observations; ``finish`` once, when it has ended. ``series``: its
    tenant's children of the ``TENANT_SERIES`` metrics (``series.forgotten``: the tenant was
    forgotten, nothing more is recorded for it)."""

    def __init__(self, metrics: GatewayMetrics, series: Any, tenant: str, ttft_slo_s: float,
                 floor_tokens_per_s: float, clock: Any = time.monotonic) -> None:
        self.m, self.s, self.tenant, self.clock = metrics, series, tenant, clock
        self.ttft_slo_s, self.floor_tokens_per_s = ttft_slo_s, floor_tokens_per_s
        self.arrival_s = clock()
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.num_tokens = 0
        self.finished_reason = ""
        self.done = False

    def observe(self, event: dict[str, Any]) -> None:
        """A node event of this request (``started``, ``delta``, ``finished``), as it arrives."""
        kind = event["type"]
        if kind == "delta":
            if event["token_ids"]:
                self._tokens(len(event["token_ids"]))
        elif kind == "started":
            self.s.prompt_tokens.inc(int(event["prompt_tokens"]))
        elif kind == "finished":
            self.finished_reason = str(event["finish_reason"])

    def _tokens(self, n: int) -> None:
        now = self.clock()
        if self.first_token_s is None:
            self.first_token_s = now
            ttft_s = now - self.arrival_s
            self.s.ttft.observe(ttft_s)
            self.s.slo_requests.inc()
            if ttft_s <= self.ttft_slo_s:
                self.s.slo_met.inc()
        else:
            self.s.itl.observe(now - self.last_token_s)
        self.last_token_s = now
        self.num_tokens += n
        self.s.generation_tokens.inc(n)

    def rejected(self, reason: str) -> None:
        """The admission refused it (``Admission.reason``); ``finish`` still follows."""
        if not self.s.forgotten:
            self.m.rejections.labels(self.tenant, reason or "unknown").inc()

    def finish(self, status: str) -> None:
        """It ended with gRPC status name ``status`` ("OK" once its ``finished`` event came);
        later calls are no-ops."""
        if self.done:
            return
        self.done = True
        if self.s.forgotten:  # a forgotten tenant's children are not made again
            return
        self.m.requests.labels(self.tenant, status).inc()
        if status != "OK" or not self.finished_reason:
            return
        self.m.success.labels(self.tenant, self.finished_reason).inc()
        self.s.e2e.observe(self.clock() - self.arrival_s)
        if self.floor_tokens_per_s > 0 and self.num_tokens >= 2 and self.first_token_s is not None:
            self.s.floor_requests.inc()
            decode_s = self.last_token_s - self.first_token_s
            if decode_s <= 0 or (self.num_tokens - 1) / decode_s >= self.floor_tokens_per_s:
                self.s.floor_met.inc()


def status_of(exc: BaseException, context: Any) -> str:
    """The gRPC status name a request ended with when ``exc`` ended it: "CANCELLED" for a
    cancelled call or a consumer that stopped reading; the code ``context.abort`` set (a gRPC
    ``ServicerContext``, or an exception carrying ``code`` as the HTTP API's does); else
    "INTERNAL"."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    code = getattr(exc, "code", None)
    if not isinstance(code, grpc.StatusCode) and callable(getattr(context, "code", None)):
        code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "INTERNAL"
