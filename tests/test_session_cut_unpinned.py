"""A session turn ended on a stop string whose session is unpinned before its end is delivered
(review 30i F1).

The node ends such a turn with ``abort_request(reason="stop")``: the session is idle at once,
but the turn's end comes with the next ``step()``, which may first unpin the idle session (the
pool short of blocks for a waiting request, a put-off compaction that failed, or
``demote_session``). Unpinning emptied ``Session.blocks`` and kept ``num_computed_tokens``, so
the node's cut of the history to the reply the client got (``cut_session_turn``) indexed an
empty block list: IndexError on the step thread, and every tenant's requests on the node ended
UNAVAILABLE. Now a session without KV counts no computed tokens, and the cut keeps at most the
blocks the session holds.
"""

from __future__ import annotations

from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine
from tests.test_tier_engine import prompt_of


def test_a_stop_cut_after_the_session_was_unpinned_keeps_the_history_and_the_pool(tiny) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny, kv_pool_bytes=256 * 8192)
    free_before = eng.kv_manager.pool.num_free_blocks
    p1 = prompt_of(30, 1)
    eng.add_request(p1, SamplingParams(max_tokens=30, ignore_eos=True), request_id="t1", session_id="s")
    for _ in range(12):
        eng.step()
    assert eng.abort_request("t1", reason="stop")  # what the node does when a stop string matches
    eng.demote_session("s")  # (or the next step's release of idle sessions under pool pressure)
    out = next(o for o in eng.step() if o.request_id == "t1")
    assert out.finished and out.finish_reason == "stop"
    # the reply the client got ends after 3 output tokens, then a re-tokenized tail
    assert eng.cut_session_turn("s", "t1", len(p1), out.output_token_ids, 3, [5])
    sess = eng.sessions.sessions["s"]
    assert sess.token_ids == [*p1, *out.output_token_ids[:3], 5]
    assert (sess.blocks, sess.num_computed_tokens) == ([], 0)
    # the next turn continues from that history (its KV found through the prefix cache or prefilled)
    eng.add_request([*sess.token_ids, 7, 8], SamplingParams(max_tokens=2, ignore_eos=True), request_id="t2",
                    session_id="s")
    while not any(o.finished for o in eng.step() if o.request_id == "t2"):
        pass
    eng.close_session("s")
    eng.check_integrity()
    assert eng.kv_manager.pool.num_free_blocks == free_before
