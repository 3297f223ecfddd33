"""Prometheus metrics on the real stack (issue 20): scrape ``/metrics`` of the gateway, both
cache nodes and the spill node after traffic, parse it with ``prometheus_client.parser``, and
check every metric is there and the counters and histogram counts match the requests sent;
the deploy scrape config and Grafana dashboard name only exported metrics."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.v1 import admin_pb2
from services.metrics.targets import TARGETS_FILE, write_targets
from tests.service_fixtures import Stack, chat

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
NODES = ("cache_node_0", "cache_node_1")

GATEWAY_FAMILIES = {  # family -> kind, as prometheus_client.parser names them
    "kvstrata:time_to_first_token_seconds": "histogram", "kvstrata:inter_token_latency_seconds": "histogram",
    "kvstrata:e2e_request_latency_seconds": "histogram", "kvstrata:prompt_tokens": "counter",
    "kvstrata:generation_tokens": "counter", "kvstrata:requests": "counter", "kvstrata:request_success": "counter",
    "kvstrata:admission_rejections": "counter", "kvstrata:ttft_slo_requests": "counter",
    "kvstrata:ttft_slo_met": "counter", "kvstrata:token_rate_floor_requests": "counter",
    "kvstrata:token_rate_floor_met": "counter", "kvstrata:tenant_ttft_slo_seconds": "gauge",
    "kvstrata:tenant_token_rate_floor": "gauge", "kvstrata:http_connections_open": "gauge",
    "kvstrata:http_connections_unauthenticated": "gauge", "kvstrata:http_connections_refused_or_closed": "counter",
    "kvstrata:streams_ended_unread": "counter",
}
NODE_FAMILIES = {
    "kvstrata:num_requests_running": "gauge", "kvstrata:num_requests_waiting": "gauge",
    "kvstrata:kv_cache_usage_perc": "gauge", "kvstrata:num_sessions": "gauge", "kvstrata:kv_blocks": "gauge",
    "kvstrata:kv_capacity_blocks": "gauge", "kvstrata:prefix_cache_queries": "counter",
    "kvstrata:prefix_cache_hits": "counter", "kvstrata:cached_tokens": "counter",
    "kvstrata:num_preemptions": "counter", "kvstrata:spill_read_errors": "counter",
    "kvstrata:num_requests_failed": "counter",
    "kvstrata:compressed_prefix_hits": "counter", "kvstrata:compressed_prefix_stores": "counter",
    "kvstrata:compressed_prefixes": "gauge", "kvstrata:compressed_prefix_lossy_skipped": "counter",
    "kvstrata:session_policy_continuations": "counter",
    "kvstrata:session_policy_fallbacks": "counter", "kvstrata:compactions_deferred": "counter",
    "kvstrata:session_states_dropped": "counter",
    "kvstrata:compaction_released_hashes": "counter",
    **{f"kvstrata:{name}": "histogram" for name in (
        "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
        "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
        "grammar_compile_seconds")},
    **{f"kvstrata:{name}": "counter" for name in (
        "grammar_compiles", "grammar_cache_queries", "grammar_cache_hits", "grammar_requests_refused")},
    **{f"kvstrata:{name}": "gauge" for name in (
        "grammar_compiles_queued", "grammar_compiles_running", "grammar_compiler_processes",
        "grammar_cache_entries", "grammar_cache_bytes", "grammar_failed_specs")},
    **{f"kvstrata:kv_{move}_{unit}": "counter" for move in ("demoted", "promoted", "prefetched", "spilled")
       for unit in ("blocks", "bytes")},
}
SPILL_FAMILIES = {
    "kvstrata:kv_blocks": "gauge", "kvstrata:kv_capacity_blocks": "gauge", "kvstrata:spill_hits": "counter",
    "kvstrata:spill_misses": "counter", "kvstrata:spill_read_errors": "counter",
    "kvstrata:spill_bytes_used": "gauge",
}


def scrape(address: str) -> dict:
    """Family name -> family of ``http://address/metrics``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return {f.name: f for f in text_string_to_metric_families(reply.read().decode())}


