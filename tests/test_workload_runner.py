"""The async runner and the live agents, driven by a small in-memory fake client (no server,
no model): its scripted replies stand in for the model's, so every agent decision is checked."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from workloads.corpus import search
from workloads.deepresearch import prompts
from workloads.deepresearch.client import CallResult
from workloads.deepresearch.plan import (
    AgentScript,
    PlannedCall,
    ResearchSession,
    SubagentTask,
    WorkloadPlan,
)
from workloads.deepresearch.records import agent_counts
from workloads.deepresearch.runner import RunOptions, RunResult, run_workload
from workloads.deepresearch.trace import load_replay, write_trace


def _call(agent: str, turn: int, kind: str, **extra: Any) -> PlannedCall:
    session_id = f"t-0000/{agent}"
    return PlannedCall(
        call_id=f"{session_id}#{turn}", research_id="t-0000", session_id=session_id,
        tenant="t", agent=agent, kind=kind, turn=turn, pause_s=extra.pop("pause_s", 0.0),
        max_tokens=8, **extra,
    )  # fmt: skip


def _task(target: str, answer: str) -> SubagentTask:
    return SubagentTask(target, f"On {target}: ____?", answer, prompts.fallback_question(target))


def _plan() -> WorkloadPlan:
    """One session: lead plans; sub1 searches and answers; sub2 searches, reads, answers."""
    sub1 = AgentScript("t-0000/sub1", "sub1", (
        _call("sub1", 0, "search", pause_s=0.02),
        _call("sub1", 1, "answer", expected_answer="Fritz Lang"),
    ), _task("Metropolis (1927 film)", "Fritz Lang"))  # fmt: skip
    sub2 = AgentScript("t-0000/sub2", "sub2", (
        _call("sub2", 0, "search", pause_s=0.01),
        _call("sub2", 1, "read", pause_s=0.01),
        _call("sub2", 2, "answer", expected_answer="1927"),
    ), _task("Berlin", "1927"))  # fmt: skip
    lead = AgentScript("t-0000/lead", "lead", (_call("lead", 0, "plan"), _call("lead", 1, "report")))
    return WorkloadPlan(0, 1.0, (ResearchSession("t-0000", "t", 0.05, lead, (sub1, sub2)),))


class FakeClient:
    """Answers from a table; fails the calls named in ``failures`` with that status."""

    def __init__(self, replies: dict[str, str], failures: dict[str, str] | None = None) -> None:
        self.replies, self.failures = replies, failures or {}
        self.sent: list[dict[str, Any]] = []
        self.closed: list[tuple[str, str]] = []

    async def generate(self, *, api_key: str, session_id: str, messages: list[dict[str, str]],
                       max_tokens: int, temperature: float, request_id: str) -> CallResult:  # fmt: skip
        start_s = time.monotonic()
        self.sent.append({"request_id": request_id, "session_id": session_id,
                          "messages": messages, "api_key": api_key})  # fmt: skip
        await asyncio.sleep(0.001)
        call_id = request_id.removeprefix("run1:")
        if call_id in self.failures:
            return CallResult(status=self.failures[call_id], start_s=start_s,
                              end_s=time.monotonic(), error="no room")  # fmt: skip
        return CallResult(status="ok", text=self.replies.get(call_id, "fine"), prompt_tokens=10,
                          completion_tokens=2, cached_device_tokens=4, ttft_ms=1.0,
                          start_s=start_s, end_s=time.monotonic())  # fmt: skip

    async def close_session(self, *, api_key: str, session_id: str) -> str:
        self.closed.append((api_key, session_id))
        return "ok"


REPLIES = {
    "t-0000/lead#0": "Here is the plan:\n1. **Who directed Metropolis?**\n2. Berlin Wall history",
    "t-0000/sub1#0": 'Query: "Metropolis film director"',
    "t-0000/sub2#0": "Berlin Wall\nThis query finds the wall.",
    "t-0000/sub1#1": "It was Fritz Lang.",
    "t-0000/sub2#2": "1926",
}


def _run(client: FakeClient, plan: WorkloadPlan | None = None, **options: Any) -> RunResult:
    options = {"time_scale": 0.0, "show_progress": False, "session_prefix": "run1:", **options}
    plan = plan or _plan()
    return asyncio.run(run_workload(plan, client, {"t": "key-t"}, options=RunOptions(**options)))


def _sent(client: FakeClient, call_id: str) -> list[dict[str, str]]:
    return next(s["messages"] for s in client.sent if s["request_id"] == "run1:" + call_id)


def test_every_call_is_sent_graded_and_sessions_are_closed() -> None:
    client = FakeClient(REPLIES)
    result = _run(client)
    by_id = {r["call_id"]: r for r in result.records}
    assert len(result.records) == len(by_id) == 7
    assert {r["status"] for r in result.records} == {"ok"}
    assert by_id["t-0000/sub1#1"]["correct"] is True
    assert by_id["t-0000/sub2#2"]["correct"] is False
    assert by_id["t-0000/lead#0"]["correct"] is None
    assert client.sent[0]["request_id"] == "run1:t-0000/lead#0"
    assert client.sent[-1]["request_id"] == "run1:t-0000/lead#1"
    assert {s["api_key"] for s in client.sent} == {"key-t"}
    assert sorted(client.closed) == [
        ("key-t", "run1:t-0000/lead"), ("key-t", "run1:t-0000/sub1"), ("key-t", "run1:t-0000/sub2"),
    ]  # fmt: skip
    assert result.close_failures == 0
    assert [row["call_id"] for row in result.trace] == [
        "t-0000/lead#0", "t-0000/sub1#0", "t-0000/sub1#1", "t-0000/sub2#0", "t-0000/sub2#1",
        "t-0000/sub2#2", "t-0000/lead#1",
    ]  # fmt: skip


def test_agents_act_on_the_replies_plan_query_hits_read_findings() -> None:
    client = FakeClient(REPLIES)
    by_id = {r["call_id"]: r for r in _run(client).records}
    plan = by_id["t-0000/lead#0"]["decision"]
    assert plan["sub_questions"] == ["Who directed Metropolis?", "Berlin Wall history"]
    assert plan["plan_fallback"] is False
    assert "Your task: Who directed Metropolis?" in _sent(client, "t-0000/sub1#0")[1]["content"]
    search2 = by_id["t-0000/sub2#0"]["decision"]
    hits = [h.title for h in search("Berlin Wall", k=3)]
    assert (search2["query"], search2["query_fallback"], search2["hits"]) == ("Berlin Wall", False, hits)
    read = _sent(client, "t-0000/sub2#1")[0]["content"]
    assert read.startswith('Search results for "Berlin Wall":\n1. ' + hits[0])
    assert by_id["t-0000/sub2#1"]["decision"] == {"read": "Berlin Wall", "choice": "named"}
    assert "Article: Berlin Wall\n" in read and by_id["t-0000/sub2#1"]["doc_ids"] == hits
    assert by_id["t-0000/sub1#0"]["decision"]["query"] == "Metropolis film director"
    assert by_id["t-0000/sub1#1"]["decision"] == {"target": "Metropolis (1927 film)",
                                                  "found_target": False}  # fmt: skip
    report = _sent(client, "t-0000/lead#1")[0]["content"]
    assert "- sub1 on 'Who directed Metropolis?', read nothing: quote:  answer: It was Fritz Lang." in report
    assert "- sub2 on 'Berlin Wall history', read Berlin Wall: quote: fine answer: 1926" in report


def test_an_unusable_plan_and_query_fall_back_and_say_so() -> None:
    replies = REPLIES | {"t-0000/lead#0": "Sure!", "t-0000/sub2#0": '""'}
    client = FakeClient(replies)
    by_id = {r["call_id"]: r for r in _run(client).records}
    plan = by_id["t-0000/lead#0"]["decision"]
    assert plan["plan_fallback"] is True and plan["plan_items_parsed"] == 0
    assert plan["sub_questions"] == [prompts.fallback_question("Metropolis (1927 film)"),
                                     prompts.fallback_question("Berlin")]  # fmt: skip
    search2 = by_id["t-0000/sub2#0"]["decision"]
    assert search2["model_query"] == "" and search2["query_fallback"] is True
    assert search2["query"] == prompts.fallback_question("Berlin")
    assert agent_counts(list(by_id.values())) == {
        "plans": 1, "plan_fallbacks": 1, "searches": 2, "query_fallbacks": 1, "answers": 2,
        "found_target": 0,
    }  # fmt: skip


def test_a_replayed_trace_sends_the_same_messages_whatever_the_model_says(tmp_path: Path) -> None:
    """Replay must not depend on the model: other replies, same messages call by call."""
    first = FakeClient(REPLIES)
    recorded = _run(first)
    write_trace(recorded.trace, tmp_path / "trace.jsonl")
    replayed = load_replay(tmp_path / "trace.jsonl")
    assert replayed.sessions[0].replayed and replayed.num_calls() == 7
    second = FakeClient({"t-0000/lead#0": "1. Something else entirely", "t-0000/sub2#0": "Paris"})
    again = _run(second, replayed)
    assert [(s["request_id"], s["messages"]) for s in second.sent if "lead#1" not in s["request_id"]] \
        == [(s["request_id"], s["messages"]) for s in first.sent if "lead#1" not in s["request_id"]]
    assert _sent(second, "t-0000/lead#1") == _sent(first, "t-0000/lead#1")
    assert [r["call_id"] for r in again.trace] == [r["call_id"] for r in recorded.trace]
    assert {r["decision"]["replayed"] for r in again.records} == {True}
    assert set(agent_counts(again.records).values()) == {0}  # a replay decides nothing


def test_a_failed_call_skips_the_rest_of_its_agent_and_is_recorded() -> None:
    client = FakeClient(REPLIES, failures={"t-0000/sub2#0": "RESOURCE_EXHAUSTED"})
    result = _run(client)
    status = {r["call_id"]: r["status"] for r in result.records}
    assert status == {
        "t-0000/lead#0": "ok", "t-0000/sub1#0": "ok", "t-0000/sub1#1": "ok",
        "t-0000/sub2#0": "RESOURCE_EXHAUSTED", "t-0000/sub2#1": "SKIPPED",
        "t-0000/sub2#2": "SKIPPED", "t-0000/lead#1": "ok",
    }  # fmt: skip
    skipped = next(r for r in result.records if r["call_id"] == "t-0000/sub2#1")
    assert skipped["error"] == "not sent: t-0000/sub2#0 ended RESOURCE_EXHAUSTED"
    assert "- sub2: (no answer: RESOURCE_EXHAUSTED)" in client.sent[-1]["messages"][0]["content"]
    assert len(client.sent) == 5


def test_a_failed_lead_plan_skips_the_whole_session() -> None:
    client = FakeClient(REPLIES, failures={"t-0000/lead#0": "UNAVAILABLE"})
    result = _run(client)
    assert [s["request_id"] for s in client.sent] == ["run1:t-0000/lead#0"]
    assert [r["status"] for r in result.records].count("SKIPPED") == 6
    assert client.closed == [("key-t", "run1:t-0000/lead")]


def test_resend_history_sends_the_whole_conversation() -> None:
    client = FakeClient(REPLIES | {"t-0000/sub1#0": "read A"})
    _run(client, resend_history=True)
    answer = next(s for s in client.sent if s["request_id"] == "run1:t-0000/sub1#1")
    assert [m["role"] for m in answer["messages"]] == ["system", "user", "assistant", "user"]
    assert answer["messages"][2] == {"role": "assistant", "content": "read A"}
    assert answer["messages"][3]["content"] == prompts.answer_prompt("On Metropolis (1927 film): ____?")
    assert answer["session_id"] == "run1:t-0000/sub1"


def test_arrival_and_tool_pauses_are_waited_in_scaled_time() -> None:
    result = _run(FakeClient(REPLIES), time_scale=2.0)
    by_id = {r["call_id"]: r for r in result.records}
    assert by_id["t-0000/lead#0"]["start_s"] >= 0.1  # arrival 0.05 s x 2
    lead_end_s = by_id["t-0000/lead#0"]["end_s"]
    assert by_id["t-0000/sub1#0"]["start_s"] >= lead_end_s + 0.04  # pause 0.02 s x 2
    assert by_id["t-0000/sub2#1"]["start_s"] >= by_id["t-0000/sub2#0"]["end_s"] + 0.02
    assert by_id["t-0000/lead#1"]["start_s"] >= max(r["end_s"] for r in result.records[:-1])


def test_stats_probe_is_sampled_and_its_failures_recorded() -> None:
    calls = {"n": 0}

    async def probe() -> dict[str, float]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("gateway down")
        return {"device_bytes_used": 1000.0 * calls["n"]}

    plan, client = _plan(), FakeClient(REPLIES)
    options = RunOptions(time_scale=1.0, show_progress=False, probe_interval_s=0.01)
    result = asyncio.run(run_workload(plan, client, {"t": "k"}, options=options, stats_probe=probe))
    samples = result.timeseries
    assert len(samples) >= 4
    assert samples[0] == {"t_s": pytest.approx(samples[0]["t_s"]), "device_bytes_used": 1000.0}
    assert samples[1]["error"] == "ConnectionError: gateway down"
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    assert samples[-1]["t_s"] >= max(r["end_s"] for r in result.records)


def test_missing_api_key_is_refused_before_anything_is_sent() -> None:
    client = FakeClient(REPLIES)
    with pytest.raises(ValueError, match=r"no API key for tenants \['t'\]"):
        asyncio.run(run_workload(_plan(), client, {}, options=RunOptions(show_progress=False)))
    assert client.sent == []


class RaisingClient(FakeClient):
    """Breaks the contract: raises instead of returning a failed result."""

    async def generate(self, **kwargs: Any) -> CallResult:
        if kwargs["request_id"].endswith("sub1#0"):
            raise RuntimeError("socket closed")
        return await super().generate(**kwargs)


def test_a_client_that_raises_is_recorded_as_a_failure_not_a_crash() -> None:
    result = _run(RaisingClient(REPLIES))
    by_id = {r["call_id"]: r for r in result.records}
    assert len(by_id) == 7
    assert by_id["t-0000/sub1#0"]["status"] == "UNKNOWN"
    assert by_id["t-0000/sub1#0"]["error"] == "client raised RuntimeError: socket closed"
    assert by_id["t-0000/sub1#1"]["status"] == "SKIPPED"
    assert by_id["t-0000/lead#1"]["status"] == "ok"


def test_a_malformed_trace_is_refused_naming_the_line(tmp_path: Path) -> None:
    recorded = _run(FakeClient(REPLIES))
    path = tmp_path / "trace.jsonl"
    write_trace(recorded.trace, path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:3: not JSON"):
        load_replay(path)
    path.write_text("\n".join(lines[1:]) + "\n")  # no lead plan
    with pytest.raises(ValueError, match=r"trace.jsonl:1: session t-0000 needs one lead whose first"):
        load_replay(path)
    path.write_text(lines[0].replace('"messages"', '"msgs"') + "\n")
    with pytest.raises(ValueError, match=r"trace.jsonl:1: trace row lacks \['messages'\]"):
        load_replay(path)
    path.write_text("")
    with pytest.raises(ValueError, match="the trace has no calls"):
        load_replay(path)


def test_the_same_replies_give_the_same_trace() -> None:
    """Deterministic under the seed given the model's outputs: no other input to a decision."""
    first, second = _run(FakeClient(REPLIES)).trace, _run(FakeClient(REPLIES)).trace
    assert first == second
    with pytest.raises(ValueError, match="sub-agent sub1 has no task"):
        plan = _plan()
        session = plan.sessions[0]
        bare = ResearchSession("t-0000", "t", 0.0, session.lead,
                               (AgentScript("t-0000/sub1", "sub1", session.subagents[0].calls),))
        _run(FakeClient(REPLIES), WorkloadPlan(0, 1.0, (bare,)))


