"""What the gateway's request metrics count, and so why their counts differ.

New-user report: ``time_to_first_token_seconds``' count differed from ``requests_total`` for
cancelled requests, and the help texts ("Time to first token, s.", "Requests ended, by gRPC
status name.") did not say which requests each counts. By design ``requests_total`` counts
every request past its key check once, when it ends, by status; the TTFT histogram (and
``ttft_slo_requests``) each request that got a token event, whatever its end; the e2e histogram
and ``request_success`` those that ended OK. The help texts now say so; this pins the counts.
"""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.metrics.requests import GatewayMetrics
from tenants.model import Tenant, TenantSpec


def _samples(metrics: GatewayMetrics) -> tuple[dict[tuple[str, tuple], float], dict[str, str]]:
    text = generate_latest(metrics.registry).decode()
    families = list(text_string_to_metric_families(text))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return values, {f.name: f.documentation for f in families}


def test_cancelled_requests_count_in_ttft_only_once_they_had_a_token() -> None:
    """Four requests: finished OK, cancelled before its first token, cancelled after it, and
    refused at admission. ``requests_total`` counts 4 (OK 1, CANCELLED 2, RESOURCE_EXHAUSTED
    1), the TTFT histogram and ``ttft_slo_requests`` 2, the e2e histogram and
    ``request_success`` 1; each help text names what it counts."""
    metrics = GatewayMetrics()
    tenant = Tenant("t-1", TenantSpec("ann"), 0.0)
    token = {"type": "delta", "token_ids": [5], "text": "x"}
    done = metrics.track(tenant)
    for event in ({"type": "started", "prompt_tokens": 3}, token, token, {"type": "finished", "finish_reason": "stop"}):
        done.observe(event)
    done.finish("OK")
    early = metrics.track(tenant)
    early.observe({"type": "started", "prompt_tokens": 3})
    early.finish("CANCELLED")
    late = metrics.track(tenant)
    late.observe({"type": "started", "prompt_tokens": 3})
    late.observe(token)
    late.finish("CANCELLED")
    refused = metrics.track(tenant)
    refused.rejected("queue_full")
    refused.finish("RESOURCE_EXHAUSTED")

    values, docs = _samples(metrics)
    ann = (("tenant", "ann"),)
    requests = {status: values.get(("kvstrata:requests_total", (("status", status), ("tenant", "ann"))), 0)
                for status in ("OK", "CANCELLED", "RESOURCE_EXHAUSTED")}
    assert requests == {"OK": 1, "CANCELLED": 2, "RESOURCE_EXHAUSTED": 1}
    assert values[("kvstrata:time_to_first_token_seconds_count", ann)] == 2
    assert values[("kvstrata:ttft_slo_requests_total", ann)] == 2
    assert values[("kvstrata:e2e_request_latency_seconds_count", ann)] == 1
    assert values[("kvstrata:request_success_total", (("finished_reason", "stop"), ("tenant", "ann")))] == 1
    assert "cancelled after its first token included" in docs["kvstrata:time_to_first_token_seconds"]
    assert "counted once when they end" in docs["kvstrata:requests"]
    assert "ended OK only" in docs["kvstrata:e2e_request_latency_seconds"]
