"""The DeepResearch agents on a real in-process engine and the real model (SmolLM2-135M):
later prompts carry what the model wrote earlier in the session, and a replay of the run's
trace sends the same messages, call by call, whatever the model says the second time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from cache_node.model_loader import LoadedModel
from tests.conftest import make_engine
from workloads.deepresearch.config import CallMaxTokens, TenantProfile, WorkloadConfig
from workloads.deepresearch.engine_client import EngineClient
from workloads.deepresearch.generator import generate_plan
from workloads.deepresearch.parsing import clean_query
from workloads.deepresearch.plan import WorkloadPlan
from workloads.deepresearch.runner import RunOptions, RunResult, run_workload
from workloads.deepresearch.trace import load_replay, write_trace
from workloads.text import first_words

pytestmark = pytest.mark.slow

CONFIG = WorkloadConfig(
    seed=3, duration_s=5.0, max_sessions_per_tenant=1, min_subagents=2, max_subagents=2,
    max_reads=2, max_article_words=50,
    tenants=(TenantProfile("t", "standard", 5000.0, 500.0, 1.0, sessions_per_s=1.0),),
    # the queries as long as the demo's (the checks parse them), the plan 32 tokens (its first two
    # lines hold the two sub-agents' questions); the replies only
    # carried forward (reads, answers) or not read at all (the report) a few tokens: the run is
    # a chain of dependent calls, each token of its longest path one engine step; the articles
    # read cut to 50 words (150 by default): each is prefilled in the run and in its replay
    max_tokens=CallMaxTokens(plan=32, search=12, read=2, answer=4, report=1),
)  # fmt: skip


class RecordingClient(EngineClient):
    """The engine client, keeping every request it was sent; ``max_tokens``: a cap on each
    call's reply (None: the call's own)."""

    def __init__(self, *args: Any, max_tokens: int | None = None) -> None:
        super().__init__(*args)
        self.sent: list[tuple[str, list[dict[str, str]]]] = []
        self.max_tokens = max_tokens

    async def generate(self, **kw: Any) -> Any:
        self.sent.append((kw["request_id"], kw["messages"]))
        if self.max_tokens is not None:
            kw["max_tokens"] = min(kw["max_tokens"], self.max_tokens)
        return await super().generate(**kw)


def _run(lm: LoadedModel, plan: WorkloadPlan, temperature: float,
         max_tokens: int | None = None) -> tuple[RunResult, RecordingClient]:
    engine = make_engine(lm, kv_pool_bytes=64 << 20, max_num_batched_tokens=512)
    client = RecordingClient(engine, lm.tokenizer, max_tokens=max_tokens)
    options = RunOptions(time_scale=0.0, show_progress=False, temperature=temperature)
    return asyncio.run(run_workload(plan, client, {"t": "t"}, options=options)), client


@pytest.fixture(scope="module")
def live(real_model: LoadedModel) -> tuple[RunResult, RecordingClient]:
    return _run(real_model, generate_plan(CONFIG), temperature=0.0)


def _user_text(row: dict[str, Any]) -> str:
    return row["messages"][-1]["content"]


def test_later_prompts_carry_what_the_model_wrote(live: tuple[RunResult, RecordingClient]) -> None:
    result, _ = live
    assert {r["status"] for r in result.records} <= {"ok", "SKIPPED"}
    text = {r["call_id"]: r["text"] for r in result.records}
    trace = {row["call_id"]: row for row in result.trace}
    plan = trace["t-0000/lead#0"]["decision"]
    for k, question in enumerate(plan["sub_questions"], start=1):
        search = trace[f"t-0000/sub{k}#0"]
        # plan -> sub-question: a parsed line of the lead's reply (or the counted fallback)
        assert f"Your task: {question}\n" in _user_text(search)
        if search["decision"]["question_source"] == "plan":
            assert question.split()[0] in text["t-0000/lead#0"]
        # query -> hits -> read: the sub-agent's reply is the query the first read shows
        query = search["decision"]["query"]
        if not search["decision"]["query_fallback"]:
            assert query == clean_query(text[f"t-0000/sub{k}#0"]) != ""
        first_read = _user_text(trace[f"t-0000/sub{k}#1"])
        assert first_read.startswith(f'Search results for "{query}":\n1. {search["decision"]["hits"][0]}: ')
        assert trace[f"t-0000/sub{k}#1"]["decision"]["read"] in search["decision"]["hits"]
    # findings -> report: each sub-agent's answer, as the model wrote it
    report = _user_text(trace["t-0000/lead#1"])
    for k in (1, 2):
        answer_id = max(cid for cid in trace if cid.startswith(f"t-0000/sub{k}#"))
        assert f"answer: {first_words(text[answer_id], 40)}" in report
    assert len(plan["sub_questions"]) == 2
    searches = [trace[f"t-0000/sub{k}#0"]["decision"] for k in (1, 2)]
    assert any(d["question_source"] == "plan" for d in searches)  # the model's plan was used
    assert any(not d["query_fallback"] for d in searches)  # and a query it wrote


def test_replay_sends_the_recorded_messages_call_by_call(
    live: tuple[RunResult, RecordingClient], real_model: LoadedModel, tmp_path: Path
) -> None:
    """The replay's model says something else (sampled at temperature 1, each reply cut to at
    most 3 tokens: checked to differ from the recorded replies); the replay still sends every
    recorded call's messages, in each agent's order."""
    result, client = live
    write_trace(result.trace, tmp_path / "trace.jsonl")
    replay, again = _run(real_model, load_replay(tmp_path / "trace.jsonl"), temperature=1.0, max_tokens=3)
    assert [r["call_id"] for r in replay.records if r["completion_tokens"] > 3] == []
    assert [r["text"] for r in replay.records] != [r["text"] for r in result.records]  # other replies
    assert sorted(again.sent) == sorted(client.sent)
    for agent in {rid.rsplit("#", 1)[0] for rid, _ in client.sent}:
        order = [rid for rid, _ in client.sent if rid.startswith(agent + "#")]
        assert [rid for rid, _ in again.sent if rid.startswith(agent + "#")] == order
    assert again.sent[0] == client.sent[0] and again.sent[-1] == client.sent[-1]
    assert [row["messages"] for row in replay.trace] == [row["messages"] for row in result.trace]
