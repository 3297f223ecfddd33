"""The generated plan: research sessions, agents, and the LLM calls they make.

A plan is data only; the runner gives it time. Pauses are relative: a call's
``pause_s`` is waited after the agent's previous call ended (for the first call
of a sub-agent, after the lead's plan call ended; for the lead's first call,
after the session's ``arrival_s``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CALL_KINDS = ("plan", "search", "read", "answer", "report")
FINDINGS_MARK = "{findings}"
"""Placeholder in the lead's report message, replaced at run time by sub-agent outputs."""


@dataclass(frozen=True)
class ChatMessage:
    """One chat message (``role`` is system, user, assistant or tool)."""

    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class PlannedCall:
    """One LLM call of one agent.

    Attributes:
        call_id: ``"<session_id>#<turn>"``, unique in a plan.
        research_id: the research session (lead plus sub-agents) it belongs to.
        session_id: the agent's server-side session; history is kept by it.
        tenant: who pays.
        agent: ``"lead"`` or ``"sub<k>"``.
        kind: one of ``CALL_KINDS``.
        turn: index of this call in the agent's session, from 0.
        pause_s: wait before sending (tool latency), see the module docstring.
        messages: only this turn's new messages (system + user on turn 0).
        max_tokens: output budget.
        doc_ids: titles of the shared articles whose text is in ``messages``
            (search snippets included).
        expected_answer: the graded answer of an ``answer`` call, else None.
        findings_from: for the lead's ``report`` call, the sub-agent session ids
            whose last outputs replace ``FINDINGS_MARK``.
    """

    call_id: str
    research_id: str
    session_id: str
    tenant: str
    agent: str
    kind: str
    turn: int
    pause_s: float
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    doc_ids: tuple[str, ...] = ()
    expected_answer: str | None = None
    findings_from: tuple[str, ...] = ()

    @property
    def prompt_chars(self) -> int:
        """Characters of this turn's new messages (placeholder included)."""
        return sum(len(m.content) for m in self.messages)

    def record_fields(self) -> dict[str, Any]:
        """The call's identity and plan as JSON-ready fields (trace rows and ``calls.jsonl``)."""
        return {
            "call_id": self.call_id, "research_id": self.research_id, "session_id": self.session_id,
            "tenant": self.tenant, "agent": self.agent, "kind": self.kind, "turn": self.turn,
            "pause_s": self.pause_s, "max_tokens": self.max_tokens, "doc_ids": list(self.doc_ids),
            "expected_answer": self.expected_answer,
        }

    def render_messages(self, findings: str = "") -> list[dict[str, str]]:
        """This turn's messages as dicts, with ``FINDINGS_MARK`` replaced by ``findings``."""
        return [
            {"role": m.role, "content": m.content.replace(FINDINGS_MARK, findings)}
            for m in self.messages
        ]


@dataclass(frozen=True)
class AgentScript:
    """One agent: its own session and its calls in turn order."""

    session_id: str
    agent: str
    calls: tuple[PlannedCall, ...]


@dataclass(frozen=True)
class ResearchSession:
    """A lead (calls: plan, report) and its sub-agents, arriving at ``arrival_s``."""

    research_id: str
    tenant: str
    arrival_s: float
    lead: AgentScript
    subagents: tuple[AgentScript, ...]

    @property
    def agents(self) -> tuple[AgentScript, ...]:
        return (self.lead, *self.subagents)


@dataclass(frozen=True)
class WorkloadPlan:
    """All research sessions of a run, ordered by arrival time then tenant."""

    seed: int
    duration_s: float
    sessions: tuple[ResearchSession, ...]

    def calls(self) -> Iterator[tuple[ResearchSession, PlannedCall]]:
        """Every call with its session: per session the lead's plan, sub-agents, report."""
        for session in self.sessions:
            for agent in (session.lead, *session.subagents):
                for call in agent.calls:
                    if call.kind != "report":
                        yield session, call
            yield from ((session, c) for c in session.lead.calls if c.kind == "report")

    def num_calls(self) -> int:
        return sum(1 for _ in self.calls())

    def trace_rows(self) -> list[dict[str, Any]]:
        """One dict per LLM call: the JSONL trace (see :func:`write_trace`)."""
        rows: list[dict[str, Any]] = []
        context_chars: dict[str, int] = {}
        for session, call in self.calls():
            context_chars[call.session_id] = context_chars.get(call.session_id, 0)
            context_chars[call.session_id] += call.prompt_chars
            rows.append(
                call.record_fields()
                | {
                    "arrival_s": session.arrival_s,
                    "prompt_chars": call.prompt_chars,
                    "context_chars": context_chars[call.session_id],
                }
            )
        return rows


def write_trace(plan: WorkloadPlan, path: str | Path) -> int:
    """Write the plan's trace as JSONL (one line per LLM call); returns the line count.

    ``context_chars`` counts the characters the client sent in this agent's
    session so far (model outputs, unknown before the run, excluded); output
    length is the planned ``max_tokens``.
    """
    rows = plan.trace_rows()
    with Path(path).open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows)
    return len(rows)
