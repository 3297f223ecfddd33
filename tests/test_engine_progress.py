"""No request wedges a node: oversize requests are refused at admission, and a waiting queue
whose head cannot be scheduled while nothing runs always moves (every scheduling policy)."""

from __future__ import annotations

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel
from cache_node.outputs import InvalidRequestError, RequestOutput
from cache_node.sampling_params import SamplingParams

SCHEDULERS = ["fcfs", "priority", "vtc", "kvstrata"]


def engine(lm: LoadedModel, scheduler: str, num_blocks: int = 20) -> LLMEngine:
    mc = lm.model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    per_block = 16 * KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, lm.model.dtype)
    config = EngineConfig(block_size=16, kv_pool_bytes=num_blocks * per_block, max_num_batched_tokens=64,
                          max_num_seqs=8, scheduling_policy=scheduler)
    return LLMEngine(lm.model, config, lm.model_id, lm.eos_token_ids)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def drain(eng: LLMEngine, max_steps: int = 2000) -> dict[str, RequestOutput]:
    """Step until idle; fails (instead of hanging) when the node wedges."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return final
        final.update({o.request_id: o for o in eng.step() if o.finished})
    stats = eng.stats()
    pytest.fail(f"wedged: {stats['running']} running, {stats['waiting']} waiting, {len(final)} finished")


def assert_pool_empty(eng: LLMEngine) -> None:
    eng.check_integrity()
    pool = eng.kv_manager.pool
    assert pool.num_free_blocks() == pool.num_blocks
    assert not eng.scheduler.waiting and eng.scheduler.running == []


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_request_that_can_never_fit_is_refused_naming_the_pool_and_nothing_waits(tiny, scheduler) -> None:
    """issue 18 fault 1: one request wedges a node. A 300-token prompt with max_tokens 100 in a
    20-block (320-token) pool was admitted, preempted at 21 output tokens, never re-admitted,
    and 4 of the 5 small requests behind it never finished (fcfs, priority, vtc)."""
    eng = engine(tiny, scheduler)
    with pytest.raises(InvalidRequestError, match=r"KV pool holds 320 tokens"):
        eng.add_request(prompt_of(300), SamplingParams(max_tokens=100, ignore_eos=True), request_id="big")
    small = [eng.add_request(prompt_of(20, i + 1), SamplingParams(max_tokens=5, ignore_eos=True),
                             request_id=f"s{i}") for i in range(5)]
    final = drain(eng)
    assert sorted(final) == small
    assert [(final[s].finish_reason, final[s].num_output_tokens) for s in small] == [("length", 5)] * 5
    assert_pool_empty(eng)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_requests_that_each_fit_alone_all_finish_when_together_they_overflow_the_pool(tiny, scheduler) -> None:
    """issue 18 fault 1: a request that fits alone but finds the pool full while it runs is
    preempted and must come back; nothing behind it waits forever."""
    eng = engine(tiny, scheduler)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [eng.add_request(prompt_of(200), params, request_id="a"),
           eng.add_request(prompt_of(180, 3), params, request_id="b")]
    ids += [eng.add_request(prompt_of(20, i + 5), SamplingParams(max_tokens=5, ignore_eos=True),
                            request_id=f"s{i}") for i in range(3)]
    final = drain(eng)
    assert sorted(final) == sorted(ids)
    assert {i: (final[i].finish_reason, final[i].num_output_tokens) for i in ids} == {
        "a": ("length", 40), "b": ("length", 40), "s0": ("length", 5), "s1": ("length", 5),
        "s2": ("length", 5)}
    # the pool really overflowed (kvstrata admits whole prompts only: b waits for a instead)
    assert (eng.scheduler.num_preemptions == 0) == (scheduler == "kvstrata")
    assert_pool_empty(eng)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_waiting_turn_holding_blocks_does_not_wedge_the_request_ahead_of_it(tiny, scheduler) -> None:
    """issue 18 fault 1 (the class): the queue head cannot get blocks while nothing runs,
    because a session turn queued behind it holds the session's pinned blocks. The head must
    still run, then the turn (its history comes back through the prefix cache)."""
    eng = engine(tiny, scheduler)
    history = prompt_of(200, 9)
    first = eng.add_request(history, SamplingParams(max_tokens=1, ignore_eos=True), session_id="s")
    turn1 = drain(eng)[first]
    assert eng.kv_manager.pool.num_free_blocks() == 20 - 13  # the session pins 200 tokens
    eng.add_request(prompt_of(150, 4), SamplingParams(max_tokens=5, ignore_eos=True), request_id="x")
    prompt2 = history + list(turn1.output_token_ids) + prompt_of(10, 11)
    eng.add_request(prompt2, SamplingParams(max_tokens=5, ignore_eos=True), request_id="t2", session_id="s")
    final = drain(eng)
    assert {i: (o.finish_reason, o.num_output_tokens) for i, o in final.items()} == {
        "x": ("length", 5), "t2": ("length", 5)}
    eng.close_session("s")
    assert_pool_empty(eng)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_preempted_request_that_can_never_come_back_finishes_with_length(tiny, scheduler) -> None:
    """issue 18 fault 1: a compressing request (streaming keeps 48 tokens) fits while it
    decodes, but once preempted it must recompute its whole history, which the pool cannot
    hold at once under a policy that admits whole prompts only (kvstrata): it finishes with
    reason "length" and its tokens so far. Chunked policies recompute it chunk by chunk (the
    policy compresses between chunks) and it runs to max_tokens. Nothing behind it waits."""
    eng = engine(tiny, scheduler, num_blocks=12)  # 192 tokens
    long = eng.add_request(prompt_of(100), SamplingParams(max_tokens=150, ignore_eos=True), request_id="long",
                           policy="streaming-48-sink_tokens_4-window_tokens_16")
    final: dict[str, RequestOutput] = {}
    while len(eng.requests[long].output_token_ids) < 100:
        final.update({o.request_id: o for o in eng.step() if o.finished})
    eng.scheduler.preempt(eng.requests[long])  # as a higher class or a block shortage would
    eng.add_request(prompt_of(30, 2), SamplingParams(max_tokens=5, ignore_eos=True), request_id="small")
    final.update(drain(eng))
    expected = 100 if scheduler == "kvstrata" else 150
    assert (final["long"].finish_reason, final["long"].num_output_tokens) == ("length", expected)
    assert (final["small"].finish_reason, final["small"].num_output_tokens) == ("length", 5)
    assert_pool_empty(eng)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_running_request_that_cannot_grow_alone_is_given_up_not_preempted_forever(tiny, scheduler) -> None:
    """Regression (hangs review H1): on a node without a host tier SentenceKV charges the
    sentences it demotes to the pool, past what the admission bound counts; alone on a
    10-block pool a 136-token prompt could not get its next block, preempted itself, was
    readmitted and preempted itself again at the same point: 3000 steps, 3000 preemptions,
    one output token. Alone, with every other block freed, it now finishes with "length" and
    its output so far, and the node serves the next request."""
    from cache_node.policies import PolicyEnv

    eng = engine(tiny, scheduler, num_blocks=10)  # 160 tokens
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [13 if i % 12 == 11 else (7 * i) % 400 + 20 for i in range(136)]
    eng.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True), request_id="s", policy="sentencekv-0.5")
    final: dict[str, RequestOutput] = {}
    for _ in range(200):
        final.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished_requests():
            break
    assert final["s"].finish_reason == "length" and 0 < final["s"].num_output_tokens < 20
    assert final["s"].num_preemptions == 0
    eng.add_request(prompt_of(30, 2), SamplingParams(max_tokens=5, ignore_eos=True), request_id="next")
    final.update(drain(eng))
    assert (final["next"].finish_reason, final["next"].num_output_tokens) == ("length", 5)
    assert_pool_empty(eng)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_request_whose_compressed_prompt_cannot_fit_is_refused_at_arrival(tiny, scheduler) -> None:
    """Regression (hangs review 18 H1, admission bound): without a host tier SentenceKV
    charges the sentences it demotes (their K/V and region codes) and its recall region to the
    pool; a 600-token prompt on a 40-block (640-token) pool then held 2 blocks and owed 64
    after its first compaction, more than the pool, yet it was admitted as fitting (its
    uncompressed prompt does): it preempted itself 83 times in 250 steps (since 6bb8353 it
    was given up with "length" after its prefill). Now ``Scheduler.peak_tokens`` counts the
    charge of the prompt's compaction and the request is refused at arrival, naming the
    policy; the same request on a node with a host tier is admitted."""
    from cache_node.tiers.manager import TierConfig

    eng = engine(tiny, scheduler, num_blocks=40)
    with pytest.raises(InvalidRequestError, match=r"under KV policy 'sentencekv-0.5'.*KV pool holds 640 tokens"):
        eng.add_request(prompt_of(600), SamplingParams(max_tokens=30, ignore_eos=True), policy="sentencekv-0.5")
    assert not eng.has_unfinished_requests()
    # max_tokens 1 ends at the prompt's last step, before the charge is due (review of ac27634, F1)
    eng.add_request(prompt_of(600), SamplingParams(max_tokens=1, ignore_eos=True), request_id="one",
                    policy="sentencekv-0.5")
    assert drain(eng)["one"].num_output_tokens == 1
    tiered = LLMEngine(tiny.model, eng.config, tiny.model_id, tiny.eos_token_ids,
                       tier_config=TierConfig(host_bytes=100 * eng.pool.bytes_per_block))
    tiered.add_request(prompt_of(600), SamplingParams(max_tokens=3, ignore_eos=True), request_id="t",
                       policy="sentencekv-0.5")
    assert drain(tiered)["t"].num_output_tokens == 3


@pytest.mark.parametrize("spec", ["sentencekv-0.5", "sentencekv-64", "snapkv-0.25-cold_bits_4", "h2o-0.5-cold_bits_8",
                                  "quant-bits_4"])
@pytest.mark.parametrize("num_prompt_tokens", [120, 400])
def test_the_compressed_prompt_charge_bound_is_at_most_what_it_holds(tiny, spec, num_prompt_tokens) -> None:
    """``Policy.min_charge_tokens`` is a lower bound: a request the admission check refuses
    would really hold more than the bound after its prompt's compaction (blocks, charge
    blocks and charge debt), so no request that fits is refused."""
    eng = engine(tiny, "fcfs", num_blocks=200)
    eng.add_request(prompt_of(num_prompt_tokens), SamplingParams(max_tokens=3, ignore_eos=True), request_id="r",
                    policy=spec)
    seq = eng.requests["r"]
    bound = seq.kv.policy.min_charge_tokens(seq.kv, num_prompt_tokens)
    held = 0
    while eng.has_unfinished_requests():
        eng.step()
        if seq.kv is not None and seq.num_computed_tokens >= num_prompt_tokens and seq.block_table:
            held = max(held, (len(seq.block_table) + len(seq.kv.charge_blocks) + seq.kv.charge_debt) * 16)
    assert 0 < bound <= held


def test_a_lone_request_one_block_short_reclaims_one_idle_state_not_all(tiny) -> None:
    """Regression (hangs review 19 O1): a lone request one block short of its next decode
    made the scheduler reclaim the whole pool (``reclaim(pool.num_blocks)``): all four
    tenants' idle snapkv sessions lost their compacted states and the stored compressed
    prefix went (15 of 18 blocks freed for one), and the most recently used session's next
    turn prefilled its history again and decoded other tokens than with its state kept. Now
    idle states go least recently used first, only until the request's block fits."""
    from tests.conftest import make_engine

    def two(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True)

    def setup(num_blocks: int) -> LLMEngine:
        eng = make_engine(tiny, kv_pool_bytes=num_blocks * 8192, max_num_batched_tokens=64, max_num_seqs=4)
        for i in range(4):
            eng.add_request(prompt_of(64, 10 * i), two(4), session_id=f"S{i}", tenant=f"t{i}", policy="snapkv-0.5")
            drain(eng)
        eng.add_request(prompt_of(64, 99) + [7] * 8, two(2), tenant="tp", policy="snapkv-0.5", prefix_tokens=64)
        drain(eng)
        return eng

    def states(eng: LLMEngine) -> list[str]:
        return sorted(sid for sid, s in eng.sessions.sessions.items() if s.kv is not None)

    roomy = setup(256)
    held = roomy.kv_manager.pool.num_blocks - roomy.kv_manager.pool.num_free_blocks()
    tight = setup(held + 3)  # a 16-token request needs a 4th block at 48 tokens
    assert states(tight) == ["S0", "S1", "S2", "S3"] and len(tight.prefixes.entries) == 1
    tight.add_request(prompt_of(16, 5), two(40), request_id="x", tenant="tx")
    assert drain(tight)["x"].num_output_tokens == 40
    assert states(tight) == ["S1", "S2", "S3"] and len(tight.prefixes.entries) == 1  # S0: least recently used
    outs = []
    for eng in (tight, roomy):
        eng.add_request(eng.session_history("S3") + prompt_of(12, 7), two(12), request_id="S3-2", session_id="S3",
                        tenant="t3", policy="snapkv-0.5")
        outs.append(drain(eng)["S3-2"].output_token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("spec", ["snapkv-0.25-cold_bits_4", "quant-bits_4"])
def test_a_request_whose_codes_outgrow_the_pool_is_marked_cut_short(tiny, spec) -> None:
    """Regression (hangs review 19 C1): the codes a cold tier or quant keeps of what it
    evicts are charged to the pool and grow while the request decodes; alone on a 10-block
    pool a request for 1000 tokens finished "length" after ~500 (here: a 6-block pool, 400
    tokens), with nothing telling it from
    one that reached max_tokens. Now it is marked ``policy_stats["cut_short"]``, counted
    (``requests_cut_short``) and logged; its tokens are the roomy run's first ones."""
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    roomy = engine(tiny, "fcfs", num_blocks=200)
    roomy.add_request(prompt_of(60), params, request_id="r", policy=spec)
    full = drain(roomy)["r"]
    assert full.num_output_tokens == 400 and "cut_short" not in full.policy_stats
    eng = engine(tiny, "fcfs", num_blocks=6)
    eng.add_request(prompt_of(60), params, request_id="r", policy=spec)
    out = drain(eng)["r"]
    assert out.finish_reason == "length" and 0 < out.num_output_tokens < 400
    assert out.policy_stats["cut_short"] == 1.0 and eng.stats()["requests_cut_short"] == 1
    assert out.output_token_ids == full.output_token_ids[: out.num_output_tokens]
    assert_pool_empty(eng)
