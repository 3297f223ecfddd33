"""Runs a :class:`WorkloadPlan` against an :class:`InferenceClient`, in real time.

Every research session is an asyncio task that sleeps until its arrival; the
lead's plan call goes first, then all sub-agents run concurrently (each waits
its tool pauses between turns), then the lead's report call gets their findings.
What each call says is written by the session's director just before it is sent
(:mod:`workloads.deepresearch.agents`: from the model's earlier replies, or the
recorded messages of a replayed plan). Times are multiplied by ``RunOptions.time_scale``.

A failed call stops its agent: the agent's remaining calls are recorded as
``SKIPPED`` (a failed lead plan skips the whole session), so every planned call
appears in the records exactly once. Each agent's session is closed when the
agent is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from workloads.deepresearch.agents import Director, Turn, director_for
from workloads.deepresearch.client import CallResult, InferenceClient, StatsProbe
from workloads.deepresearch.plan import AgentScript, PlannedCall, ResearchSession, WorkloadPlan
from workloads.deepresearch.records import call_record, skipped_record

MAX_RETRY_WAIT_S = 10.0
"""Longest wait before sending a call admission refused again, whatever its hint."""


@dataclass(frozen=True)
class RunOptions:
    """How to run a plan.

    Attributes:
        time_scale: multiplies arrival times and tool pauses (0.1 = ten times faster).
        temperature: sampling temperature sent with every call.
        resend_history: send the agent's whole conversation each turn (for servers
            that do not keep history by session id) instead of only the new messages.
        session_prefix: prepended to session and request ids on the wire, so two
            runs against one server never share a session.
        probe_interval_s: seconds between stats samples (wall clock, not scaled).
        show_progress: draw a rich progress bar per tenant.
        findings_words: words of each sub-agent's last quote and of its answer passed to the lead.
        admission_retries: times a call refused at admission with a retry hint
            (RESOURCE_EXHAUSTED, ``retry-after-ms``) is sent again after the hint (at most
            ``MAX_RETRY_WAIT_S`` each), as an OpenAI client does with a 429; 0 = never.
    """

    time_scale: float = 1.0
    temperature: float = 0.0
    resend_history: bool = False
    session_prefix: str = ""
    probe_interval_s: float = 1.0
    show_progress: bool = True
    findings_words: int = 40
    admission_retries: int = 3

    def __post_init__(self) -> None:
        if (self.time_scale < 0 or self.probe_interval_s <= 0 or self.findings_words <= 0
                or self.admission_retries < 0):
            raise ValueError(
                "need time_scale >= 0, probe_interval_s > 0, findings_words > 0 and admission_retries "
                f">= 0, got {self.time_scale}, {self.probe_interval_s}, {self.findings_words}, "
                f"{self.admission_retries}"
            )


@dataclass(frozen=True)
class RunResult:
    """Records in completion order, stats samples in time order, totals, and the trace.

    ``trace`` has one row per sent call, in plan order: the call's plan fields, the
    messages sent this turn, its article titles, the agent's decisions and its status
    (see :mod:`workloads.deepresearch.trace`, which writes and replays it).
    """

    records: tuple[dict[str, Any], ...]
    timeseries: tuple[dict[str, Any], ...]
    wall_s: float
    close_failures: int
    trace: tuple[dict[str, Any], ...] = ()


class _Run:
    """Shared state of one run: clock, client, keys, records, trace rows, progress."""

    def __init__(self, plan: WorkloadPlan, client: InferenceClient, api_keys: Mapping[str, str],
                 options: RunOptions, progress: Progress, tasks: dict[str, TaskID]) -> None:  # fmt: skip
        self.plan, self.client, self.api_keys, self.options = plan, client, api_keys, options
        self.progress, self.tasks = progress, tasks
        self.t0_s = time.monotonic()
        self.records: list[dict[str, Any]] = []
        self.trace: dict[str, dict[str, Any]] = {}
        self.close_failures = 0

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.progress.advance(self.tasks[record["tenant"]])

    def skip(self, calls: tuple[PlannedCall, ...], reason: str) -> None:
        for call in calls:
            self.add(skipped_record(call, reason, time.monotonic(), self.t0_s))

    async def sleep_until(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, self.t0_s + at_s * self.options.time_scale - time.monotonic()))

    def trace_rows(self) -> tuple[dict[str, Any], ...]:
        """The sent calls' trace rows in plan order (sessions by arrival; lead plan,
        sub-agents, report), whatever order they completed in."""
        return tuple(self.trace[c.call_id] for _, c in self.plan.calls() if c.call_id in self.trace)


class _Agent:
    """One agent's conversation: sends its calls in order, keeps the transcript."""

    def __init__(self, run: _Run, script: AgentScript, director: Director, arrival_s: float) -> None:
        self.run, self.script, self.director, self.arrival_s = run, script, director, arrival_s
        self.history: list[dict[str, str]] = []
        self.last: dict[str, Any] | None = None
        self.sent_chars = 0
        self.sent = False

    async def call(self, call: PlannedCall) -> bool:
        """Wait the call's pause, have the director write it, send it, record it.

        True when it succeeded or the director had nothing to send (recorded as skipped).
        A call admission refuses with a retry hint is sent again after it (``admission_retries``);
        its record keeps the admitted attempt's figures, ``admission_retries`` and
        ``first_start_s`` (when its first attempt was sent).
        """
        run = self.run
        await asyncio.sleep(call.pause_s * run.options.time_scale)
        turn = self.director.turn(call)
        if turn.skip_reason:
            run.skip((call,), turn.skip_reason)
            return True
        messages = list(turn.messages)
        send = self.history + messages if run.options.resend_history else messages
        self.sent = True
        first_start_s, retries = time.monotonic(), 0
        while True:
            result = await self._send(call, send, retries)
            if (result.status != "RESOURCE_EXHAUSTED" or result.retry_after_s is None
                    or retries >= run.options.admission_retries):
                break
            retries += 1
            await asyncio.sleep(min(result.retry_after_s, MAX_RETRY_WAIT_S))
        decision = turn.decision | self.director.observe(call, result.ok, result.text, result.status)
        self.last = call_record(call, result, run.t0_s, turn.doc_ids, decision) | {
            "admission_retries": retries, "first_start_s": first_start_s - run.t0_s}
        run.add(self.last)
        self._trace(call, messages, turn, decision)
        if result.ok:
            self.history += [*messages, {"role": "assistant", "content": result.text}]
        return result.ok

    async def _send(self, call: PlannedCall, messages: list[dict[str, str]], attempt: int) -> CallResult:
        """One attempt at ``call`` (a retry's request id gets ``~attempt``)."""
        run, prefix = self.run, self.run.options.session_prefix
        request_id = prefix + call.call_id + (f"~{attempt}" if attempt else "")
        start_s = time.monotonic()
        try:
            return await run.client.generate(
                api_key=run.api_keys[call.tenant], session_id=prefix + call.session_id,
                messages=messages, max_tokens=call.max_tokens, temperature=run.options.temperature,
                request_id=request_id,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a client that breaks its contract is a failure
            error = f"client raised {type(exc).__name__}: {exc}"
            return CallResult("UNKNOWN", start_s=start_s, end_s=time.monotonic(), error=error)

    def _trace(self, call: PlannedCall, messages: list[dict[str, str]], turn: Turn,
               decision: dict[str, Any]) -> None:  # fmt: skip
        prompt_chars = sum(len(m["content"]) for m in messages)
        self.sent_chars += prompt_chars
        self.run.trace[call.call_id] = call.record_fields() | {
            "arrival_s": self.arrival_s, "messages": messages, "doc_ids": list(turn.doc_ids),
            "decision": decision, "status": self.last_status, "prompt_chars": prompt_chars,
            "context_chars": self.sent_chars,
        }  # fmt: skip

    async def run_calls(self, calls: tuple[PlannedCall, ...]) -> None:
        """Send ``calls`` in order; after a failure, record the rest as skipped."""
        for i, call in enumerate(calls):
            if not await self.call(call):
                self.run.skip(calls[i + 1 :], f"not sent: {call.call_id} ended {self.last_status}")
                return

    @property
    def last_status(self) -> str:
        return self.last["status"] if self.last else "not run"

    async def close(self) -> None:
        if not self.sent:
            return
        try:
            status = await self.run.client.close_session(
                api_key=self.run.api_keys[self.script.calls[0].tenant],
                session_id=self.run.options.session_prefix + self.script.session_id,
            )
        except Exception:  # noqa: BLE001 - counted in RunResult.close_failures
            status = "UNKNOWN"
        self.run.close_failures += status != "ok"


async def _run_session(run: _Run, session: ResearchSession) -> None:
    """The lead's plan, then every sub-agent at once, then the lead's report (if planned)."""
    await run.sleep_until(session.arrival_s)
    director = director_for(session, run.plan, run.options.findings_words)
    lead = _Agent(run, session.lead, director, session.arrival_s)
    plan_call, *report_calls = session.lead.calls
    subs = [_Agent(run, script, director, session.arrival_s) for script in session.subagents]
    if not await lead.call(plan_call):
        reason = f"not sent: lead plan {plan_call.call_id} ended {lead.last_status}"
        for script in session.subagents:
            run.skip(script.calls, reason)
        run.skip(tuple(report_calls), reason)
    else:
        await asyncio.gather(*(_run_agent(sub) for sub in subs))
        await lead.run_calls(tuple(report_calls))
    await lead.close()


async def _run_agent(agent: _Agent) -> None:
    await agent.run_calls(agent.script.calls)
    await agent.close()


async def _sample(run: _Run, probe: StatsProbe, out: list[dict[str, Any]]) -> None:
    """Append one sample (or an error sample: a failed probe is recorded, not fatal)."""
    t_s = time.monotonic() - run.t0_s
    try:
        out.append({"t_s": t_s, **await probe()})
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        out.append({"t_s": t_s, "error": f"{type(exc).__name__}: {exc}"})


async def _probe_loop(run: _Run, probe: StatsProbe, out: list[dict[str, Any]]) -> None:
    """Sample ``probe`` every ``probe_interval_s`` until cancelled."""
    while True:
        await _sample(run, probe, out)
        await asyncio.sleep(run.options.probe_interval_s)


def _progress(
    plan: WorkloadPlan, options: RunOptions, console: Console | None
) -> tuple[Progress, dict[str, TaskID]]:
    progress = Progress(
        TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, disable=not options.show_progress,
    )  # fmt: skip
    totals: dict[str, int] = {}
    for _, call in plan.calls():
        totals[call.tenant] = totals.get(call.tenant, 0) + 1
    return progress, {t: progress.add_task(t, total=n) for t, n in sorted(totals.items())}


async def run_workload(
    plan: WorkloadPlan,
    client: InferenceClient,
    api_keys: Mapping[str, str],
    *,
    options: RunOptions | None = None,
    stats_probe: StatsProbe | None = None,
    console: Console | None = None,
) -> RunResult:
    """Run every session of ``plan``; returns all records and stats samples.

    Args:
        plan: from :func:`workloads.deepresearch.generator.generate_plan`.
        client: any :class:`InferenceClient` (the gRPC one in production).
        api_keys: tenant name -> API key; every tenant in the plan needs one.
        options: timing and wire options (defaults: real time, greedy).
        stats_probe: sampled every ``options.probe_interval_s`` while running,
            once more at the end.
        console: where the progress bar draws (default: stdout).

    Raises:
        ValueError: a tenant of the plan has no API key.
    """
    options = options or RunOptions()
    missing = sorted({s.tenant for s in plan.sessions} - set(api_keys))
    if missing:
        raise ValueError(f"no API key for tenants {missing}")
    progress, tasks = _progress(plan, options, console)
    run = _Run(plan, client, api_keys, options, progress, tasks)
    samples: list[dict[str, Any]] = []
    with progress:
        prober = (
            asyncio.create_task(_probe_loop(run, stats_probe, samples)) if stats_probe else None
        )
        try:
            await asyncio.gather(*(_run_session(run, s) for s in plan.sessions))
        finally:
            if prober is not None:
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)
    if stats_probe is not None:
        await _sample(run, stats_probe, samples)
    wall_s = time.monotonic() - run.t0_s
    return RunResult(tuple(run.records), tuple(samples), wall_s, run.close_failures,
                     run.trace_rows())
