"""Contract matrix: every registered policy on the tiny model (CPU).

Budgets respected per layer, pool integrity, positions unchanged after eviction, determinism
under a seed, a budget that fits everything changes nothing, per-request selection in one batch.
"""

from __future__ import annotations

import pytest
import torch

from cache_node.engine import LLMEngine
from cache_node.outputs import InvalidRequestError
from cache_node.policies import known_policies, make_policy
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

POLICIES = known_policies()
COMPRESSING = [p for p in POLICIES if make_policy(p).compresses]
BUDGET = 40


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def run_until(eng: LLMEngine, rid: str, num_output: int, check=None) -> None:
    """Step until request ``rid`` has ``num_output`` tokens, calling ``check(seq)`` every step."""
    while True:
        eng.step()
        seq = eng.requests[rid]
        eng.check_integrity()
        if check is not None:
            check(seq)
        if len(seq.output_token_ids) >= num_output:
            return


def reference_kv(tiny, tokens: list[int]) -> tuple[LLMEngine, list[int]]:
    """Full-cache pool and slot-per-position for ``tokens`` (prefill only)."""
    eng = make_engine(tiny)
    rid = eng.add_request(tokens, SamplingParams(max_tokens=2, ignore_eos=True))
    seq = eng.requests[rid]
    while seq.num_computed_tokens < len(tokens):
        eng.step()
    bs = eng.pool.block_size
    return eng, [seq.block_table[p // bs].block_id * bs + p % bs for p in range(len(tokens))]


@pytest.mark.parametrize("name", POLICIES)
def test_budget_respected_per_layer_and_pool_integrity(tiny, name: str) -> None:
    eng = make_engine(tiny)
    spec = f"{name}-{BUDGET}"
    rid = eng.add_request(prompt_of(100), SamplingParams(max_tokens=40, ignore_eos=True), policy=spec)
    policy = make_policy(spec)
    peak = {"all": 0, "compacted": 0}

    def check(seq) -> None:
        peak["all"] = max(peak["all"], len(seq.block_table))
        if seq.kv is None or not seq.kv.compacted:  # the prompt itself is prefilled in full
            return
        peak["compacted"] = max(peak["compacted"], len(seq.block_table))
        budgets = policy.layer_budgets(seq.kv.budget, eng.pool.num_layers)
        for layer, (count, budget) in enumerate(zip(seq.kv.kept_counts(), budgets)):
            assert count <= budget + policy.evict_every, f"layer {layer}: {count} > {budget}"
        assert seq.num_computed_tokens - seq.num_evicted_tokens == seq.kv.frontier

    run_until(eng, rid, 30, check)
    seq = eng.requests[rid]
    if policy.compresses:
        assert seq.kv.compacted and seq.kv.budget == policy.budget_tokens(100)
        assert peak["compacted"] <= -(-(seq.kv.budget + policy.evict_every + 1) // 16)
        assert all(b.block_hash is None and b.ref_cnt == 1 for b in seq.block_table)
    else:
        assert seq.kv is None and peak["all"] == 9  # ceil(130 / 16): nothing evicted
    eng.abort_request(rid)
    eng.step()
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0


@pytest.mark.parametrize("name", COMPRESSING)
def test_positions_unchanged_after_eviction(tiny, name: str) -> None:
    """Kept KV is the KV computed at its true absolute position: nothing re-rotated or shifted.

    Prompt tokens must match a full-cache prefill in every layer; generated tokens in layer 0
    (whose keys depend only on token and position). Merged entries are skipped.
    """
    eng = make_engine(tiny)
    prompt = prompt_of(100)
    rid = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True), policy=f"{name}-{BUDGET}")
    run_until(eng, rid, 20)
    seq = eng.requests[rid]
    tokens = seq.all_token_ids[: seq.num_computed_tokens]
    ref, ref_slots = reference_kv(tiny, tokens)
    bs = eng.pool.block_size
    checked = 0
    for layer in range(eng.pool.num_layers):
        pos = seq.kv.positions[layer]
        assert torch.equal(pos[pos >= 0], pos[pos >= 0].sort().values)  # slot order = position order
        assert len(set(pos[pos >= 0].tolist())) == int((pos >= 0).sum())
        for i, p in enumerate(pos.tolist()):
            if p < 0 or seq.kv.support[layer, i] != 1 or (layer > 0 and p >= len(prompt)):
                continue
            slot = seq.block_table[i // bs].block_id * bs + i % bs
            got, want = eng.pool.kv[layer, :, slot], ref.pool.kv[layer, :, ref_slots[p]]
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            checked += 1
    assert checked > 0
    assert seq.kv.positions[:, -1].tolist() == [seq.num_computed_tokens - 1] * eng.pool.num_layers


@pytest.mark.parametrize("name", POLICIES)
def test_deterministic_under_seed(tiny, name: str) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng = make_engine(tiny)
        out = eng.generate([prompt_of(90, 3)], params, policy=f"{name}-{BUDGET}")[0]
        runs.append(out.output_token_ids)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", COMPRESSING)
def test_budget_that_fits_everything_matches_full_cache(tiny, name: str) -> None:
    """Regression: the managed attention path must equal the plain paged path when nothing is
    evicted (masks, support bias and stats must not perturb the output)."""
    if make_policy(name).__class__.__name__.startswith("Quant"):
        pytest.skip("quantization changes KV by design; see test_quant")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    eng = make_engine(tiny)
    full = eng.generate([prompt_of(60)], params)[0]
    kept = make_engine(tiny).generate([prompt_of(60)], params, policy=f"{name}-200")[0]
    assert kept.output_token_ids == full.output_token_ids


def test_policies_mix_in_one_batch_and_match_solo_runs(tiny) -> None:
    """Per-request selection: one continuous batch, each request under its own policy."""
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    specs = ["", "streaming-32", "h2o-40", "snapkv-48"]
    prompts = [prompt_of(70 + 9 * i, i) for i in range(len(specs))]
    solo = [make_engine(tiny).generate([p], params, policy=s)[0].output_token_ids for p, s in zip(prompts, specs)]
    eng = make_engine(tiny)
    ids = [eng.add_request(p, params, policy=s) for p, s in zip(prompts, specs)]
    done: dict[str, tuple[int, ...]] = {}
    while len(done) < len(ids):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
        eng.check_integrity()
    assert [done[i] for i in ids] == solo


def test_unknown_policy_lists_the_known_ones(tiny) -> None:
    eng = make_engine(tiny)
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([1, 2, 3], policy="nosuch")
    assert "nosuch" in str(err.value) and ", ".join(POLICIES) in str(err.value)
    with pytest.raises(InvalidRequestError, match="bad part 'frobs_3'"):
        eng.add_request([1, 2, 3], policy="h2o-frobs_3")
    assert eng.stats()["used_blocks"] == 0


def test_spec_parsing() -> None:
    p = make_policy("h2o-0.125-window_tokens_8-sink_tokens_2")
    assert (p.budget, p.window_tokens, p.sink_tokens) == (0.125, 8, 2)
    assert p.budget_tokens(1000) == 125
    assert make_policy("snapkv-256").budget_tokens(1000) == 256
    assert make_policy("streaming-0.01").budget_tokens(1000) == 4 + 16 + 1  # sinks + window + 1
    with pytest.raises(ValueError, match="budget must be > 0"):
        make_policy("h2o-0")


def test_compacted_blocks_are_copied_on_write_not_overwritten(tiny) -> None:
    """Regression: compaction must not write into blocks the prefix cache can still hand out."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng = make_engine(tiny)
    prompt = prompt_of(100)
    first = eng.generate([prompt], params)[0]
    eng.generate([prompt], params, policy="h2o-40")
    again = eng.generate([prompt], params)[0]
    assert again.num_cached_tokens == 96
    assert again.output_token_ids == first.output_token_ids


STATS_POLICIES = [p for p in COMPRESSING if make_policy(p).needs.any]


@pytest.mark.parametrize("name", STATS_POLICIES)
def test_a_prefix_cache_hit_leaves_the_compression_as_on_a_cold_cache(tiny, name: str) -> None:
    """Regression: an H2O or G-KV request whose prompt a plain request had cached took the
    hit, compressed from the attention of its few computed tokens only, and decoded other
    tokens than on a cold cache (G-KV from its second token). Now a policy reading
    cumulative attention takes no hit before its first compression, and one reading an
    observation window of w queries computes at least those w."""
    prompt, params = prompt_of(200, 3), SamplingParams(max_tokens=12, ignore_eos=True)
    spec = f"{name}-{BUDGET}" if name != "sentencekv" else "sentencekv-0.25"
    cold = make_engine(tiny, max_num_batched_tokens=256).generate([prompt], params, policy=spec)[0]
    eng = make_engine(tiny, max_num_batched_tokens=256)
    eng.generate([prompt + [9]], SamplingParams(max_tokens=1))  # caches the prompt's full blocks
    warm = eng.generate([prompt], params, policy=spec)[0]
    assert warm.output_token_ids == cold.output_token_ids
    needs, bs = make_policy(spec).needs, eng.pool.block_size
    want = 0 if needs.attention else (len(prompt) - needs.window_queries) // bs * bs
    assert warm.num_cached_tokens == want
