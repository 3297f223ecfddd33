"""The DeepResearch plan: determinism, structure, shared targets, answerable questions."""

from __future__ import annotations

from collections import defaultdict

import pytest

from workloads.corpus import get_article
from workloads.deepresearch import prompts
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.demo_config import demo_config
from workloads.deepresearch.generator import generate_plan
from workloads.deepresearch.plan import WorkloadPlan
from workloads.facts import grade
from workloads.text import truncate_to_sentences


def _config(seed: int) -> WorkloadConfig:
    tenants = (
        TenantProfile("alpha", "interactive", 1000.0, 100.0, 2.0, sessions_per_s=0.1),
        TenantProfile("beta", "batch", 9000.0, 900.0, 0.5, sessions_per_s=0.1, arrival_cv=2.0),
    )
    return WorkloadConfig(seed=seed, duration_s=100.0, tenants=tenants, max_subagents=6,
                          max_reads=3)  # fmt: skip


@pytest.fixture(scope="module")
def plan() -> WorkloadPlan:
    return generate_plan(_config(seed=11))


def test_same_seed_gives_the_identical_plan(plan: WorkloadPlan) -> None:
    assert generate_plan(_config(seed=11)) == plan


def test_another_seed_gives_another_plan(plan: WorkloadPlan) -> None:
    other = generate_plan(_config(seed=12))
    assert other != plan
    assert [s.topics for s in other.sessions] != [s.topics for s in plan.sessions]


def test_call_ids_are_unique_and_the_lead_plans_first(plan: WorkloadPlan) -> None:
    calls = [call for _, call in plan.calls()]
    assert len({c.call_id for c in calls}) == len(calls) == plan.num_calls()
    first = calls[0]
    assert (first.agent, first.kind, first.turn, first.pause_s) == ("lead", "plan", 0, 0.0)
    assert all(not c.messages for c in calls)  # the agents write them at run time
    assert (plan.search_top_k, plan.max_article_words) == (3, 150)


def test_session_structure(plan: WorkloadPlan) -> None:
    assert len(plan.sessions) >= 10
    assert [s.arrival_s for s in plan.sessions] == sorted(s.arrival_s for s in plan.sessions)
    assert {s.tenant for s in plan.sessions} == {"alpha", "beta"}
    for session in plan.sessions:
        assert 2 <= len(session.subagents) <= 6
        assert [c.kind for c in session.lead.calls] == ["plan", "report"]
        assert session.topics == tuple(s.task.target for s in session.subagents if s.task)
        assert len(set(session.topics)) == len(session.subagents)
        for sub in session.subagents:
            kinds = [c.kind for c in sub.calls]
            assert kinds[0] == "search" and kinds[-1] == "answer"
            assert 1 <= kinds.count("read") <= 3 and len(kinds) == kinds.count("read") + 2
            assert [c.turn for c in sub.calls] == list(range(len(sub.calls)))
            assert {c.session_id for c in sub.calls} == {sub.session_id}
            assert sub.task is not None and sub.calls[-1].expected_answer == sub.task.answer
            assert sub.task.fallback_question == prompts.fallback_question(sub.task.target)
            assert all(0.0 < c.pause_s <= 10.0 for c in sub.calls if c.kind in ("search", "read"))


def test_every_graded_answer_is_in_its_target_as_the_agents_see_it(plan: WorkloadPlan) -> None:
    for session in plan.sessions:
        for sub in session.subagents:
            assert sub.task is not None
            text = truncate_to_sentences(get_article(sub.task.target).extract, 150)
            assert grade(text, sub.task.answer)
            assert sub.task.question.startswith(f"According to the article on {sub.task.target},")


def test_targets_recur_across_agents_and_tenants(plan: WorkloadPlan) -> None:
    tenants_of: dict[str, set[str]] = defaultdict(set)
    n = 0
    for session in plan.sessions:
        for target in session.topics:
            tenants_of[target].add(session.tenant)
            n += 1
    assert any(len(t) == 2 for t in tenants_of.values()), "no target shared by both tenants"
    assert len(tenants_of) < n  # some article is the target of more than one agent


def test_demo_config_has_a_noisy_neighbour_at_four_times_the_share() -> None:
    config = demo_config()
    by_class = {t.slo_class for t in config.tenants}
    assert by_class == {"interactive", "standard", "batch"}
    (noisy,) = [t for t in config.tenants if t.noisy]
    quiet = [t for t in config.tenants if not t.noisy]
    assert all(noisy.sessions_per_s == 4 * t.sessions_per_s for t in quiet)


def test_config_rejects_bad_values() -> None:
    tenant = TenantProfile("a", "standard", 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="min_subagents"):
        WorkloadConfig(tenants=(tenant,), min_subagents=1)
    with pytest.raises(ValueError, match="max_subagents <= 6"):
        WorkloadConfig(tenants=(tenant,), max_subagents=7)
    with pytest.raises(ValueError, match=r"search_top_k \(2\) must be >= max_reads \(3\)"):
        WorkloadConfig(tenants=(tenant,), max_reads=3, search_top_k=2)
    with pytest.raises(ValueError, match="unique"):
        WorkloadConfig(tenants=(tenant, tenant))
    with pytest.raises(ValueError, match="slo_class"):
        TenantProfile("a", "gold", 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="ttft_slo_ms must be positive"):
        TenantProfile("a", "batch", 0.0, 1.0, 0.0)
    assert tenant.cache_namespace == "a"


def test_first_arrival_s_is_where_the_plan_gets_its_first_session() -> None:
    """`kvstrata run deepresearch` names the --duration that gives a session when the plan has
    none: the first arrival does not depend on the duration."""
    import dataclasses
    import math

    from workloads.deepresearch.demo_config import demo_tenants
    from workloads.deepresearch.generator import first_arrival_s

    short = WorkloadConfig(seed=0, duration_s=20.0, tenants=demo_tenants(0.054)[:2], max_subagents=2)
    assert not generate_plan(short).sessions
    first = first_arrival_s(short)
    assert first is not None and first > 20.0
    assert not generate_plan(dataclasses.replace(short, duration_s=first)).sessions  # [0, duration) only
    longer = generate_plan(dataclasses.replace(short, duration_s=math.floor(first) + 1))
    assert [s.arrival_s for s in longer.sessions] == [first]
    assert first_arrival_s(dataclasses.replace(short, duration_s=500.0)) == first
    tiny = TenantProfile("slow", "batch", 9000.0, 900.0, 0.5, sessions_per_s=1e-30)
    assert first_arrival_s(WorkloadConfig(duration_s=1.0, tenants=(tiny,)), max_doublings=3) is None


def test_the_demo_refuses_a_plan_without_a_session_before_starting_anything(capsys) -> None:
    """A fresh-user trial: ``python -m workloads.demo --duration-s 1`` started the cluster and
    ran an empty plan (0 sessions, empty tables); ``kvstrata run deepresearch`` already refused
    it. Now the demo's arguments are refused as a usage error (exit 2) with the numbers and the
    ``--duration-s`` that gives a session; a plan with one is accepted."""
    from workloads.demo import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--duration-s", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "no research session to run: --duration-s 1 s" in err and "(4 tenants)" in err
    assert "raise --duration-s (16 gives one)" in err
    assert parse_args(["--duration-s", "16"]).duration_s == 16
