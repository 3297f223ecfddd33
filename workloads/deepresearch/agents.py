"""What the agents of one research session say, decided from what the model said before.

The lead's plan reply is parsed into one sub-question per sub-agent (the generator's
sub-question fills in for each one the plan does not give: ``plan_fallback``). A sub-agent
asks the model for a search query about its sub-question; the cleaned reply is the query
(or, when it is empty or finds nothing, the sub-question, then the generator's question:
``query_fallback``); BM25 (:func:`workloads.corpus.search`) returns the hits. Each read
opens the first hit, best first, whose title the model's latest reply names and that the
agent has not read, else the best unread hit. The answer call asks the graded question; the
lead's report call gets every sub-agent's sub-question, reads, last quote and answer.

Every rule is a pure function of the plan and the model's replies, so a run is
deterministic under the seed given the model's outputs; :class:`ReplayTurns` sends a
trace's recorded messages instead (no decision at all).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from workloads.corpus import SearchHit, articles_by_title, search
from workloads.deepresearch import prompts
from workloads.deepresearch.parsing import clean_query, names_title, parse_plan
from workloads.deepresearch.plan import (
    AgentScript,
    PlannedCall,
    ResearchSession,
    SubagentTask,
    WorkloadPlan,
)
from workloads.text import first_words, truncate_to_sentences


@dataclass(frozen=True)
class Turn:
    """What an agent sends on one call.

    Attributes:
        messages: this turn's new messages (system + user on an agent's first turn).
        doc_ids: titles of the articles whose text (or search snippet) is in ``messages``.
        decision: what the agent decided in writing them (JSON-ready).
        skip_reason: non-empty when the agent has nothing to send (the call is recorded
            as skipped with this reason and the agent goes on with its next call).
    """

    messages: tuple[dict[str, str], ...] = ()
    doc_ids: tuple[str, ...] = ()
    decision: dict[str, Any] = field(default_factory=dict)
    skip_reason: str = ""


class Director(Protocol):
    """Writes a session's turns and reads the model's replies."""

    def turn(self, call: PlannedCall) -> Turn: ...

    def observe(self, call: PlannedCall, ok: bool, text: str, status: str) -> dict[str, Any]:
        """Take in a call's outcome; returns the decisions the reply led to (JSON-ready)."""
        ...


@dataclass
class _Sub:
    """One sub-agent's state."""

    script: AgentScript
    task: SubagentTask
    question: str = ""
    question_source: str = ""
    query: str = ""
    hits: list[SearchHit] = field(default_factory=list)
    read: list[str] = field(default_factory=list)
    last_reply: str = ""
    quote: str = ""
    answer: str = ""
    status: str = "not run"


