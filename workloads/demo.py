"""`make demo`: the DeepResearch multi-agent job on a local cluster, end to end.

Starts an embedded Ray cluster (2 cache nodes), the services and the gRPC gateway; registers
the demo tenants over gRPC; runs the workload on the real model and real Wikipedia text;
prints the per-tenant summary and where the report is; shuts everything down. Exit code 1
when no call succeeded. ``--compare fcfs`` then replays the run's calls on a fresh deployment
running fcfs and adds both side by side to the run's report.md
(``workloads.deepresearch.compare``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from rich.console import Console

from cache_node.scheduling import SCHEDULING_POLICIES
from services.config import NodeConfig, ServiceConfig
from services.grpc_messages import client_channel_options
from services.launcher import Services, start_services, stop_services
from services.tls import ClientTls, http_scheme, open_aio_channel
from workloads.deepresearch.compare import append_comparison, print_comparison
from workloads.deepresearch.config import WorkloadConfig
from workloads.deepresearch.demo_config import demo_tenants
from workloads.deepresearch.generator import generate_plan, no_session_message
from workloads.deepresearch.job import JobOutcome, run_deepresearch_grpc
from workloads.deepresearch.register import register_tenants


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration-s", type=float, default=50.0, help="arrival window of research sessions")
    p.add_argument("--sessions-per-s", type=float, default=0.054,
                   help="research sessions per second of one tenant share (the noisy tenant arrives at 4x this rate)")
    p.add_argument("--seed", type=int, default=0, help="the plan's random seed (same seed: same sessions)")
    p.add_argument("--max-subagents", type=int, default=3, help="sub-agents per research session (2..6)")
    p.add_argument("--nodes", type=int, default=2, help="cache nodes")
    p.add_argument("--scheduler", default="kvstrata", help="kvstrata (default) | fcfs | priority | vtc")
    p.add_argument("--policy", default="", help="KV policy for every tenant (cache_node.policies spec)")
    p.add_argument("--kv-pool-mib", type=int, default=128, help="device-tier pool per cache node")
    p.add_argument("--reports", default="reports",
                   help="where the report folder goes (<reports>/latest points at it)")
    p.add_argument("--replay", default="", help="trace.jsonl of an earlier run: send its calls again with the "
                   "recorded messages, arrivals and pauses, whatever the model replies (for benchmarking)")
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc", help="the API the calls go through: "
                   "gRPC, or the OpenAI-compatible HTTP API with the official openai client")
    p.add_argument("--compare", default="", metavar="SCHEDULER",
                   help="after the run, replay its calls (trace.jsonl) on a fresh deployment running this "
                   "scheduler (e.g. fcfs) and add both side by side to report.md (about doubles the time)")
    args = p.parse_args(argv)
    for name in ("scheduler", "compare"):
        value = getattr(args, name)
        if value and value not in SCHEDULING_POLICIES:
            p.error(f"--{name} must be one of {sorted(SCHEDULING_POLICIES)}, got {value!r}")
    config = workload_config(args)
    if not args.replay and not generate_plan(config).sessions:  # before starting anything
        p.error(no_session_message(config, args.sessions_per_s, "--duration-s", ""))
    return args


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(seed=args.seed, duration_s=args.duration_s, tenants=demo_tenants(args.sessions_per_s),
                          max_subagents=args.max_subagents)


async def _run(args: argparse.Namespace, services: Services, console: Console, replay: str,
               reports: str) -> JobOutcome:
    config = workload_config(args)
    address, admin_key, tls = services.address, services.admin_key, ClientTls.of_config(services.config)
    async with open_aio_channel(address, tls, client_channel_options(services.config.grpc_max_message_bytes)) as channel:
        keys = await register_tenants(channel, admin_key, config.tenants, policy=args.policy,
                                      replace_any=True)  # a deployment of its own (_serve_and_run)
    console.print(f"registered tenants over gRPC: {', '.join(keys)}")
    url = f"{http_scheme(tls)}://{services.http_address}/v1" if args.api == "openai" else ""
    return await run_deepresearch_grpc(config, address, keys, admin_key=admin_key, root=reports,
                                       console=console, policy=args.policy,
                                       replay=replay or None, openai_url=url, tls=tls)


def _serve_and_run(args: argparse.Namespace, scheduler: str, console: Console, replay: str,
                   reports: str) -> JobOutcome:
    """Start the services with ``scheduler``, run the workload (or ``replay``), stop them."""
    t0 = time.monotonic()
    cfg = ServiceConfig(
        num_cache_nodes=args.nodes, gateway_port=0, http_port=0, scheduler=scheduler,
        state_dir=tempfile.mkdtemp(prefix="kvstrata-demo-"), node=NodeConfig(kv_pool_bytes=args.kv_pool_mib << 20),
    )
    console.print(f"starting {args.nodes} cache nodes ({scheduler} scheduler), the global scheduler and the gateway ...")
    services = start_services(cfg)
    console.print(f"gateway at {services.address} (up in {time.monotonic() - t0:.0f} s)")
    try:
        return asyncio.run(_run(args, services, console, replay, reports))
    finally:
        stop_services(services)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up when piped too
    console = Console(width=None if sys.stdout.isatty() else 160)  # piped: keep the table readable
    t0 = time.monotonic()
    ray.init(address="local", num_cpus=os.cpu_count() or 2, namespace="kvstrata-demo", include_dashboard=False,
             resources={"cache_node": args.nodes, "spill_node": 1}, log_to_driver=False)
    try:
        outcome = _serve_and_run(args, args.scheduler, console, args.replay, args.reports)
        if args.compare and outcome.exit_code == 0:
            console.print(f"--compare {args.compare}: the same calls again, on a fresh deployment")
            other = _serve_and_run(args, args.compare, console, str(outcome.run_dir / "trace.jsonl"),
                                   str(Path(args.reports) / f"compare-{args.compare}"))
            append_comparison(outcome.run_dir, outcome.report, other.report, other.run_dir)
            print_comparison(outcome.report, other.report, console)
            console.print(f"comparison: {outcome.run_dir / 'report.md'} (section 'Compared with {args.compare}')")
        return outcome.exit_code
    finally:
        ray.shutdown()
        console.print(f"shut down; total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
