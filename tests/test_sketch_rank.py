"""SentenceKV's low-rank key sketch (``sketch_rank``, Loki; issue 22 build point 4): scores on
the principal-component codes track the exact ``q . k``, the basis is fitted once and shared by
forks, its bytes are counted, and the option is validated and runs in the engine."""

from __future__ import annotations

import pytest
import torch

from cache_node.policies import PolicyEnv
from cache_node.policies.registry import parse_spec
from cache_node.policies.sentencekv import KeySketch, SentenceKV
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def low_rank_keys(g: torch.Generator, layers: int, n: int, h_kv: int, d: int, rank: int) -> torch.Tensor:
    """(layers, n, h_kv, d) keys = offset + coefficients in a random rank-``rank`` subspace + 1% noise."""
    basis = torch.linalg.qr(torch.randn(layers, h_kv, d, d, generator=g))[0][..., :rank]
    coef = torch.randn(layers, h_kv, n, rank, generator=g) * torch.linspace(4, 1, rank)
    offset = torch.randn(layers, h_kv, 1, d, generator=g) * 3
    keys = offset + coef @ basis.transpose(-1, -2) + 0.01 * torch.randn(layers, h_kv, n, d, generator=g)
    return keys.permute(0, 2, 1, 3)


def exact_logits(keys: torch.Tensor, q: torch.Tensor, layer: int, scaling: float) -> torch.Tensor:
    """(n, H_kv, g, N) exact ``scaling * q . k``."""
    n, h, d = q.shape
    h_kv = keys.shape[2]
    return torch.einsum("nhgd,thd->nhgt", q.view(n, h_kv, h // h_kv, d), keys[layer]) * scaling


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_rank_sketch_tracks_exact_logits_on_low_rank_keys(bits: int) -> None:
    """Keys near a rank-8 subspace (plus a large mean): a rank-8 sketch's logits are as close to
    the exact ones as a full-channel sketch of the same bits at a quarter of the code bytes,
    and both keep the mean offset (the ``q . mean`` term)."""
    g = torch.Generator().manual_seed(0)
    layers, h_kv, d, rank = 2, 2, 32, 8
    keys = low_rank_keys(g, layers, 96, h_kv, d, rank)
    low, full = KeySketch(bits, 16, rank), KeySketch(bits, 16)
    for s in range(8):
        chunk = keys[:, s * 12:(s + 1) * 12]
        low.append(chunk, s)
        full.append(chunk, s)
    q = torch.randn(3, h_kv * 2, d, generator=g)
    for layer in range(layers):
        want = exact_logits(keys, q, layer, d**-0.5)
        err_low = (low.logits(layer, q, d**-0.5) - want).abs().mean()
        err_full = (full.logits(layer, q, d**-0.5) - want).abs().mean()
        assert err_low <= 1.5 * err_full + 0.02, (bits, err_low, err_full)
        assert err_low < want.std() * (0.3 if bits == 2 else 0.1)
    assert low.codes.shape[-1] * 4 == full.codes.shape[-1]


def test_basis_is_fitted_once_and_shared_by_forks() -> None:
    """The first ``append`` fits the basis; later sentences are projected on it, unchanged; a
    fork shares it (and its codes) and counts it in ``nbytes``."""
    g = torch.Generator().manual_seed(1)
    keys = low_rank_keys(g, 1, 40, 1, 16, 8)
    sketch = KeySketch(4, 8, 8)
    sketch.append(keys[:, :20], 0)
    basis = sketch.basis
    assert basis is not None and basis.shape == (1, 1, 16, 8)
    assert torch.allclose(basis.transpose(-1, -2) @ basis, torch.eye(8), atol=1e-5)  # orthonormal
    sketch.append(keys[:, 20:], 1)
    assert sketch.basis is basis
    twin = sketch.fork()
    assert twin.basis is basis and twin.mean is sketch.mean and twin.codes is sketch.codes
    codes = sketch.codes.numel() + 2 * 2 * sketch.scale.numel()
    assert sketch.nbytes == codes + 4 * (basis.numel() + sketch.mean.numel())


def test_rank_above_head_dim_keeps_every_direction_and_few_keys_still_fit() -> None:
    """Three keys of a 16-dim head: a full orthonormal basis is still taken; rank 32 > d is
    clamped to d, so the sketch is the full key in a rotated basis."""
    keys = torch.randn(1, 3, 1, 16, generator=torch.Generator().manual_seed(2))
    sketch = KeySketch(8, 16, 32)
    sketch.append(keys, 0)
    assert sketch.rank == 16 and sketch.basis.shape == (1, 1, 16, 16)
    q = torch.randn(1, 1, 16)
    assert torch.allclose(sketch.logits(0, q, 0.25), exact_logits(keys, q, 0, 0.25), atol=0.05)


def test_spec_validates_sketch_rank() -> None:
    cls, kw = parse_spec("sentencekv-0.125-sketch_rank_32-region_bits_4")
    assert cls(**kw).sketch_rank == 32
    assert SentenceKV(budget=0.25, sketch_rank=8, sketch_group=16).sketch_rank == 8  # below the group
    for bad in (-8, 12, 24):  # negative, not a multiple of 8, not a multiple of the group (16)
        with pytest.raises(ValueError, match="sketch_rank"):
            SentenceKV(budget=0.25, sketch_rank=bad)


def test_engine_runs_with_a_rank_sketch(tiny) -> None:
    """A real engine step under ``sketch_rank``: the run finishes, recalls by the rank sketch,
    and the recall bound (Quest key bounds alone under a rank sketch) stays in (0, 1]."""
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    out = eng.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True),
                       policy="sentencekv-96-sketch_rank_8-bound_tier_host")[0]
    assert len(out.output_token_ids) == 6
    assert out.policy_stats["recall_bound_steps"] >= 5 and 0 < out.policy_stats["recall_bound_max"] <= 1
    eng.check_integrity()


