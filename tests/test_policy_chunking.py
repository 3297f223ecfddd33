"""Every registered KV policy decodes the same tokens however its request's prompt was chunked.

The chunking of a prompt is set by what a step's token budget leaves after the other requests
(FCFS: earlier prompts, decodes), so a statistic a policy reads that counted engine steps would
let another tenant's load change this tenant's output. Every per-sequence statistic is a
function of the token stream instead (``AttentionStats.begin_step``: the prompt is one unit,
each later token one).

Regression (review 22a, F1): the recent-attention ring (SpindleKV's score, half of G-KV's)
advanced, and G-KV's cumulative scores decayed, once per engine step, a prefill chunk being a
step; a SpindleKV prompt chunked 24 + 76 by another tenant's prompt decoded other tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv, known_policies
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

PROMPT_TOKENS, MAX_TOKENS = 100, 24
# (max_num_batched_tokens, another tenant's 200-token prompt arrives first): the first one
# prefills the prompt in one step (the reference), the others in 2 to 6 chunks of other sizes
CASES = [(128, False), (64, False), (23, False), (17, False), (112, True), (64, True)]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [13 if i % 12 == 11 else rng.randrange(20, 500) for i in range(n)]  # 13 ends a sentence


def run(tiny, spec: str, batched: int, other: bool) -> tuple[list[int], tuple[int, ...]]:
    """(the request's prefill chunks, its output token ids)."""
    eng = make_engine(tiny, kv_pool_bytes=512 * 8192, max_num_batched_tokens=batched, max_num_seqs=8)
    eng.policy_env = PolicyEnv(frozenset({13}))
    if other:
        eng.add_request(prompt(200, 2), SamplingParams(max_tokens=30, ignore_eos=True), request_id="b",
                        tenant="B", cache_namespace="B")
    eng.add_request(prompt(PROMPT_TOKENS, 1), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    request_id="a", tenant="A", cache_namespace="A", policy=spec)
    return step_until_done(eng)


def step_until_done(eng: LLMEngine) -> tuple[list[int], tuple[int, ...]]:
    chunks: list[int] = []
    for _ in range(500):
        seq = eng.requests.get("a")
        before = seq.num_computed_tokens if seq is not None else 0
        outs = eng.step()
        seq = eng.requests.get("a")
        if seq is not None and before < PROMPT_TOKENS and seq.num_computed_tokens > before:
            chunks.append(seq.num_computed_tokens - before)
        for o in outs:
            if o.request_id == "a" and o.finished:
                return chunks, tuple(o.output_token_ids)
    raise AssertionError("request a never finished")


@pytest.mark.parametrize("spec", known_policies())
def test_output_does_not_depend_on_prompt_chunking(tiny, spec: str) -> None:
    ref_chunks, ref = run(tiny, spec, *CASES[0])
    assert ref_chunks == [PROMPT_TOKENS]
    differ = []
    for batched, other in CASES[1:]:
        chunks, out = run(tiny, spec, batched, other)
        assert len(chunks) > 1, (batched, other, chunks)  # the case chunks the prompt
        if out != ref:
            differ.append(f"budget {batched}{' + other tenant' if other else ''}: chunks {chunks} -> {out}")
    assert not differ, f"{spec}: one chunk -> {ref}; " + "; ".join(differ)


def stats_after(tiny, spec: str, batched: int, other: bool, outputs: int):  # type: ignore[no-untyped-def]
    """Request a's ``AttentionStats`` once it has ``outputs`` output tokens."""
    eng = make_engine(tiny, kv_pool_bytes=512 * 8192, max_num_batched_tokens=batched, max_num_seqs=8)
    if other:
        eng.add_request(prompt(200, 2), SamplingParams(max_tokens=30, ignore_eos=True), request_id="b",
                        tenant="B", cache_namespace="B")
    eng.add_request(prompt(PROMPT_TOKENS, 1), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                    request_id="a", tenant="A", cache_namespace="A", policy=spec)
    for _ in range(500):
        eng.step()
        seq = eng.requests["a"]
        if len(seq.output_token_ids) >= outputs:
            return seq.kv.stats
    raise AssertionError("request a never got its outputs")


@pytest.mark.parametrize("spec", ["h2o-200", "gkv-200", "spindlekv-200"])
@pytest.mark.parametrize("outputs", [1, 8, 12])
def test_attention_statistics_do_not_depend_on_prompt_chunking(tiny, spec: str, outputs: int) -> None:
    """The statistics themselves (a budget over the prompt: no compaction moves them), after the
    prompt, after 7 decode tokens (its ring slot the oldest) and after 11 (its slot gone): the same
    cumulative (decayed) attention and the same ring maxima, chunked or not."""
    ref = stats_after(tiny, spec, 128, False, outputs)
    for batched, other in CASES[1:]:
        got = stats_after(tiny, spec, batched, other, outputs)
        n = PROMPT_TOKENS + outputs - 1  # the tokens computed so far
        torch.testing.assert_close(got.cum[..., :n], ref.cum[..., :n], rtol=1e-5, atol=1e-6)
        for layer in range(got.num_layers):
            torch.testing.assert_close(got.recent_max(layer, n), ref.recent_max(layer, n), rtol=1e-5, atol=1e-6)
        assert got.step == ref.step, (batched, other)  # the units opened: the prompt and each later token


def _prefix_consumer(tiny, spec: str, producer_question: int) -> tuple[tuple[int, float], tuple[int, ...]]:
    """A 300-token document stored as a compressed prefix by a producer asking a question of
    ``producer_question`` tokens, then a consumer's 6-token question forking it: the
    consumer's (units opened, cumulative-score sum) after its prompt, and its tokens."""
    doc = [(7 * i) % 500 + 1 for i in range(300)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = make_engine(tiny, kv_pool_bytes=4 << 20)
    eng.generate([doc + [(13 * i) % 400 + 5 for i in range(producer_question)]], params, policy=spec,
                 prefix_tokens=len(doc))
    eng.add_request(doc + [(11 * i) % 400 + 3 for i in range(6)], params, request_id="B", policy=spec,
                    prefix_tokens=len(doc))
    seen = None
    while eng.has_unfinished_requests():
        outs = eng.step()
        seq = eng.requests.get("B")
        if seen is None and seq is not None and seq.num_computed_tokens == len(doc) + 6:
            seen = (seq.kv.stats.step, round(float(seq.kv.stats.cum.sum()), 3))
        done = [o for o in outs if o.request_id == "B" and o.finished]
        if done:
            assert eng.stats()["compressed_prefix_hits"] == 1
            assert seen is not None
            return seen, tuple(done[0].output_token_ids)
    raise AssertionError("the consumer did not finish")


@pytest.mark.parametrize("spec", ["gkv-0.1", "spindlekv-0.1"])
def test_a_compressed_prefix_fork_does_not_depend_on_the_producers_prompt(tiny, spec: str) -> None:
    """Review 22c: the producer's prefix steps kept its whole prompt's length as their unit's
    end, and the fork inherited that open unit, so a consumer whose prompt had the producer's
    length continued it (no new unit, no decay) and another opened one: spindlekv-0.1 decoded
    other tokens from the 9th on. The prefix's boundary ends its unit."""
    same, other = (_prefix_consumer(tiny, spec, n) for n in (6, 7))
    assert same == other
