"""Running SentenceKV requests give host-tier room back to another tenant within its share.

SentenceKV (``cache_node.policies.sentencekv``) demotes the sentences it evicts to host-tier
slots its request reserves (``TierHostKV``). Idle holders give such slots back
(``LLMEngine._reclaim_host``); a running request of a tenant over its max-min fair share of
the tier is preempted for another tenant's compaction within its share
(``SequenceKV.wait_for_host``, ``Scheduler._compact_due``). The oracle is the other tenant's
greedy output on an idle node.
"""

from __future__ import annotations

import dataclasses

import pytest

from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.base import TenantShare
from cache_node.tiers.manager import TierConfig
from tests.conftest import make_engine

SPEC = "sentencekv-64"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _engine(tiny, host_slots: int, scheduling_policy: str = "fcfs", **engine: int) -> LLMEngine:
    """A tiny-model engine with a host tier of ``host_slots`` blocks, sentences ending at token
    13; ``engine``: EngineConfig fields over the defaults (4 MiB pool, 128-token steps)."""
    probe = make_engine(tiny, **{"kv_pool_bytes": 4 << 20, "max_num_batched_tokens": 128, **engine})
    config = dataclasses.replace(probe.config, scheduling_policy=scheduling_policy)
    eng = LLMEngine(tiny.model, config, tiny.model_id, tiny.eos_token_ids,
                    tier_config=TierConfig(host_bytes=host_slots * probe.pool.bytes_per_block))
    eng.policy_env = PolicyEnv(frozenset({13}))  # token 13 ends a sentence
    return eng


def _prompt(n: int, off: int) -> list[int]:  # sentences of 12 tokens
    return [13 if i % 12 == 11 else (7 * i + off) % 400 + 20 for i in range(n)]


def _start(eng: LLMEngine, tenant: str, offsets: list[int], max_tokens: int) -> list[str]:
    """Add ``tenant``'s requests and step until each has decoded a token (compacted)."""
    ids = [eng.add_request(_prompt(400, off), SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant=tenant,
                           cache_namespace=f"tenant:{tenant}", policy=SPEC) for off in offsets]
    started: set[str] = set()
    for _ in range(200):
        started |= {out.request_id for out in eng.step() if out.new_token_ids}
        if started >= set(ids):
            return ids
    raise AssertionError(f"{tenant}'s requests did not start")


def _run(eng: LLMEngine, tenant: str, off: int) -> tuple[tuple[int, ...], dict[str, float], dict[str, object]]:
    """Run one request of ``tenant`` to its end (others step along); its output, policy stats
    and the other requests' finished outputs meanwhile."""
    rid = eng.add_request(_prompt(400, off), GREEDY, tenant=tenant, cache_namespace=f"tenant:{tenant}", policy=SPEC)
    others: dict[str, object] = {}
    for _ in range(2000):
        for out in eng.step():
            if out.finished and out.request_id == rid:
                return out.output_token_ids, dict(out.policy_stats or {}), others
            if out.finished:
                others[out.request_id] = out
    raise AssertionError("the request did not finish")


def _drain(eng: LLMEngine) -> set[str]:
    """Step until every request finished (returned); then every block and slot is free."""
    finished: set[str] = set()
    for _ in range(5000):
        if not eng.has_unfinished_requests():
            break
        finished |= {out.request_id for out in eng.step() if out.finished}
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks
    assert eng.tiers.host.num_reserved == 0
    return finished


@pytest.mark.timeout(300)
def test_running_holders_over_their_share_give_way(tiny) -> None:
    """Regression (security review 18 C): tenant A's two running SentenceKV requests held most
    of the host tier (a request of 400 tokens keeps ~32 slots of 68); tenant B's request,
    within its share, found no room for the sentences it demoted, dropped them
    (``dropped_tokens``) and decoded other tokens than on an idle node. Now B's compaction
    waits one step while the scheduler preempts one of A's requests; B decodes as alone,
    drops nothing, and A's preempted request still finishes (with its over-share part
    dropped, counted)."""
    alone, alone_stats, _ = _run(_engine(tiny, 68), "B", 3)
    assert "dropped_tokens" not in alone_stats
    eng = _engine(tiny, 68)
    a_ids = _start(eng, "A", [100, 101], max_tokens=40)
    host = eng.tiers.host
    assert host.reserved_by["tenant:A"] > 30 and not host.can_reserve(20, "tenant:B")
    got, stats, _ = _run(eng, "B", 3)
    assert got == alone
    assert "dropped_tokens" not in stats and stats["deferred_compactions"] >= 1
    # A's requests gave way (one of them preempted again when it restarted into B's room)
    assert 1 <= eng.scheduler.num_preemptions <= 3
    finished = _drain(eng)
    assert set(a_ids) <= finished  # A's preempted request ran again to its end


@pytest.mark.timeout(300)
def test_a_holder_over_its_share_preempts_nobody(tiny) -> None:
    """A tenant already holding more of the host tier than the others never preempts them
    for its own sentences: its request drops what does not fit (counted), and the other
    tenant's running request is not preempted (no compaction put off for it)."""
    eng = _engine(tiny, 40)
    _start(eng, "B", [3], max_tokens=60)
    _start(eng, "A", [100], max_tokens=60)
    before = eng.scheduler.num_preemptions
    _, stats, _ = _run(eng, "A", 101)  # A would hold more than B
    assert stats.get("dropped_tokens", 0) > 0 and "deferred_compactions" not in stats
    assert eng.scheduler.num_preemptions == before
    _drain(eng)


@pytest.mark.timeout(300)
def test_a_tenants_own_running_requests_are_not_contenders(tiny) -> None:
    """One tenant alone: its second request drops what its first holds (as before: the tier
    is too small for it), and preempts nothing."""
    eng = _engine(tiny, 30)
    _start(eng, "A", [100], max_tokens=60)
    _, stats, _ = _run(eng, "A", 101)
    assert stats.get("dropped_tokens", 0) > 0 and "deferred_compactions" not in stats
    assert eng.scheduler.num_preemptions == 0
    _drain(eng)


@pytest.mark.timeout(300)
def test_a_lower_class_never_preempts_a_higher_one_for_host_room(tiny) -> None:
    """Regression (review of e3eb2b5, F2): a batch tenant's compaction preempted an interactive
    tenant's running requests for host room (the share counted holdings alone), and the
    interactive request restarted and dropped 348 tokens instead of 24. Now only requests of
    the compacting request's class or a lower one give way: the batch tenant drops its
    over-share sentences (counted) and preempts nobody."""
    eng = _engine(tiny, 68, scheduling_policy="priority")
    eng.scheduler.policy.set_tenant("A", TenantShare("interactive", ttft_slo_ms=1000.0, weight=4.0))
    eng.scheduler.policy.set_tenant("B", TenantShare("batch", ttft_slo_ms=60000.0))
    _start(eng, "A", [100, 101], max_tokens=40)
    _, stats, _ = _run(eng, "B", 3)
    assert stats.get("dropped_tokens", 0) > 0 and "deferred_compactions" not in stats
    assert eng.scheduler.num_preemptions == 0
    _drain(eng)
