"""Turns a :class:`WorkloadConfig` into a :class:`WorkloadPlan`, deterministically.

Randomness comes only from ``numpy.random.default_rng`` streams keyed by the
seed: ``[seed, 0]`` ranks target popularity (one ranking shared by all tenants,
so popular articles recur across agents and tenants), ``[seed, 1, t]`` draws
tenant ``t``'s Gamma arrivals, and ``[seed, 2, t, s]`` draws the content of
tenant ``t``'s session ``s``. Adding a tenant at the end therefore leaves the
other tenants' sessions unchanged.

Per research session: the lead plans; each of 2-6 sub-agents gets a target
article (Zipf popularity) with a cloze question cut from it, searches (tool
pause), reads 1..max_reads articles (each after a fetch pause) and answers the
question; the lead then writes the report from the findings. What each call
says is written at run time from the model's replies
(:mod:`workloads.deepresearch.agents`); the plan fixes the calls, pauses and tasks.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from workloads.corpus import load_corpus
from workloads.deepresearch import prompts
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.plan import (
    AgentScript,
    PlannedCall,
    ResearchSession,
    SubagentTask,
    WorkloadPlan,
)
from workloads.deepresearch.sampling import ZipfSampler, gamma_arrival_times, tool_pause_s
from workloads.facts import FactQuestion, fact_questions


@functools.lru_cache(maxsize=4)
def questions_by_title(max_article_words: int) -> dict[str, tuple[FactQuestion, ...]]:
    """Fact questions of every article that has at least one (cached per word cap)."""
    table = {a.title: tuple(fact_questions(a, max_article_words)) for a in load_corpus()}
    return {title: qs for title, qs in table.items() if qs}


def _targets(config: WorkloadConfig) -> tuple[dict[str, tuple[FactQuestion, ...]], ZipfSampler]:
    """The articles with questions and their shared popularity ranking."""
    questions = questions_by_title(config.max_article_words)
    rng = np.random.default_rng([config.seed, 0])
    return questions, ZipfSampler(sorted(questions), config.zipf_exponent, rng)


def _subagent(
    config: WorkloadConfig,
    ids: tuple[str, str, str],
    target: str,
    questions: tuple[FactQuestion, ...],
    rng: np.random.Generator,
) -> AgentScript:
    """One sub-agent in its own session ``<research_id>/<agent>``: search, 1..max_reads
    reads (each after a fetch pause), answer; its task is one of ``target``'s questions."""
    research_id, tenant, agent = ids
    session_id = f"{research_id}/{agent}"
    question = questions[int(rng.integers(len(questions)))]
    n_reads = int(rng.integers(1, config.max_reads + 1))
    kinds = ["search", *["read"] * n_reads, "answer"]
    calls = tuple(
        PlannedCall(
            call_id=f"{session_id}#{turn}", research_id=research_id, session_id=session_id,
            tenant=tenant, agent=agent, kind=kind, turn=turn,
            pause_s=0.0 if kind == "answer" else tool_pause_s(config.tool_pause, rng),
            max_tokens=config.max_tokens.for_kind(kind),
            expected_answer=question.answer if kind == "answer" else None,
        )
        for turn, kind in enumerate(kinds)
    )  # fmt: skip
    task = SubagentTask(target, question.question, question.answer, prompts.fallback_question(target))
    return AgentScript(session_id, agent, calls, task)


def _lead(config: WorkloadConfig, research_id: str, tenant: str) -> AgentScript:
    """The lead: a plan call at arrival, a report call after every sub-agent is done."""
    session_id = f"{research_id}/lead"
    common = {"research_id": research_id, "session_id": session_id, "tenant": tenant,
              "agent": "lead", "pause_s": 0.0}  # fmt: skip
    return AgentScript(session_id, "lead", (
        PlannedCall(f"{session_id}#0", kind="plan", turn=0, max_tokens=config.max_tokens.plan,
                    **common),
        PlannedCall(f"{session_id}#1", kind="report", turn=1,
                    max_tokens=config.max_tokens.report, **common),
    ))  # fmt: skip


