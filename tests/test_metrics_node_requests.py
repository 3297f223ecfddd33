"""A cache node's structured-output (``grammar_*``) and request-phase metrics, on the real
CacheNode (xgrammar's compiler processes, the tiny Llama) behind the gateway's gRPC server of
``test_logprobs_served``, read from the node's own registry as ``/metrics`` renders it.

- a structured request's compile counts ``grammar_compiles_total{result="compiled"}`` and one
  ``grammar_compile_seconds`` observation; the same spec again is a cache hit (no compile); a
  spec that does not compile counts ``spec_error``, and again (the same tenant, within a
  minute) ``grammar_requests_refused_total{reason="failed_spec"}``; a grammar left with no token
  to draw ``no_token``; a tenant past its compile queue ``queue_full``; a matcher past
  ``grammar_request_budget_ms`` ``request_budget``.
- a finished request lands once in each of vLLM's phase histograms (``request_queue_time_
  seconds``, ``request_prefill_time_seconds``, ``request_decode_time_seconds``,
  ``request_inference_time_seconds``) and the token histograms, with values that add up:
  prefill + decode = inference, queue + prefill = the node's TTFT, queue + inference within the
  client's wall time; a request refused before its first token lands in none.

Before: none of these families existed (operators could not see grammar compiling at all, nor
where a request's time went on the node)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.v1 import inference_pb2 as pb
from tests.test_logprobs_served import PROMPT, Served

PHASES = ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
          "request_inference_time_seconds")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def samples(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The node's exposition: (sample name, its labels but ``node``) -> value."""
    text = generate_latest(served.node.metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("node") == "n0", s
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "node")))] = s.value
    return out


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(f"kvstrata:{name}", tuple(sorted(labels.items())))]


def compiles(scraped: dict, result: str) -> float:
    return value(scraped, "grammar_compiles_total", result=result)


def refused(scraped: dict, reason: str) -> float:
    return value(scraped, "grammar_requests_refused_total", reason=reason)


def test_compiles_cache_hits_and_refusals_are_counted_by_result_and_reason(served: Served) -> None:
    before = samples(served)
    regex = pb.StructuredOutput(regex="[0-9]{4}-metrics")
    served.generate(max_tokens=12, structured_output=regex)
    first = samples(served)
    assert compiles(first, "compiled") - compiles(before, "compiled") == 1
    assert value(first, "grammar_compile_seconds_count") - value(before, "grammar_compile_seconds_count") == 1
    spent = value(first, "grammar_compile_seconds_sum") - value(before, "grammar_compile_seconds_sum")
    assert 0 < spent < 30
    assert value(first, "grammar_compile_seconds_bucket", le="+Inf") == value(first, "grammar_compile_seconds_count")
    assert value(first, "grammar_cache_queries_total") - value(before, "grammar_cache_queries_total") == 1
    assert value(first, "grammar_cache_hits_total") == value(before, "grammar_cache_hits_total")
    assert value(first, "grammar_compiler_processes") >= 1  # started on first use and kept
    assert value(first, "grammar_cache_entries") >= 1 and value(first, "grammar_cache_bytes") > 0

    served.generate(max_tokens=12, structured_output=regex)  # the same spec: the cached grammar
    again = samples(served)
    assert value(again, "grammar_cache_hits_total") - value(first, "grammar_cache_hits_total") == 1
    assert value(again, "grammar_cache_queries_total") - value(first, "grammar_cache_queries_total") == 1
    assert compiles(again, "compiled") == compiles(first, "compiled")
    assert value(again, "grammar_compile_seconds_count") == value(first, "grammar_compile_seconds_count")

    bad = pb.StructuredOutput(regex="(abc-metrics")
    for _ in range(2):  # the second is refused from the tenant's failed-spec memory, not compiled
        with pytest.raises(grpc.RpcError) as err:
            served.generate(max_tokens=4, structured_output=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    failed = samples(served)
    assert compiles(failed, "spec_error") - compiles(again, "spec_error") == 1
    assert refused(failed, "failed_spec") - refused(again, "failed_spec") == 1
    assert value(failed, "grammar_failed_specs") >= 1
    assert value(failed, "grammar_compile_seconds_count") - value(again, "grammar_compile_seconds_count") == 1

    with pytest.raises(grpc.RpcError) as err:  # after "a" nothing may follow: refused at that step
        served.generate(max_tokens=4, structured_output=pb.StructuredOutput(grammar='root ::= "a" b\nb ::= b "c"'))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    dead_end = samples(served)
    assert refused(dead_end, "no_token") - refused(failed, "no_token") == 1

    queue = served.node.engine.grammars._queue
    bound, queue.max_per_tenant = queue.max_per_tenant, 0
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.generate(max_tokens=4, structured_output=pb.StructuredOutput(regex="[x-z]{2}-metrics"))
    finally:
        queue.max_per_tenant = bound
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    full = samples(served)
    assert refused(full, "queue_full") - refused(dead_end, "queue_full") == 1
    assert compiles(full, "busy_refused") == compiles(full, "timeout") == compiles(full, "failed") == 0
    assert value(full, "grammar_compiles_queued") == value(full, "grammar_compiles_running") == 0


def test_a_matcher_past_its_request_budget_is_counted(served: Served) -> None:
    before = samples(served)
    engine = served.node.engine
    config = engine.config
    engine.config = dataclasses.replace(config, grammar_request_budget_ms=1e-6)  # read each step
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.generate(max_tokens=4, structured_output=pb.StructuredOutput(regex="[a-c]{3}-budget"))
    finally:
        engine.config = config
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar_request_budget_ms" in err.value.details()
    assert refused(samples(served), "request_budget") - refused(before, "request_budget") == 1


def test_a_finished_request_lands_once_in_each_phase_histogram_with_times_that_add_up(served: Served) -> None:
    before = samples(served)
    t0 = time.monotonic()
    responses = served.generate(max_tokens=6, ignore_eos=True)
    wall_s = time.monotonic() - t0
    (finished,) = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert finished.completion_tokens == 6
    after = samples(served)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    for histogram in (*PHASES, "request_prompt_tokens", "request_generation_tokens"):
        assert delta(f"{histogram}_count") == 1, histogram
    assert delta("request_prompt_tokens_sum") == len(PROMPT)
    assert delta("request_generation_tokens_sum") == 6
    queue, prefill, decode, inference = (delta(f"{h}_sum") for h in PHASES)
    assert min(queue, prefill, inference) >= 0 and decode > 0  # 6 tokens: 5 steps between first and last
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + prefill == pytest.approx(finished.ttft_ms / 1000.0, abs=1e-3)  # the node's own TTFT
    assert queue + inference <= wall_s

    with pytest.raises(grpc.RpcError):  # refused before its first token: in no phase histogram
        served.generate(max_tokens=4, structured_output=pb.StructuredOutput(regex="(abc-phases"))
    refused_after = samples(served)
    for histogram in (*PHASES, "request_prompt_tokens", "request_generation_tokens"):
        assert value(refused_after, f"{histogram}_count") == value(after, f"{histogram}_count"), histogram
