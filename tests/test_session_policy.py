"""Sessions under a compressing KV policy keep the policy state between turns (issue 22, 1a).

The reference every continuation is compared with: ONE sequence driven through the same
engine pieces (runner, ``SequenceKV``, sampler) over a separate engine, whose prompt is
extended turn after turn (the previous turn's tokens, then the new ones) without ever freeing
its KV; at each turn its policy budget is recomputed from the grown prompt, as a new request's
is. A session turn that continues from the kept state must produce exactly its greedy
tokens; a turn that prefilled the history again would not (its policy would compress the
whole history with the question in view).
"""

from __future__ import annotations

import pytest

from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv, attach_policy
from cache_node.sampler import sample
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from tests.conftest import make_engine, node_metric


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def count_prefill(eng: LLMEngine) -> list[int]:
    """Wrap the engine's runner so every executed token is counted (one entry per step)."""
    counts: list[int] = []
    execute = eng.runner.execute

    def counted(batch, *args, **kw):  # type: ignore[no-untyped-def]
        counts.append(sum(n for _, n in batch))
        return execute(batch, *args, **kw)

    eng.runner.execute = counted  # type: ignore[method-assign]
    return counts


def one_sequence_turns(eng: LLMEngine, spec: str, turns: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of ``turns`` (each turn's new tokens) run as one ever-growing sequence,
    stepped as the engine steps a lone request (chunks of ``max_num_batched_tokens``,
    ``after_step`` after every step, the last sampled token left uncomputed; the budget
    recomputed at each turn's end of prefill)."""
    budget = eng.config.max_num_batched_tokens
    seq = Sequence("reference", list(turns[0]), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   policy=spec)
    attach_policy(seq, eng.pool, eng.kv_manager.pool, eng.policy_env, eng.host_for_policies)
    outs = []
    for k, new in enumerate(turns):
        if k:  # a new request's prompt: its policy budget follows the grown prompt
            seq.prompt_token_ids, seq.output_token_ids = seq.all_token_ids + new, []
            if seq.kv is not None:
                seq.kv.budget = None
        while len(seq.output_token_ids) < max_tokens:
            n = min(seq.num_uncomputed_tokens, budget)
            assert eng.kv_manager.allocate_slots(seq, n) is not None
            logits = eng.runner.execute([(seq, n)])
            seq.num_computed_tokens += n
            if seq.kv is not None:
                seq.kv.after_step()
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(int(sample(logits, [seq])[0]))
        outs.append(list(seq.output_token_ids))
    eng.kv_manager.free(seq)
    eng.check_integrity()
    return outs


def session_turns(eng: LLMEngine, spec: str, turns: list[list[int]], max_tokens: int,
                  tenant: str = "a") -> tuple[list[list[int]], list[int], list]:
    """Run ``turns`` as one session; returns outputs, tokens computed per turn, RequestOutputs."""
    counts = count_prefill(eng)
    history: list[int] = []
    outs, computed, results = [], [], []
    for new in turns:
        before = len(counts)
        res = eng.generate([history + new], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           session_id="s", tenant=tenant, policy=spec)[0]
        history = history + new + list(res.output_token_ids)
        outs.append(list(res.output_token_ids))
        computed.append(sum(counts[before:]))
        results.append(res)
    return outs, computed, results


@pytest.mark.parametrize("spec", ["sentencekv-0.25", "h2o-0.25", "quant-bits_4", ""])
def test_session_turns_continue_from_the_kept_policy_state(tiny, spec: str) -> None:
    """Fault (issue 22): a compacted turn's KV was dropped at the turn's end, so every later
    turn of a session under a compressing policy prefilled its whole history again. Now each
    turn after the first computes only its new tokens (plus the previous turn's last sampled
    token) and decodes, and answers as one sequence that was never freed; everything is free
    after close."""
    turns = [prompt_of(300)] + [prompt_of(9, k) for k in range(1, 5)]
    max_tokens = 5
    eng = make_engine(tiny)
    outs, computed, results = session_turns(eng, spec, turns, max_tokens)
    assert computed[0] == len(turns[0]) + max_tokens - 1
    for k in range(1, 5):  # the last output token, the new tokens, then the decodes
        assert computed[k] == 1 + len(turns[k]) + max_tokens - 1
        assert results[k].num_cached_tokens == results[k].num_prompt_tokens - 1 - len(turns[k])
    assert outs == one_sequence_turns(make_engine(tiny), spec, turns, max_tokens)
    compacting = spec != ""
    assert eng.sessions.num_policy_continuations == (4 if compacting else 0)
    # the node's /metrics reads the same count from the engine's stats
    assert node_metric(eng, "kvstrata:session_policy_continuations_total") == (4 if compacting else 0)
    assert node_metric(eng, "kvstrata:session_policy_fallbacks_total") == 0
    assert eng.stats()["used_blocks"] > 0
    eng.close_session("s")
    stats = eng.stats()
    assert stats["used_blocks"] == 0 and stats["policy_blocks"] == 0
    eng.check_integrity()


def test_non_extending_turn_or_other_policy_falls_back_and_frees(tiny) -> None:
    """A turn whose prompt does not extend the history, or that names another policy, must
    not attend the kept (compacted) state: it prefills from scratch, is counted, and the kept
    state (blocks, charge blocks, host sentences) is freed."""
    eng = make_engine(tiny)
    p1 = prompt_of(300)
    eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                 policy="sentencekv-0.25")
    assert eng.sessions.sessions["s"].compacted
    other = prompt_of(120, 9)  # does not extend the history
    counts = count_prefill(eng)
    t2 = eng.generate([other], SamplingParams(max_tokens=2, ignore_eos=True), session_id="s", tenant="a",
                      policy="sentencekv-0.25")[0]
    assert eng.sessions.num_fallbacks == 1 and sum(counts) >= len(other)
    assert t2.output_token_ids == make_engine(tiny).generate(
        [other], SamplingParams(max_tokens=2, ignore_eos=True), policy="sentencekv-0.25")[0].output_token_ids
    history = other + list(t2.output_token_ids)
    p3 = history + prompt_of(7, 3)  # extends, but under h2o: falls back too
    counts.clear()
    t3 = eng.generate([p3], SamplingParams(max_tokens=2, ignore_eos=True), session_id="s", tenant="a",
                      policy="h2o-0.25")[0]
    assert eng.sessions.num_fallbacks == 2 and eng.sessions.num_policy_continuations == 0
    assert node_metric(eng, "kvstrata:session_policy_fallbacks_total") == 2
    # today's behaviour: only the prefix cache's uncompressed blocks (cached before turn 2's
    # compaction copied them on write) spare recomputation
    assert t3.num_cached_tokens < len(other) and sum(counts) == len(p3) - t3.num_cached_tokens + 1
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


def test_idle_policy_session_is_charged_then_freed_on_expiry_and_unpin(tiny) -> None:
    """While idle, a kept policy state still holds its blocks and charge blocks (the pool and
    its tenant pay for it); expiry frees all of it, and unpinning it under pool pressure drops
    it whole instead of offering its compacted blocks to the prefix cache."""
    eng = make_engine(tiny)
    p1 = prompt_of(300)
    eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                  policy="quant-bits_4")
    sess = eng.sessions.sessions["s"]
    assert sess.compacted and sess.kv is not None
    charged = len(sess.kv.charge_blocks)
    assert charged > 0
    stats = eng.stats()
    assert stats["used_blocks"] == sess.num_held_blocks == len(sess.blocks) + charged
    assert stats["policy_blocks"] == charged
    assert all(b.block_hash is None for b in sess.blocks)  # never matchable, never demoted
    assert eng.sessions.unpin("s") == [] and eng.stats()["used_blocks"] == 0
    eng.check_integrity()
    eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="t", tenant="a",
                  policy="quant-bits_4")
    assert eng.stats()["used_blocks"] > 0
    assert eng.expire_sessions(0.0) == ["s", "t"]
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


