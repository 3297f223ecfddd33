"""services.metrics without Ray: the request tracker against a clock, the spill collector and
the HTTP server over a real SpillNode, and the admission's rejection reasons (issue 20)."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.global_scheduler import GlobalScheduler
from services.global_scheduler_checks import REJECT_REASONS
from services.metrics import GatewayMetrics, MetricsEndpoint, MetricsServer, RequestTracker
from services.metrics.requests import status_of
from services.metrics.targets import role_of
from services.spill_node import SpillNode
from tenants.model import TenantSpec
from tests.test_slo_admission import Clock
from tests.test_spill_store import BLOCK, DISK, FMT, hashes_of, make_blocks


def samples(registry_or_text) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of an exposition (text or registry)."""
    from prometheus_client import generate_latest

    text = registry_or_text if isinstance(registry_or_text, str) else generate_latest(registry_or_text).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def tracked(metrics: GatewayMetrics, clock: Clock, slo_ms: float = 1000.0, floor: float = 4.0) -> RequestTracker:
    spec = SimpleNamespace(name="acme", ttft_slo_ms=slo_ms, min_tokens_per_s=floor)
    track = metrics.track(SimpleNamespace(tenant_id="00000000000000a1", spec=spec))  # a Tenant's fields
    track.clock, track.arrival_s = clock, clock()
    return track


def test_tracker_observes_ttft_itl_e2e_slo_and_floor_at_the_times_events_arrive() -> None:
    metrics, clock = GatewayMetrics(), Clock()
    track = tracked(metrics, clock)
    track.observe({"type": "started", "prompt_tokens": 30})
    clock.t += 0.8  # first token at 0.8 s: meets the 1 s SLO
    track.observe({"type": "delta", "token_ids": [5]})
    for _ in range(3):  # 3 more tokens 0.5 s apart: 2 tokens/s, under the floor of 4
        clock.t += 0.5
        track.observe({"type": "delta", "token_ids": [6]})
    track.observe({"type": "finished", "finish_reason": "length"})
    clock.t += 0.1
    track.finish("OK")
    track.finish("CANCELLED")  # a second end is ignored
    s, t = samples(metrics.registry), (("tenant", "acme"),)
    assert s[("kvstrata:time_to_first_token_seconds_count", t)] == 1
    assert s[("kvstrata:time_to_first_token_seconds_sum", t)] == pytest.approx(0.8)
    assert s[("kvstrata:time_to_first_token_seconds_bucket", (("le", "0.75"), *t))] == 0
    assert s[("kvstrata:time_to_first_token_seconds_bucket", (("le", "1.0"), *t))] == 1
    assert s[("kvstrata:inter_token_latency_seconds_count", t)] == 3
    assert s[("kvstrata:inter_token_latency_seconds_sum", t)] == pytest.approx(1.5)
    assert s[("kvstrata:e2e_request_latency_seconds_sum", t)] == pytest.approx(2.4)
    assert s[("kvstrata:prompt_tokens_total", t)] == 30
    assert s[("kvstrata:generation_tokens_total", t)] == 4
    assert s[("kvstrata:requests_total", (("status", "OK"), *t))] == 1
    assert ("kvstrata:requests_total", (("status", "CANCELLED"), *t)) not in s
    assert s[("kvstrata:request_success_total", (("finished_reason", "length"), *t))] == 1
    assert (s[("kvstrata:ttft_slo_requests_total", t)], s[("kvstrata:ttft_slo_met_total", t)]) == (1, 1)
    assert (s[("kvstrata:token_rate_floor_requests_total", t)], s[("kvstrata:token_rate_floor_met_total", t)]) == (1, 0)
    assert s[("kvstrata:tenant_ttft_slo_seconds", t)] == 1.0
    assert s[("kvstrata:tenant_token_rate_floor", t)] == 4.0


def test_a_refused_request_counts_its_reason_and_status_but_no_latency() -> None:
    metrics, clock = GatewayMetrics(), Clock()
    track = tracked(metrics, clock, slo_ms=100.0)
    track.rejected("queue_full")
    track.finish("RESOURCE_EXHAUSTED")
    s, t = samples(metrics.registry), (("tenant", "acme"),)
    assert s[("kvstrata:admission_rejections_total", (("reason", "queue_full"), *t))] == 1
    assert s[("kvstrata:requests_total", (("status", "RESOURCE_EXHAUSTED"), *t))] == 1
    assert s[("kvstrata:time_to_first_token_seconds_count", t)] == 0  # the tenant's series, at 0
    assert s[("kvstrata:e2e_request_latency_seconds_count", t)] == 0


def test_status_of_names_cancels_aborts_and_internal_errors() -> None:
    class Aborted(Exception):
        code = grpc.StatusCode.INVALID_ARGUMENT

    context = SimpleNamespace(code=lambda: grpc.StatusCode.UNAVAILABLE)
    import asyncio

    assert status_of(asyncio.CancelledError(), context) == "CANCELLED"
    assert status_of(GeneratorExit(), context) == "CANCELLED"
    assert status_of(Aborted(), context) == "INVALID_ARGUMENT"  # the HTTP API's CallAborted
    assert status_of(RuntimeError(), context) == "UNAVAILABLE"  # what context.abort set (gRPC)
    assert status_of(RuntimeError(), SimpleNamespace(code=lambda: None)) == "INTERNAL"


