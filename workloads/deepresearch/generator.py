"""Turns a :class:`WorkloadConfig` into a :class:`WorkloadPlan`, deterministically.

Randomness comes only from ``numpy.random.default_rng`` streams keyed by the
seed: ``[seed, 0]`` ranks document popularity (one ranking shared by all
tenants, so popular articles recur across agents and tenants), ``[seed, 1, t]``
draws tenant ``t``'s Gamma arrivals, and ``[seed, 2, t, s]`` draws the content
of tenant ``t``'s session ``s``. Adding a tenant at the end therefore leaves the
other tenants' sessions unchanged.

Per research session: the lead plans; each of 2-6 sub-agents searches (tool
pause, BM25 snippets), reads 1-3 articles (Zipf popularity; each read preceded
by a fetch pause), and answers a cloze question cut from one article it read;
the lead then writes the report from the findings.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from workloads.corpus import articles_by_title, load_corpus, search
from workloads.deepresearch import prompts
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.plan import (
    AgentScript,
    ChatMessage,
    PlannedCall,
    ResearchSession,
    WorkloadPlan,
)
from workloads.deepresearch.sampling import ZipfSampler, gamma_arrival_times, tool_pause_s
from workloads.facts import FactQuestion, fact_questions
from workloads.text import truncate_to_sentences


@functools.lru_cache(maxsize=4)
def questions_by_title(max_article_words: int) -> dict[str, tuple[FactQuestion, ...]]:
    """Fact questions of every article that has at least one (cached per word cap)."""
    table = {a.title: tuple(fact_questions(a, max_article_words)) for a in load_corpus()}
    return {title: qs for title, qs in table.items() if qs}


class _Samplers:
    """The shared popularity rankings: targets (articles with questions) and all articles."""

    def __init__(self, config: WorkloadConfig) -> None:
        rng = np.random.default_rng([config.seed, 0])
        self.questions = questions_by_title(config.max_article_words)
        self.targets = ZipfSampler(sorted(self.questions), config.zipf_exponent, rng)
        self.documents = ZipfSampler([a.title for a in load_corpus()], config.zipf_exponent, rng)


def _call(session_id: str, research_id: str, tenant: str, agent: str, **fields: Any) -> PlannedCall:
    turn = fields["turn"]
    return PlannedCall(
        call_id=f"{session_id}#{turn}",
        research_id=research_id,
        session_id=session_id,
        tenant=tenant,
        agent=agent,
        **fields,
    )


class _Step(NamedTuple):
    kind: str
    pause_s: float
    doc_ids: tuple[str, ...]
    text: str
    expected_answer: str | None = None


def _subagent_steps(
    config: WorkloadConfig, target: str, samplers: _Samplers, rng: np.random.Generator
) -> list[_Step]:
    """Search for ``target``, read it and 0..max_reads-1 other articles, answer."""
    questions = samplers.questions[target]
    question = questions[int(rng.integers(len(questions)))]
    n_extra = int(rng.integers(1, config.max_reads + 1)) - 1
    extras = samplers.documents.draw_distinct(n_extra, rng, exclude={target})
    reads = [[target, *extras][i] for i in rng.permutation(1 + n_extra)]
    hits = search(target, k=config.search_top_k)
    search_step = _Step(
        "search",
        tool_pause_s(config.tool_pause, rng),
        tuple(h.title for h in hits),
        prompts.search_prompt(question.question, target, hits),
    )
    read_steps = [
        _Step(
            "read",
            tool_pause_s(config.tool_pause, rng),
            (title,),
            prompts.read_prompt(title, _article_text(title, config.max_article_words)),
        )
        for title in reads
    ]
    answer = _Step("answer", 0.0, (), prompts.answer_prompt(question.question), question.answer)
    return [search_step, *read_steps, answer]


def _subagent(
    config: WorkloadConfig,
    ids: tuple[str, str, str],
    target: str,
    samplers: _Samplers,
    rng: np.random.Generator,
) -> AgentScript:
    """One sub-agent in its own session ``<research_id>/<agent>``."""
    research_id, tenant, agent = ids
    session_id = f"{research_id}/{agent}"
    calls = []
    for turn, step in enumerate(_subagent_steps(config, target, samplers, rng)):
        messages: tuple[ChatMessage, ...] = (ChatMessage("user", step.text),)
        if turn == 0:
            messages = (ChatMessage("system", prompts.SUBAGENT_SYSTEM), *messages)
        calls.append(
            _call(session_id, research_id, tenant, agent, kind=step.kind, turn=turn,
                  pause_s=step.pause_s, messages=messages,
                  max_tokens=config.max_tokens.for_kind(step.kind), doc_ids=step.doc_ids,
                  expected_answer=step.expected_answer)
        )  # fmt: skip
    return AgentScript(session_id, agent, tuple(calls))


def _article_text(title: str, max_words: int) -> str:
    return truncate_to_sentences(articles_by_title()[title].extract, max_words)


def _lead(
    config: WorkloadConfig, research_id: str, tenant: str, targets: list[str], subs: list[str]
) -> AgentScript:
    """The lead: a plan call at arrival, a report call after every sub-agent is done."""
    session_id = f"{research_id}/lead"
    plan_messages = (
        ChatMessage("system", prompts.LEAD_SYSTEM),
        ChatMessage("user", prompts.plan_prompt(targets)),
    )
    report_messages = (ChatMessage("user", prompts.report_prompt(targets)),)
    common = {"session_id": session_id, "research_id": research_id, "tenant": tenant}
    return AgentScript(
        session_id,
        "lead",
        (
            _call(**common, agent="lead", kind="plan", turn=0, pause_s=0.0,
                  messages=plan_messages, max_tokens=config.max_tokens.plan),
            _call(**common, agent="lead", kind="report", turn=1, pause_s=0.0,
                  messages=report_messages, max_tokens=config.max_tokens.report,
                  findings_from=tuple(subs)),
        ),
    )  # fmt: skip


def research_session(
    config: WorkloadConfig,
    tenant: TenantProfile,
    index: int,
    arrival_s: float,
    samplers: _Samplers,
    rng: np.random.Generator,
) -> ResearchSession:
    """Session ``index`` of ``tenant``: ``tenant-NNNN`` with a lead and its sub-agents."""
    research_id = f"{tenant.name}-{index:04d}"
    n_subs = int(rng.integers(config.min_subagents, config.max_subagents + 1))
    targets = samplers.targets.draw_distinct(n_subs, rng, exclude=set())
    subagents = tuple(
        _subagent(config, (research_id, tenant.name, f"sub{k}"), target, samplers, rng)
        for k, target in enumerate(targets, start=1)
    )
    lead = _lead(config, research_id, tenant.name, targets, [s.session_id for s in subagents])
    return ResearchSession(research_id, tenant.name, arrival_s, lead, subagents)


def generate_plan(config: WorkloadConfig) -> WorkloadPlan:
    """The full plan for ``config``; identical configs give identical plans."""
    samplers = _Samplers(config)
    sessions: list[ResearchSession] = []
    for t, tenant in enumerate(config.tenants):
        arrivals = gamma_arrival_times(
            tenant.sessions_per_s,
            tenant.arrival_cv,
            config.duration_s,
            np.random.default_rng([config.seed, 1, t]),
        )
        if config.max_sessions_per_tenant:
            arrivals = arrivals[: config.max_sessions_per_tenant]
        for s, arrival_s in enumerate(arrivals):
            rng = np.random.default_rng([config.seed, 2, t, s])
            sessions.append(research_session(config, tenant, s, arrival_s, samplers, rng))
    sessions.sort(key=lambda session: (session.arrival_s, session.research_id))
    return WorkloadPlan(config.seed, config.duration_s, tuple(sessions))
