"""What the service layer costs: the same workload in-process vs. through gRPC + Ray.

``python -m bench.service [--quick]``. Both paths run one cache node with the same config and
the same Wikipedia chat prompts (as token ids, so templating is identical):

* in-process: ``services.cache_node.CacheNode.generate`` called directly;
* service: a local Ray cluster with the GlobalScheduler, one CacheNode actor and the Gateway
  actor, driven by a grpc.aio client with a real tenant and API key.

Both run side by side in one process and are measured in alternating rounds (order flipped
each round; round 0 warms up), so load from elsewhere on the machine hits both. TTFT is
measured one request at a time (first streamed token, client side, cold cache); throughput
with all requests in flight at once. ``added_ttft_ms_p50`` = median service TTFT - median
in-process TTFT over all rounds; ``throughput_ratio`` = median over rounds of service /
in-process tokens/s. Last stdout line: JSON with ``ttft_ms_p50`` (both paths),
``added_ttft_ms_p50`` and ``throughput_ratio`` (service / in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import grpc
import ray

from bench.common import median, wiki_chat_requests
from cache_node.model_loader import load_model
from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.cache_node import CacheNode
from services.config import NodeConfig, ServiceConfig
from services.launcher import start_services, stop_services
from services.node_request import NodeRequest
from workloads.corpus import load_corpus


async def _inproc_one(node: CacheNode, ns: str, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    req = NodeRequest(request_id=rid, tenant="bench", cache_namespace=ns, token_ids=tuple(ids),
                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time_s=time.monotonic())
    t0, ttft, n = time.perf_counter(), 0.0, 0
    async for ev in node.generate(req):
        if ev["type"] == "delta":
            ttft = ttft or (time.perf_counter() - t0) * 1000
            n += len(ev["token_ids"])
    return ttft, n


async def _grpc_one(stub, md, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    req = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=ids), request_id=rid,
                                        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0, ttft, n = time.perf_counter(), 0.0, 0
    async for msg in stub.Generate(req, metadata=md):
        if msg.WhichOneof("event") == "delta":
            ttft = ttft or (time.perf_counter() - t0) * 1000
            n += len(msg.delta.token_ids)
    return ttft, n


async def _measure(one, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """One round on one path: TTFT of each prompt alone (cold), then all prompts at once."""
    ttfts = [(await one(f"{tag}-t{i}", p, 4))[0] for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(f"{tag}-b{i}", p, max_tokens) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"ttfts_ms": ttfts, "tokens_per_s": sum(n for _, n in done) / wall}


async def _rounds(node: CacheNode, address: str, admin_key: str, prompts: list[list[int]], max_tokens: int,
                  rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Alternate the two paths round by round (order flipped each round) so machine noise hits both.

    Round ``r`` uses the cache namespace ``bench-r<r>`` on both paths (the service path through a
    tenant registered with that namespace): each round's TTFT phase is cold, and its throughput
    phase finds that round's prompts cached, the same way on both paths.
    """
    results: dict[str, list[dict[str, Any]]] = {"in_process": [], "service": []}
    async with grpc.aio.insecure_channel(address) as ch:
        admin = (("authorization", f"Bearer {admin_key}"),)
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        keys = []
        for r in range(rounds + 1):  # round 0 = warm-up, not reported
            resp = await tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(
                spec=tenant_pb2.TenantSpec(name=f"bench-r{r}", cache_namespace=f"bench-r{r}")), metadata=admin)
            keys.append((("authorization", f"Bearer {resp.api_key}"),))
        for r in range(rounds + 1):
            ns = f"bench-r{r}"
            paths = {
                "in_process": lambda rid, p, m, ns=ns: _inproc_one(node, ns, rid, p, m),
                "service": lambda rid, p, m, md=keys[r]: _grpc_one(stub, md, rid, p, m),
            }
            order = ["in_process", "service"] if r % 2 else ["service", "in_process"]
            for name in order:
                if r == 0:
                    await paths[name](f"{name}-warm", prompts[0][:32], 2)
                    continue
                results[name].append(await _measure(paths[name], prompts, max_tokens, f"{name}-r{r}"))
                print(f"round {r} {name}: ttft p50 {median(results[name][-1]['ttfts_ms']):.1f} ms, "
                      f"{results[name][-1]['tokens_per_s']:.2f} tok/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0, help="measured rounds per path (default 2 quick, 3 full)")
    args = ap.parse_args(argv)
    n, max_tokens = (8, 24) if args.quick else (16, 48)
    rounds = args.rounds or (2 if args.quick else 3)
    tok = load_model().tokenizer
    prompts = [list(r.prompt_token_ids) for r in wiki_chat_requests(tok, load_corpus(), n, seed=1)]
    threads = os.cpu_count() or 2
    cfg = NodeConfig(kv_pool_bytes=256 << 20, torch_threads=threads, max_num_seqs=32)
    ray.init(address="local", namespace="kvstrata-bench", include_dashboard=False, log_to_driver=False,
             resources={"cache_node": 1})
    # no spill node: the in-process peer has none either (both have the node's host tier)
    services = start_services(ServiceConfig(num_cache_nodes=1, num_spill_nodes=0, node=cfg, gateway_port=0,
                                            state_dir=tempfile.mkdtemp(prefix="kvstrata-bench-")))
    node = CacheNode("inproc", cfg, threads)
    try:
        res = asyncio.run(_rounds(node, services.address, services.admin_key, prompts, max_tokens, rounds))
    finally:
        node.shutdown()
        stop_services(services)
        ray.shutdown()
    ttft = {k: median([t for rr in v for t in rr["ttfts_ms"]]) for k, v in res.items()}
    tps = {k: median([rr["tokens_per_s"] for rr in v]) for k, v in res.items()}
    ratios = [s["tokens_per_s"] / i["tokens_per_s"] for s, i in zip(res["service"], res["in_process"])]
    added = [median(s["ttfts_ms"]) - median(i["ttfts_ms"]) for s, i in zip(res["service"], res["in_process"])]
    print(json.dumps({
        "requests": n,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "ttft_ms_p50": {k: round(v, 2) for k, v in ttft.items()},
        "added_ttft_ms_p50": round(ttft["service"] - ttft["in_process"], 2),
        "added_ttft_ms_p50_per_round": [round(a, 2) for a in added],
        "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
        "throughput_ratio": round(median(ratios), 3),
        "throughput_ratio_per_round": [round(x, 3) for x in ratios],
    }))


if __name__ == "__main__":
    main()
