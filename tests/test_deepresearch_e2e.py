"""The DeepResearch main job, tiny, against the real services (real Ray, gRPC, model, text)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from workloads.deepresearch.config import CallMaxTokens, WorkloadConfig
from workloads.deepresearch.demo_config import demo_tenants
from workloads.deepresearch.job import run_deepresearch_grpc
from workloads.deepresearch.register import register_tenants
from workloads.deepresearch.report import compute_report, load_jsonl
from workloads.deepresearch.runner import RunOptions

pytestmark = pytest.mark.slow


def test_tiny_deepresearch_run_end_to_end(stack, tmp_path) -> None:
    """Two tenants' research sessions (a lead, two sub-agents with one read each) through the
    gateway to the cache nodes: every call ok, graded answers, session turns reusing their KV,
    and the saved report equal to one recomputed from the run's files. Replies are capped at
    8-16 tokens (the demo's 12-48) and articles shown at 60 words (150): decoding and
    prefilling on the nodes are most of this test's time."""
    tenants = demo_tenants(0.5)[:2]
    short = CallMaxTokens(plan=16, search=8, read=8, answer=8, report=8)
    config = WorkloadConfig(seed=3, duration_s=3.0, tenants=tenants, max_sessions_per_tenant=1,
                            min_subagents=2, max_subagents=2, max_reads=1, max_tokens=short,
                            max_article_words=60)
    address, admin = stack.services.address, stack.services.admin_key

    async def go():
        async with grpc.aio.insecure_channel(address) as ch:
            keys = await register_tenants(ch, admin, config.tenants, name_suffix="-e2e")
        return await run_deepresearch_grpc(
            config, address, keys, admin_key=admin, root=tmp_path,
            options=RunOptions(time_scale=0.05, show_progress=False, probe_interval_s=0.5),
        )

    outcome = asyncio.run(asyncio.wait_for(go(), timeout=240))
    records = outcome.result.records
    statuses = [r["status"] for r in records]
    assert outcome.exit_code == 0 and statuses.count("ok") == len(records) >= 8
    assert {r["tenant"] for r in records} == {t.name for t in tenants}
    assert all(r["completion_tokens"] > 0 and r["text"] for r in records)
    assert max(r["completion_tokens"] for r in records) <= 16  # the caps were sent and kept
    graded = [r for r in records if r["expected_answer"]]
    assert graded and all(r["correct"] in (True, False) for r in graded)
    assert any(r["cached_device_tokens"] > 0 for r in records)  # session turns reuse their KV
    saved = json.loads((outcome.run_dir / "report.json").read_text())
    run_dir = outcome.run_dir
    info = json.loads((run_dir / "run.json").read_text())  # the scheduler the gateway named, the policy
    again = compute_report(load_jsonl(run_dir / "calls.jsonl"), load_jsonl(run_dir / "timeseries.jsonl"), tenants,
                           scheduler=info["scheduler"], policy=info["policy"])
    assert json.loads(json.dumps(again)) == saved
    assert saved["scheduler"] == stack.config.scheduler == "fcfs"  # the test stack pins fcfs
