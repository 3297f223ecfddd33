"""Device-pool reclaim of idle states is max-min fair across holders (security review 20 S1):
a waiting request unpins the idle sessions (and stored compressed prefixes) of the holder
holding the most idle blocks first, least recently used first within it, and still gets every
block it needs when only other holders' idle states are left."""

from __future__ import annotations

import pytest

from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_tier_engine import prompt_of

P = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama: 2 layers x K/V x 16 tokens x 2 heads x 16 dims x fp32


def held(eng: LLMEngine, tenant: str) -> int:
    return sum(s.num_held_blocks for s in eng.sessions.sessions.values() if s.tenant == tenant)


def b_then_a(tiny: LoadedModel, flood: bool, policy: str) -> tuple[tuple[int, int], int, list[int]]:
    """B opens a session, then A three (used later, so B's is the least recently used); then
    (``flood``) A sends one 150-token request that cannot start without unpinning; then B's
    next turn. Returns idle blocks (A, B) before B's turn, its reused tokens and its output."""
    eng = make_engine(tiny, kv_pool_bytes=30 * BLOCK)
    history = prompt_of(80, 1)
    out = eng.generate([history], P, session_id="B/s1", tenant="B", cache_namespace="tenant:B", policy=policy)[0]
    for i in range(3):
        eng.generate([prompt_of(80, 100 + i)], P, session_id=f"A/s{i}", tenant="A", cache_namespace="tenant:A")
    if flood:
        done = eng.generate([prompt_of(150, 999)], P, tenant="A", cache_namespace="tenant:A")[0]
        assert len(done.output_token_ids) == 8
    idle = (held(eng, "A"), held(eng, "B"))
    turn = eng.generate([history + list(out.output_token_ids) + prompt_of(16, 555)], P, session_id="B/s1",
                        tenant="B", cache_namespace="tenant:B", policy=policy)[0]
    assert not eng.check_integrity()
    return idle, turn.num_cached_tokens, list(turn.output_token_ids)


@pytest.mark.parametrize("policy", ["", "snapkv-40"])
def test_a_waiting_request_unpins_its_own_larger_idle_holding_before_another_tenants(tiny: LoadedModel,
                                                                                    policy: str) -> None:
    """Regression: one LRU order over every tenant; A's request (A holding 18 idle blocks)
    unpinned B's older session (3-6 blocks) and none of A's: B's next turn reused 32 (full
    cache) or 0 (snapkv-40: its compacted state went whole, and its output changed) of 104
    prompt tokens instead of 87."""
    (a_quiet, b_quiet), reused_quiet, out_quiet = b_then_a(tiny, False, policy)
    (a_after, b_after), reused, out = b_then_a(tiny, True, policy)
    assert b_after == b_quiet > 0 and a_after < a_quiet
    assert reused == reused_quiet == 87
    assert out == out_quiet


def test_other_holders_idle_states_still_give_way_largest_first(tiny: LoadedModel) -> None:
    """A request of a holder with no idle state still gets its blocks (progress): the other
    holders' idle sessions go, the largest holder's first, least recently used first within it."""
    eng = make_engine(tiny, kv_pool_bytes=30 * BLOCK)
    eng.generate([prompt_of(40, 7)], P, session_id="C/s0", tenant="C", cache_namespace="tenant:C")
    for i in range(3):
        eng.generate([prompt_of(60, 100 + i)], P, session_id=f"B/s{i}", tenant="B", cache_namespace="tenant:B")
    c_before, b_before = held(eng, "C"), held(eng, "B")
    assert eng.kv_manager.pool.num_free_blocks() < 13 and c_before < b_before
    done = eng.generate([prompt_of(190, 999)], P, tenant="A", cache_namespace="tenant:A")[0]
    assert len(done.output_token_ids) == 8
    sessions = eng.sessions.sessions
    assert held(eng, "C") == c_before  # B still held more than C after each of its sessions went
    assert not sessions["B/s0"].blocks and sessions["B/s2"].blocks  # least recently used first
    assert not eng.check_integrity()
