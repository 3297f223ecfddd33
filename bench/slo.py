"""Per-tenant SLOs under overload: one multi-tenant trace through fcfs, vtc and kvstrata.

``python -m bench.slo [--quick]``. For each scheduler a fresh deployment (local Ray cluster,
global scheduler, one cache node with the real SmolLM2, gRPC gateway) serves the same trace:

* tenants ``live`` (interactive), ``std`` (standard), ``bulk`` (batch) and ``noisy`` (standard,
  offering 4x the others' rate), with their class's weight. Their TTFT targets, TPOT targets and
  token-rate floors are, by default (``--slo calibrated``), multiples of what one request alone
  sees on this deployment, measured first (``TTFT_SCALE``, ``TPOT_SCALE``, ``FLOOR_SHARE``: the
  SLO scale of DistServe and Apt-Serve); ``--slo defaults`` takes the class defaults of
  ``tenants.model`` (sized for a GPU: the interactive floor of 10 tok/s is above a lone SmolLM2
  decode on 2 CPU cores);
* single-turn chat requests over Wikipedia extracts (``bench.common.wiki_chat_requests``);
* Gamma arrivals per tenant (``workloads.deepresearch.sampling``): CV 1 for ``live`` and
  ``std``, CV 4 for ``bulk`` and ``noisy``; the total mean rate is ``--load`` times the capacity
  measured first (requests/s with every request in flight at once), so bursts reach well over
  2x capacity.

Per scheduler and tenant the report (``workloads.deepresearch.metrics.compute_report``) gives
``ttft_p50_ms``, ``ttft_p95_ms``, ``ttft_slo_attainment``, ``floor_attainment``,
``tokens_per_s``, ``rejected``, ``preempted`` (floors over 2 s windows, counting uncached
prefill and output tokens, as the scheduler meters them); goodput is requests that finished within their
tenant's TTFT target per second, and ``goodput_ratio_vs_fcfs`` divides by fcfs's. The last
stdout line is that JSON; ``reports/slo/`` gets it plus ``attainment.png`` and
``requests.jsonl`` (every request's record, per scheduler).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np
import ray

from bench.common import wiki_chat_requests
from cache_node.model_loader import load_model
from services.config import NodeConfig, ServiceConfig
from services.grpc_messages import client_channel_options
from services.launcher import Services, start_services, stop_services
from services.ray_auth import init_local_cluster
from tenants.model import SLO_CLASS_DEFAULTS, SloClass
from workloads.corpus import load_corpus
from workloads.deepresearch.config import TenantProfile
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.metrics import compute_report
from workloads.deepresearch.sampling import gamma_arrival_times

SCHEDULERS = ("fcfs", "vtc", "kvstrata")
FLOOR_WINDOW_S = 2.0  # floor-attainment window of the report: the kvstrata scheduler's rate meter window
# name, class, share of the offered rate, arrival CV
TENANTS = (("live", "interactive", 1.0, 1.0), ("std", "standard", 1.0, 1.0),
           ("bulk", "batch", 1.0, 4.0), ("noisy", "standard", 4.0, 4.0))


# Calibrated SLOs (``--slo calibrated``, the default): each class's targets as multiples of
# this deployment's unloaded latency, the "SLO scale" of DistServe (§6.1) and Apt-Serve (§5),
# so a target is one the hardware can meet at all. TTFT target = scale x the isolated TTFT p50;
# floor = share x the lone decode rate (tokens/s of one request alone); TPOT target = scale x
# the lone TPOT. The ratios between classes follow ``tenants.model.SLO_CLASS_DEFAULTS``
# (TTFT 1 : 5 : 60; floors 10 : 4 : 0 tok/s).
TTFT_SCALE = {"interactive": 4.0, "standard": 20.0, "batch": 240.0}
FLOOR_SHARE = {"interactive": 0.25, "standard": 0.1, "batch": 0.0}
TPOT_SCALE = {"interactive": 2.5, "standard": 6.0, "batch": 25.0}


@dataclass(frozen=True)
class Unloaded:
    """What one request alone sees on this deployment (medians over the calibration prompts)."""

    ttft_ms: float
    tpot_ms: float


def profiles(unloaded: Unloaded | None) -> list[TenantProfile]:
    """The bench's tenants: class defaults (``unloaded`` None) or calibrated SLOs."""
    out = []
    for name, cls, share, cv in TENANTS:
        d = SLO_CLASS_DEFAULTS[SloClass(cls)]
        ttft, tpot, floor = d.ttft_slo_ms, d.tpot_slo_ms, d.min_tokens_per_s
        if unloaded is not None:
            ttft = round(TTFT_SCALE[cls] * unloaded.ttft_ms, 1)
            tpot = round(TPOT_SCALE[cls] * unloaded.tpot_ms, 1)
            floor = round(FLOOR_SHARE[cls] * 1000.0 / unloaded.tpot_ms, 2)
        out.append(TenantProfile(name, cls, ttft, tpot, floor, d.weight,
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


def peak_load(arrivals: list[tuple[float, str, int]], capacity_rps: float, window_s: float = 10.0) -> float:
    """Most arrivals in any ``window_s`` window (starting at an arrival) per second, over the
    capacity: the trace's peak offered load."""
    times = [a[0] for a in arrivals]
    most = max((sum(t <= u < t + window_s for u in times) for t in times), default=0)
    return most / window_s / capacity_rps if capacity_rps > 0 else 0.0


def deploy(scheduler: str, node: NodeConfig) -> Services:
    if not ray.is_initialized():
        init_local_cluster(namespace="kvstrata-bench-slo", include_dashboard=False,  # token-authenticated
                           log_to_driver=False, resources={"cache_node": 1, "spill_node": 1})
    cfg = ServiceConfig(num_cache_nodes=1, node=node, gateway_port=0, http_port=0, scheduler=scheduler,
                        queue_limit=10_000, state_dir=tempfile.mkdtemp(prefix="kvstrata-slo-"))
    return start_services(cfg)


async def register(services: Services, tenants: list[TenantProfile], calib: bool = False) -> dict[str, str]:
    """Register ``tenants`` with their SLO fields and, with ``calib``, tenant ``calib`` (batch
    class, class defaults) for the calibration and capacity runs. Returns name -> API key."""
    import grpc

    from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
    from services.convert import slo_class_to_pb

    specs = [tenant_pb2.TenantSpec(name=t.name, slo_class=slo_class_to_pb(SloClass(t.slo_class)),
                                   ttft_slo_ms=t.ttft_slo_ms, tpot_slo_ms=t.tpot_slo_ms,
                                   min_tokens_per_s=t.min_tokens_per_s, weight=t.weight) for t in tenants]
    if calib:
        specs.append(tenant_pb2.TenantSpec(name="calib", slo_class=slo_class_to_pb(SloClass.BATCH)))
    keys = {}
    async with grpc.aio.insecure_channel(services.address, options=client_channel_options()) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        admin = (("authorization", f"Bearer {services.admin_key}"),)
        for pb in specs:
            resp = await stub.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=pb), metadata=admin)
            keys[pb.name] = resp.api_key
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


