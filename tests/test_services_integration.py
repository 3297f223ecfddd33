"""Real Ray (two-node Cluster, custom resources) + real gRPC on port 0 + the real model."""

from __future__ import annotations

import json
import re
import threading
import time

import grpc
import pytest

from kvstrata.v1 import admin_pb2, inference_pb2, tenant_pb2
from tests.service_fixtures import Stack, chat, collect
from workloads.corpus import load_corpus

pytestmark = pytest.mark.slow


def md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def keys(stack) -> dict[str, str]:
    return {
        "alice": stack.register("alice", namespace="shared"),
        "bob": stack.register("bob", namespace="shared"),
        "carol": stack.register("carol"),  # own namespace
    }


def long_doc(i: int = 0) -> str:
    arts = load_corpus()
    return " ".join(a.extract for a in arts[100 + i : 103 + i])


def node_stats(stack: Stack) -> list:
    return list(stack.admin.Stats(admin_pb2.StatsRequest(check_integrity=True), metadata=stack.admin_md()).nodes)


def test_two_tenants_stream_real_text(stack, keys) -> None:
    a = collect(stack.inference.Generate(chat("What is the capital of France?", 12), metadata=md(keys["alice"])))
    c = collect(stack.inference.Generate(chat("Name a large planet.", 12), metadata=md(keys["carol"])))
    for r in (a, c):
        assert r["started"] is not None and r["finished"].completion_tokens == len(r["tokens"]) > 0
        assert r["text"].strip()
    assert "Paris" in a["text"]


def test_session_second_turn_prefills_only_new_tokens(stack, keys) -> None:
    k = md(keys["alice"])
    t1 = collect(stack.inference.Generate(chat(long_doc() + "\nSummarize.", 10, session_id="sess-1"), metadata=k))
    t2 = collect(stack.inference.Generate(chat("Give one date from it.", 6, session_id="sess-1"), metadata=k))
    history = t1["finished"].prompt_tokens + t1["finished"].completion_tokens
    assert t2["started"].node_id == t1["started"].node_id  # session turns stick to their node
    assert t2["started"].cached_tokens.device == history - 1
    assert t2["finished"].prompt_tokens > history
    resp = stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id="sess-1"), metadata=k)
    assert resp.freed_tokens == t2["finished"].prompt_tokens + t2["finished"].completion_tokens


