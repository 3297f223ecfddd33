"""SentenceKV's deep layers (issue 22, point 4: 8x): from ``deep_from`` of the layers on, the
key sketch takes ``deep_sketch_bits`` codes (``LayeredSketch``) and a decode step reselects
every ``deep_recall_every`` tokens, while the other layers keep ``sketch_bits`` and
``recall_every``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cache_node.policies import PolicyEnv
from cache_node.policies.registry import make_policy
from cache_node.policies.sentencekv import KeySketch, LayeredSketch, SentenceKV
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def test_layered_sketch_scores_each_layer_with_its_parts_codes() -> None:
    """A layer's logits and log mass are those of a ``KeySketch`` of its part's bits fed the same
    keys; bytes add up, forks share the codes, and the finer part tracks the keys closer."""
    g = torch.Generator().manual_seed(3)
    layers, h_kv, d = 4, 2, 32
    keys = torch.randn(layers, 60, h_kv, d, generator=g) * torch.linspace(3, 0.5, d)
    layered = LayeredSketch([(0, KeySketch(2, 16, 16, True)), (2, KeySketch(4, 16, 16, True))])
    coarse, fine = KeySketch(2, 16, 16, True), KeySketch(4, 16, 16, True)
    for s in range(5):
        chunk = keys[:, s * 12:(s + 1) * 12]
        layered.append(chunk, s)
        coarse.append(chunk[:2], s)
        fine.append(chunk[2:], s)
    q = torch.randn(2, 2 * h_kv, d, generator=g)
    for layer in range(layers):
        ref, local = (coarse, layer) if layer < 2 else (fine, layer - 2)
        assert layered.part(layer) == (layered.parts[0 if layer < 2 else 1][1], local)
        torch.testing.assert_close(layered.logits(layer, q, 0.2), ref.logits(local, q, 0.2))
        torch.testing.assert_close(layered.log_mass(layer, q, 0.2, 5), ref.log_mass(local, q, 0.2, 5))
    assert layered.nbytes == coarse.nbytes + fine.nbytes
    twin = layered.fork()
    assert all(a[1].codes is b[1].codes for a, b in zip(twin.parts, layered.parts))
    exact = torch.einsum("nhgd,thd->nhgt", q.view(2, h_kv, 2, d), keys[3]) * 0.2
    exact_2bit = torch.einsum("nhgd,thd->nhgt", q.view(2, h_kv, 2, d), keys[1]) * 0.2
    assert ((layered.logits(3, q, 0.2) - exact).abs().mean() / exact.std()
            < (layered.logits(1, q, 0.2) - exact_2bit).abs().mean() / exact_2bit.std())


def test_layered_sketch_refuses_parts_that_do_not_cover_from_layer_0() -> None:
    for parts in ([], [(1, KeySketch(2, 16))], [(0, KeySketch(2, 16)), (0, KeySketch(4, 16))]):
        with pytest.raises(ValueError, match="parts"):
            LayeredSketch(parts)


def test_the_compact_preset_has_deep_layers_and_deep_from_1_turns_them_off() -> None:
    policy = make_policy("sentencekv-0.125-deep_from_1")
    assert (policy.deep_from, policy.deep_sketch_bits, policy.deep_recall_every) == (1, 4, 1)
    assert policy.deep_start(30) == 30 and isinstance(policy._sketch(30), KeySketch)
    policy = make_policy("sentencekv-0.125")
    assert (policy.deep_from, policy.recall_every, policy.deep_recall_every) == (0.5, 8, 1)
    assert policy.deep_start(30) == 15
    sketch = policy._sketch(30)
    assert isinstance(sketch, LayeredSketch) and [(f, s.bits) for f, s in sketch.parts] == [(0, 2), (15, 4)]
    assert make_policy("sentencekv-0.125-deep_from_0")._sketch(30).bits == 4
    assert make_policy("sentencekv-0.25").deep_start(30) == 30  # standard: no deep layers


def test_deep_sketch_whiten_sets_the_deep_parts_whitening_alone() -> None:
    sketch = make_policy("sentencekv-0.125-deep_from_0.5-deep_sketch_whiten_0")._sketch(30)
    assert [(f, s.bits, s.whiten) for f, s in sketch.parts] == [(0, 2, True), (15, 4, False)]
    # same bits, different whitening: still two parts
    sketch = make_policy("sentencekv-0.125-deep_from_0.5-deep_sketch_bits_2-deep_sketch_whiten_0")._sketch(30)
    assert [(f, s.bits, s.whiten) for f, s in sketch.parts] == [(0, 2, True), (15, 2, False)]
    assert isinstance(make_policy("sentencekv-0.125-deep_from_0.5-deep_sketch_bits_2")._sketch(30), KeySketch)


@pytest.mark.parametrize(("field", "bad"), [("deep_from", 1.5), ("deep_from", -0.1), ("deep_sketch_bits", 3),
                                            ("deep_recall_every", 0), ("deep_recall_every", 1.5),
                                            ("deep_sketch_whiten", 2), ("layer_floor", 1.5), ("layer_floor", "x")])
def test_deep_fields_are_validated(field: str, bad: float) -> None:
    with pytest.raises(ValueError, match=field):
        SentenceKV(budget=0.125, **{field: bad})


def test_deep_layers_reselect_every_step_and_the_rest_every_other(tiny, monkeypatch) -> None:
    """A real engine under ``recall_every_2-deep_from_0.5``: on a decode step at an odd
    computed-token count only the deep half of the layers selects, at an even one every layer."""
    calls: Counter = Counter()
    real = SentenceKV.recall

    def counting(self, state, layer_idx, q):
        if q.shape[0] == 1:
            calls[(state.seq.num_computed_tokens % 2, layer_idx >= self.deep_start(state.pool.num_layers))] += 1
        return real(self, state, layer_idx, q)

    monkeypatch.setattr(SentenceKV, "recall", counting)
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    spec = "sentencekv-96-recall_every_2-deep_from_0.5-deep_sketch_bits_4-sketch_rank_16-sketch_group_16"
    out = eng.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True), policy=spec)[0]
    eng.check_integrity()
    assert len(out.output_token_ids) == 9
    assert calls[(1, True)] > 0 and calls[(1, False)] == 0  # odd steps: deep layers only
    assert calls[(0, True)] > 0 and calls[(0, False)] > 0


@pytest.mark.parametrize("bits", [0, 8])
def test_incremental_region_load_holds_what_a_full_reload_holds(bits: int) -> None:
    """Loading only the sentences new to a head (``load_region(..., before)``) leaves each head
    holding the same (position, K/V) slots as refilling it from scratch, empty slots included."""
    from cache_node.policies.sentencekv import HostSentenceStore, PrivateHostKV, SentenceCodes

    g = torch.Generator().manual_seed(5)
    layers, h_kv, d = 2, 3, 16
    store = HostSentenceStore(PrivateHostKV())
    if bits:
        store.codes = SentenceCodes(bits, 16)
    first = 0
    for n in (5, 3, 7, 4, 6, 2):
        store.put(torch.randn(layers, n, 2, h_kv, d, generator=g), torch.arange(first, first + n))
        first += n
    pool_like = torch.zeros(layers, 2, 8, h_kv, d)

    def slots(s: HostSentenceStore, layer: int, h: int) -> dict[int, torch.Tensor]:
        pos = s.region_positions[layer][h]
        parts = [s.region_kv[layer][:, h]] + ([s.region_scale[layer][:, h], s.region_zero[layer][:, h]] if bits else [])
        return {int(p): torch.cat([t[:, i].flatten().float() for t in parts]) for i, p in enumerate(pos.tolist()) if p >= 0}

    a, b = ((0, 1, 2), (3,), (4, 5)), ((1, 2, 4), (0, 5), (4,))  # per head: kept, dropped, added
    store.resize_region([16, 16], pool_like, bits, 16)
    store.load_region(1, a, [0, 1, 2])
    store.load_region(1, b, [0, 1, 2], before=a)
    fresh = HostSentenceStore(store.host, codes=store.codes, positions=store.positions, handles=store.handles)
    fresh.resize_region([16, 16], pool_like, bits, 16)
    fresh.load_region(1, b, [0, 1, 2])
    for h in range(h_kv):
        got, want = slots(store, 1, h), slots(fresh, 1, h)
        assert got.keys() == want.keys() == {int(p) for s in b[h] for p in store.positions[s]}
        assert all(torch.equal(got[p], want[p]) for p in got)