def unloaded(services: Services, keys: dict[str, str], prompts: list, max_tokens: int, n: int) -> Unloaded:
    """Send ``n`` prompts one at a time (nothing else running); medians of TTFT and TPOT."""
    recs = []
    for i in range(n):
        recs += asyncio.run(play(services, keys, [(0.0, "calib", i % len(prompts))], prompts, max_tokens))
    ok = [r for r in recs if r["status"] == "ok" and r["ttft_ms"] is not None and r["tpot_ms"] is not None]
    if not ok:
        raise RuntimeError(f"calibration: no request succeeded ({[r['status'] for r in recs]})")
    return Unloaded(float(np.median([r["ttft_ms"] for r in ok])), float(np.median([r["tpot_ms"] for r in ok])))


def capacity_rps(services: Services, keys: dict[str, str], prompts: list, max_tokens: int, n: int) -> float:
    """Requests/s with ``n`` requests in flight at once (saturated throughput)."""
    t0 = time.monotonic()
    recs = asyncio.run(play(services, keys, [(0.0, "calib", i % len(prompts)) for i in range(n)], prompts,
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
    for ax, key, title, ylabel in (
        (axes[0], "ttft_slo_attainment", "TTFT SLO attainment", "fraction of ok requests"),
        (axes[1], "floor_attainment", "token-rate floor attainment",
         f"fraction of backlogged {FLOOR_WINDOW_S:g} s windows"),
    ):
        for k, sched in enumerate(results):
            vals = [results[sched][n][key] if results[sched][n][key] is not None else np.nan for n in names]
            ax.bar(np.arange(len(names)) + 0.27 * (k - 1), vals, width=0.27, label=sched)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--load", type=float, default=1.5, help="mean offered rate / measured capacity")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--slo", choices=("calibrated", "defaults"), default="calibrated",
                    help="tenant SLOs: multiples of the measured unloaded latency, or the class defaults")
    ap.add_argument("--out", default="reports/slo")
    args = ap.parse_args(argv)
    duration_s, n_prompts, max_tokens = (40.0, 24, 16) if args.quick else (120.0, 64, 24)
    tok = load_model().tokenizer
    reqs = wiki_chat_requests(tok, load_corpus(), n_prompts, seed=3, min_words=30, max_words=90)
    prompts = [[{"role": "user", "content": r.user_text}] for r in reqs]
    node = NodeConfig(kv_pool_bytes=96 << 20, max_num_seqs=16, max_num_batched_tokens=256,
                      torch_threads=os.cpu_count() or 2)
    results: dict[str, Any] = {}
    per_request: dict[str, list[dict[str, Any]]] = {}
    cap, base, tenants = 0.0, None, profiles(None)
    for sched in args.schedulers.split(","):
        services = deploy(sched, node)
        try:
            if not cap:  # the first deployment measures, before any tenant of the trace exists
                calib_keys = asyncio.run(register(services, [], calib=True))
                if args.slo == "calibrated":
                    base = unloaded(services, calib_keys, prompts, max_tokens, n=6 if args.quick else 10)
                    tenants = profiles(base)
                    print(f"unloaded: TTFT p50 {base.ttft_ms:.0f} ms, TPOT p50 {base.tpot_ms:.1f} ms", flush=True)
                cap = capacity_rps(services, calib_keys, prompts, max_tokens, n=16 if args.quick else 32)
                print(f"capacity {cap:.2f} requests/s", flush=True)
                keys = asyncio.run(register(services, tenants)) | calib_keys
            else:
                keys = asyncio.run(register(services, tenants))
            arrivals = trace(args.load * cap, duration_s, n_prompts, seed=11)
            records = asyncio.run(play(services, keys, arrivals, prompts, max_tokens))
        finally:
            stop_services(services)
        per_request[sched] = records
        report = compute_report(records, [], tenants, window_s=FLOOR_WINDOW_S)
        results[sched] = summarize(report, records, {t.name: t.ttft_slo_ms for t in tenants})
        print(f"{sched}: {json.dumps(results[sched])}", flush=True)
    ray.shutdown()
    fcfs_goodput = results.get("fcfs", {}).get("goodput_rps") or None
    out = {
        "capacity_rps": cap, "offered_load": args.load, "duration_s": duration_s, "slo": args.slo,
        "unloaded": None if base is None else {"ttft_ms": round(base.ttft_ms, 1), "tpot_ms": round(base.tpot_ms, 1)},
        "tenants": {t.name: {"slo_class": t.slo_class, "ttft_slo_ms": t.ttft_slo_ms, "tpot_slo_ms": t.tpot_slo_ms,
                             "min_tokens_per_s": t.min_tokens_per_s} for t in tenants},
        "floor_window_s": FLOOR_WINDOW_S,
        "peak_load_10s": round(peak_load(arrivals, cap), 2),  # every scheduler served this trace
        "schedulers": results,
        "goodput_ratio_vs_fcfs": {s: (r["goodput_rps"] / fcfs_goodput if fcfs_goodput else None)
                                  for s, r in results.items()},
    }
    _write(Path(args.out), out, per_request)
    print(json.dumps(out))


def _write(path: Path, out: dict[str, Any], per_request: dict[str, list[dict[str, Any]]]) -> None:
    """``result.json``, ``requests.jsonl`` (one line per request, for diagnosing misses) and the
    attainment plot under ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "result.json").write_text(json.dumps(out, indent=2))
    with (path / "requests.jsonl").open("w") as f:
        for sched, records in per_request.items():
            for r in records:
                f.write(json.dumps({"scheduler": sched, **r}, default=str) + "\n")
    plot(out["schedulers"], path / "attainment.png")


if __name__ == "__main__":
    main()
