"""A session history's partly filled last block, once the prefix cache hashed it, is never
written again.

The fault (review, session 32): a session turn is lent its history's blocks, the partly filled
last one included (``SessionTable.lend``: a turn under a compressing policy, ``quant`` among
them, continuing from plain history KV). The turn fills that block with its own tokens and the
prefix cache hashes it (``LLMEngine._after_forward``). Cancelled (``detach``), undone
(``rewind_session``) or restarted, the turn left the history holding the hashed block with the
history's shorter length, and the next turn wrote its own tokens' KV into the block's free
slots. A later prefix hit on the cancelled turn's tokens (any request of the namespace, another
tenant's where one is shared) read the next turn's KV and decoded other tokens than on an idle
node; demoted, the block carried that KV to the host tier.

Now ``SessionTable._seal`` copies such a block into a fresh block of the history's own before a
turn writes past it (the hashed block stays cached with its KV; review s34 A L1: it was dropped
and its up to ``block_size - 1`` tokens computed again, which under a statistics-reading policy
made the next turn decode other tokens than had the cancelled turn never run), and
``KVCacheManager._guard_writes`` counts a write that would still reach a hashed block
(``check_integrity`` fails on it).
"""

from __future__ import annotations

import pytest

from cache_node.engine import LLMEngine
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from tests.conftest import make_engine
from tests.test_session_rewind_state import drain
from tests.test_tier_engine import prompt_of, tiered

BS = 16
HISTORY = 44  # computed tokens of the first turn's history (37 prompt + 8 output, the last not computed)


def engine(tiny: LoadedModel) -> LLMEngine:
    return make_engine(tiny, kv_pool_bytes=256 * 8192, max_num_batched_tokens=64, max_num_seqs=4)


def greedy(eng: LLMEngine, prompt: list[int], rid: str = "r", **kw: str | None) -> tuple[int, ...]:
    eng.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True), request_id=rid, **kw)  # type: ignore[arg-type]
    return drain(eng)[rid].output_token_ids


def cancelled_turn(eng: LLMEngine, first: str | None, policy: str | None, end: str) -> tuple[list[int], list[int]]:
    """A session's first turn under ``first`` (history: 45 tokens, 44 computed, its third block
    partial), then a second (``t2``, under ``policy``) ended by ``end``: "cancel" after its
    prefill (the history's partial block is filled and hashed by then), or "rewind" after it
    finished. Returns the history and ``t2``'s prompt."""
    eng.add_request(prompt_of(37, 1), SamplingParams(max_tokens=8, ignore_eos=True), request_id="t1",
                    session_id="s", policy=first)
    drain(eng)
    history = eng.session_history("s")
    assert history is not None and len(history) == HISTORY + 1
    p2 = history + prompt_of(24, 2)
    eng.add_request(p2, SamplingParams(max_tokens=8, ignore_eos=True), request_id="t2", session_id="s",
                    policy=policy)
    if end == "cancel":
        for _ in range(3):  # 69 prompt tokens past the 44 lent: computed in one step
            eng.step()
        eng.abort_request("t2")
        drain(eng)
    else:
        out = drain(eng)["t2"].output_token_ids
        assert eng.rewind_session("s", history, len(p2), out)
    assert eng.session_history("s") == history
    return history, p2


def history_is_sealed(eng: LLMEngine) -> bool:
    """No block of the idle history that a next turn writes into carries a prefix-cache hash."""
    sess = eng.sessions.sessions["s"]
    first = (sess.num_computed_tokens - sess.num_evicted_tokens) // BS
    return all(b.block_hash is None for b in sess.blocks[first:])


CASES = [  # (first turn's policy, second's, how it ends)
    ("quant", "quant", "cancel"),  # an ordinary cancel, one policy
    (None, "snapkv-0.5", "cancel"),  # a plain history lent to a compressing turn
    (None, "h2o-0.5", "cancel"),
    (None, "streaming", "cancel"),
    (None, "snapkv-0.5", "rewind"),  # undone after its end: the history restored (``Session.previous``)
]


@pytest.mark.parametrize(("first", "policy", "end"), CASES)
def test_a_prefix_hit_on_a_cancelled_turns_tokens_reads_their_kv(tiny: LoadedModel, first: str | None,
                                                                 policy: str, end: str) -> None:
    """The next turn of the session writes its own tokens past the history; a request whose
    prompt starts with the cancelled turn's tokens (no session, same namespace) then hits the
    block that turn filled, and decodes as on an idle node."""
    eng = engine(tiny)
    history, p2 = cancelled_turn(eng, first, policy, end)
    assert history_is_sealed(eng)
    sess = eng.sessions.sessions["s"]
    # the hashed partial block was copied: the history keeps every computed token, in a block of its own
    assert sess.num_computed_tokens == HISTORY and len(sess.blocks) == 3 and sess.blocks[-1].block_hash is None
    eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t3",
                    session_id="s", policy=policy)
    t3 = drain(eng)["t3"]
    assert t3.num_cached_tokens == HISTORY  # it reused every computed history token
    probe = p2 + prompt_of(8, 4)
    warm = greedy(eng, probe)
    assert warm == greedy(engine(tiny), probe)
    eng.check_integrity()


