"""A session never counts history KV it holds no blocks for, and a turn that ends without
handing its KV on leaves the history's KV, or records its loss (review s34 A L1).

Before: (a) a full-cache turn took its history's blocks over (``SessionTable.attach``), so a
cancelled one freed them while the session kept its count (no blocks, no ``lost``): the next
turn prefilled the whole history again and, under a statistics-reading policy (H2O), decoded
other tokens than had the cancelled turn never run, unmarked; (b) a turn cut short (its
policy's codes outgrew the pool) became a history of hundreds of computed tokens in no block,
its loss unrecorded. Now a full-cache turn is lent the blocks as a compressing turn is, a
history's partial block that the turn filled and the cache hashed is copied (``_seal``), a turn
handing over no blocks hands over no count and records the loss, and ``check_integrity`` fails
on an idle session counting KV it holds no blocks for. Tiny random Llama.
"""

from __future__ import annotations

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from tests.test_session_rewind_state import drain
from tests.test_tier_engine import prompt_of

BS = 16


def engine(tiny: LoadedModel, num_blocks: int = 64) -> LLMEngine:
    mc = tiny.model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    per_block = BS * KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, tiny.model.dtype)
    return LLMEngine(tiny.model, EngineConfig(block_size=BS, kv_pool_bytes=num_blocks * per_block,
                                              max_num_batched_tokens=64, max_num_seqs=8),
                     tiny.model_id, tiny.eos_token_ids)


def first_turn(eng: LLMEngine) -> list[int]:
    """A full-cache first turn: 44 computed history tokens, the third block partial."""
    eng.add_request(prompt_of(40, 1), SamplingParams(max_tokens=5, ignore_eos=True), request_id="t1",
                    session_id="s", tenant="t")
    drain(eng)
    history = eng.session_history("s")
    assert history is not None
    return history


def third_turn(eng: LLMEngine, history: list[int], policy: str) -> tuple[tuple[int, ...], int, float | None]:
    eng.add_request(history + prompt_of(4, 3), SamplingParams(max_tokens=12, ignore_eos=True), request_id="t3",
                    session_id="s", tenant="t", policy=policy)
    out = drain(eng)["t3"]
    return out.output_token_ids, out.num_cached_tokens, out.policy_stats.get("session_state_dropped")


@pytest.mark.parametrize("steps", [1, 3])  # cancelled mid-prefill / after its prefill filled the partial block
def test_a_cancelled_full_cache_turn_leaves_the_history_its_kv(tiny: LoadedModel, steps: int) -> None:
    """A cancelled full-cache turn changes nothing for the session: the history keeps its 44
    computed tokens in its 3 blocks, and the next turn under H2O (which reads every query's
    attention) continues from all of them and decodes what it decodes where the cancelled turn
    never ran."""
    eng = engine(tiny)
    history = first_turn(eng)
    eng.add_request(history + prompt_of(60, 2), SamplingParams(max_tokens=20, ignore_eos=True), request_id="t2",
                    session_id="s", tenant="t")
    for _ in range(steps):
        eng.step()
    assert eng.abort_request("t2")
    drain(eng)
    sess = eng.sessions.sessions["s"]
    assert (sess.num_computed_tokens, len(sess.blocks), sess.lost) == (len(history) - 1, 3, None)
    eng.check_integrity()
    here = third_turn(eng, history, "h2o-0.5")

    never = engine(tiny)
    assert first_turn(never) == history
    assert here == third_turn(never, history, "h2o-0.5")
    assert here[1] == len(history) - 1 and here[2] is None
    eng.check_integrity()


def test_a_turn_cut_short_hands_over_no_kv_and_records_the_loss(tiny: LoadedModel) -> None:
    """A turn whose policy's codes outgrew a 6-block pool ends cut short with its blocks freed:
    the history it becomes counts no computed tokens and records the loss (before: 294 computed
    tokens in 0 blocks, ``lost`` None)."""
    eng = engine(tiny, num_blocks=6)
    eng.add_request(prompt_of(60, 1), SamplingParams(max_tokens=400, ignore_eos=True), request_id="t1",
                    session_id="s", tenant="t", policy="snapkv-0.25-cold_bits_4")
    out = drain(eng)["t1"]
    assert out.policy_stats.get("cut_short") == 1.0
    sess = eng.sessions.sessions["s"]
    assert len(sess.token_ids) > 6 * BS and not sess.blocks  # (more than the pool holds)
    assert sess.num_computed_tokens == sess.num_evicted_tokens == 0 and sess.kv is None
    assert sess.lost is not None and sess.lost.policy == "snapkv-0.25-cold_bits_4"
    eng.check_integrity()


def test_check_integrity_fails_on_a_session_counting_kv_it_has_no_blocks_for(tiny: LoadedModel) -> None:
    eng = engine(tiny)
    first_turn(eng)
    eng.check_integrity()
    sess = eng.sessions.sessions["s"]
    blocks, sess.blocks = sess.blocks, sess.blocks[:1]  # as the faults left it: a count past its blocks
    with pytest.raises(RuntimeError, match="counts 44 computed tokens .* in 1 blocks"):
        eng.check_integrity()
    sess.blocks = blocks
    eng.check_integrity()


def test_reclaim_keeps_a_running_full_cache_turns_history_that_frees_nothing(tiny: LoadedModel) -> None:
    """The engine's last resort for blocks (``_reclaim``) drops the histories sessions keep for
    their turns; a running full-cache turn shares every block of its history, so dropping it
    frees nothing and would only lose what a cancel falls back on (diff review s34 F7): it is
    skipped, and a cancel after it still leaves the history its KV."""
    eng = engine(tiny)
    history = first_turn(eng)
    eng.add_request(history + prompt_of(60, 2), SamplingParams(max_tokens=20, ignore_eos=True), request_id="t2",
                    session_id="s", tenant="t")
    eng.step()
    seq = eng.requests["t2"]
    assert seq.kept is not None and seq.kept.num_blocks_beside(seq) == 0
    with eng._lock:
        eng._reclaim(eng.kv_manager.pool.num_blocks)  # more than can ever be free: every candidate tried
    assert seq.kept is not None
    sess = eng.sessions.sessions["s"]
    assert eng.abort_request("t2")
    drain(eng)
    assert (sess.num_computed_tokens, len(sess.blocks), sess.lost) == (len(history) - 1, 3, None)
    eng.check_integrity()
