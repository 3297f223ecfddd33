"""A session turn that finishes with its compaction put off hands its session the compacted
state, never the uncompacted one (hangs review 20 W1; ``LLMEngine._settle_finished_turns``,
``Scheduler.settle_compaction``)."""

from __future__ import annotations

from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_host_share_running import SPEC, _engine, _prompt, _start
from tests.test_tier_engine import prompt_of


def finish(eng: LLMEngine, rid: str):  # type: ignore[no-untyped-def]
    for _ in range(5000):
        for out in eng.step():
            if out.finished and out.request_id == rid:
                return out
    raise AssertionError(f"{rid} did not finish")


def drain(eng: LLMEngine) -> None:
    for _ in range(5000):
        if not eng.has_unfinished_requests():
            return
        eng.step()
    raise AssertionError("the engine did not drain")


def host_wait_session(eng: LLMEngine) -> tuple[tuple[int, bool, int], tuple[int, ...]]:
    """Tenant B's 400-token sentencekv-64 turn of one token (its compaction is due at its
    only step), then its next turn once the engine is idle."""
    p1 = _prompt(400, 3)
    o1 = finish(eng, eng.add_request(p1, SamplingParams(max_tokens=1, ignore_eos=True), tenant="B",
                                     cache_namespace="tenant:B", policy=SPEC, session_id="s", request_id="t1"))
    kv = eng.sessions.sessions["s"].kv
    assert kv is not None
    state = (kv.num_compactions, kv.compaction_due, kv.positions.shape[1])
    drain(eng)
    p2 = p1 + list(o1.output_token_ids) + _prompt(36, 77)
    o2 = finish(eng, eng.add_request(p2, SamplingParams(max_tokens=24, ignore_eos=True), tenant="B",
                                     cache_namespace="tenant:B", policy=SPEC, session_id="s", request_id="t2"))
    assert not eng.check_integrity()
    return state, o2.output_token_ids


def test_a_turn_whose_compaction_waited_for_host_room_leaves_its_session_compacted(tiny: LoadedModel) -> None:
    """Regression: tenant A's running requests held the host tier; B's one-token session turn
    put its compaction off for host room and finished that step; its session kept the whole
    uncompacted layout (400 slots instead of 20, compaction due), and B's next turn decoded
    other tokens than on an idle node."""
    idle_state, idle_out = host_wait_session(_engine(tiny, 68))
    busy = _engine(tiny, 68)
    _start(busy, "A", [100, 101], max_tokens=40)
    busy_state, busy_out = host_wait_session(busy)
    assert idle_state == busy_state == (1, False, 20)
    assert busy_out == idle_out


def shared_history(tiny: LoadedModel, blocks: int, shared: bool = True) -> tuple[LLMEngine, list[int]]:
    """A session "s" of 129 tokens on a pool of ``blocks`` blocks and (``shared``) a request R
    running over its history's blocks until 3 are free. Returns the engine and the history."""
    eng = make_engine(tiny, kv_pool_bytes=blocks * 8192, max_num_batched_tokens=256, max_num_seqs=4)
    finish(eng, eng.add_request(prompt_of(128, 1), SamplingParams(max_tokens=1, ignore_eos=True),
                                request_id="t0", session_id="s"))
    history = eng.session_history("s")
    assert history is not None
    if shared:
        eng.add_request(history + prompt_of(8, 5), SamplingParams(max_tokens=blocks * 16 - 140, ignore_eos=True),
                        request_id="R")
        while eng.kv_manager.pool.num_free_blocks() > 3:
            eng.step()
    return eng, history


def cow_session(tiny: LoadedModel, blocks: int, shared: bool) -> tuple[dict[str, float], tuple[int, ...], LLMEngine]:
    """A snapkv-0.5 session turn of one token whose prompt-end compaction must copy the
    history blocks another running request R shares, on a pool with 3 free blocks."""
    eng, history = shared_history(tiny, blocks, shared)
    o1 = finish(eng, eng.add_request(history + prompt_of(40, 2), SamplingParams(max_tokens=1, ignore_eos=True),
                                     request_id="t1", session_id="s", policy="snapkv-0.5"))
    sess = eng.sessions.sessions["s"]
    assert sess.kv is not None and sess.kv.num_compactions == 1 and not sess.kv.compaction_due
    eng.abort_request("R")
    history = eng.session_history("s")
    assert history is not None
    o2 = finish(eng, eng.add_request(history + prompt_of(20, 3), SamplingParams(max_tokens=12, ignore_eos=True),
                                     request_id="t2", session_id="s", policy="snapkv-0.5"))
    drain(eng)
    assert not eng.check_integrity()
    return o1.policy_stats, o2.output_token_ids, eng


def test_a_turn_whose_compaction_waited_for_blocks_leaves_its_session_compacted(tiny: LoadedModel) -> None:
    """Regression: the turn's copy-on-write found no free blocks at its last step; its session
    kept the uncompacted layout (11 blocks, compaction due) and the next turn decoded other
    tokens than on a roomy pool. Now the request sharing the blocks gives them back first."""
    _, roomy, _ = cow_session(tiny, 512, False)
    stats, tight, eng = cow_session(tiny, 24, True)
    assert stats.get("deferred_compactions") == 1.0  # the case under test happened
    assert tight == roomy
    assert eng.stats()["settle_fallbacks"] == 0