def test_basis_spans_the_top_singular_directions_and_scales_to_long_demotions() -> None:
    """The fitted basis spans the centred keys' top right singular vectors (the projector
    matches a thin SVD's), and a 20k-token demotion fits without an (n, n) factor (a full SVD
    would allocate 1.6 GB for it; the original fit did, and ran an 8k context out of memory)."""
    g = torch.Generator().manual_seed(4)
    keys = low_rank_keys(g, 2, 300, 2, 32, 8)
    sketch = KeySketch(4, 8, 8)
    sketch.fit(keys)
    k = keys.permute(0, 2, 1, 3)
    _, _, vh = torch.linalg.svd(k - k.mean(2, keepdim=True), full_matrices=False)
    want = vh[..., :8, :].transpose(-1, -2)
    torch.testing.assert_close(sketch.basis @ sketch.basis.transpose(-1, -2), want @ want.transpose(-1, -2),
                               atol=1e-4, rtol=0)
    big = KeySketch(2, 16, 16)
    big.fit(torch.randn(1, 20000, 1, 64, generator=g))
    assert big.basis.shape == (1, 1, 64, 16)


@pytest.mark.parametrize("rank,bits,group", [(0, 2, 16), (32, 4, 16), (32, 4, 32)])
def test_a_long_chunk_scores_the_dequantized_codes_as_the_codes(monkeypatch, rank: int, bits: int, group: int) -> None:
    """A prompt's span or chunk of >= quant.SPAN_DEQUANT_MIN_ROWS query rows scores a
    dequantized copy of the codes in one bmm; it must give the scores the computation on the
    codes gives (float rounding apart), with and without a rank."""
    import cache_node.policies.sentencekv.sketch as sketch_mod

    gen = torch.Generator().manual_seed(rank + bits)
    layers, n, h_kv, d = 2, 300, 3, 64
    sketch = KeySketch(bits, group, rank=rank, whiten=bool(rank))
    keys = torch.randn(layers, n, h_kv, d, generator=gen)
    sketch.append(keys[:, :170], 0)
    sketch.append(keys[:, 170:], 1)
    q = torch.randn(200, 3 * h_kv, d, generator=gen)  # 600 query rows per KV head
    fast = sketch.head_logits(1, q, 0.125).clone()
    monkeypatch.setattr(sketch_mod, "SPAN_DEQUANT_MIN_ROWS", 1 << 30)
    sketch._last = None
    on_codes = sketch.head_logits(1, q, 0.125)
    torch.testing.assert_close(fast, on_codes, atol=1e-3, rtol=1e-4)
    mass = sketch.log_mass(1, q, 0.125, 2)
    assert mass.shape == (200, h_kv, 3, 2) and torch.isfinite(mass).all()
