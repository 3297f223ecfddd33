"""Per-tenant SLOs under overload: one multi-tenant trace through fcfs, vtc and kvstrata.

``python -m bench.slo [--quick]``. For each scheduler a fresh deployment (local Ray cluster,
global scheduler, one cache node with the real SmolLM2, gRPC gateway) serves the same trace:

* tenants ``live`` (interactive), ``std`` (standard), ``bulk`` (batch) and ``noisy`` (standard,
  offering 4x the others' rate), with the class defaults of ``tenants.model`` for TTFT targets,
  floors and weights;
* single-turn chat requests over Wikipedia extracts (``bench.common.wiki_chat_requests``);
* Gamma arrivals per tenant (``workloads.deepresearch.sampling``): CV 1 for ``live`` and
  ``std``, CV 4 for ``bulk`` and ``noisy``; the total mean rate is ``--load`` times the capacity
  measured first (requests/s with every request in flight at once), so bursts reach well over
  2x capacity.

Per scheduler and tenant the report (``workloads.deepresearch.metrics.compute_report``) gives
``ttft_p50_ms``, ``ttft_p95_ms``, ``ttft_slo_attainment``, ``floor_attainment``,
``tokens_per_s``, ``rejected``, ``preempted``; goodput is requests that finished within their
tenant's TTFT target per second, and ``goodput_ratio_vs_fcfs`` divides by fcfs's. The last
stdout line is that JSON; ``reports/slo/`` gets it plus ``attainment.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray

from bench.common import wiki_chat_requests
from cache_node.model_loader import load_model
from services.config import NodeConfig, ServiceConfig
from services.launcher import Services, start_services, stop_services
from tenants.model import SLO_CLASS_DEFAULTS, SloClass
from workloads.corpus import load_corpus
from workloads.deepresearch.config import TenantProfile
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.metrics import compute_report
from workloads.deepresearch.sampling import gamma_arrival_times

SCHEDULERS = ("fcfs", "vtc", "kvstrata")
# name, class, share of the offered rate, arrival CV
TENANTS = (("live", "interactive", 1.0, 1.0), ("std", "standard", 1.0, 1.0),
           ("bulk", "batch", 1.0, 4.0), ("noisy", "standard", 4.0, 4.0))


def profiles() -> list[TenantProfile]:
    out = []
    for name, cls, share, cv in TENANTS:
        d = SLO_CLASS_DEFAULTS[SloClass(cls)]
        out.append(TenantProfile(name, cls, d.ttft_slo_ms, d.tpot_slo_ms, d.min_tokens_per_s, d.weight,
                                 sessions_per_s=share, arrival_cv=cv, noisy=name == "noisy"))
    return out


def trace(rate_rps: float, duration_s: float, n_prompts: int, seed: int) -> list[tuple[float, str, int]]:
    """(arrival_s, tenant, prompt index), sorted; tenant rates split ``rate_rps`` by share."""
    total_share = sum(t[2] for t in TENANTS)
    out = []
    for k, (name, _, share, cv) in enumerate(TENANTS):
        rng = np.random.default_rng([seed, k])
        for t in gamma_arrival_times(rate_rps * share / total_share, cv, duration_s, rng):
            out.append((t, name, int(rng.integers(n_prompts))))
    return sorted(out)


def deploy(scheduler: str, node: NodeConfig) -> Services:
    if not ray.is_initialized():
        ray.init(address="local", namespace="kvstrata-bench-slo", include_dashboard=False,
                 log_to_driver=False, resources={"cache_node": 1, "spill_node": 1})
    cfg = ServiceConfig(num_cache_nodes=1, node=node, gateway_port=0, scheduler=scheduler,
                        queue_limit=10_000, state_dir=tempfile.mkdtemp(prefix="kvstrata-slo-"))
    return start_services(cfg)


async def register(services: Services) -> dict[str, str]:
    import grpc

    from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
    from services.convert import slo_class_to_pb

    keys = {}
    async with grpc.aio.insecure_channel(services.address) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        admin = (("authorization", f"Bearer {services.admin_key}"),)
        for name, cls, _, _ in TENANTS:  # every SLO field takes its class default
            pb = tenant_pb2.TenantSpec(name=name, slo_class=slo_class_to_pb(SloClass(cls)))
            resp = await stub.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=pb), metadata=admin)
            keys[name] = resp.api_key
    return keys


async def play(services: Services, keys: dict[str, str], arrivals: list[tuple[float, str, int]],
               prompts: list[list[dict[str, str]]], max_tokens: int) -> list[dict[str, Any]]:
    """Send every arrival at its time (open loop); one record per request."""
    client = GrpcInferenceClient(services.address, timeout_s=300.0)
    t0 = time.monotonic()

    async def one(i: int, at_s: float, tenant: str, p: int) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
        res = await client.generate(api_key=keys[tenant], session_id="", messages=prompts[p],
                                    max_tokens=max_tokens, temperature=0.0, request_id=f"{tenant}-{i}")
        # each request is its own agent (one call, no session)
        rec = res.as_dict() | {"tenant": tenant, "correct": None, "session_id": f"{tenant}-{i}"}
        rec["start_s"], rec["end_s"] = res.start_s - t0, res.end_s - t0
        return rec

    try:
        return list(await asyncio.gather(*(one(i, *a) for i, a in enumerate(arrivals))))
    finally:
        await client.close()


def capacity_rps(services: Services, keys: dict[str, str], prompts: list, max_tokens: int, n: int) -> float:
    """Requests/s with ``n`` requests in flight at once (saturated throughput)."""
    t0 = time.monotonic()
    recs = asyncio.run(play(services, keys, [(0.0, "bulk", i % len(prompts)) for i in range(n)], prompts,
                            max_tokens))
    ok = sum(r["status"] == "ok" for r in recs)
    return ok / (time.monotonic() - t0)


def summarize(report: dict[str, Any], records: list[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, row in report["tenants"].items():
        out[name] = {
            "ttft_p50_ms": row["ttft_ms"]["p50"], "ttft_p95_ms": row["ttft_ms"]["p95"],
            "ttft_slo_attainment": row["ttft_slo_attainment"], "floor_attainment": row["floor"]["attainment"],
            "tokens_per_s": row["output_tokens_per_s"], "rejected": row["rejections"],
            "preempted": row["preemptions"], "requests": row["calls"], "ok": row["ok"],
        }
    good = sum(r["status"] == "ok" and r["ttft_ms"] is not None and r["ttft_ms"] <= slo[r["tenant"]]
               for r in records)
    span = max(r["end_s"] for r in records) - min(r["start_s"] for r in records)
    out["goodput_rps"] = good / span if span > 0 else 0.0
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [t[0] for t in TENANTS]
    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "ttft_slo_attainment", "TTFT SLO attainment"),
                           (axes[1], "floor_attainment", "token-rate floor attainment")):
        for k, sched in enumerate(results):
            vals = [results[sched][n][key] if results[sched][n][key] is not None else np.nan for n in names]
            ax.bar(np.arange(len(names)) + 0.27 * (k - 1), vals, width=0.27, label=sched)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--load", type=float, default=1.5, help="mean offered rate / measured capacity")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--out", default="reports/slo")
    args = ap.parse_args(argv)
    duration_s, n_prompts, max_tokens = (40.0, 24, 16) if args.quick else (120.0, 64, 24)
    tok = load_model().tokenizer
    reqs = wiki_chat_requests(tok, load_corpus(), n_prompts, seed=3, min_words=30, max_words=90)
    prompts = [[{"role": "user", "content": r.user_text}] for r in reqs]
    node = NodeConfig(kv_pool_bytes=96 << 20, max_num_seqs=16, max_num_batched_tokens=256,
                      torch_threads=os.cpu_count() or 2)
    tenants, slo = profiles(), {t.name: t.ttft_slo_ms for t in profiles()}
    results: dict[str, Any] = {}
    cap = 0.0
    for sched in args.schedulers.split(","):
        services = deploy(sched, node)
        try:
            keys = asyncio.run(register(services))
            if not cap:
                cap = capacity_rps(services, keys, prompts, max_tokens, n=16 if args.quick else 32)
                print(f"capacity {cap:.2f} requests/s", flush=True)
            arrivals = trace(args.load * cap, duration_s, n_prompts, seed=11)
            records = asyncio.run(play(services, keys, arrivals, prompts, max_tokens))
        finally:
            stop_services(services)
        report = compute_report(records, [], tenants)
        results[sched] = summarize(report, records, slo)
        print(f"{sched}: {json.dumps(results[sched])}", flush=True)
    ray.shutdown()
    base = results.get("fcfs", {}).get("goodput_rps") or None
    out = {
        "capacity_rps": cap, "offered_load": args.load, "duration_s": duration_s,
        "schedulers": results,
        "goodput_ratio_vs_fcfs": {s: (r["goodput_rps"] / base if base else None) for s, r in results.items()},
    }
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "result.json").write_text(json.dumps(out, indent=2))
    plot(results, path / "attainment.png")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