def test_a_compaction_that_can_never_run_leaves_the_session_its_tokens_not_its_kv(tiny: LoadedModel,
                                                                                  monkeypatch) -> None:
    """When nothing can give the blocks back (only higher-class requests hold them), the session
    keeps the turn's tokens and unpins the uncompacted KV, counted, rather than keep a state
    its policy never compacted; the next turn prefills the history again and the pool stays
    whole."""
    eng, history = shared_history(tiny, 24)
    monkeypatch.setattr(eng.scheduler, "settle_compaction", lambda seq: False)
    p1 = history + prompt_of(40, 2)
    o1 = finish(eng, eng.add_request(p1, SamplingParams(max_tokens=1, ignore_eos=True), request_id="t1",
                                     session_id="s", policy="snapkv-0.5"))
    assert o1.policy_stats.get("deferred_compactions") == 1.0
    sess = eng.sessions.sessions["s"]
    assert sess.kv is None and not sess.blocks and sess.token_ids == p1 + list(o1.output_token_ids)
    assert eng.stats()["settle_fallbacks"] == 1
    eng.abort_request("R")
    o2 = finish(eng, eng.add_request(sess.token_ids + prompt_of(20, 3), SamplingParams(max_tokens=4, ignore_eos=True),
                                     request_id="t2", session_id="s", policy="snapkv-0.5"))
    assert len(o2.output_token_ids) == 4 and o2.policy_stats.get("session_state_dropped") == 1.0
    drain(eng)
    assert not eng.check_integrity()


def test_a_policy_fault_in_a_settling_compaction_costs_that_turn_its_kv_alone(tiny: LoadedModel,
                                                                                monkeypatch) -> None:
    """Regression (review of 29983c3, D3): the fault escaped to the step's recovery, which
    failed another request ("error"), left the turn's session busy for ever (its next turn
    refused, never expiring) and 11 blocks held after close and flush."""
    from cache_node.kv_state import SequenceKV

    retry = SequenceKV.retry_compaction

    def faulty(self: SequenceKV) -> bool:
        if self.seq.is_finished and self.compaction_due:
            raise RuntimeError("policy fault in compaction")
        return retry(self)

    monkeypatch.setattr(SequenceKV, "retry_compaction", faulty)
    eng, history = shared_history(tiny, 24)
    eng.add_request(history + prompt_of(40, 2), SamplingParams(max_tokens=1, ignore_eos=True), request_id="t1",
                    session_id="s", policy="snapkv-0.5")
    ended = {}
    for _ in range(50):
        ended.update({o.request_id: o.finish_reason for o in eng.step() if o.finished})
        if "t1" in ended:
            break
    assert ended == {"t1": "length"} and eng.stats()["settle_fallbacks"] == 1  # R goes on
    sess = eng.sessions.sessions["s"]
    assert sess.active_request is None and sess.kv is None
    eng.abort_request("R")
    drain(eng)
    finish(eng, eng.add_request(sess.token_ids + prompt_of(8, 9), SamplingParams(max_tokens=2, ignore_eos=True),
                                request_id="t2", session_id="s"))
    eng.close_session("s")
    eng.flush()
    assert all(b.ref_cnt == 0 for b in eng.kv_manager.pool.blocks)
    assert not eng.check_integrity()


def two_turns_ending_together(tiny: LoadedModel, blocks: int, free: int | None) -> tuple[tuple[int, ...], bool]:
    """Sessions a and b (standard) end snapkv-0.5 turns in one step while an interactive
    request R (sharing a's history) holds all but ``free`` blocks: a's compaction waits for
    blocks and settles. Returns b's next turn's output and whether both ended together."""
    from cache_node.scheduling import TenantShare

    eng = make_engine(tiny, kv_pool_bytes=blocks * 8192, max_num_batched_tokens=512, max_num_seqs=4)
    eng.scheduler.policy.set_tenant("R", TenantShare("interactive"))
    finish(eng, eng.add_request(prompt_of(128, 1), SamplingParams(max_tokens=1, ignore_eos=True), request_id="a0",
                                session_id="a"))
    finish(eng, eng.add_request(prompt_of(64, 4), SamplingParams(max_tokens=1, ignore_eos=True), request_id="b0",
                                session_id="b"))
    ha, hb = eng.session_history("a"), eng.session_history("b")
    assert ha is not None and hb is not None
    if free is not None:
        eng.add_request(ha + prompt_of(8, 9), SamplingParams(max_tokens=blocks * 16 - 140, ignore_eos=True),
                        request_id="R", tenant="R")
        while eng.kv_manager.pool.num_free_blocks() > free:
            eng.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.add_request(hb + prompt_of(40, 5), one, request_id="b1", session_id="b", policy="snapkv-0.5")
    eng.add_request(ha + prompt_of(40, 2), one, request_id="a1", session_id="a", policy="snapkv-0.5")
    at: dict[str, int] = {}
    for n in range(1000):
        at.update({o.request_id: n for o in eng.step() if o.finished})
        if "a1" in at and "b1" in at:
            break
    eng.abort_request("R")
    drain(eng)
    hb2 = eng.session_history("b")
    assert hb2 is not None
    out = finish(eng, eng.add_request(hb2 + prompt_of(20, 6), SamplingParams(max_tokens=12, ignore_eos=True),
                                      request_id="b2", session_id="b", policy="snapkv-0.5"))
    assert not eng.check_integrity()
    return out.output_token_ids, at["a1"] == at["b1"]


def test_a_settling_turn_takes_the_histories_kept_for_an_undo_before_another_sessions_state(
        tiny: LoadedModel) -> None:
    """Regression (review of b4a2ce4, D8): b's previous history, kept to undo b's turn, held the
    blocks a's settling compaction needed; its last resort unpinned session b, whose fresh
    compacted state went whole, and b's next turn decoded other tokens (8 of 8 pool sizes)."""
    roomy, _ = two_turns_ending_together(tiny, 512, None)
    tight, together = two_turns_ending_together(tiny, 24, 8)
    assert together and tight == roomy
