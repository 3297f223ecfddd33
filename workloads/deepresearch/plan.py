"""The generated plan: research sessions, agents, and the LLM calls they make.

A plan fixes who calls when (sessions, agents, call kinds, tool pauses, output budgets) and
each sub-agent's task (its target article and graded question); what most calls *say*
depends on the model's earlier outputs and is written at run time by the agents
(:mod:`workloads.deepresearch.agents`). A replayed plan (:mod:`workloads.deepresearch.trace`)
instead carries every call's recorded messages, so it runs without any agent decision.

Pauses are relative: a call's ``pause_s`` is waited after the agent's previous call ended
(for the first call of a sub-agent, after the lead's plan call ended; for the lead's first
call, after the session's ``arrival_s``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CALL_KINDS = ("plan", "search", "read", "answer", "report")


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
        max_tokens: output budget.
        expected_answer: the graded answer of an ``answer`` call, else None.
        messages: this turn's new messages when they are fixed in advance (a replayed call);
            empty when the agent writes them at run time.
        doc_ids: a replayed call's recorded article titles (see ``Turn.doc_ids``).
        decision_json: a replayed call's recorded decision, as JSON text ("" when none).
    """

    call_id: str
    research_id: str
    session_id: str
    tenant: str
    agent: str
    kind: str
    turn: int
    pause_s: float
    max_tokens: int
    expected_answer: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    doc_ids: tuple[str, ...] = ()
    decision_json: str = ""

    def record_fields(self) -> dict[str, Any]:
        """The call's identity and plan as JSON-ready fields (trace rows and ``calls.jsonl``)."""
        return {
            "call_id": self.call_id, "research_id": self.research_id, "session_id": self.session_id,
            "tenant": self.tenant, "agent": self.agent, "kind": self.kind, "turn": self.turn,
            "pause_s": self.pause_s, "max_tokens": self.max_tokens,
            "expected_answer": self.expected_answer,
        }


@dataclass(frozen=True)
class SubagentTask:
    """What a sub-agent is for, fixed by the generator.

    Attributes:
        target: title of the article that holds the graded fact.
        question: the graded (cloze) question, asked in the agent's ``answer`` call.
        answer: its expected answer, exactly as written in ``target``'s text.
        fallback_question: the sub-question the agent works on when the lead's plan
            gives it none (names ``target``).
    """

    target: str
    question: str
    answer: str
    fallback_question: str


@dataclass(frozen=True)
class AgentScript:
    """One agent: its own session, its calls in turn order, and (sub-agents) its task."""

    session_id: str
    agent: str
    calls: tuple[PlannedCall, ...]
    task: SubagentTask | None = None


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

    @property
    def topics(self) -> tuple[str, ...]:
        """The sub-agents' target titles, in sub-agent order (empty for a replayed session)."""
        return tuple(s.task.target for s in self.subagents if s.task is not None)

    @property
    def replayed(self) -> bool:
        """True when every call's messages are fixed (a session read back from a trace)."""
        return all(call.messages for agent in self.agents for call in agent.calls)


@dataclass(frozen=True)
class WorkloadPlan:
    """All research sessions of a run, ordered by arrival time then research id.

    Attributes:
        seed: the generator's seed (a replayed plan keeps the recorded run's).
        duration_s: the arrival window.
        sessions: the research sessions.
        search_top_k: hits the search tool returns.
        max_article_words: articles are cut to whole sentences within this many words.
    """

    seed: int
    duration_s: float
    sessions: tuple[ResearchSession, ...]
    search_top_k: int = 3
    max_article_words: int = 150

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
