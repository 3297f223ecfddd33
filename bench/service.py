"""What the service layer costs: the same workload in-process vs. through gRPC + Ray.

``python -m bench.service [--quick]``. Both paths run one cache node with the same config and
the same Wikipedia chat prompts (as token ids, so templating is identical):

* in-process: ``services.cache_node.CacheNode.generate`` called directly;
* service: a local Ray cluster with the GlobalScheduler, one CacheNode actor and the Gateway
  actor, driven by a grpc.aio client with a real tenant and API key.

TTFT is measured one request at a time (first streamed token, client side); throughput with
all requests in flight at once. Both paths use one cache namespace for every request, so both
find the same prefixes cached in the throughput phase. Last stdout line: JSON with ``ttft_ms_p50`` (both paths),
``added_ttft_ms_p50`` and ``throughput_ratio`` (service / in-process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time

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


async def _inproc_one(node: CacheNode, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int]:
    req = NodeRequest(request_id=rid, tenant="bench", cache_namespace="bench", token_ids=tuple(ids),
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


async def _measure(one, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    await one(f"{tag}-warm", prompts[0][:32], 2)
    ttfts = [(await one(f"{tag}-t{i}", p, 4))[0] for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(f"{tag}-b{i}", p, max_tokens) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"ttft_ms_p50": median(ttfts), "tokens_per_s": sum(n for _, n in done) / wall}


def run_inprocess(cfg: NodeConfig, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    node = CacheNode("inproc", cfg, cfg.torch_threads)
    try:
        return asyncio.run(_measure(lambda r, p, m: _inproc_one(node, r, p, m), prompts, max_tokens, "in"))
    finally:
        node.shutdown()


def run_service(cfg: NodeConfig, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    ray.init(address="local", namespace="kvstrata-bench", include_dashboard=False, log_to_driver=False,
             resources={"cache_node": 1})
    services = start_services(ServiceConfig(num_cache_nodes=1, node=cfg, gateway_port=0,
                                            state_dir=tempfile.mkdtemp(prefix="kvstrata-bench-")))

    async def go() -> dict[str, float]:
        async with grpc.aio.insecure_channel(services.address) as ch:
            admin = (("authorization", f"Bearer {services.admin_key}"),)
            resp = await tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
                tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="bench")), metadata=admin)
            md = (("authorization", f"Bearer {resp.api_key}"),)
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            return await _measure(lambda r, p, m: _grpc_one(stub, md, r, p, m), prompts, max_tokens, "svc")

    try:
        return asyncio.run(go())
    finally:
        stop_services(services)
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    n, max_tokens = (8, 24) if args.quick else (16, 48)
    tok = load_model().tokenizer
    prompts = [list(r.prompt_token_ids) for r in wiki_chat_requests(tok, load_corpus(), n, seed=1)]
    cfg = NodeConfig(kv_pool_bytes=256 << 20, torch_threads=os.cpu_count() or 2, max_num_seqs=32)
    inproc = run_inprocess(cfg, prompts, max_tokens)
    print(f"in-process: {inproc}", flush=True)
    service = run_service(cfg, prompts, max_tokens)
    print(f"gRPC + Ray: {service}", flush=True)
    print(json.dumps({
        "requests": n,
        "max_tokens": max_tokens,
        "ttft_ms_p50": {"in_process": round(inproc["ttft_ms_p50"], 2), "service": round(service["ttft_ms_p50"], 2)},
        "added_ttft_ms_p50": round(service["ttft_ms_p50"] - inproc["ttft_ms_p50"], 2),
        "tokens_per_s": {"in_process": round(inproc["tokens_per_s"], 2), "service": round(service["tokens_per_s"], 2)},
        "throughput_ratio": round(service["tokens_per_s"] / inproc["tokens_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
