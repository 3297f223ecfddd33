"""The async runner, driven by a small in-memory fake client (no server, no model)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from workloads.deepresearch.client import CallResult
from workloads.deepresearch.plan import (
    FINDINGS_MARK,
    AgentScript,
    ChatMessage,
    PlannedCall,
    ResearchSession,
    WorkloadPlan,
)
from workloads.deepresearch.runner import RunOptions, RunResult, run_workload


def _call(agent: str, turn: int, kind: str, text: str, **extra: Any) -> PlannedCall:
    session_id = f"t-0000/{agent}"
    return PlannedCall(
        call_id=f"{session_id}#{turn}", research_id="t-0000", session_id=session_id,
        tenant="t", agent=agent, kind=kind, turn=turn, pause_s=extra.pop("pause_s", 0.0),
        messages=(ChatMessage("user", text),), max_tokens=8, **extra,
    )  # fmt: skip


def _plan() -> WorkloadPlan:
    """One session: lead plans; sub1 searches and answers; sub2 searches, reads, answers."""
    sub1 = AgentScript("t-0000/sub1", "sub1", (
        _call("sub1", 0, "search", "search 1", pause_s=0.02, doc_ids=("A",)),
        _call("sub1", 1, "answer", "who directed?", expected_answer="Fritz Lang"),
    ))  # fmt: skip
    sub2 = AgentScript("t-0000/sub2", "sub2", (
        _call("sub2", 0, "search", "search 2", pause_s=0.01),
        _call("sub2", 1, "read", "article B", pause_s=0.01, doc_ids=("B",)),
        _call("sub2", 2, "answer", "what year?", expected_answer="1927"),
    ))  # fmt: skip
    lead = AgentScript("t-0000/lead", "lead", (
        _call("lead", 0, "plan", "plan it"),
        _call("lead", 1, "report", f"findings:\n{FINDINGS_MARK}\nreport",
              findings_from=("t-0000/sub1", "t-0000/sub2")),
    ))  # fmt: skip
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


REPLIES = {"t-0000/sub1#1": "It was Fritz Lang.", "t-0000/sub2#2": "1926"}


def _run(client: FakeClient, **options: Any) -> RunResult:
    options = {"time_scale": 0.0, "show_progress": False, "session_prefix": "run1:", **options}
    return asyncio.run(run_workload(_plan(), client, {"t": "key-t"}, options=RunOptions(**options)))


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
    assert client.sent[-1]["messages"] == [
        {"role": "user", "content": "findings:\n- sub1: It was Fritz Lang.\n- sub2: 1926\nreport"}
    ]
    assert {s["api_key"] for s in client.sent} == {"key-t"}
    assert sorted(client.closed) == [
        ("key-t", "run1:t-0000/lead"), ("key-t", "run1:t-0000/sub1"), ("key-t", "run1:t-0000/sub2"),
    ]  # fmt: skip
    assert result.close_failures == 0


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
    client = FakeClient({"t-0000/sub1#0": "read A"})
    _run(client, resend_history=True)
    answer = next(s for s in client.sent if s["request_id"] == "run1:t-0000/sub1#1")
    assert answer["messages"] == [
        {"role": "user", "content": "search 1"},
        {"role": "assistant", "content": "read A"},
        {"role": "user", "content": "who directed?"},
    ]
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