def test_namespaces_isolate_and_share_prefixes(stack, keys) -> None:
    prompt = long_doc(7) + "\nWhat is this about?"
    first = collect(stack.inference.Generate(chat(prompt, 4), metadata=md(keys["alice"])))
    time.sleep(0.3)  # block events reach the global index
    same_ns = collect(stack.inference.Generate(chat(prompt, 4), metadata=md(keys["bob"])))
    other_ns = collect(stack.inference.Generate(chat(prompt, 4), metadata=md(keys["carol"])))
    n = first["finished"].prompt_tokens
    # at most the chat template's system-prompt block, cached by earlier calls in each namespace
    assert first["started"].cached_tokens.device <= 16
    assert same_ns["started"].node_id == first["started"].node_id  # prefix affinity routing
    assert same_ns["started"].cached_tokens.device == ((n - 1) // 16) * 16
    assert other_ns["started"].cached_tokens.device <= 16
    assert same_ns["tokens"] == first["tokens"] == other_ns["tokens"]
    stats = stack.admin.Stats(admin_pb2.StatsRequest(), metadata=stack.admin_md())
    indexed = json.loads(stats.stats_json)["scheduler"]["indexed_blocks_by_tier"]
    # both namespaces' prompts, from the nodes' tier events (some may be demoted to host by now)
    assert indexed["device"] + indexed["host"] >= 2 * ((n - 1) // 16)


def test_a_tenant_registered_under_a_deleted_name_reaches_none_of_its_kv(stack) -> None:
    """Regression: the default namespace was the tenant's name, so a new "dave" got the
    deleted "dave"'s prompt blocks as cached tokens (and so learned what it had sent)."""
    prompt = long_doc(11) + "\nSummarize it."
    old = collect(stack.inference.Generate(chat(prompt, 2), metadata=md(stack.register("dave"))))
    stack.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="dave"), metadata=stack.admin_md())
    time.sleep(0.3)
    new = collect(stack.inference.Generate(chat(prompt, 2), metadata=md(stack.register("dave"))))
    assert old["finished"].prompt_tokens == new["finished"].prompt_tokens > 64
    assert new["started"].cached_tokens.device <= 16  # the chat template's block at most
    assert sum(getattr(new["started"].cached_tokens, t) for t in ("host", "spill_ram", "spill_disk")) == 0
    stack.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="dave"), metadata=stack.admin_md())


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_bad_input_gets_precise_status_and_others_finish(stack, keys) -> None:
    k = md(keys["alice"])
    results: dict[str, dict] = {}
    bg = threading.Thread(
        target=lambda: results.update(ok=collect(stack.inference.Generate(chat("Count to ten.", 24), metadata=k)))
    )
    bg.start()
    gen = stack.inference.Generate
    assert _code(lambda: collect(gen(chat("hi"), metadata=md("kvs_nope_nope")))) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: collect(gen(chat("hi")))) == grpc.StatusCode.UNAUTHENTICATED
    empty = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(max_tokens=4))
    assert _code(lambda: collect(gen(empty, metadata=k))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: collect(gen(chat("x " * 9000, 4), metadata=k))) == grpc.StatusCode.INVALID_ARGUMENT
    # each limit names itself (a fresh-user trial: "... exceeds the context limit or the KV pool")
    with pytest.raises(grpc.RpcError) as over_pool:
        collect(gen(inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[100] * 2000),
                                                  sampling=inference_pb2.SamplingParams(max_tokens=4)), metadata=k))
    pooled = re.fullmatch(r"This model's maximum context length is (\d+) tokens on a cache node \(its KV pool holds "
                          r"\1 tokens: the prompt and at least one generated token\)\. However, you requested 2000 "
                          r"tokens in the prompt\. Please reduce the length of the prompt\.", over_pool.value.details())
    assert pooled
    over_pool_tokens = int(pooled.group(1))
    with pytest.raises(grpc.RpcError) as over_context:  # a compressing policy's bound is the context
        collect(gen(inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[100] * 1000), policy="snapkv-0.5",
                                                  sampling=inference_pb2.SamplingParams(max_tokens=8000)), metadata=k))
    assert over_context.value.details().startswith("This model's maximum context length is 8192 tokens. However, "
                                                   "you requested 9000 tokens (1000 in the prompt, 8000 in the completion).")
    with pytest.raises(grpc.RpcError) as over_both:  # the full cache's is the smaller pool (review 25b R2)
        collect(gen(inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[100] * 1000),
                                                  sampling=inference_pb2.SamplingParams(max_tokens=8000)), metadata=k))
    assert over_both.value.details().startswith(
        f"This model's maximum context length is {over_pool_tokens} tokens on a cache node under a KV policy that "
        f"keeps every token (its KV pool holds {over_pool_tokens} tokens). However, you requested 9000 tokens (1000 "
        "in the prompt, 8000 in the completion).")
    for ids in ([2**31], [49152], [2**32 - 1]):  # outside the vocabulary (49152): was UNAVAILABLE
        out_of_vocab = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, *ids]),
                                                     sampling=inference_pb2.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as info:
            collect(gen(out_of_vocab, metadata=k))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"prompt.1: token id {ids[0]} is outside the vocabulary; token ids must lie in [0, 49152)")
    bad = chat("hi", 4)
    bad.sampling.temperature = -1
    assert _code(lambda: collect(gen(bad, metadata=k))) == grpc.StatusCode.INVALID_ARGUMENT
    zero = chat("hi", 0)
    assert _code(lambda: collect(gen(zero, metadata=k))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: collect(gen(chat("hi", 2, policy="no-such-policy"), metadata=k))) == grpc.StatusCode.INVALID_ARGUMENT
    # a known policy with a value its field refuses (once: the node's step loop died on them)
    for spec in ("snapkv-inf", "h2o-1e999", "snapkv-sink_tokens_1.5", "quant-group_size_0"):
        assert _code(lambda s=spec: collect(gen(chat("hi", 2, policy=s), metadata=k))) == \
            grpc.StatusCode.INVALID_ARGUMENT
    for field in ("policy", "allowed_policies"):
        value = "snapkv-nan" if field == "policy" else ["h2o", "snapkv-kernel_size_2"]
        reg = tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="dora", **{field: value}))
        assert _code(lambda r=reg: stack.tenants.RegisterTenant(r, metadata=stack.admin_md())) == \
            grpc.StatusCode.INVALID_ARGUMENT
    collect(gen(chat("hi", 2, session_id="alice-s"), metadata=k))
    other = md(keys["carol"])
    # session ids are the tenant's own (issue 18 fault 2): carol's "alice-s" is another session
    assert collect(gen(chat("hi", 2, session_id="alice-s"), metadata=other))["finished"] is not None
    close = inference_pb2.CloseSessionRequest(session_id="alice-s")
    assert stack.inference.CloseSession(close, metadata=other).freed_tokens > 0
    assert _code(lambda: stack.inference.CloseSession(close, metadata=other)) == grpc.StatusCode.NOT_FOUND
    dup = tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="alice"))
    assert _code(lambda: stack.tenants.RegisterTenant(dup, metadata=stack.admin_md())) == grpc.StatusCode.ALREADY_EXISTS
    assert _code(lambda: stack.tenants.RegisterTenant(dup, metadata=k)) == grpc.StatusCode.PERMISSION_DENIED
    # UpdateTenant: spec.name may be left out; an unknown tenant is NOT_FOUND (a trial got
    # INVALID_ARGUMENT), a rename INVALID_ARGUMENT
    update = stack.tenants.UpdateTenant
    for name, spec_name, code in (("nobody", "", grpc.StatusCode.NOT_FOUND), ("nobody", "nobody", grpc.StatusCode.NOT_FOUND),
                                  ("carol", "carla", grpc.StatusCode.INVALID_ARGUMENT)):
        req = tenant_pb2.UpdateTenantRequest(name=name, spec=tenant_pb2.TenantSpec(name=spec_name))
        assert _code(lambda r=req: update(r, metadata=stack.admin_md())) == code, (name, spec_name)
    bg.join()
    assert results["ok"]["finished"].completion_tokens == 24 or results["ok"]["finished"].finish_reason == "stop"
    stack.inference.CloseSession(close, metadata=k)


