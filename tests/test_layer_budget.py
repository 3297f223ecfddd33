"""SentenceKV's layer-wise region split (``layer_budget="mass"``) and whitened low-rank sketch
(``sketch_whiten``), issue 22 build point 4: the split follows where the window queries'
attention lies, keeps every layer above its floor, stays within the budget in the engine, and
the options are validated."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.policies import PolicyEnv
from cache_node.policies.registry import parse_spec
from cache_node.policies.sentencekv import KeySketch, SentenceKV
from cache_node.policies.sentencekv.layer_budget import layer_shares, split_slots
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.floats(0, 1), min_size=1, max_size=40))
def test_split_slots_sums_to_total_and_follows_the_shares(total: int, raw: list[float]) -> None:
    w = torch.tensor(raw) + 1e-3
    shares = w / w.sum()
    sizes = split_slots(total, shares)
    assert sum(sizes) == total and min(sizes) >= 0
    assert all(abs(s - float(f) * total) < 1 for s, f in zip(sizes, shares))


def test_diffuse_layer_gets_more_slots_and_every_layer_keeps_its_floor() -> None:
    """Layer 0's window queries spread their attention over all demoted tokens, layer 1's fall
    on two of them: layer 0 takes most of the region, layer 1 keeps the floor share."""
    g = torch.Generator().manual_seed(0)
    n, m, h_kv, group, d, w = 256, 8, 2, 2, 16, 4
    keys = torch.randn(2, n, h_kv, d, generator=g) * 0.01  # layer 0: flat logits everywhere
    q = torch.randn(2, w, h_kv * group, d, generator=g)
    keys[1, 5] = q[1].view(w, h_kv, group, d).mean((0, 2)) * 20  # layer 1: two sharp targets
    keys[1, 90] = keys[1, 5]
    kept = torch.randn(2, m, h_kv, d, generator=g) * 0.01
    demoted_pos, kept_pos = torch.arange(4, 4 + n), torch.tensor([0, 1, 2, 3, *range(4 + n, 8 + n)])
    qpos = torch.arange(4 + n, 8 + n)
    shares = layer_shares([q[0], q[1]], [qpos, qpos], keys, demoted_pos, kept, kept_pos, d**-0.5, 32, floor=0.5)
    assert abs(float(shares.sum()) - 1) < 1e-6
    assert float(shares[0]) > 0.7 and abs(float(shares[1]) - 0.25) < 1e-6
    # a floor of a whole equal share is the uniform split; 0 leaves the measured one
    uniform = layer_shares([q[0], q[1]], [qpos, qpos], keys, demoted_pos, kept, kept_pos, d**-0.5, 32, floor=1.0)
    torch.testing.assert_close(uniform, torch.full((2,), 0.5))
    bare = layer_shares([q[0], q[1]], [qpos, qpos], keys, demoted_pos, kept, kept_pos, d**-0.5, 32, floor=0.0)
    assert float(bare[1]) < 0.25 < float(bare[0])
    # no window queries in a layer: that layer gets an equal share of the top tokens' count
    shares = layer_shares([None, q[1]], [None, qpos], keys, demoted_pos, kept, kept_pos, d**-0.5, 32)
    assert float(shares[0]) >= 0.25 and abs(float(shares.sum()) - 1) < 1e-6


def test_engine_splits_the_region_by_layer_within_the_budget(tiny) -> None:
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    outs = {}
    for spec in ("sentencekv-96-region_bits_8", "sentencekv-96-region_bits_8-layer_budget_mass"):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), policy=spec)
        seq = eng.requests[rid]
        while len(seq.output_token_ids) < 4:
            eng.step()
        store = seq.kv.extra["sentences"]
        sizes = [store.region_slots(layer) for layer in range(eng.pool.num_layers)]
        outs[spec] = sizes
        assert seq.kv.device_bytes() <= 96 * seq.kv.policy._token_bytes(seq.kv)
        assert seq.kv.policy.extra_device_bytes(seq.kv) == store.index_nbytes + store.region_nbytes
        for layer, r in enumerate(sizes):  # every layer's slots hold only that layer's recalled tokens
            assert store.region_positions[layer].shape == (eng.pool.num_kv_heads, r)
            assert store.region_kv[layer].shape[2] == r
        while not seq.is_finished:
            eng.step()
    uniform, split = outs.values()
    assert len(set(uniform)) == 1 and store.layer_share is not None
    assert abs(sum(split) - sum(uniform)) <= 1  # the same slots, split differently
    assert min(split) >= uniform[0] // 2 - 1  # the floor: half an equal share


def test_whitened_sketch_keeps_its_logits_unbiased_and_counts_its_bytes() -> None:
    """Whitening divides each principal coordinate by its spread before the codes and scales
    the query back: with 8-bit codes the logits match the unwhitened sketch's, and the spreads
    are counted in ``nbytes`` and shared by forks."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 64, 2, 16, generator=g) * torch.logspace(1, -1, 16)
    plain, white = KeySketch(8, 8, 8), KeySketch(8, 8, 8, whiten=True)
    plain.append(keys, 0)
    white.append(keys, 0)
    q = torch.randn(2, 4, 16, generator=g)
    a, b = plain.logits(0, q, 0.25), white.logits(0, q, 0.25)
    assert (a - b).abs().max() < 0.02 * a.abs().max()  # both within 8-bit rounding of the rank-8 logits
    assert white.spread is not None and white.spread.shape == (1, 2, 8)
    assert white.nbytes == plain.nbytes + white.spread.numel() * 4
    assert white.fork().spread is white.spread


@pytest.mark.parametrize("spec", ["sentencekv-0.125-layer_budget_heads", "sentencekv-0.125-sketch_whiten_2",
                                  "sentencekv-0.25-sketch_rank_0-sketch_whiten_1"])
def test_bad_layer_budget_or_whiten_is_refused(spec: str) -> None:
    cls, kwargs = parse_spec(spec)
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_presets_name_the_new_fields() -> None:
    assert SentenceKV(budget=0.25).layer_budget in ("uniform", "mass")
    assert SentenceKV(budget=0.25, preset="standard").sketch_whiten == 0


def test_recall_next_ranks_the_following_sentence_after_the_top_ones() -> None:
    """``recall_next`` k: each of the k best sentences is followed by the sentence that starts
    where it ends (not by one after a gap), so a selection reused over decode steps holds the
    text the model copies next."""
    policy = SentenceKV(budget=0.125, recall_next=2)
    lengths, first = [5, 5, 5, 5, 5], [0, 5, 10, 20, 25]  # sentence 3 starts after a gap
    assert policy._with_next([2, 0, 3, 1], lengths, first) == [2, 0, 1, 3, 1]
    assert SentenceKV(budget=0.125, recall_next=0)._with_next([2, 0], lengths, first) == [2, 0]


def test_engine_runs_the_new_options_together(tiny) -> None:
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    spec = "sentencekv-96-preset_compact-layer_budget_mass-sketch_whiten_1-recall_next_4"
    rid = eng.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), policy=spec)
    seq = eng.requests[rid]
    while not seq.is_finished:
        eng.step()
        if seq.kv is not None and "sentences" in seq.kv.extra:
            assert seq.kv.device_bytes() <= seq.kv.budget * seq.kv.policy._token_bytes(seq.kv)
    assert len(seq.output_token_ids) == 12
