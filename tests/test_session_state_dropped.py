"""A session whose history KV the node dropped while keeping it (``SessionTable.lose``) has its
next turn that would have continued from that KV marked ``session_state_dropped``, whichever
path dropped it; a turn that lost nothing is not marked (review 22a, F2).

Regression: only a turn that lost its kept history while waiting was marked
(``Sequence.restart``); an idle session's compacted state dropped for another tenant's request
(``_unpin_idle_sessions``, ``_reclaim_host``, ``demote_session``) made its next turn prefill and
compress the history again and decode other tokens, with nothing in its usage saying so.
"""

from __future__ import annotations

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine, node_metric
from tests.test_session_policy import host_reclaim_engine, sentence_prompt
from tests.test_session_rewind_state import drain, second_turn
from tests.test_tier_engine import prompt_of

MARK = "session_state_dropped"
TWELVE = SamplingParams(max_tokens=12, ignore_eos=True)


def turns(tiny: LoadedModel, first: str | None, second: str | None, drop: str) -> tuple[tuple[int, ...], dict]:
    """Session "A/s": a 120-token turn under ``first``, then ``drop`` ("" none, "demote":
    ``demote_session``, "tenant": tenant B's 440-token request on the 30-block pool, which
    unpins idle sessions), then a turn extending the history under ``second``: its tokens and
    ``policy_stats``."""
    eng = LLMEngine(tiny.model, EngineConfig(block_size=16, kv_pool_bytes=30 * 8192, max_num_batched_tokens=64,
                                             max_num_seqs=4), tiny.model_id, tiny.eos_token_ids)
    p1 = prompt_of(120, 3)
    o1 = eng.generate([p1], TWELVE, session_id="A/s", tenant="A", cache_namespace="A", policy=first)[0]
    held = eng.sessions.sessions["A/s"].num_held_blocks
    if drop == "demote":
        eng.demote_session("A/s")
    elif drop == "tenant":
        eng.generate([prompt_of(440, 9)], SamplingParams(max_tokens=4, ignore_eos=True), tenant="B",
                     cache_namespace="B")
    assert (eng.sessions.sessions["A/s"].num_held_blocks == held) == (drop == "") and held
    p2 = p1 + list(o1.output_token_ids) + prompt_of(10, 5)
    o2 = eng.generate([p2], TWELVE, session_id="A/s", tenant="A", cache_namespace="A", policy=second)[0]
    assert eng.stats()["session_states_dropped"] == (MARK in o2.policy_stats)
    assert node_metric(eng, "kvstrata:session_states_dropped_total") == (MARK in o2.policy_stats)
    assert not eng.check_integrity()
    return o2.output_token_ids, o2.policy_stats


@pytest.mark.parametrize(("first", "second", "marked"), [
    ("snapkv-0.5", "snapkv-0.5", True),  # its compacted state went whole
    ("sentencekv-0.5", "sentencekv-0.5", True),
    ("snapkv-200", "snapkv-200", True),  # plain history under a compressing policy: cold != continued
    (None, "snapkv-0.5", True),  # a full-cache history a compressing turn would have continued
    ("snapkv-0.5", None, False),  # a compacted state a full-cache turn could not have used
    (None, None, False),  # full cache: recomputed KV decodes the same tokens
])
@pytest.mark.parametrize("drop", ["demote", "tenant"])
def test_a_turn_after_its_sessions_kv_was_dropped_is_marked(tiny: LoadedModel, first: str | None,
                                                              second: str | None, marked: bool, drop: str) -> None:
    kept, kept_stats = turns(tiny, first, second, "")
    got, stats = turns(tiny, first, second, drop)
    assert MARK not in kept_stats
    assert stats.get(MARK) == (1.0 if marked else None)
    if not marked and first is None:
        assert got == kept  # the claim that makes a full-cache turn's drop no loss


def test_an_idle_state_reclaimed_for_host_slots_marks_its_next_turn_only(tiny: LoadedModel) -> None:
    """``_reclaim_host``: tenant A's reservation drops A's own idle SentenceKV session (the
    larger holder's on a tie); A's next turn is marked, B's (kept) is not."""
    spec, two = "sentencekv-64", SamplingParams(max_tokens=2, ignore_eos=True)
    prompt, eng = sentence_prompt, host_reclaim_engine(tiny)
    firsts = {}
    for tenant, off in (("B", 3), ("A", 5)):
        out = eng.generate([prompt(200, off)], two, session_id=f"{tenant}/s", tenant=tenant,
                           cache_namespace=f"tenant:{tenant}", policy=spec)[0]
        firsts[tenant] = prompt(200, off) + list(out.output_token_ids)
    eng.generate([prompt(400, 7)], two, tenant="A", cache_namespace="tenant:A", policy=spec)
    assert eng.stats()["host_reclaims"] == 1 and eng.sessions.sessions["A/s"].kv is None
    marks = {}
    for tenant in ("A", "B"):
        out = eng.generate([firsts[tenant] + prompt(24, 11)], two, session_id=f"{tenant}/s", tenant=tenant,
                           cache_namespace=f"tenant:{tenant}", policy=spec)[0]
        marks[tenant] = out.policy_stats.get(MARK)
    assert marks == {"A": 1.0, "B": None} and eng.stats()["session_states_dropped"] == 1
    assert not eng.check_integrity()


