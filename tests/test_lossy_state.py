"""A policy state that lost KV for want of room is never handed on unmarked.

SentenceKV demotes the sentences it evicts to host-tier slots; when the tier is full they are
lost (``HostSentenceStore.dropped_tokens``, the request's ``policy_stats["dropped_tokens"]``).
Such a state is not stored as a compressed prefix (``CompressedPrefixCache.store``,
``Policy.lost_tokens``), and a fork of it (a session's next turn: ``SequenceKV.fork``) reports
the parent's loss in ``policy_stats["inherited_dropped_tokens"]``. The scenarios are the
hangs review 20 W5 repro (fuzz seed 21) and its session fuzz seed 39: a 16-slot host tier
that another request's sentences fill.
"""

from __future__ import annotations

from cache_node.engine import LLMEngine
from cache_node.outputs import RequestOutput
from cache_node.sampling_params import SamplingParams
from tests.conftest import node_metric
from tests.test_host_share_running import _engine as host_engine
from tests.test_host_share_running import _prompt

SPEC = "sentencekv-64"


def _engine(tiny, host_slots: int = 16) -> LLMEngine:
    return host_engine(tiny, host_slots, kv_pool_bytes=512 * 8192, max_num_batched_tokens=2048, max_num_seqs=4)


DOC = _prompt(96, 28)
A = {"tokens": _prompt(160, 250) + _prompt(29, 86), "max_tokens": 33, "tenant": "A", "prefix_tokens": 0}
C1 = {"tokens": DOC + _prompt(26, 43), "max_tokens": 27, "tenant": "C", "prefix_tokens": 96}
C2 = {"tokens": DOC + _prompt(29, 150), "max_tokens": 11, "tenant": "C", "prefix_tokens": 96}


def _add(eng: LLMEngine, req: dict, rid: str) -> None:
    eng.add_request(req["tokens"], SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True), request_id=rid,
                    tenant=req["tenant"], cache_namespace="ns", policy=SPEC, prefix_tokens=req["prefix_tokens"])


def _drain(eng: LLMEngine) -> dict[str, RequestOutput]:
    out: dict[str, RequestOutput] = {}
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            return out
        out.update({o.request_id: o for o in eng.step() if o.finished})
    raise AssertionError("requests did not finish")


def _prefix_run(tiny, contended: bool) -> tuple[LLMEngine, RequestOutput, RequestOutput]:
    """C1 computes the prefix (while A's sentences fill the host tier when ``contended``),
    then, on the idle node, C2 with the same prefix."""
    eng = _engine(tiny)
    if contended:
        _add(eng, A, "A")
        for _ in range(4):
            eng.step()
    _add(eng, C1, "C1")
    c1 = _drain(eng)["C1"]
    _add(eng, C2, "C2")
    c2 = _drain(eng)["C2"]
    eng.check_integrity()
    return eng, c1, c2


def test_a_prefix_that_dropped_sentences_is_not_stored(tiny) -> None:
    """Regression (hangs review 20 W5): C1's prefix, compressed while the host tier was full,
    was stored with 104 tokens' sentences dropped; C2, forking it later on an idle node,
    decoded (325, 261, 388, 488, 442, 250, ...) instead of (..., 488, 73, 156, ...) and its
    ``policy_stats`` said nothing. Now the lossy state is not stored and C2 computes the
    prefix itself (and stores it)."""
    roomy, r1, r2 = _prefix_run(tiny, contended=False)
    eng, c1, c2 = _prefix_run(tiny, contended=True)
    assert (r1.policy_stats, r2.policy_stats) == ({}, {})
    assert c1.policy_stats == {"dropped_tokens": 104.0}  # the producer says what it lost
    assert c2.output_token_ids == r2.output_token_ids == (325, 261, 388, 488, 73, 156, 248, 104, 366, 325, 261)
    assert c2.policy_stats == {}
    s = roomy.stats()
    assert (s["compressed_prefix_stores"], s["compressed_prefix_hits"], s["compressed_prefix_lossy_skipped"]) == (1, 1, 0)
    s = eng.stats()
    assert (s["compressed_prefix_stores"], s["compressed_prefix_hits"], s["compressed_prefix_lossy_skipped"]) == (1, 0, 1)
    assert s["compressed_prefixes"] == 1  # C2's, computed with room
    assert node_metric(eng, "kvstrata:compressed_prefix_lossy_skipped_total") == 1
    eng.prefixes.clear()
    eng.check_integrity()
    assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks


