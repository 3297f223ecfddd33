"""run_deepresearch_grpc end to end against the stand-in servicer: plan, run, report, exit code."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import grpc
from rich.console import Console

from kvstrata.v1 import inference_pb2_grpc
from tests.test_workload_grpc_client import StandIn
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.job import JobOutcome, run_deepresearch_grpc
from workloads.deepresearch.runner import RunOptions

CONFIG = WorkloadConfig(
    seed=3, duration_s=30.0, max_sessions_per_tenant=1,
    tenants=(TenantProfile("t", "standard", 5000.0, 500.0, 1.0, sessions_per_s=1.0),),
)  # fmt: skip


def _job(api_key: str, root: Path, replay: Path | None = None) -> tuple[JobOutcome, StandIn]:
    async def main() -> tuple[JobOutcome, StandIn]:
        server = grpc.aio.server()
        servicer = StandIn()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            outcome = await run_deepresearch_grpc(
                CONFIG, f"127.0.0.1:{port}", {"t": api_key}, timeout_s=10.0, root=root,
                options=RunOptions(time_scale=0.0, show_progress=False),
                console=Console(file=io.StringIO(), width=200), replay=replay,
            )  # fmt: skip
        finally:
            await server.stop(None)
        return outcome, servicer

    return asyncio.run(main())


def test_a_good_run_writes_the_report_and_exits_zero(tmp_path: Path) -> None:
    outcome, servicer = _job("good", tmp_path)
    overall = outcome.report["overall"]
    assert outcome.exit_code == 0
    assert overall["ok"] == overall["sent"] == overall["calls"] == len(servicer.requests)
    assert overall["cache_hit_rate"]["device"] == 0.25  # 5 of 20 prompt tokens per call
    assert overall["preemptions"] == overall["ok"]
    assert outcome.run_dir.parent == tmp_path / "deepresearch"
    trace = (outcome.run_dir / "trace.jsonl").read_text().splitlines()
    assert len(trace) == overall["calls"]
    run_info = json.loads((outcome.run_dir / "run.json").read_text())
    assert run_info["config"]["seed"] == 3 and run_info["close_failures"] == 0
    assert sorted(servicer.closed) == sorted({json.loads(row)["session_id"] for row in trace})
    # the stand-in answers "Fritz Lang" to everything: no plan items (fallback), its own query
    agents = outcome.report["agents"]
    assert (agents["plans"], agents["plan_fallbacks"]) == (1, 1)
    assert agents["searches"] == agents["answers"] > 0 and agents["query_fallbacks"] == 0
    assert (f"Agents: 0 of 1 lead plans gave every sub-agent a question (the others fell back to "
            f"the generator's); {agents['searches']} of {agents['searches']} searches ran the model's "
            f"own query; {agents['found_target']} of {agents['answers']} answers") \
        in (outcome.run_dir / "report.md").read_text()


def test_a_run_with_no_successful_call_exits_non_zero(tmp_path: Path) -> None:
    outcome, servicer = _job("wrong-key", tmp_path)
    overall = outcome.report["overall"]
    assert outcome.exit_code == 1
    assert overall["ok"] == 0
    assert overall["failures_by_status"]["UNAUTHENTICATED"] == 1  # the lead's plan
    assert overall["failures_by_status"]["SKIPPED"] == overall["calls"] - 1
    assert len(servicer.requests) == 1


def _sent(servicer: StandIn) -> list[tuple[str, str, str]]:
    return sorted((r.request_id, r.session_id, str(r.chat)) for r in servicer.requests)


def test_a_replay_of_the_run_trace_sends_the_same_requests(tmp_path: Path) -> None:
    outcome, servicer = _job("good", tmp_path / "first")
    replayed, again = _job("good", tmp_path / "again", replay=outcome.run_dir / "trace.jsonl")
    assert replayed.exit_code == 0 and _sent(again) == _sent(servicer)
    assert json.loads((replayed.run_dir / "run.json").read_text())["replay"].endswith("trace.jsonl")
    first = (outcome.run_dir / "trace.jsonl").read_text().splitlines()
    second = (replayed.run_dir / "trace.jsonl").read_text().splitlines()
    assert [json.loads(a)["messages"] for a in first] == [json.loads(b)["messages"] for b in second]