def research_session(
    config: WorkloadConfig,
    tenant: TenantProfile,
    index: int,
    arrival_s: float,
    targets: tuple[dict[str, tuple[FactQuestion, ...]], ZipfSampler],
    rng: np.random.Generator,
) -> ResearchSession:
    """Session ``index`` of ``tenant``: ``tenant-NNNN`` with a lead and its sub-agents."""
    research_id = f"{tenant.name}-{index:04d}"
    questions, sampler = targets
    n_subs = int(rng.integers(config.min_subagents, config.max_subagents + 1))
    titles = sampler.draw_distinct(n_subs, rng, exclude=set())
    subagents = tuple(
        _subagent(config, (research_id, tenant.name, f"sub{k}"), title, questions[title], rng)
        for k, title in enumerate(titles, start=1)
    )
    return ResearchSession(research_id, tenant.name, arrival_s,
                           _lead(config, research_id, tenant.name), subagents)  # fmt: skip


def _arrivals(config: WorkloadConfig, t: int, duration_s: float) -> list[float]:
    """Tenant ``t``'s session arrivals in ``[0, duration_s)``: the first ones do not depend on
    ``duration_s`` (a longer duration only adds later ones)."""
    tenant = config.tenants[t]
    return gamma_arrival_times(
        tenant.sessions_per_s, tenant.arrival_cv, duration_s, np.random.default_rng([config.seed, 1, t])
    )


def first_arrival_s(config: WorkloadConfig, max_doublings: int = 40) -> float | None:
    """When ``config``'s first research session arrives under its seed, whatever its
    ``duration_s`` (a plan has a session exactly when ``duration_s`` exceeds this); None when
    none arrives within ``duration_s * 2**max_doublings``."""
    duration_s = config.duration_s
    for _ in range(max_doublings + 1):
        firsts = [a[0] for t in range(len(config.tenants)) if (a := _arrivals(config, t, duration_s))]
        if firsts:
            return min(firsts)
        duration_s *= 2
    return None


def generate_plan(config: WorkloadConfig) -> WorkloadPlan:
    """The full plan for ``config``; identical configs give identical plans."""
    targets = _targets(config)
    sessions: list[ResearchSession] = []
    for t, tenant in enumerate(config.tenants):
        arrivals = _arrivals(config, t, config.duration_s)
        if config.max_sessions_per_tenant:
            arrivals = arrivals[: config.max_sessions_per_tenant]
        for s, arrival_s in enumerate(arrivals):
            rng = np.random.default_rng([config.seed, 2, t, s])
            sessions.append(research_session(config, tenant, s, arrival_s, targets, rng))
    sessions.sort(key=lambda session: (session.arrival_s, session.research_id))
    return WorkloadPlan(config.seed, config.duration_s, tuple(sessions), config.search_top_k,
                        config.max_article_words)


def no_session_message(config: WorkloadConfig, sessions_per_s: float, duration_flag: str = "--duration",
                       tenants_flag: str = "--tenants") -> str:
    """Why a DeepResearch plan without a research session is refused before anything runs:
    the arrival window times the rate gives none under this seed; with the numbers, and the
    duration (``duration_flag``, the entry point's option) that would give one (the first
    arrival does not depend on the duration). ``tenants_flag``: the option that sets the
    number of tenants ("": the entry point has none)."""
    shares = sum(t.sessions_per_s for t in config.tenants) / sessions_per_s
    expected = config.duration_s * sessions_per_s * shares
    first = first_arrival_s(config)
    hint = (f" (its first arrives at {first:.2f} s)" if first is not None else "")
    longer = f" ({math.floor(first) + 1:g} gives one)" if first is not None else ""
    n = len(config.tenants)
    tenants = f"{tenants_flag} {n}" if tenants_flag else f"{n} tenants"
    return (f"no research session to run: {duration_flag} {config.duration_s:g} s x --sessions-per-s "
            f"{sessions_per_s:g} x {shares:g} tenant shares ({tenants}) expects "
            f"{expected:.2g} sessions, but --seed {config.seed} draws none before {config.duration_s:g} s{hint}; "
            f"raise {duration_flag}{longer} or --sessions-per-s")
