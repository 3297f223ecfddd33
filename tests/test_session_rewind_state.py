"""A session turn undone after its end (``LLMEngine.rewind_session``: its client's cancel
landed while the last step computed) leaves its session the KV and policy state it had before
the turn, as a cancel one step earlier does (hangs review 20 W2)."""

from __future__ import annotations

from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_tier_engine import prompt_of

POLICY = "snapkv-0.5"


def drain(eng: LLMEngine) -> dict:  # type: ignore[type-arg]
    final = {}
    for _ in range(3000):
        if not eng.has_unfinished_requests():
            return final
        final.update({o.request_id: o for o in eng.step() if o.finished})
    raise AssertionError("the engine did not drain")


def second_turn(tiny: LoadedModel, max_tokens: int = 8) -> tuple[LLMEngine, list[int], list[int]]:
    """A snapkv-0.5 session's first turn, done, and its second (``t2``) queued: the engine,
    the history before ``t2`` and ``t2``'s prompt."""
    eng = make_engine(tiny, kv_pool_bytes=256 * 8192, max_num_batched_tokens=64, max_num_seqs=4)
    eng.add_request(prompt_of(96, 1), SamplingParams(max_tokens=8, ignore_eos=True), request_id="t1",
                    session_id="s", policy=POLICY)
    drain(eng)
    history = eng.session_history("s")
    assert history is not None
    p2 = history + prompt_of(24, 2)
    eng.add_request(p2, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id="t2", session_id="s",
                    policy=POLICY)
    return eng, history, p2


def third_turn(tiny: LoadedModel, rewind: bool) -> tuple[tuple[int, ...], int, LLMEngine]:
    eng, history, p2 = second_turn(tiny)
    if rewind:  # the cancel lost the race: the turn finished in the step it landed in
        o2 = drain(eng)["t2"]
        assert eng.rewind_session("s", history, len(p2), o2.output_token_ids)
    else:  # the cancel landed a step earlier
        for _ in range(5):
            eng.step()
        eng.abort_request("t2")
        drain(eng)
    assert eng.session_history("s") == history
    kv = eng.sessions.sessions["s"].kv
    assert kv is not None and kv.compacted
    eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=16, ignore_eos=True), request_id="t3",
                    session_id="s", policy=POLICY)
    out = drain(eng)["t3"].output_token_ids
    assert not eng.check_integrity()
    return out, eng.sessions.num_policy_continuations, eng


def test_a_turn_undone_after_its_end_leaves_the_history_state_it_found(tiny: LoadedModel) -> None:
    """Regression: the rewind dropped the history's compacted state (it had been freed when the
    turn ended); the next turn prefilled the whole history, compressed it at once and decoded
    other tokens than after an abort a step earlier (1 policy continuation instead of 2)."""
    aborted, continued_aborted, _ = third_turn(tiny, False)
    rewound, continued_rewound, _ = third_turn(tiny, True)
    assert rewound == aborted
    assert continued_rewound == continued_aborted == 2


def test_the_history_kept_for_an_undo_is_freed_by_the_next_step(tiny: LoadedModel) -> None:
    eng, _, _ = second_turn(tiny)
    pool = eng.kv_manager.pool
    drain(eng)
    sess = eng.sessions.sessions["s"]
    assert sess.previous is not None and sess.previous.blocks  # kept for an undo until the next step
    held = pool.num_free_blocks()
    eng.step()
    assert sess.previous is None and pool.num_free_blocks() > held
    assert eng.close_session("s") and all(b.ref_cnt == 0 for b in pool.blocks)  # nothing leaked
    assert not eng.check_integrity()


def test_a_turn_that_loses_its_sessions_kept_state_says_so(tiny: LoadedModel) -> None:
    """Regression (hangs review 20 N-a): a waiting session turn whose kept history state the
    engine took back as its last resort for blocks (``LLMEngine._reclaim``) computed history
    and prompt at once, and may decode other tokens, with nothing in its usage saying so."""
    marks = []
    for reclaim in (False, True):
        eng, _, _ = second_turn(tiny, max_tokens=4)
        rid = "t2"
        if reclaim:  # as when a lone request is short of blocks: kept histories go last
            eng._reclaim(eng.kv_manager.pool.num_blocks + 1)
        out = drain(eng)[rid]
        marks.append(out.policy_stats.get("session_state_dropped"))
        assert len(out.output_token_ids) == 4 and not eng.check_integrity()
    assert marks == [None, 1.0]


def test_a_turn_ended_on_a_stop_string_can_still_be_undone_to_its_state(tiny: LoadedModel) -> None:
    """Regression (review of b4a2ce4, D1): a turn the cache node ends on a stop string
    (``abort_request(reason="stop")``) reports its end in the next step, which freed the kept
    history before the node could undo the turn; the session got its tokens without KV."""
    aborted, _, _ = third_turn(tiny, False)
    eng, history, p2 = second_turn(tiny)
    for _ in range(5):
        eng.step()
    assert eng.abort_request("t2", reason="stop")  # the node matched a stop string
    ended = next(o for o in eng.step() if o.request_id == "t2")  # its end is reported now
    assert eng.rewind_session("s", history, len(p2), ended.output_token_ids)  # its client had cancelled
    eng.release_undo()
    kv = eng.sessions.sessions["s"].kv
    assert kv is not None and kv.compacted
    eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=16, ignore_eos=True), request_id="t3",
                    session_id="s", policy=POLICY)
    assert drain(eng)["t3"].output_token_ids == aborted
    assert not eng.check_integrity()