def value(families: dict, sample: str, **labels: str) -> float:
    """Sum of the samples named ``sample`` whose labels include ``labels`` (0 when none)."""
    family = families.get(sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum"))
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def nodes_value(stack: Stack, sample: str, **labels: str) -> float:
    return sum(value(scrape(stack.services.metrics[n]), sample, **labels) for n in NODES)


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def run(stack: Stack, key: str, text: str) -> dict:
    """One request to its end: its started event and how many token events it had."""
    out = {"started": None, "token_events": 0, "tokens": 0, "finish_reason": ""}
    for msg in stack.inference.Generate(chat(text, max_tokens=6), metadata=md(key)):
        kind = msg.WhichOneof("event")
        if kind == "started":
            out["started"] = msg.started
        elif kind == "delta" and msg.delta.token_ids:
            out["token_events"] += 1
            out["tokens"] += len(msg.delta.token_ids)
        elif kind == "finished":
            out["finish_reason"] = msg.finished.finish_reason
    return out


def test_every_metric_is_exported_and_counts_match_the_requests_sent(stack: Stack) -> None:
    metrics = stack.services.metrics
    assert set(metrics) == {"gateway", *NODES, "spill_node_0"}
    key = stack.register("metrics-count")
    queries0, hits0 = nodes_value(stack, "kvstrata:prefix_cache_queries_total"), nodes_value(
        stack, "kvstrata:prefix_cache_hits_total")
    phases0 = nodes_value(stack, "kvstrata:request_inference_time_seconds_count")
    runs = [run(stack, key, text) for text in ("Name a prime number.", "Name a prime number.", "Say hi.")]
    with pytest.raises(grpc.RpcError) as bad:  # refused before admission: counted by its status
        list(stack.inference.Generate(chat("too long", max_tokens=10**6), metadata=md(key)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    gw, tenant = scrape(metrics["gateway"]), {"tenant": "metrics-count"}
    for name, kind in GATEWAY_FAMILIES.items():
        assert gw[name].type == kind, name
    assert value(gw, "kvstrata:requests_total", status="OK", **tenant) == 3
    assert value(gw, "kvstrata:requests_total", status="INVALID_ARGUMENT", **tenant) == 1
    reasons = {r["finish_reason"] for r in runs}
    assert sum(value(gw, "kvstrata:request_success_total", finished_reason=r, **tenant) for r in reasons) == 3
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert value(gw, f"kvstrata:{histogram}_count", **tenant) == 3  # 3 produced a first token
    assert value(gw, "kvstrata:inter_token_latency_seconds_count", **tenant) == sum(
        r["token_events"] - 1 for r in runs)
    assert value(gw, "kvstrata:generation_tokens_total", **tenant) == sum(r["tokens"] for r in runs)
    assert value(gw, "kvstrata:prompt_tokens_total", **tenant) == sum(r["started"].prompt_tokens for r in runs)
    assert value(gw, "kvstrata:ttft_slo_requests_total", **tenant) == 3

    cached = {t: sum(getattr(r["started"].cached_tokens, t) for r in runs)
              for t in ("device", "host", "spill_ram", "spill_disk")}
    assert nodes_value(stack, "kvstrata:prefix_cache_queries_total") - queries0 == sum(
        r["started"].prompt_tokens for r in runs)
    assert nodes_value(stack, "kvstrata:prefix_cache_hits_total") - hits0 == sum(cached.values())
    # each finished request's phases, once, on the node that ran it (the refused one has none)
    assert nodes_value(stack, "kvstrata:request_inference_time_seconds_count") - phases0 == 3
    for n in NODES:
        families = scrape(metrics[n])
        for name, kind in NODE_FAMILIES.items():
            assert families[name].type == kind, (n, name)
        assert {s.labels["tier"] for s in families["kvstrata:cached_tokens"].samples
                if s.name.endswith("_total")} == set(cached)
        assert 0 <= value(families, "kvstrata:kv_cache_usage_perc") <= 1
    spill = scrape(metrics["spill_node_0"])
    for name, kind in SPILL_FAMILIES.items():
        assert spill[name].type == kind, name


def test_the_openai_http_api_is_observed_by_the_same_metrics(stack: Stack) -> None:
    """One place observes both APIs: a streamed chat completion through the unmodified openai
    client counts as the gRPC requests do (tokens, TTFT, one inter-token gap per later chunk)."""
    import openai

    key = stack.register("metrics-http")
    client = openai.OpenAI(base_url=f"http://{stack.services.http_address}/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=5)
    gw, tenant = scrape(stack.services.metrics["gateway"]), {"tenant": "metrics-http"}
    assert value(gw, "kvstrata:requests_total", status="OK", **tenant) == 1
    assert value(gw, "kvstrata:time_to_first_token_seconds_count", **tenant) == 1
    assert value(gw, "kvstrata:e2e_request_latency_seconds_count", **tenant) == 1
    assert value(gw, "kvstrata:prompt_tokens_total", **tenant) == usage.prompt_tokens
    assert value(gw, "kvstrata:generation_tokens_total", **tenant) == usage.completion_tokens
    # the empty message list is refused by the call path's parse step: counted by its status
    assert value(gw, "kvstrata:requests_total", status="INVALID_ARGUMENT", **tenant) == 1


def test_stats_and_the_targets_file_name_every_metrics_address(stack: Stack, tmp_path: Path) -> None:
    stats = json.loads(stack.admin.Stats(admin_pb2.StatsRequest(), metadata=stack.admin_md()).stats_json)
    assert {n["node_id"]: n["metrics_address"] for n in stats["nodes"]} == {
        n: stack.services.metrics[n] for n in NODES}
    path = write_targets(stack.services.metrics, tmp_path / TARGETS_FILE, "kvstrata-test")
    groups = json.loads(path.read_text())
    assert {g["labels"]["actor"]: g["targets"] for g in groups} == {
        n: [a] for n, a in stack.services.metrics.items()}
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvstrata"]
    assert Path(job["file_sd_configs"][0]["files"][0]).name == TARGETS_FILE


def test_queue_full_rejections_and_cancels_are_counted_by_reason_and_status(stack: Stack) -> None:
    """40 requests at once against 2 nodes x 16 running + a queue of 4: the rest are refused
    (queue_full); the admitted ones are cancelled; the gateway counts each as its client saw
    it, and the nodes end with nothing running."""
    key = stack.register("metrics-flood")
    calls = [stack.inference.Generate(chat(f"Count to {200 + i}.", max_tokens=200), metadata=md(key))
             for i in range(40)]
    deadline = time.monotonic() + 30
    while sum(c.done() for c in calls) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    for c in calls:
        c.cancel()
    codes = [c.code().name for c in calls]
    rejected = codes.count("RESOURCE_EXHAUSTED")
    assert rejected >= 4 and codes.count("CANCELLED") + codes.count("OK") + rejected == 40, codes
    for c in calls:
        if c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "retry-after-ms" in dict(c.trailing_metadata())
    tenant = {"tenant": "metrics-flood"}
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        gw = scrape(stack.services.metrics["gateway"])
        if sum(value(gw, "kvstrata:requests_total", **tenant, status=s) for s in set(codes)) == 40:
            break
        time.sleep(0.2)
    for status in set(codes):
        assert value(gw, "kvstrata:requests_total", status=status, **tenant) == codes.count(status), status
    assert value(gw, "kvstrata:admission_rejections_total", reason="queue_full", **tenant) == rejected
    deadline = time.monotonic() + 20
    while nodes_value(stack, "kvstrata:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert nodes_value(stack, "kvstrata:num_requests_running") == 0
    assert nodes_value(stack, "kvstrata:num_requests_waiting") == 0


def exported_names(stack: Stack) -> set[str]:
    """Every name a query may use: families and their samples (a counter's ``_total``, a
    histogram's ``_bucket``/``_sum``/``_count``), labelled ones without samples included."""
    names: set[str] = set()
    for address in stack.services.metrics.values():
        for name, family in scrape(address).items():
            names |= {name} | {s.name for s in family.samples}
            names |= {name + "_total"} if family.type == "counter" else set()
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if family.type == "histogram" else set()
    return names


def test_scrape_config_and_dashboard_name_only_exported_metrics(stack: Stack) -> None:
    exported = exported_names(stack)
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") if isinstance(v.get("query"), str) else v.get("query", {}).get("query", "")
              for v in dashboard["templating"]["list"]]
    referenced = set(re.findall(r"kvstrata:[a-z0-9_]+", " ".join(exprs) + (DEPLOY / "prometheus.yml").read_text()))
    assert referenced, "the dashboard queries no kvstrata metric"
    assert referenced <= exported, sorted(referenced - exported)
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    for panel in ("TTFT p50 / p99 against the SLO", "token rate against the floor", "tier occupancy",
                  "prefix-cache hit rate", "admission rejections"):
        assert panel.lower() in titles.lower(), panel