def test_quota_charge_of_a_continued_turn_is_exact(tiny) -> None:
    """The continuing turn holds the kept state's blocks and charge blocks as its own: its
    tenant's held blocks equal the pool's used blocks and the charge pays the policy bytes."""
    eng = make_engine(tiny)
    p1 = prompt_of(300)
    t1 = eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy="quant-bits_4")[0]
    rid = eng.add_request(p1 + list(t1.output_token_ids) + prompt_of(5, 1),
                          SamplingParams(max_tokens=4, ignore_eos=True), session_id="s", tenant="a",
                          policy="quant-bits_4")
    for _ in range(3):
        eng.step()
        held = eng.held_by_tenant()["a"]
        seq = eng.requests[rid]
        assert held["blocks"] == eng.stats()["used_blocks"] == seq.num_held_blocks
        assert held["policy_bytes"] > 0
        assert len(seq.kv.charge_blocks) == -(-held["policy_bytes"] // eng.pool.bytes_per_block)
    while eng.has_unfinished_requests():
        eng.step()
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


@pytest.mark.slow
def test_sentencekv_session_over_a_wikipedia_document(real_model) -> None:
    """Acceptance (issue 22, 1a): a 5-turn session under sentencekv-0.25 over a 512-token real
    Wikipedia context (with a pass key; its first turn prefilled in three chunks) on SmolLM2,
    its demoted sentences in the host tier:
    after turn 1 each turn computes only its new tokens, the greedy answers equal one
    never-freed sequence's (``one_sequence_turns``), and closing frees every block and host
    slot."""
    from bench.quality import build_items
    from cache_node.config import EngineConfig
    from cache_node.tiers.manager import TierConfig

    tok = real_model.tokenizer
    item = build_items(tok, [512], [0.5])[0]
    questions = [q for _, q, _ in item["questions"]] * 3
    turns = [item["context"] + questions[0]] + questions[1:5]

    def engine() -> LLMEngine:
        cfg = EngineConfig(block_size=16, kv_pool_bytes=256 << 20, max_num_batched_tokens=256, max_num_seqs=4)
        eng = LLMEngine(real_model.model, cfg, real_model.model_id, real_model.eos_token_ids,
                        tier_config=TierConfig(host_bytes=128 << 20))
        eng.policy_env = PolicyEnv.from_tokenizer(tok)
        return eng

    eng = engine()
    assert eng.host_for_policies is not None
    outs, computed, _ = session_turns(eng, "sentencekv-0.25", turns, max_tokens=4)
    for k in range(1, 5):
        assert computed[k] == 1 + len(turns[k]) + 3, computed
    assert sum(computed[1:]) < len(turns[0]) // 4
    assert outs == one_sequence_turns(engine(), "sentencekv-0.25", turns, max_tokens=4)
    key = item["questions"][0][2]  # the pass key, asked with the document: its first digits
    assert key[:3] in tok.decode(outs[0])
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0 and eng.tiers.host.num_reserved == 0
    eng.check_integrity()


def test_preempted_continuation_restarts_from_the_kept_history(tiny) -> None:
    """A continued turn that is preempted loses its own blocks and policy state (nothing of
    them may leak or be attended half-freed) but not the history's: the session keeps that
    while the turn runs, so the turn re-queues holding it again (shared blocks, a fresh fork
    of the kept state), recomputes only its own tokens and answers exactly as never
    preempted; the session still closes clean.

    Regression: it prefilled the whole history again with its prompt, compressed at once
    with the new turn in view, and decoded other tokens (tests/test_engine_soak.py has every
    compressing policy)."""
    turns, spec = [prompt_of(300), prompt_of(9, 1)], "sentencekv-0.25"
    ref, _, _ = session_turns(make_engine(tiny), spec, turns, max_tokens=3)
    eng = make_engine(tiny)
    t1 = eng.generate([turns[0]], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy=spec)[0]
    p2 = turns[0] + list(t1.output_token_ids) + turns[1]
    sess = eng.sessions.sessions["s"]
    kept_blocks, kept_kv = list(sess.blocks), sess.kv
    rid = eng.add_request(p2, SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                          policy=spec)
    eng.step()
    seq = eng.requests[rid]
    assert seq.kv is not None and seq.kv.compacted and seq.output_token_ids == ref[1][:1]
    assert sess.blocks == kept_blocks and sess.kv is kept_kv and seq.kept is not None
    held = eng.held_by_tenant()["a"]["blocks"]
    assert held == eng.stats()["used_blocks"] == seq.num_held_blocks  # the kept history counts
    counts = count_prefill(eng)
    eng.scheduler.preempt(seq)
    assert seq.block_table == kept_blocks and all(b.ref_cnt == 2 for b in kept_blocks)
    assert seq.kv is not kept_kv and seq.num_computed_tokens == len(p2) - 1 - len(turns[1])
    assert seq.num_evicted_tokens == sess.num_evicted_tokens > 0
    eng.check_integrity()
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.finished else out
    assert out is not None and out.num_preemptions == 1 and list(out.output_token_ids) == ref[1]
    assert sum(counts) == 1 + len(turns[1]) + 2  # its own tokens, the first output, 1 decode
    assert eng.sessions.sessions["s"].kept_for is None and eng.sessions.sessions["s"].kv is not kept_kv
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


def test_continued_turn_is_admitted_by_its_kept_blocks_under_kvstrata(tiny) -> None:
    """Fault: kvstrata admits a request only when the free blocks cover its whole prompt, and
    counted a continued turn's whole history against them although the kept state holds only
    a few compacted blocks; with the pool nearly full the turn could never start. Now the
    check counts the physical slots (history minus the evicted tokens)."""
    eng = make_engine(tiny, scheduling_policy="kvstrata")
    p1 = prompt_of(300)
    t1 = eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy="sentencekv-0.25")[0]
    sess = eng.sessions.sessions["s"]
    assert sess.compacted and len(sess.blocks) < 8
    pool = eng.kv_manager.pool
    filler = pool.allocate(pool.num_free_blocks() - 4)  # 4 free blocks: far less than 300 tokens
    p2 = p1 + list(t1.output_token_ids) + prompt_of(9, 1)
    out = eng.generate([p2], SamplingParams(max_tokens=2, ignore_eos=True), session_id="s", tenant="a",
                       policy="sentencekv-0.25")[0]
    assert out.finish_reason == "length" and out.num_cached_tokens == len(p2) - 10
    pool.free(filler)
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