def test_a_query_with_one_hit_is_topped_up_so_every_planned_read_is_sent() -> None:
    """Regression: a model query matching a single article left a two-read sub-agent with no
    unread hit for its second read, which was recorded SKIPPED (a failed call in the report)."""
    sub = AgentScript("t-0000/sub1", "sub1", (
        _call("sub1", 0, "search"), _call("sub1", 1, "read"), _call("sub1", 2, "read"),
        _call("sub1", 3, "answer", expected_answer="1968"),
    ), _task("Led Zeppelin", "1968"))  # fmt: skip
    lead = AgentScript("t-0000/lead", "lead", (_call("lead", 0, "plan"), _call("lead", 1, "report")))
    plan = WorkloadPlan(0, 1.0, (ResearchSession("t-0000", "t", 0.05, lead, (sub,)),))
    client = FakeClient({"t-0000/lead#0": "1. Who founded Led Zeppelin?", "t-0000/sub1#0": "Zeppelin"})
    by_id = {r["call_id"]: r for r in _run(client, plan).records}
    assert {r["status"] for r in by_id.values()} == {"ok"}
    search1 = by_id["t-0000/sub1#0"]["decision"]
    assert search1["query"] == "Zeppelin" and search1["query_fallback"] is False
    assert search1["hits"][0] == "Led Zeppelin" and len(search1["hits"]) == 3
    assert len(set(search1["hits"])) == 3
    assert by_id["t-0000/sub1#1"]["decision"]["read"] == "Led Zeppelin"
    assert by_id["t-0000/sub1#2"]["decision"]["read"] == search1["hits"][1]