def test_queue_full_is_resource_exhausted_with_retry_hint(stack, keys) -> None:
    """2 nodes x 16 running slots + queue_limit 4: a burst of 48 requests overflows (16 tokens
    each, EOS ignored: the admitted ones keep their slots while the burst arrives)."""
    k = md(keys["carol"])
    reqs = [chat(f"Write a long story number {i}.", 16) for i in range(48)]
    for req in reqs:
        req.sampling.ignore_eos = True
    calls = [stack.inference.Generate(req, metadata=k) for req in reqs]
    codes, hints = [], []
    for call in calls:
        try:
            collect(call)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
            hints += [v for key, v in (err.trailing_metadata() or ()) if key == "retry-after-ms"]
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) > 0
    assert codes.count(grpc.StatusCode.OK) >= 32
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert hints and all(int(h) > 0 for h in hints)


def settled(stack: Stack, base: list[int], timeout_s: float = 10.0) -> list:
    """Node stats once every node is back to ``base`` used blocks with nothing running (or
    the last ones seen after ``timeout_s``)."""
    deadline = time.time() + timeout_s
    while True:
        stats = node_stats(stack)
        done = [s.used_blocks for s in stats] == base and all(s.running == 0 for s in stats)
        if done or time.time() > deadline:
            return stats
        time.sleep(0.2)


def test_cancel_streams_frees_every_block(stack, keys) -> None:
    k = md(keys["bob"])
    base = [s.used_blocks for s in node_stats(stack)]
    for i in range(40):  # mid-generation
        call = stack.inference.Generate(chat(f"Tell me about topic {i}.", 64), metadata=k)
        for msg in call:
            if msg.WhichOneof("event") == "delta":
                break
        call.cancel()
    doc = long_doc(20)
    for i in range(20):  # during prefill: cancel before the first token
        call = stack.inference.Generate(chat(f"{i} {doc}", 32), metadata=k)
        time.sleep(0.02)
        call.cancel()
    stats = settled(stack, base)
    assert [s.used_blocks for s in stats] == base
    assert all(s.integrity_ok and s.running == 0 and s.waiting == 0 for s in stats)
    t0 = time.time()
    r = collect(stack.inference.Generate(chat("Say hello.", 2), metadata=k))
    assert r["finished"] is not None and time.time() - t0 < 5.0


def test_a_request_id_reused_right_after_a_cancel_runs_as_itself(stack, keys) -> None:
    """Regression (security review): a client id retried at once after a cancel got the
    cancelled attempt's ending (finish reason "abort", its token counts) while the retry ran
    on, unseen and unabortable, on the node; five such retries left 5 hidden requests
    running. Each attempt now has its own id past the gateway."""
    k = md(keys["bob"])
    base = [s.used_blocks for s in node_stats(stack)]
    for i in range(3):
        call = stack.inference.Generate(chat(f"Tell me about topic {i}.", 200, request_id="again"), metadata=k)
        for msg in call:
            if msg.WhichOneof("event") == "delta":
                break
        call.cancel()
        retry = collect(stack.inference.Generate(chat("Say hello.", 3, request_id="again"), metadata=k))
        assert retry["finished"].finish_reason in ("length", "stop"), retry["finished"]
        assert retry["started"].request_id == "again"
    stats = settled(stack, base)
    assert all(s.running == 0 for s in stats) and [s.used_blocks for s in stats] == base