def test_demoting_an_idle_policy_session_drops_its_state_whole(tiny) -> None:
    """The tier mover never moves a kept policy state (its compacted blocks match no prefix
    and its sentences sit in reserved host slots): demoting the idle session drops all of it,
    device blocks, charge blocks and host slots, and its next turn prefills the history."""
    from cache_node.config import EngineConfig
    from cache_node.tiers.manager import TierConfig

    cfg = EngineConfig(block_size=16, kv_pool_bytes=1 << 20, max_num_batched_tokens=64, max_num_seqs=8)
    eng = LLMEngine(tiny.model, cfg, tiny.model_id, tiny.eos_token_ids, tier_config=TierConfig(host_bytes=1 << 20))
    p1 = prompt_of(300)
    t1 = eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy="sentencekv-0.25")[0]
    assert eng.sessions.sessions["s"].compacted and eng.tiers.host.num_reserved > 0
    eng.demote_all()  # the watermark mover's path: only free cached blocks move
    assert eng.sessions.sessions["s"].compacted
    assert eng.demote_session("s") == 0
    assert eng.stats()["used_blocks"] == 0 and eng.tiers.host.num_reserved == 0
    p2 = p1 + list(t1.output_token_ids) + prompt_of(9, 1)
    out = eng.generate([p2], SamplingParams(max_tokens=2, ignore_eos=True), session_id="s", tenant="a",
                       policy="sentencekv-0.25")[0]
    assert eng.sessions.num_policy_continuations == 0 and out.num_cached_tokens < len(p2) - 10
    eng.close_session("s")
    eng.check_integrity()