def test_a_kept_history_dropped_under_an_aborted_turn_marks_the_next_turn(tiny: LoadedModel) -> None:
    """The engine's last resort took the history a running turn's session kept for it
    (``SessionKept.drop``); the turn, aborted, leaves the history without KV: the next turn
    is marked. Without the drop it is not."""
    marks = []
    for reclaim in (False, True):
        eng, history, _ = second_turn(tiny)
        for _ in range(3):
            eng.step()
        if reclaim:
            eng._reclaim(eng.kv_manager.pool.num_blocks + 1)
        eng.abort_request("t2")
        drain(eng)
        eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t3",
                        session_id="s", policy="snapkv-0.5")
        marks.append(drain(eng)["t3"].policy_stats.get(MARK))
        assert not eng.check_integrity()
    assert marks == [None, 1.0]


def test_an_undo_after_its_kept_history_went_marks_the_next_turn(tiny: LoadedModel) -> None:
    """A turn undone after the history kept for its undo was freed (``release_undo``, or
    ``_unpin_idle_sessions`` for another request) restores the history without KV: the next
    turn is marked; undone while it was kept, it is not."""
    marks = []
    for released in (False, True):
        eng, history, p2 = second_turn(tiny)
        o2 = drain(eng)["t2"]
        if released:
            eng.release_undo()
        assert eng.rewind_session("s", history, len(p2), o2.output_token_ids)
        eng.add_request(history + prompt_of(24, 3), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t3",
                        session_id="s", policy="snapkv-0.5")
        marks.append(drain(eng)["t3"].policy_stats.get(MARK))
        assert not eng.check_integrity()
    assert marks == [None, 1.0]


def test_a_closed_session_reopened_is_not_marked(tiny: LoadedModel) -> None:
    """A session's own close is no loss: a turn under the same id opens a new session."""
    eng = make_engine(tiny)
    p1 = prompt_of(120, 3)
    o1 = eng.generate([p1], TWELVE, session_id="s", policy="snapkv-0.5")[0]
    eng.close_session("s")
    o2 = eng.generate([p1 + list(o1.output_token_ids) + prompt_of(10, 5)], TWELVE, session_id="s",
                      policy="snapkv-0.5")[0]
    assert MARK not in o2.policy_stats and eng.stats()["session_states_dropped"] == 0


@pytest.mark.parametrize("policy", ["snapkv-40", "h2o-0.5"])
def test_turns_continuing_from_a_rebuilt_state_stay_marked(tiny: LoadedModel, policy: str) -> None:
    """Verification 22: the turn after the loss rebuilt its policy state cold over the history
    and was marked; the next turn continued from that rebuilt state unmarked and, though the
    marked turn's tokens were the same as undisturbed, decoded other tokens (snapkv-40 and
    h2o-0.5, seed 12: ``(238, 305, 341, 27)`` undisturbed, ``(367, 27, 426, 312)`` after the
    loss). Every turn descending from the loss is marked; an undisturbed chain's are not."""
    import random

    rng = random.Random(12)
    parts = [[rng.randrange(1, 500) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    params = SamplingParams(max_tokens=rng.randrange(4, 12), ignore_eos=True)
    chains = {}
    for drop in (False, True):
        eng = LLMEngine(tiny.model, EngineConfig(block_size=16, kv_pool_bytes=200 * 8192, max_num_batched_tokens=64,
                                                 max_num_seqs=4), tiny.model_id, tiny.eos_token_ids)
        kw = {"session_id": "A/s", "tenant": "A", "cache_namespace": "A", "policy": policy}
        prompt, outs = [], []
        for i, part in enumerate(parts):
            if drop and i == 1:
                eng.demote_session("A/s")
            prompt = prompt + (list(outs[-1].output_token_ids) if outs else []) + part
            outs.append(eng.generate([prompt], params, **kw)[0])
        chains[drop] = outs
    assert not any(MARK in o.policy_stats for o in chains[False])
    assert [MARK in o.policy_stats for o in chains[True]] == [False, True, True]
    assert chains[True][1].output_token_ids == chains[False][1].output_token_ids  # the case
    assert chains[True][2].output_token_ids != chains[False][2].output_token_ids