def test_deadline_aborts_request(stack, keys) -> None:
    k = md(keys["bob"])
    with pytest.raises(grpc.RpcError) as info:
        collect(stack.inference.Generate(chat("Write a very long essay.", 200), metadata=k, timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.0)
    assert all(s.running == 0 for s in node_stats(stack))


def test_usage_is_accounted(stack, keys) -> None:
    usage = stack.tenants.GetUsage(tenant_pb2.GetUsageRequest(name="alice"), metadata=stack.admin_md()).usage
    assert usage.requests >= 4 and usage.completion_tokens > 0
    # prompt tokens as the nodes ran them (session history included), hits per tier
    assert usage.prompt_tokens > 0 and usage.cached_tokens.device > 0


def test_serving_actors_run_at_normal_priority_not_rays_nice_15(stack) -> None:
    """Regression: spill nodes ran at Ray's worker nice 15; next to busy cache nodes a spill
    prefetch then held an interactive request in the queue ~1 s (make demo, issue 21). Every
    actor on the request path (cache nodes, spill nodes, scheduler, gateway) runs at nice 0."""
    import os

    import ray

    svc = stack.services
    actors = [*svc.nodes.values(), *svc.spill_nodes, svc.scheduler, svc.gateway]
    assert svc.spill_nodes, "the stack starts a spill node"
    pids = ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in actors], timeout=60)
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {0}


def test_a_live_gateway_counted_gone_serves_on(stack, keys) -> None:
    """Regression: once the scheduler counted the running gateway as gone (one failed poll of
    its watch), every request through it was refused ``gateway_gone``. Now the gateway attaches
    again on the refusal (``RayGateway.reattach``) and the request runs."""
    import ray

    gateway, scheduler = stack.services.gateway, stack.services.scheduler
    subscriber = ray.get(gateway.__ray_call__.remote(lambda self: self.streams.subscriber))
    ray.get(scheduler.gateway_gone.remote(subscriber))
    r = collect(stack.inference.Generate(chat("Name a large planet.", 4), metadata=md(keys["alice"])))
    assert r["finished"] is not None and r["finished"].completion_tokens == len(r["tokens"]) > 0
    assert ray.get(gateway.__ray_call__.remote(lambda self: self.streams.subscriber)) == subscriber
    # the scheduler's watch tells a gateway it counted as gone (review 21b, G1): it attaches again
    ray.get(scheduler.gateway_gone.remote(subscriber))
    assert ray.get(gateway.counted_gone.remote(subscriber, [])) is True
    assert ray.get(gateway.counted_gone.remote("tcp://not-its-inbox", [])) is False
    r = collect(stack.inference.Generate(chat("Name a large planet.", 4), metadata=md(keys["alice"])))
    assert r["finished"] is not None


def test_status_shows_each_spill_nodes_state(stack: Stack) -> None:
    """``kvstrata status``'s spill table, from the gateway's ``Stats`` (the scheduler's spill
    watch, ``services.spill_watch``): the stack's spill nodes serve, and say so; so do the
    gateway's HTTP ``/health`` and ``/metrics`` (the scheduler's ``spill_down`` through each
    gateway's ``NodeMonitor``). Regression (s37): ``kvstrata status`` showed no spill node,
    serving or not."""
    import urllib.request

    from rich.console import Console

    from cli.lifecycle import spill_table

    names = {f"spill_node_{i}" for i in range(stack.config.num_spill_nodes)}
    deadline = time.monotonic() + 60
    while True:
        stats = stack.admin.Stats(admin_pb2.StatsRequest(), metadata=stack.admin_md())
        nodes = json.loads(stats.stats_json)["scheduler"]["spill_nodes"]
        if all(nodes.get(n, {}).get("state", "unknown") != "unknown" for n in names) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert names and {n: s["state"] for n, s in nodes.items()} == dict.fromkeys(names, "serving")
    console = Console(record=True, width=200)
    console.print(spill_table(stats))
    rows = [line for line in console.export_text().splitlines() if line.count("│") == 3]
    assert sorted(row.split("│")[1].strip() for row in rows) == sorted(names)
    assert all(row.split("│")[2].strip() == "serving" for row in rows)
    with urllib.request.urlopen(f"http://{stack.services.http_address}/health", timeout=10) as reply:
        assert (reply.status, json.loads(reply.read())["status"]) == (200, "ok")
    with urllib.request.urlopen(f"http://{stack.services.metrics['gateway']}/metrics", timeout=10) as reply:
        assert re.search(r"^kvstrata:spill_nodes_not_serving 0\.0$", reply.read().decode(), re.MULTILINE)
