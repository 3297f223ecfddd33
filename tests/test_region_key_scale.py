"""SentenceKV's per-channel key scales for the recall region's codes (``region_key_scale``,
KIVI §3; issue 22 build point 4): on keys with outlier channels the region's logits on int4
codes are closer to the exact ``q . k`` than without the scales, the recall bound's code error
stays an upper bound of the real one, the scales count as device bytes, and the option is
validated and runs in the engine under the exact-recall mode."""

from __future__ import annotations

import pytest
import torch

from cache_node.policies import PolicyEnv
from cache_node.policies.quant import QuantLayerKV, unpack_bits
from cache_node.policies.sentencekv import SentenceCodes, SentenceKV
from cache_node.policies.sentencekv.bound import quant_error
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def outlier_kv(g: torch.Generator, layers: int, n: int, h_kv: int, d: int) -> torch.Tensor:
    """(layers, n, 2, h_kv, d): keys with a few channels offset by 20 and 4x wider (as RoPE'd
    keys' outlier channels are), values plain."""
    k = torch.randn(layers, n, h_kv, d, generator=g)
    k[..., ::8] = 4 * k[..., ::8] + 20 * torch.randn(layers, 1, h_kv, d // 8, generator=g).sign()
    v = torch.randn(layers, n, h_kv, d, generator=g)
    return torch.stack([k, v], 2)


def region_logits(codes: SentenceCodes, kv: torch.Tensor, q: torch.Tensor, layer: int) -> torch.Tensor:
    """(H_kv, g, n, N) logits of ``q`` (H_kv, g, n, d) on the codes of every token of ``kv``,
    computed as ``QuantSentenceRegion`` does (query times the key scales)."""
    packed, scale, zero = codes.quantize(kv)  # (L, N, 2, H_kv, ...)
    qkv = QuantLayerKV(packed[layer].transpose(0, 1), scale[layer].transpose(0, 1),
                       zero[layer].transpose(0, 1), codes.bits)
    if codes.key_scale is None or codes.key_shift is None:
        return qkv.logits(q, 1.0)
    base = (q * codes.key_shift[layer][:, None, None, :]).sum(-1, keepdim=True)
    return qkv.logits(q * codes.key_scale[layer][:, None, None, :], 1.0) + base


@pytest.mark.parametrize("bits", [4, 8])
def test_key_scales_bring_the_region_logits_closer(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    kv = outlier_kv(g, 2, 64, 2, 32)
    q = torch.randn(2, 3, 4, 32, generator=g)
    plain, scaled = SentenceCodes(bits, 16), SentenceCodes(bits, 16, key_scale=True)
    scaled.fit_key_scale(kv[:, :, 0])
    assert scaled.key_scale is not None and scaled.key_scale.shape == (2, 2, 32)
    plain.fit_key_scale(kv[:, :, 0])  # off: nothing fitted
    assert plain.key_scale is None
    for layer in range(2):
        want = torch.einsum("hgnd,Nhd->hgnN", q, kv[layer, :, 0])
        err_plain = (region_logits(plain, kv, q, layer) - want).abs().mean()
        err_scaled = (region_logits(scaled, kv, q, layer) - want).abs().mean()
        assert err_scaled < 0.7 * err_plain, (bits, err_scaled, err_plain)
    # the values are coded as before
    assert torch.equal(plain.quantize(kv)[0][:, :, 1], scaled.quantize(kv)[0][:, :, 1])


def test_bound_code_error_covers_the_scaled_codes() -> None:
    """``quant_error`` with the scales is >= every token's real key error, and far below the
    unscaled codes' error on outlier keys."""
    g = torch.Generator().manual_seed(1)
    kv = outlier_kv(g, 1, 40, 2, 32)
    codes = SentenceCodes(4, 16, key_scale=True)
    codes.fit_key_scale(kv[:, :8, 0])  # fitted on the first tokens only: later ones may exceed it
    packed, scale, zero = codes.quantize(kv)
    c = unpack_bits(packed[:, :, 0], 4).float().unflatten(-1, (-1, 16))
    deq = (c * scale[:, :, 0].float().unsqueeze(-1) + zero[:, :, 0].float().unsqueeze(-1)).flatten(-2)
    real = (kv[:, :, 0] - codes.key_shift[:, None] - deq * codes.key_scale[:, None]).norm(dim=-1)  # (L, n, H_kv)
    bound = quant_error(kv[:, :, 0], 4, 16, (codes.key_shift, codes.key_scale))
    assert (real.amax(1) <= bound + 1e-5).all()
    assert (bound < 0.7 * quant_error(kv[:, :, 0], 4, 16)).all()


def test_spec_validates_region_key_scale() -> None:
    assert SentenceKV(budget=0.25, region_bits=4, region_key_scale=1).region_key_scale == 1
    for kw in ({"region_key_scale": 2}, {"region_key_scale": 1, "region_bits": 0}):
        with pytest.raises(ValueError, match="region_key_scale"):
            SentenceKV(budget=0.25, **kw)


def test_engine_runs_with_key_scales_and_counts_them(tiny) -> None:
    """A real engine run under ``region_key_scale`` with exact recall: it finishes, the bound
    after recall stays below the run's epsilon, and the scales' bytes count."""
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    spec = "sentencekv-96-region_bits_4-region_key_scale_1-recall_eps_0.05"
    out = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), policy=spec)[0]
    assert len(out.output_token_ids) == 6
    assert out.policy_stats["recall_bound_steps"] >= 5 and 0 <= out.policy_stats["recall_bound_max"] <= 0.05
    eng.check_integrity()
    cfg = tiny.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    codes = SentenceCodes(4, 16, key_scale=True)
    codes.fit_key_scale(torch.randn(cfg.num_hidden_layers, 5, cfg.num_key_value_heads, d))
    assert codes.key_scale_nbytes == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * d * 4
