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


SPEC = "snapkv-0.25"
DOCS = [[(7 * i + 13 * d) % 500 + 1 for i in range(640)] for d in range(3)]  # 10 blocks each, compressed
Q = [5, 6, 7, 8, 9, 10]


def reclaim_with_forks_queued(tiny: LoadedModel, queue_forks: bool,
                              max_num_seqs: int = 2) -> tuple[int, list[int], int, LLMEngine]:
    """B keeps one compacted session idle (7 blocks), A stores three compressed prefixes (10
    blocks each); two long decodes of C leave 13 of 256 blocks free. B's next request is the
    queue's head (it needs 25) and, when ``queue_forks``, one fork of each of A's prefixes
    queues behind it. The head's reclaim runs. Returns B's session blocks, the indexes (in
    ``DOCS``) of A's prefixes still stored, the free blocks after it, and the engine."""
    from tests.test_compressed_prefix_admission import drain

    eng = make_engine(tiny, kv_pool_bytes=2 << 20, max_num_seqs=max_num_seqs, max_num_batched_tokens=128)
    pool = eng.kv_manager.pool
    eng.add_request([(3 * i) % 400 + 2 for i in range(400)] + Q, P, request_id="b1", session_id="sb", tenant="B",
                    cache_namespace="b", policy=SPEC)
    drain(eng)
    keys = []
    for d, doc in enumerate(DOCS):
        eng.add_request(doc + Q, P, request_id=f"a{d}", tenant="A", cache_namespace="a", policy=SPEC,
                        prefix_tokens=len(doc))
        keys.append(eng.prefixes.keys[f"a{d}"])
        drain(eng)
    assert eng.sessions.sessions["sb"].num_held_blocks == 7 and eng.stats()["compressed_prefix_blocks"] == 30
    each = (pool.num_free_blocks() - 6) // 2
    for k in range(2):
        eng.add_request([200 + k] * (each * 16 - 62), SamplingParams(max_tokens=60, ignore_eos=True),
                        request_id=f"c{k}", tenant="C", cache_namespace="c")
    while any(eng.requests[f"c{k}"].in_prefill for k in range(2)):
        eng.step()
    assert (pool.num_blocks, pool.num_free_blocks()) == (256, 13)
    eng.add_request([9] * 20, P, request_id="bhead", tenant="B", cache_namespace="b")
    if queue_forks:
        for d, doc in enumerate(DOCS):
            eng.add_request(doc + [11, 12], P, request_id=f"af{d}", tenant="A", cache_namespace="a", policy=SPEC,
                            prefix_tokens=len(doc))
    eng._release_idle_sessions()
    stored = [d for d, key in enumerate(keys) if key in eng.prefixes.entries]
    return eng.sessions.sessions["sb"].num_held_blocks, stored, pool.num_free_blocks(), eng


def test_queued_forks_pin_no_idle_state_past_their_holders_fair_share(tiny: LoadedModel) -> None:
    """Regression (review 26e, F1): every stored prefix a queued request would fork was kept
    from the reclaim and left out of its holder's count, so A (30 idle blocks in three stored
    prefixes, a fork of each queued) made B's whole compacted session (7 blocks) go instead of
    its own prefixes, and only 20 blocks came free for a need of 25. Now A's prefixes go as
    without the forks queued, B's session stays, and the one A keeps is the prefix of the fork
    admission starts next (two slots: the head, then it); the later forks compute theirs."""
    from tests.test_compressed_prefix_admission import drain

    b_control, stored_control, free_control, _ = reclaim_with_forks_queued(tiny, False)
    b_blocks, stored, free, eng = reclaim_with_forks_queued(tiny, True)
    assert (b_control, free_control) == (7, 33) and len(stored_control) == 1
    assert (b_blocks, stored, free) == (7, [0], 33)
    out = drain(eng)
    assert [out[f"af{d}"].num_cached_tokens > 0 for d in range(3)] == [True, False, False]
    assert out["af0"].num_cached_tokens == len(DOCS[0])
    assert not eng.check_integrity()


def test_no_other_holder_gives_up_idle_state_for_a_holders_kept_prefixes(tiny: LoadedModel) -> None:
    """Four slots: all three of A's queued forks start next, so all of A's prefixes stay. A
    still holds the most idle blocks (30, counted), so B's session stays too, and the head
    waits for the running requests' blocks (before, review 26e F1: B's session went)."""
    from tests.test_compressed_prefix_admission import drain

    b_blocks, stored, free, eng = reclaim_with_forks_queued(tiny, True, max_num_seqs=4)
    assert (b_blocks, stored, free) == (7, [0, 1, 2], 13)
    out = drain(eng)
    assert [out[f"af{d}"].num_cached_tokens for d in range(3)] == [len(doc) for doc in DOCS]
    assert len(out["bhead"].output_token_ids) == P.max_tokens
    assert not eng.check_integrity()


def test_idle_reclaim_weighs_each_holders_blocks_by_its_tenants_weight(tiny: LoadedModel) -> None:
    """B (weight 8) holds 5x C's idle blocks (weight 1), but less per unit of weight: a third
    tenant's request unpins C's session first, as the host tier and spill evict (held / weight).
    Regression: the device reclaim compared raw blocks, so a tenant's weight bought it nothing
    here: B's sessions went and C's stayed."""
    eng = make_engine(tiny, kv_pool_bytes=30 * BLOCK)
    eng.tiers.note_weight("tenant:B", 8.0)  # as a request of B's tenant (weight 8) tells it
    eng.generate([prompt_of(40, 7)], P, session_id="C/s0", tenant="C", cache_namespace="tenant:C")
    for i in range(3):
        eng.generate([prompt_of(60, 100 + i)], P, session_id=f"B/s{i}", tenant="B", cache_namespace="tenant:B")
    c_before, b_before = held(eng, "C"), held(eng, "B")
    assert 0 < c_before < b_before < 8 * c_before and eng.kv_manager.pool.num_free_blocks() < 13
    done = eng.generate([prompt_of(190, 999)], P, tenant="A", cache_namespace="tenant:A")[0]
    assert len(done.output_token_ids) == 8
    assert held(eng, "C") == 0  # C held more per weight: its session went first
    assert held(eng, "B") == b_before  # C's 3 blocks were enough
    assert not eng.check_integrity()
