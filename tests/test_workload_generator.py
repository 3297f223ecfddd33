"""The DeepResearch plan: determinism, structure, shared documents, answerable questions."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from workloads.corpus import get_article
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.demo_config import demo_config
from workloads.deepresearch.generator import generate_plan
from workloads.deepresearch.plan import FINDINGS_MARK, WorkloadPlan, write_trace
from workloads.facts import grade


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


def _trace(plan: WorkloadPlan, path: Path) -> bytes:
    write_trace(plan, path)
    return path.read_bytes()


def test_same_seed_gives_the_identical_trace(plan: WorkloadPlan, tmp_path: Path) -> None:
    again = generate_plan(_config(seed=11))
    assert again == plan
    assert _trace(plan, tmp_path / "a.jsonl") == _trace(again, tmp_path / "b.jsonl")


def test_another_seed_gives_another_trace(plan: WorkloadPlan, tmp_path: Path) -> None:
    other = generate_plan(_config(seed=12))
    assert _trace(plan, tmp_path / "a.jsonl") != _trace(other, tmp_path / "b.jsonl")


def test_trace_has_one_line_per_call(plan: WorkloadPlan, tmp_path: Path) -> None:
    n = write_trace(plan, tmp_path / "t.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert n == len(rows) == plan.num_calls()
    assert len({r["call_id"] for r in rows}) == n
    first = rows[0]
    assert (first["agent"], first["kind"], first["turn"], first["pause_s"]) == (
        "lead",
        "plan",
        0,
        0.0,
    )
    assert set(first) == {
        "agent", "arrival_s", "call_id", "context_chars", "doc_ids", "expected_answer",
        "kind", "max_tokens", "pause_s", "prompt_chars", "research_id", "session_id",
        "tenant", "turn",
    }  # fmt: skip


def test_session_structure(plan: WorkloadPlan) -> None:
    assert len(plan.sessions) >= 10
    assert [s.arrival_s for s in plan.sessions] == sorted(s.arrival_s for s in plan.sessions)
    assert {s.tenant for s in plan.sessions} == {"alpha", "beta"}
    for session in plan.sessions:
        assert 2 <= len(session.subagents) <= 6
        assert [c.kind for c in session.lead.calls] == ["plan", "report"]
        report = session.lead.calls[1]
        assert report.findings_from == tuple(s.session_id for s in session.subagents)
        assert FINDINGS_MARK in report.messages[0].content
        for sub in session.subagents:
            kinds = [c.kind for c in sub.calls]
            assert kinds[0] == "search" and kinds[-1] == "answer"
            assert 1 <= kinds.count("read") <= 3 and len(kinds) == kinds.count("read") + 2
            assert [c.turn for c in sub.calls] == list(range(len(sub.calls)))
            assert {c.session_id for c in sub.calls} == {sub.session_id}
            assert [m.role for m in sub.calls[0].messages] == ["system", "user"]
            assert all([m.role for m in c.messages] == ["user"] for c in sub.calls[1:])
            assert all(0.0 < c.pause_s <= 10.0 for c in sub.calls if c.kind in ("search", "read"))


def test_every_answer_is_in_an_article_the_agent_read(plan: WorkloadPlan) -> None:
    answers = 0
    for session in plan.sessions:
        for sub in session.subagents:
            answer = sub.calls[-1]
            read_text = " ".join(c.messages[0].content for c in sub.calls if c.kind == "read")
            assert answer.expected_answer is not None
            assert grade(read_text, answer.expected_answer)
            title = answer.messages[0].content.split("According to the article on ")[1]
            assert any(title.startswith(doc + ",") for c in sub.calls for doc in c.doc_ids)
            answers += 1
    assert answers == sum(len(s.subagents) for s in plan.sessions)


def test_documents_recur_across_agents_and_tenants(plan: WorkloadPlan) -> None:
    readers: dict[str, set[str]] = defaultdict(set)
    reads = 0
    for _, call in plan.calls():
        if call.kind == "read":
            readers[call.doc_ids[0]].add(call.tenant)
            reads += 1
    shared = [doc for doc, tenants in readers.items() if len(tenants) == 2]
    assert shared, "no article was read by both tenants"
    assert len(readers) < reads  # some article was read more than once
    assert all(get_article(doc) for doc in readers)


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
    with pytest.raises(ValueError, match="unique"):
        WorkloadConfig(tenants=(tenant, tenant))
    with pytest.raises(ValueError, match="slo_class"):
        TenantProfile("a", "gold", 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="ttft_slo_ms must be positive"):
        TenantProfile("a", "batch", 0.0, 1.0, 0.0)
    assert tenant.cache_namespace == "a"