def test_requests_parked_on_a_lossy_prefix_compute_it_themselves(tiny) -> None:
    """C2 arrives while C1 computes the prefix under contention and waits for it; C1's state
    lost sentences, so nothing is stored and C2 computes the prefix itself: it finishes, its
    output the roomy node's or marked with what it lost itself (here 105 tokens, the tier
    still full), never a silent fork of C1's loss (before: C2 forked it, ``policy_stats`` {})."""
    roomy = _engine(tiny, host_slots=512)
    _add(roomy, C1, "C1")
    _add(roomy, C2, "C2")
    alone = _drain(roomy)

    eng = _engine(tiny)
    _add(eng, A, "A")
    for _ in range(4):
        eng.step()
    _add(eng, C1, "C1")
    _add(eng, C2, "C2")
    batches: list[list[tuple[str, int]]] = []
    eng.step(on_scheduled=lambda b: batches.append([(s.request_id, n) for s, n in b if s.tenant == "C"]))
    assert batches == [[("C1", 96)]]  # C1 computes the prefix to its boundary; C2 waits for it
    out = _drain(eng)
    eng.check_integrity()
    assert out["C1"].policy_stats == {"dropped_tokens": 104.0}
    c2 = out["C2"]
    assert c2.policy_stats == {"dropped_tokens": 105.0}  # its own loss, computing the prefix
    assert c2.output_token_ids != alone["C2"].output_token_ids
    s = eng.stats()
    assert (s["compressed_prefix_stores"], s["compressed_prefix_hits"], s["compressed_prefix_parked"]) == (0, 0, 0)
    assert s["compressed_prefix_lossy_skipped"] == 2  # C1's and C2's


# hangs review 20, session fuzz seed 39: the session's turns (new tokens, max_tokens) and
# another tenant's requests (arrival step, prompt, policy, max_tokens)
TURNS = [(_prompt(69, 26), 7), (_prompt(48, 5), 24), (_prompt(20, 261), 9)]
OTHERS = [(6, _prompt(84, 356), "sentencekv-0.25", 7), (43, _prompt(138, 75), "sentencekv-0.25", 1),
          (45, _prompt(52, 181), SPEC, 19)]


def _session(eng: LLMEngine, others: list) -> list[RequestOutput]:
    """The session's turns one after another, ``others`` arriving at their steps."""
    others, outs, cur = list(others), [], None
    for step in range(6000):
        while others and others[0][0] <= step:
            _, tokens, policy, max_tokens = others.pop(0)
            eng.add_request(tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tenant="O",
                            cache_namespace="o", policy=policy)
        if cur is None and len(outs) < len(TURNS):
            new, max_tokens = TURNS[len(outs)]
            history = eng.session_history("s") if outs else []
            cur = eng.add_request(history + new, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  request_id=f"t{len(outs)}", tenant="S", cache_namespace="s", session_id="s",
                                  policy=SPEC)
        if cur is None and not others and not eng.has_unfinished_requests():
            return outs
        for out in eng.step():
            if out.request_id == cur and out.finished:
                outs.append(out)
                cur = None
    raise AssertionError("the session did not finish")


def test_a_turn_continuing_a_lossy_history_reports_the_inherited_drops(tiny) -> None:
    """Regression (hangs review 20 W5, session fuzz seed 39): turn 2 dropped 8 tokens'
    sentences (the host tier full of the other tenant's) and handed that state to the
    session; turn 3 continued from it and decoded (443, 48, 297, ...) instead of the roomy
    node's (443, 48, 99, ...), with ``policy_stats`` {}. It now reports the 8 tokens it
    inherited (and no drops of its own)."""
    roomy = _session(_engine(tiny, host_slots=512), [])
    assert [o.policy_stats for o in roomy] == [{}, {}, {}]

    eng = _engine(tiny)
    got = _session(eng, OTHERS)
    eng.check_integrity()
    assert [o.output_token_ids for o in got[:2]] == [o.output_token_ids for o in roomy[:2]]
    assert got[1].policy_stats == {"dropped_tokens": 8.0}
    assert got[2].output_token_ids != roomy[2].output_token_ids  # the loss shows ...
    assert got[2].policy_stats == {"inherited_dropped_tokens": 8.0}  # ... and is said