class RefusingClient(FakeClient):
    """Refuses ``call_id`` at admission ``times`` times with a retry hint, then answers."""

    def __init__(self, call_id: str, times: int) -> None:
        super().__init__(REPLIES)
        self.call_id, self.left = call_id, times

    async def generate(self, **kwargs: Any) -> CallResult:
        if kwargs["request_id"].removeprefix("run1:").split("~")[0] == self.call_id and self.left:
            self.left -= 1
            self.sent.append({"request_id": kwargs["request_id"], "messages": kwargs["messages"]})
            now = time.monotonic()
            return CallResult("RESOURCE_EXHAUSTED", start_s=now, end_s=now, error="estimated TTFT",
                              retry_after_s=0.02)
        return await super().generate(**kwargs)


def test_a_call_refused_at_admission_is_sent_again_after_the_hint_and_counted() -> None:
    """Issue 21: admission refuses an interactive call it expects to miss its TTFT target; the
    agent sends it again after the hint (as an OpenAI client does with a 429) instead of
    dropping the rest of its work, and the record says so."""
    from workloads.deepresearch.config import TenantProfile
    from workloads.deepresearch.metrics import compute_report

    client = RefusingClient("t-0000/sub2#1", times=2)
    result = _run(client)
    assert {r["status"] for r in result.records} == {"ok"}
    read = next(r for r in result.records if r["call_id"] == "t-0000/sub2#1")
    assert read["admission_retries"] == 2
    assert read["start_s"] - read["first_start_s"] >= 0.04  # two waits of the 20 ms hint
    ids = [s["request_id"] for s in client.sent if "sub2#1" in s["request_id"]]
    assert ids == ["run1:t-0000/sub2#1", "run1:t-0000/sub2#1~1", "run1:t-0000/sub2#1~2"]
    report = compute_report(result.records, result.timeseries,
                            [TenantProfile("t", "interactive", ttft_slo_ms=30.0, tpot_slo_ms=100.0, min_tokens_per_s=0.0)])
    tenant = report["tenants"]["t"]
    assert (tenant["admission_retries"], tenant["retried_calls"], tenant["rejections"]) == (2, 1, 0)
    assert tenant["ttft_slo_attainment"] == 1.0  # every admitted attempt's TTFT is 1 ms
    assert tenant["ttft_slo_attainment_from_first_send"] == pytest.approx(6 / 7)


def test_admission_retries_are_bounded() -> None:
    client = RefusingClient("t-0000/sub2#1", times=10)
    result = _run(client, admission_retries=1)
    read = next(r for r in result.records if r["call_id"] == "t-0000/sub2#1")
    assert (read["status"], read["admission_retries"]) == ("RESOURCE_EXHAUSTED", 1)
    assert [r["status"] for r in result.records].count("SKIPPED") == 1  # sub2's answer


def test_retry_hints_are_read_from_grpc_metadata_and_http_headers() -> None:
    """Regression: grpc.aio's ``Metadata.items()`` gives a list of values per key, so the gRPC
    client read no hint and never retried a refused call."""
    from grpc.aio import Metadata

    from workloads.deepresearch.client import retry_after_from

    assert retry_after_from(Metadata(("retry-after-ms", "630"))) == pytest.approx(0.63)
    assert retry_after_from((("retry-after-ms", "250"),)) == pytest.approx(0.25)
    assert retry_after_from({"Retry-After": "2"}) == 2.0
    assert retry_after_from({"retry-after-ms": "-5", "retry-after": "x"}) is None
    assert retry_after_from(None) is None