def test_idle_holders_give_their_host_slots_to_a_running_request(tiny) -> None:
    """Regression (security review): tenant A's idle SentenceKV sessions and stored compressed
    prefixes held every host-tier slot until their TTL; tenant B's running request then lost
    the sentences it demoted (``dropped_tokens``) and silently decoded other tokens than on an
    idle node. Now idle holders give their slots back, least recently used first
    (``LLMEngine._reclaim_host``); what is still lost is counted on the node."""
    from cache_node.tiers.manager import TierConfig

    spec, greedy = "sentencekv-64", SamplingParams(max_tokens=24, ignore_eos=True)

    def engine() -> LLMEngine:
        probe = make_engine(tiny, kv_pool_bytes=4 << 20, max_num_batched_tokens=128)
        eng = LLMEngine(tiny.model, probe.config, tiny.model_id, tiny.eos_token_ids,
                        tier_config=TierConfig(host_bytes=40 * probe.pool.bytes_per_block))
        eng.policy_env = PolicyEnv(frozenset({13}))  # token 13 ends a sentence
        return eng

    def prompt(n: int, off: int) -> list[int]:  # sentences of 12 tokens
        return [13 if i % 12 == 11 else (7 * i + off) % 400 + 20 for i in range(n)]

    def tenant_b(eng: LLMEngine) -> tuple[tuple[int, ...], dict[str, float]]:
        out = eng.generate([prompt(400, 3)], greedy, tenant="B", cache_namespace="tenant:B", policy=spec)[0]
        return out.output_token_ids, out.policy_stats

    alone, alone_stats = tenant_b(engine())
    assert "dropped_tokens" not in alone_stats
    eng = engine()
    for k in range(2):  # tenant A: two idle sessions and two stored prefixes, holding every slot
        eng.generate([prompt(400, 100 + k)], SamplingParams(max_tokens=2, ignore_eos=True),
                     session_id=f"A/s{k}", tenant="A", cache_namespace="tenant:A", policy=spec)
        doc = prompt(396, 200 + k)
        eng.generate([doc + [5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), tenant="A",
                     cache_namespace="tenant:A", policy=spec, prefix_tokens=len(doc))
    assert not eng.tiers.host.can_reserve(10)
    got, stats = tenant_b(eng)
    assert got == alone and "dropped_tokens" not in stats
    assert eng.stats()["host_reclaims"] > 0 and eng.stats()["policy_dropped_tokens"] == 0
    eng.check_integrity()


def sentence_prompt(n: int, off: int) -> list[int]:
    """``n`` tokens in sentences of 12 (token 13 ends one: ``host_reclaim_engine``'s env)."""
    return [13 if i % 12 == 11 else (7 * i + off) % 400 + 20 for i in range(n)]


def host_reclaim_engine(tiny) -> LLMEngine:
    """A 4 MiB pool and a 60-block host tier, token 13 ending a sentence: two tenants' 200-token
    SentenceKV-64 sessions hold 16 host slots each, and a 400-token request of one of them
    needs room that only an idle state can give back (``_reclaim_host``)."""
    from cache_node.tiers.manager import TierConfig

    probe = make_engine(tiny, kv_pool_bytes=4 << 20, max_num_batched_tokens=128)
    eng = LLMEngine(tiny.model, probe.config, tiny.model_id, tiny.eos_token_ids,
                    tier_config=TierConfig(host_bytes=60 * probe.pool.bytes_per_block))
    eng.policy_env = PolicyEnv(frozenset({13}))
    return eng


def test_a_tenants_reservation_drops_its_own_idle_states_before_anothers(tiny) -> None:
    """Regression: a reservation that did not fit dropped the least recently used idle state of
    any tenant: tenant A's request took tenant B's idle session (16 host slots, B's whole
    holding) while A's own idle session held as much. Now the largest holder's idle states go
    first, and another tenant's only while it holds more than the reserving one would."""
    spec, two = "sentencekv-64", SamplingParams(max_tokens=2, ignore_eos=True)
    prompt, eng = sentence_prompt, host_reclaim_engine(tiny)
    eng.generate([prompt(200, 3)], two, session_id="B/s", tenant="B", cache_namespace="tenant:B", policy=spec)
    eng.generate([prompt(200, 5)], two, session_id="A/s", tenant="A", cache_namespace="tenant:A", policy=spec)
    assert eng.tiers.host.reserved_by == {"tenant:B": 16, "tenant:A": 16}
    out = eng.generate([prompt(400, 7)], two, tenant="A", cache_namespace="tenant:A", policy=spec)[0]
    assert "dropped_tokens" not in out.policy_stats and eng.stats()["host_reclaims"] == 1
    assert eng.sessions.sessions["B/s"].kv is not None  # B's idle state is still there
    assert eng.sessions.sessions["A/s"].kv is None  # A's own gave way
    assert eng.tiers.host.reserved_by == {"tenant:B": 16}
    eng.check_integrity()


@pytest.mark.parametrize(("spec", "free", "copied"), [("h2o-0.25", 2, False), ("sentencekv-0.25", 2, True)])
def test_kept_history_gives_way_to_its_turns_compaction_on_a_full_pool(tiny, spec: str, free: int,
                                                                       copied: bool) -> None:
    """The history a session keeps for its running turn shares its blocks with the turn,
    whose compaction copies them on write; on a pool too full for the copies the session
    drops its kept history instead (the turn's blocks are then its own, rewritten in place)
    and the turn compacts and answers as on an empty pool. A preemption after that
    recomputes the whole prompt, as before sessions kept histories.

    Regression (of keeping the history): the copy found no free blocks, the turn's compaction
    was skipped, and it decoded other tokens than on an empty pool."""
    turns = [prompt_of(300), prompt_of(9, 1)]
    ref, _, _ = session_turns(make_engine(tiny), spec, turns, max_tokens=4)
    eng = make_engine(tiny)
    t1 = eng.generate([turns[0]], SamplingParams(max_tokens=4, ignore_eos=True), session_id="s", tenant="a",
                      policy=spec)[0]
    assert list(t1.output_token_ids) == ref[0]
    pool = eng.kv_manager.pool
    filler = pool.allocate(pool.num_free_blocks() - free)  # room to grow, maybe none to copy the history
    rid = eng.add_request(turns[0] + ref[0] + turns[1], SamplingParams(max_tokens=4, ignore_eos=True),
                          session_id="s", tenant="a", policy=spec)
    seq = eng.requests[rid]
    assert seq.kept is not None
    out, kept = None, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.finished else out
        kept.append(seq.kept is not None)
    assert out is not None and out.num_preemptions == 0 and list(out.output_token_ids) == ref[1]
    assert kept[0] is copied  # after the step that compacted: kept (copied on write) or dropped
    assert seq.kept is None and eng.sessions.sessions["s"].kept_for is None
    pool.free(filler)
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


@pytest.mark.parametrize("spec", ["h2o-0.25", "quant-bits_4"])
def test_aborted_continuation_leaves_the_kept_history_for_the_next_turn(tiny, spec: str) -> None:
    """A continued turn aborted mid-decode gives back only its own blocks and state: the
    session still holds the history's KV (blocks and the policy state, which pays its charge
    blocks again), and the next turn continues from it as if the aborted turn never ran."""
    turns = [prompt_of(300), prompt_of(9, 1)]
    ref, _, _ = session_turns(make_engine(tiny), spec, turns, max_tokens=3)
    eng = make_engine(tiny)
    t1 = eng.generate([turns[0]], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy=spec)[0]
    sess = eng.sessions.sessions["s"]
    idle_blocks = eng.stats()["used_blocks"]
    assert idle_blocks == sess.num_held_blocks
    p2 = turns[0] + list(t1.output_token_ids) + prompt_of(20, 2)
    rid = eng.add_request(p2, SamplingParams(max_tokens=8, ignore_eos=True), session_id="s", tenant="a",
                          policy=spec)
    while len(eng.requests[rid].output_token_ids) < 2:
        eng.step()
    assert eng.abort_request(rid)
    eng.step()
    assert sess.active_request is None and sess.kept_for is None and sess.kv is not None
    assert eng.stats()["used_blocks"] == sess.num_held_blocks == idle_blocks  # charge blocks again
    eng.check_integrity()
    p3 = turns[0] + list(t1.output_token_ids) + turns[1]
    t3 = eng.generate([p3], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy=spec)[0]
    assert list(t3.output_token_ids) == ref[1] and t3.num_cached_tokens == len(p3) - 1 - len(turns[1])
    assert eng.sessions.num_policy_continuations == 2
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0 and eng.stats()["policy_blocks"] == 0
    eng.check_integrity()


def test_a_waiting_turns_kept_history_gives_its_blocks_to_a_lone_running_request(tiny) -> None:
    """The scheduler's last resort for a lone running request short of blocks frees the
    waiting requests' blocks; a waiting session turn's are its kept history's too (the
    session holds them, and a restarted turn borrows them again), so the engine's last resort
    (``LLMEngine._reclaim``) drops that history: the running request gets its blocks and
    runs to its end unpreempted, the turn then computes its whole prompt, and all is freed.

    Regression (of keeping the history): the running request preempted itself and was given
    up with 61 of its 85 tokens ("length")."""
    eng = make_engine(tiny, kv_pool_bytes=12 * 8192, max_num_seqs=1)  # 12 blocks
    p1 = prompt_of(60)
    t1 = eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                      policy="h2o-0.25")[0]
    assert len(eng.sessions.sessions["s"].blocks) == 2
    rid = eng.add_request(prompt_of(100, 5), SamplingParams(max_tokens=85, ignore_eos=True), tenant="b")
    eng.step()  # its peak (185 tokens) needs all 12 blocks: not with the history's 2 held
    turn = eng.add_request(p1 + list(t1.output_token_ids) + prompt_of(9, 1),
                           SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a",
                           policy="h2o-0.25")
    assert eng.requests[turn].kept is not None  # waiting (one slot), its history kept
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert outs[rid].finish_reason == "length" and len(outs[rid].output_token_ids) == 85
    assert outs[rid].num_preemptions == 0
    assert outs[turn].finish_reason == "length" and len(outs[turn].output_token_ids) == 3
    eng.close_session("s")
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()