class ResearchAgents:
    """The live agents of one research session (see the module docstring).

    Args:
        session: a generated session (every sub-agent has a task).
        plan: gives ``search_top_k`` and ``max_article_words``.
        findings_words: words of each quote and answer passed to the lead.

    Raises:
        ValueError: a sub-agent of ``session`` has no task.
    """

    def __init__(self, session: ResearchSession, plan: WorkloadPlan, findings_words: int) -> None:
        self.session, self.plan, self.findings_words = session, plan, findings_words
        self.subs: dict[str, _Sub] = {}
        for script in session.subagents:
            if script.task is None:
                raise ValueError(f"session {session.research_id}: sub-agent {script.agent} has no task")
            self.subs[script.session_id] = _Sub(script, script.task)

    def turn(self, call: PlannedCall) -> Turn:
        """The messages of ``call``, written from the session's state."""
        if call.agent == "lead":
            return self._lead_turn(call)
        sub = self.subs[call.session_id]
        if call.kind == "search":
            system = {"role": "system", "content": prompts.SUBAGENT_SYSTEM}
            user = {"role": "user", "content": prompts.search_prompt(sub.question)}
            return Turn((system, user), (), {"sub_question": sub.question,
                                             "question_source": sub.question_source})
        if call.kind == "read":
            return self._read_turn(sub)
        user = {"role": "user", "content": prompts.answer_prompt(sub.task.question)}
        target = sub.task.target
        return Turn((user,), (), {"target": target, "found_target": target in sub.read})

    def observe(self, call: PlannedCall, ok: bool, text: str, status: str) -> dict[str, Any]:
        """Parse the plan, set a query and its hits, keep quotes and answers."""
        if call.agent == "lead":
            return self._assign_questions(text) if ok and call.kind == "plan" else {}
        sub = self.subs[call.session_id]
        sub.status = status
        if not ok:
            return {}
        sub.last_reply = text
        if call.kind == "search":
            return self._search(sub, text)
        if call.kind == "read":
            sub.quote = text
        elif call.kind == "answer":
            sub.answer = text
        return {}

    def _lead_turn(self, call: PlannedCall) -> Turn:
        if call.kind == "plan":
            system = {"role": "system", "content": prompts.LEAD_SYSTEM}
            user = {"role": "user", "content": prompts.plan_prompt(self.session.topics)}
            return Turn((system, user))
        findings = "\n".join(self._finding(sub) for sub in self.subs.values())
        user = {"role": "user", "content": prompts.report_prompt(self.session.topics, findings)}
        return Turn((user,), (), {"findings_from": list(self.subs)})

    def _assign_questions(self, plan_text: str) -> dict[str, Any]:
        parsed = parse_plan(plan_text, len(self.subs))
        for k, sub in enumerate(self.subs.values()):
            sub.question, sub.question_source = (
                (parsed[k], "plan") if k < len(parsed) else (sub.task.fallback_question, "fallback")
            )
        return {"sub_questions": [s.question for s in self.subs.values()],
                "plan_items_parsed": len(parsed), "plan_fallback": len(parsed) < len(self.subs)}

    def _search(self, sub: _Sub, reply: str) -> dict[str, Any]:
        """Query BM25 with the model's query; fall back when it is empty or finds nothing.

        ``query`` is the first query with hits; when it found fewer than ``search_top_k``, the
        later queries' hits are appended (no duplicates), so an agent always has a hit left to
        read (a short model query once matched a single article and its second read was
        skipped)."""
        model_query = clean_query(reply)
        query, hits = "", []
        for candidate in (model_query, sub.question, sub.task.fallback_question):
            found = search(candidate, k=self.plan.search_top_k) if candidate else []
            query = query or (candidate if found else "")
            hits += [h for h in found if h.title not in {x.title for x in hits}]
            if len(hits) >= self.plan.search_top_k:
                break
        hits = hits[: self.plan.search_top_k]
        query = query or sub.task.fallback_question
        sub.query, sub.hits = query, hits
        return {"model_query": model_query, "query": query, "query_fallback": query != model_query,
                "hits": [h.title for h in hits]}

    def _read_turn(self, sub: _Sub) -> Turn:
        unread = [h.title for h in sub.hits if h.title not in sub.read]
        if not unread:
            return Turn(skip_reason=f"no unread search hit for {sub.query!r}")
        named = [t for t in unread if names_title(sub.last_reply, t)]
        title = (named or unread)[0]
        results = prompts.search_results(sub.query, sub.hits) if not sub.read else ""
        doc_ids = tuple(h.title for h in sub.hits) if results else (title,)
        sub.read.append(title)
        text = truncate_to_sentences(articles_by_title()[title].extract, self.plan.max_article_words)
        user = {"role": "user", "content": prompts.read_prompt(title, text, results)}
        return Turn((user,), doc_ids, {"read": title, "choice": "named" if named else "top unread"})

    def _finding(self, sub: _Sub) -> str:
        agent, words = sub.script.agent, self.findings_words
        if sub.status != "ok":
            return f"- {agent}: (no answer: {sub.status})"
        read = ", ".join(sub.read) or "nothing"
        return (f"- {agent} on {sub.question!r}, read {read}: quote: "
                f"{first_words(sub.quote, words)} answer: {first_words(sub.answer, words)}")


class ReplayTurns:
    """A replayed session: every call sends its recorded messages; nothing is decided."""

    def turn(self, call: PlannedCall) -> Turn:
        recorded = json.loads(call.decision_json) if call.decision_json else {}
        return Turn(tuple(m.as_dict() for m in call.messages), call.doc_ids,
                    {"replayed": True, "recorded": recorded})

    def observe(self, call: PlannedCall, ok: bool, text: str, status: str) -> dict[str, Any]:
        return {}


def director_for(session: ResearchSession, plan: WorkloadPlan, findings_words: int) -> Director:
    """:class:`ReplayTurns` for a replayed session, else :class:`ResearchAgents`."""
    if session.replayed:
        return ReplayTurns()
    return ResearchAgents(session, plan, findings_words)
