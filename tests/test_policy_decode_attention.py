"""A decode query over a dense layout attends the pool and the extra KV in one fused call
(``SequenceKV.attend_decode``): the same attention as the general path (``attend_all``) up to
float rounding, for every kind of extra KV sentencekv hands over (the int8/int4 region with
and without key scales, the raw region, the exact-recall overflow beside the region)."""

from __future__ import annotations

import pytest
import torch

from cache_node.kv_state import SequenceKV
from cache_node.policies import PolicyEnv
from cache_node.policies.quant import dequantize, pack_bits, quantize, unpack_bits
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


@pytest.mark.parametrize("bits,group", [(8, 16), (4, 16), (4, 64), (2, 32)])
def test_dequantize_inverts_the_codes(bits: int, group: int) -> None:
    g = torch.Generator().manual_seed(bits * group)
    x = torch.randn(2, 3, 40, 64, generator=g) * 3
    codes, scale, zero = quantize(x, bits, group)
    out = dequantize(pack_bits(codes, bits), scale, zero, bits)
    ref = (unpack_bits(pack_bits(codes, bits), bits).float().unflatten(-1, (-1, group))
           * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    step = scale.float().repeat_interleave(group, -1)  # one code step per group
    assert bool(((out - x).abs() <= step / 2 + 1e-3).all())  # within half a step of the input


SPECS = [  # (spec, the extra KV its decode steps hand over); 300-token prompts
    ("sentencekv-128", "QuantSentenceRegion"),  # standard preset: int8 region codes
    ("sentencekv-128-region_bits_4-region_key_scale_1", "QuantSentenceRegion"),  # int4, centred, scaled keys
    ("sentencekv-128-region_bits_0", "SentenceRegion"),  # the region in the pool's dtype
    ("sentencekv-128-preset_compact", "QuantSentenceRegion"),  # deep layers, layer split, key scales
    ("sentencekv-80-region_bits_4-region_key_scale_1-recall_eps_0.0001", "ChainedKV"),  # region + overflow
    ("streaming-1000", "NoneType"),  # no extra KV: the pool alone (a budget the prompt never reaches)
]


@pytest.mark.parametrize("spec,want", SPECS)
def test_fused_decode_matches_the_general_path(tiny, monkeypatch, spec: str, want: str) -> None:
    """Every decode step the fused path takes is recomputed by ``attend_all`` on the same
    state, query and extra KV; the outputs agree to float rounding, and the run's tokens
    are those of a run with the fused path off."""
    calls: list[str] = []  # the extra KV's class of every fused call
    attend_decode = SequenceKV.attend_decode

    def checked(self, q, k_cache, v_cache, ctx_slots, extra):
        out = attend_decode(self, q, k_cache, v_cache, ctx_slots, extra)
        layer = next(i for i in range(self.pool.num_layers) if self.pool.kv[i, 0].data_ptr() == k_cache.data_ptr())
        s = ctx_slots.shape[0]
        ref, _ = self.attend_all(layer, q, self.positions[layer, s - 1 : s], k_cache, v_cache, ctx_slots, extra)
        calls.append(type(extra).__name__)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        return out

    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i * 7) % 50 + 1 if i % 9 else 13 for i in range(300)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    monkeypatch.setattr(SequenceKV, "attend_decode", checked)
    fused = eng.generate([prompt], params, policy=spec)[0]
    assert calls.count(want) >= tiny.model.config.num_hidden_layers * 5, f"no fused call with {want}: {set(calls)}"
    monkeypatch.setattr(SequenceKV, "dense", False, raising=False)  # class default; instances set it
    monkeypatch.setattr(SequenceKV, "attend_decode", lambda *a: pytest.fail("fused path taken"))
    monkeypatch.setattr(SequenceKV, "set_layout", _never_dense(SequenceKV.set_layout))
    monkeypatch.setattr(SequenceKV, "reset", _never_dense(SequenceKV.reset))
    general = eng.generate([prompt], params, policy=spec)[0]
    assert fused.output_token_ids == general.output_token_ids
    eng.check_integrity()


def _never_dense(fn):
    def wrapped(self, *args, **kwargs):
        fn(self, *args, **kwargs)
        self.dense = False
    return wrapped