def test_the_host_tier_gets_the_cancelled_turns_kv(tiny: LoadedModel) -> None:
    """Demoted to the host tier, the block the cancelled turn filled holds that turn's KV: a
    request promoting it decodes as on an idle node."""
    eng = tiered(tiny, pool_blocks=128)
    history, p2 = cancelled_turn(eng, "quant", "quant", "cancel")
    eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t3",
                    session_id="s", policy="quant")
    drain(eng)
    eng.close_session("s")
    assert eng.demote_all() > 0 and not eng.kv_manager.pool.cached
    probe = p2 + prompt_of(8, 4)
    eng.add_request(probe, SamplingParams(max_tokens=16, ignore_eos=True), request_id="r")
    r = drain(eng)["r"]
    assert r.num_cached_tokens_by_tier.get("host", 0) >= 4 * BS  # (through the block t2 filled)
    assert r.output_token_ids == greedy(engine(tiny), probe)
    eng.check_integrity()


def test_a_finished_turns_next_turn_reuses_the_whole_history(tiny: LoadedModel) -> None:
    """Control: a turn that finished hands its blocks on, its partial last block unhashed and
    its own; the next turn (same policy, lent them) reuses every computed history token."""
    eng = engine(tiny)
    eng.add_request(prompt_of(37, 1), SamplingParams(max_tokens=8, ignore_eos=True), request_id="t1",
                    session_id="s", policy="quant")
    drain(eng)
    history = eng.session_history("s")
    assert history is not None
    eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t2",
                    session_id="s", policy="quant")
    assert drain(eng)["t2"].num_cached_tokens == HISTORY
    eng.check_integrity()


def test_a_restarted_turn_writes_nothing_into_the_block_it_filled(tiny: LoadedModel) -> None:
    """A turn lent a plain history (snapkv-0.5 after a full-cache turn) fills and caches the
    history's partial block, then is preempted: it restarts from the history (``lend`` again)
    with a copy of that block (its 12 history tokens' KV kept; the cached block itself never
    written again) and decodes exactly as never preempted."""
    def second(preempt: bool) -> tuple[int, ...]:
        eng = engine(tiny)
        eng.add_request(prompt_of(37, 1), SamplingParams(max_tokens=8, ignore_eos=True), request_id="t1",
                        session_id="s")
        drain(eng)
        history = eng.session_history("s")
        assert history is not None
        eng.add_request(history + prompt_of(24, 2), SamplingParams(max_tokens=8, ignore_eos=True),
                        request_id="t2", session_id="s", policy="snapkv-0.5")
        sess = eng.sessions.sessions["s"]
        partial = sess.blocks[-1]
        if preempt:
            eng.step()  # its prefill: the history's partial block filled and cached
            assert partial.block_hash is not None
            seq = eng.requests["t2"]
            eng.scheduler.preempt(seq)
            assert seq.num_computed_tokens == sess.num_computed_tokens == HISTORY
            assert partial not in seq.block_table and partial not in sess.blocks
        out = drain(eng)["t2"]
        assert out.num_preemptions == int(preempt)
        eng.check_integrity()
        return out.output_token_ids

    assert second(preempt=True) == second(preempt=False)


def test_a_write_into_a_cached_block_is_caught() -> None:
    """``KVCacheManager._guard_writes``: a sequence about to write into a block whose hash is
    registered drops the hash (no later hit reads the new KV), and ``check_integrity`` fails."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = Sequence("a", prompt_of(40, 1), SamplingParams(max_tokens=1))
    assert manager.allocate_slots(a, 40) is not None and manager.num_cached_writes == 0
    a.num_computed_tokens = 40
    manager.cache_full_blocks(a)
    cached = a.block_table[:2]
    assert all(b.block_hash is not None for b in cached)
    b = Sequence("b", prompt_of(40, 1), SamplingParams(max_tokens=1))
    manager.pool.touch(cached)
    b.block_table, b.num_computed_tokens = list(cached), BS + 3  # as a history cut into block 1
    assert manager.allocate_slots(b, 20) is not None  # slots 19..38: blocks 1 and 2 (new)
    assert cached[0].block_hash is not None and cached[1].block_hash is None
    assert manager.num_cached_writes == 1 and len(b.block_table) == 3
    with pytest.raises(RuntimeError, match="prefix-cached blocks were about to be written again"):
        manager.check_integrity()
