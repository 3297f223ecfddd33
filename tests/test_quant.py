"""Quantized tier: codes, packing, and attention computed on codes equals attention on the
dequantized KV (HACK's homomorphic identity)."""

from __future__ import annotations

import pytest
import torch

from cache_node.policies import make_policy
from cache_node.policies.quant import (
    SPAN_DEQUANT_MIN_ROWS,
    QuantLayerKV,
    QuantSegment,
    pack_bits,
    pack_int4,
    quantize,
    unpack_bits,
    unpack_bits_float,
    unpack_int4,
)
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    g = codes.float().unflatten(-1, (-1, group))
    return (g * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_error_is_within_half_a_step(bits: int) -> None:
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
    codes, scale, zero = quantize(x, bits, 32)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    err = (dequantize(codes, scale, zero, 32) - x).abs().unflatten(-1, (-1, 32)).amax(-1)
    assert bool((err <= scale.float() * 0.5 + 2e-3).all())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_bits_roundtrip(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)
    assert torch.equal(unpack_bits_float(packed, bits), codes.float())  # the float decode gives the same values
    view = packed.permute(1, 0, 2)  # a strided view (the sketch reads its codes KV head first)
    assert torch.equal(unpack_bits_float(view, bits), codes.permute(1, 0, 2).float())


def test_int4_pack_roundtrip() -> None:
    codes = torch.randint(0, 16, (2, 7, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (2, 7, 32)
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("queries", [4, 200])  # 200 x 3 query heads: a long chunk, dequantized once
@pytest.mark.parametrize("group", [32, 64])  # 64: one group per head, the bmm path
@pytest.mark.parametrize("bits", [4, 8])
def test_attention_on_codes_equals_attention_on_dequantized_kv(bits: int, group: int, queries: int) -> None:
    gen = torch.Generator().manual_seed(1)
    L, n, h_kv, d, g = 2, 11, 2, 64, 3
    kv = torch.randn(L, n, 2, h_kv, d, generator=gen)
    seg = QuantSegment(bits, group)
    seg.append(kv, torch.arange(n))
    layer = seg.layer(1)
    qh = torch.randn(h_kv, g, queries, d, generator=gen)
    codes = seg.codes[1] if bits == 8 else unpack_int4(seg.codes[1])
    k = dequantize(codes[0], seg.scale[1, 0], seg.zero[1, 0], group)  # (n, H, d)
    v = dequantize(codes[1], seg.scale[1, 1], seg.zero[1, 1], group)
    want_logits = qh @ k.permute(1, 2, 0).unsqueeze(1) * 0.125
    torch.testing.assert_close(layer.logits(qh, 0.125), want_logits, atol=1e-4, rtol=1e-4)
    probs = torch.softmax(want_logits, -1)
    torch.testing.assert_close(layer.output(probs), probs @ v.permute(1, 0, 2).unsqueeze(1), atol=1e-4, rtol=1e-4)
    # a SentenceKV span's rows (SPAN_DEQUANT_MIN_ROWS): dequantized from 2 rows, the same values
    torch.testing.assert_close(layer.logits(qh, 0.125, SPAN_DEQUANT_MIN_ROWS), want_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.output(probs, SPAN_DEQUANT_MIN_ROWS), probs @ v.permute(1, 0, 2).unsqueeze(1),
                               atol=1e-4, rtol=1e-4)
    per_token = L * 2 * h_kv * (d * bits // 8 + 2 * 2 * (d // group))
    assert seg.nbytes == n * per_token


@pytest.mark.parametrize("heads_first", [False, True])  # the quant policy's layout, the sentencekv region's
@pytest.mark.parametrize("n", [1, 7])
@pytest.mark.parametrize("bits", [4, 8])
def test_one_group_per_head_scores_bit_for_bit_as_the_grouped_einsum(bits: int, n: int, heads_first: bool) -> None:
    """The bmm taken with one channel group per head changes no bit of the scores or outputs
    against the einsum every other group size takes (so switching to it left every quality
    figure as it was)."""
    gen = torch.Generator().manual_seed(n)
    h_kv, num, d, g = 3, 37, 64, 3
    codes = torch.randint(0, 256, (2, h_kv, num, d * bits // 8), dtype=torch.uint8, generator=gen)
    scale = torch.rand(2, h_kv, num, 1, generator=gen).half()
    zero = torch.randn(2, h_kv, num, 1, generator=gen).half()
    parts = [t.transpose(1, 2) for t in (codes, scale, zero)]  # (2, N, H, ...) as QuantLayerKV takes them
    if not heads_first:
        parts = [t.contiguous() for t in parts]
    layer = QuantLayerKV(*parts, bits)
    qh = torch.randn(h_kv, g, n, d, generator=gen)
    qg = qh.unflatten(-1, (1, -1))
    sc, ze = (t.float().permute(0, 2, 1, 3) for t in parts[1:])  # (2, H, N, 1)
    want = (torch.einsum("hgnkc,Nhkc->hgnNk", qg, layer.codes[0]) * sc[0][:, None, None]).sum(-1)
    want = (want + torch.einsum("hgnk,hNk->hgnN", qg.sum(-1), ze[0])) * 0.125
    assert torch.equal(layer.logits(qh, 0.125), want)
    probs = torch.softmax(want, -1)
    out = torch.einsum("hgnNk,Nhkc->hgnkc", probs.unsqueeze(-1) * sc[1][:, None, None], layer.codes[1])
    out = out + torch.einsum("hgnN,hNk->hgnk", probs, ze[1]).unsqueeze(-1)
    assert torch.equal(layer.output(probs), out.flatten(-2))


@pytest.mark.parametrize("bits,ratio", [(8, 4 / 1.25), (4, 4 / 0.75)])
def test_quant_holds_fewer_bytes_and_tracks_tokens(tiny, bits: int, ratio: float) -> None:
    """Device bytes = fp blocks (sinks + window) + codes + scales; every token is somewhere.

    head_dim 16 = one group: per element 1 (int8) or 0.5 (int4) byte + 4 bytes of fp16
    scale/zero per 16 elements, against 4 bytes of float32.
    """
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 401)), SamplingParams(max_tokens=8, ignore_eos=True),
                          policy=f"quant-bits_{bits}")
    while len(eng.requests[rid].output_token_ids) < 4:
        eng.step()
    seq = eng.requests[rid]
    seg = seq.kv.extra["quant"]
    fp = seq.kv.positions[0]
    held = sorted(seg.positions.tolist() + fp[fp >= 0].tolist())
    assert held == list(range(seq.num_computed_tokens))
    full_bytes = seq.num_computed_tokens * eng.pool.bytes_per_block // eng.pool.block_size
    quant_tokens = len(seg.positions)
    fp32_bytes = quant_tokens * eng.pool.bytes_per_block // eng.pool.block_size
    assert fp32_bytes / seg.nbytes == pytest.approx(ratio)
    assert seq.kv.device_bytes() < full_bytes


def test_cold_tier_keeps_what_a_scoring_policy_evicts_as_codes(tiny) -> None:
    """``h2o-40-cold_bits_8``: the pool holds the 40 kept entries per layer, the cold tier every
    evicted token exactly once (kept + cold = every computed token, per layer), its bytes count,
    and attending to the int8 codes brings the output back to the full cache's."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [(7 * i) % 500 + 1 for i in range(100)]
    full = make_engine(tiny).generate([prompt], params)[0].output_token_ids
    dropped = make_engine(tiny).generate([prompt], params, policy="h2o-40")[0].output_token_ids
    eng = make_engine(tiny)
    rid = eng.add_request(prompt, params, policy="h2o-40-cold_bits_8")
    while len(eng.requests[rid].output_token_ids) < 20:
        eng.step()
    seq = eng.requests[rid]
    cold = seq.kv.extra["cold"]
    for layer in range(eng.pool.num_layers):
        kept = seq.kv.positions[layer][seq.kv.positions[layer] >= 0]
        assert len(kept) <= 40
        held = sorted(kept.tolist() + cold.layers[layer].positions.tolist())
        assert held == list(range(seq.num_computed_tokens))
    assert cold.nbytes > 0 and seq.kv.device_bytes() == len(seq.block_table) * eng.pool.bytes_per_block + cold.nbytes
    while rid in eng.requests:
        eng.step()
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0
    coded = make_engine(tiny).generate([prompt], params, policy="h2o-40-cold_bits_8")[0].output_token_ids
    assert dropped != full and coded == full


def test_cold_bits_is_rejected_where_a_policy_has_its_own_tiers() -> None:
    for spec in ("quant-bits_4-cold_bits_4", "sentencekv-0.25-cold_bits_8", "h2o-0.25-cold_bits_3"):
        with pytest.raises(ValueError, match="cold_bits"):
            make_policy(spec)