def test_spill_node_serves_its_store_counters_over_http(tmp_path) -> None:
    """A real SpillNode (the actor body) and prometheus_client's server on a free port."""
    node = SpillNode(tmp_path / "spill", FMT, 4 * BLOCK, DISK, node_id="spill_node_0",
                     metrics=MetricsEndpoint("127.0.0.1", 0), demote_low_watermark=0.5)
    try:
        node.put(hashes_of(range(6)), make_blocks(range(6)), "ns")  # 4 LRU blocks go to disk
        node.get(hashes_of([0, 5, 99]))  # disk hit, RAM hit, miss
        host, port = node.metrics_address().rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with urllib.request.urlopen(f"http://{node.metrics_address()}/metrics", timeout=10) as reply:
            s = samples(reply.read().decode())
    finally:
        node.metrics_server.close()
    n = ("node", "spill_node_0")
    assert s[("kvstrata:kv_blocks", (n, ("tier", "spill_disk")))] == 4
    assert s[("kvstrata:kv_blocks", (n, ("tier", "spill_ram")))] == 2
    assert s[("kvstrata:kv_capacity_blocks", (n, ("tier", "spill_ram")))] == 4
    assert s[("kvstrata:spill_hits_total", (n, ("tier", "spill_disk")))] == 1
    assert s[("kvstrata:spill_hits_total", (n, ("tier", "spill_ram")))] == 1
    assert s[("kvstrata:spill_misses_total", (n,))] == 1
    assert s[("kvstrata:spill_read_errors_total", (("kind", "corrupt"), n))] == 0


def test_a_taken_metrics_port_is_an_oserror(tmp_path) -> None:
    from prometheus_client import CollectorRegistry

    first = MetricsServer(CollectorRegistry(), MetricsEndpoint("127.0.0.1", 0))
    try:
        with pytest.raises(OSError):
            MetricsServer(CollectorRegistry(), MetricsEndpoint("127.0.0.1", first.port))
    finally:
        first.close()
    with pytest.raises(ValueError, match="0..65535"):
        MetricsEndpoint("127.0.0.1", 70000)


def test_a_restarted_node_serves_its_metrics_on_its_port_of_before(tmp_path) -> None:
    """Regression (review 23b F4, cache and spill nodes): with the default port 0 a restarted
    node served ``/metrics`` on a new port, and the Prometheus target ``kvstrata up`` wrote went
    stale. A spill node keeps its port in its directory, a cache node's is the scheduler's
    record (``record_metrics_port``); ``serve_again`` binds it again, or any free port while
    it is taken."""
    from prometheus_client import CollectorRegistry

    from services.metrics.server import serve_again

    first = SpillNode(tmp_path / "spill", FMT, 4 * BLOCK, DISK, node_id="spill_node_0",
                      metrics=MetricsEndpoint("127.0.0.1", 0))
    address = first.metrics_address()
    first.metrics_server.close()  # the process died
    first.close()  # a restart: the old process is gone, its lock with it
    again = SpillNode(tmp_path / "spill", FMT, 4 * BLOCK, DISK, node_id="spill_node_0",
                      metrics=MetricsEndpoint("127.0.0.1", 0))
    try:
        assert again.metrics_address() == address  # a new port before
        elsewhere = serve_again(CollectorRegistry(), MetricsEndpoint("127.0.0.1", 0), again.metrics_server.port)
        assert elsewhere.port not in (0, again.metrics_server.port)  # taken: any free port
        elsewhere.close()
    finally:
        again.metrics_server.close()
    sched = GlobalScheduler(str(tmp_path / "state"), {"n0": 4})
    assert sched.metrics_port_of("n0") == 0
    assert sched.record_metrics_port("n0", 9401) and sched.metrics_port_of("n0") == 9401
    assert not sched.record_metrics_port("nX", 9402) and not sched.record_metrics_port("n0", 70000)
    assert sched.metrics_port_of("nX") == 0 and sched.metrics_port_of("n0") == 9401


def test_admission_refusals_carry_their_reason(tmp_path) -> None:
    """The ``reason`` label of ``kvstrata:admission_rejections`` comes from the scheduler."""
    clock = Clock()
    gs = GlobalScheduler(str(tmp_path), {"n0": 1}, queue_limit=1, scheduler="kvstrata", clock=clock)
    tenant, key = gs.register_tenant(TenantSpec("live", "interactive"))
    gs.authenticate(key)
    gs.nodes["n0"].prefill.set(1000.0)
    assert gs.admit(tenant.tenant_id, "a", prompt_tokens=900).reason == ""
    slow = gs.admit(tenant.tenant_id, "b", prompt_tokens=5000)  # 5.9 s > the 1 s SLO's limit
    assert (slow.code, slow.reason) == ("RESOURCE_EXHAUSTED", "ttft_estimate")
    assert gs.admit(tenant.tenant_id, "c", prompt_tokens=10).code == "OK"  # one running, one queued
    full = gs.admit(tenant.tenant_id, "d", prompt_tokens=10)
    assert (full.code, full.reason) == ("RESOURCE_EXHAUSTED", "queue_full")
    gs.node_down("n0", "killed")
    assert gs.admit(tenant.tenant_id, "e").reason == "no_healthy_node"
    assert {slow.reason, full.reason, "no_healthy_node"} <= set(REJECT_REASONS)


def test_file_sd_roles() -> None:
    assert [role_of(n) for n in ("gateway", "cache_node_0", "spill_node_12")] == [
        "gateway", "cache_node", "spill_node"]
