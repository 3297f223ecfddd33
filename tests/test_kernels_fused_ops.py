"""Fused Triton element-wise kernels (RMSNorm, SiLU-and-mul, rotary embedding) == their torch
references and transformers' own Llama code.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
by tests/conftest.py before triton is imported); with CUDA the same tests run compiled, and the
``gpu``-marked tests at the end check the kernels on the device at serving shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

import cache_node.kernels.fused_ops as fo

if not CUDA and not fo.INTERPRETED:
    pytest.fail("triton was imported before TRITON_INTERPRET was set", pytrace=False)

# fp32: the same math up to operation order; 16-bit: about one rounding step of the output.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
       torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def _cos_sin(tokens: int, head_dim: int, dtype: torch.dtype, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..tokens-1 (shuffled) from transformers' LlamaRotaryEmbedding."""
    config = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim, **overrides)
    rope = llama.LlamaRotaryEmbedding(config)
    positions = torch.randperm(max(tokens, 1))[:tokens].unsqueeze(0) * 37
    x = torch.empty(1, dtype=dtype)
    cos, sin = rope(x, positions)
    return cos[0].to(DEVICE), sin[0].to(DEVICE)


# ---- RMSNorm -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 5, 576), (3, 4096), (0, 32)])
def test_rms_norm_matches_reference_and_llama_rmsnorm(shape, dtype) -> None:
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    norm = llama.LlamaRMSNorm(shape[-1], eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
        out = fo.rms_norm(x, norm.weight, 1e-5)
        _close(out, fo.rms_norm_reference(x, norm.weight, 1e-5), dtype)
        _close(out, norm(x), dtype)


@SETTINGS
@given(rows=st.integers(1, 9), hidden=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       fp32_weight=st.booleans(), row_pad=st.integers(0, 5))
def test_rms_norm_any_shape_strided_rows(rows, hidden, dtype, fp32_weight, row_pad) -> None:
    """Odd sizes, rows with a gap between them, an fp32 weight on 16-bit x (fp32 output)."""
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden + row_pad, generator=g) * 2).to(dtype).to(DEVICE)[:, :hidden]
    w = torch.randn(hidden, generator=g).to(torch.float32 if fp32_weight else dtype).to(DEVICE)
    _close(fo.rms_norm(x, w, 1e-6), fo.rms_norm_reference(x, w, 1e-6), dtype)


def test_rms_norm_refuses_bad_inputs() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        fo.rms_norm(x, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="contiguous last"):
        fo.rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="dtype"):
        fo.rms_norm(x.double(), torch.ones(8, device=DEVICE, dtype=torch.float64), 1e-5)


# ---- SiLU and mul, fused MLP ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (5, 1536), (3, 2, 1100), (33, 7), (0, 16)])
def test_silu_and_mul_matches_reference(shape, dtype) -> None:
    torch.manual_seed(shape[-1])
    gate, up = (torch.randn(shape, dtype=dtype, device=DEVICE) * 4 for _ in range(2))
    _close(fo.silu_and_mul(gate, up), fo.silu_and_mul_reference(gate, up), dtype)


@SETTINGS
@given(rows=st.integers(1, 11), n=st.integers(1, 2100), dtype=st.sampled_from(DTYPES))
def test_silu_and_mul_on_halves_of_one_gemm(rows, n, dtype) -> None:
    """gate and up as the two halves of one (rows, 2n) tensor: strided rows, odd widths, more
    than one column block."""
    g = torch.Generator().manual_seed(rows * 10000 + n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up[:, :n], gate_up[:, n:]
    _close(fo.silu_and_mul(gate, up), fo.silu_and_mul_reference(gate, up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_matches_llama_mlp(dtype) -> None:
    config = LlamaConfig(hidden_size=72, intermediate_size=200, num_attention_heads=4, hidden_act="silu")
    torch.manual_seed(1)
    mlp = llama.LlamaMLP(config).to(device=DEVICE, dtype=dtype)
    x = torch.randn(1, 9, 72, dtype=dtype, device=DEVICE)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        out = fo.fused_mlp(x, gate_up, mlp.down_proj.weight)
        ref = fo.mlp_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        _close(out, ref, dtype)
        _close(out, mlp(x), dtype)


def test_silu_and_mul_refuses_mismatched_halves() -> None:
    with pytest.raises(ValueError, match="differ"):
        fo.silu_and_mul(torch.randn(2, 4, device=DEVICE), torch.randn(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="even row count"):
        fo.fused_mlp(torch.randn(2, 4, device=DEVICE), torch.randn(5, 4, device=DEVICE),
                     torch.randn(4, 2, device=DEVICE))


# ---- rotary embedding ----------------------------------------------------------------------


def _hf_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' apply_rotary_pos_emb in the layout LlamaAttention calls it with."""
    qh, kh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
    qo, ko = llama.apply_rotary_pos_emb(qh, kh, cos.unsqueeze(0), sin.unsqueeze(0))
    return qo[0].transpose(0, 1), ko[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [
    (1, 4, 2, 16), (13, 9, 3, 64), (7, 32, 8, 128), (5, 3, 3, 24), (2, 1, 1, 6), (0, 4, 2, 16)])
def test_rotary_matches_reference_and_transformers(tokens, heads, kv_heads, head_dim, dtype) -> None:
    torch.manual_seed(tokens + heads + head_dim)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    cos, sin = _cos_sin(tokens, head_dim, dtype)
    out = fo.rotary_embedding(q, k, cos, sin)
    for o, r, h in zip(out, fo.rotary_embedding_reference(q, k, cos, sin), _hf_rope(q, k, cos, sin)):
        assert o.is_contiguous()
        _close(o, r, dtype)
        _close(o, h, dtype)


@SETTINGS
@given(tokens=st.integers(1, 19), kv_heads=st.integers(1, 4), group=st.integers(1, 3),
       half=st.integers(1, 40), dtype=st.sampled_from(DTYPES), inplace=st.booleans())
def test_rotary_on_views_of_a_fused_qkv(tokens, kv_heads, group, half, dtype, inplace) -> None:
    """q and k as strided views of one QKV GEMM output (as the patched attention passes them),
    llama3-scaled frequencies, in place or not; v's columns are never written."""
    head_dim, heads = 2 * half, kv_heads * group
    g = torch.Generator().manual_seed(tokens * 100 + half)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    before = qkv.clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos, sin = _cos_sin(tokens, head_dim, dtype, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    ref_q, ref_k = fo.rotary_embedding_reference(q, k, cos, sin)
    out_q, out_k = fo.rotary_embedding(q, k, cos, sin, inplace=inplace)
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)
    assert (out_q.data_ptr() == q.data_ptr()) == inplace
    v_cols = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_cols], before[:, v_cols])
    if not inplace:
        assert torch.equal(qkv, before)


def test_rotary_refuses_bad_inputs() -> None:
    q, k = torch.randn(3, 4, 16, device=DEVICE), torch.randn(3, 2, 16, device=DEVICE)
    cos, sin = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin must be"):
        fo.rotary_embedding(q, k, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="even head_dim"):
        fo.rotary_embedding(q[..., :15], k[..., :15], cos[:, :15], sin[:, :15])
    with pytest.raises(ValueError, match="dtypes differ"):
        fo.rotary_embedding(q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="token counts"):
        fo.rotary_embedding(q, k[:2], cos, sin)


# ---- on the GPU, serving shapes ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 32, 50, 512])
def test_kernels_on_cuda_at_llama_8b_shapes(tokens, dtype) -> None:
    """Llama-3.1-8B's hidden 4096, intermediate 14336, 32/8 heads of 128, llama3 RoPE."""
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 4096, dtype=dtype, device="cuda")
    w = torch.randn(4096, dtype=dtype, device="cuda")
    _close(fo.rms_norm(x, w, 1e-5), fo.rms_norm_reference(x, w, 1e-5), dtype)
    gate_up = torch.randn(tokens, 2 * 14336, dtype=dtype, device="cuda") * 4
    gate, up = gate_up[:, :14336], gate_up[:, 14336:]
    _close(fo.silu_and_mul(gate, up), fo.silu_and_mul_reference(gate, up), dtype)
    qkv = torch.randn(tokens, 48 * 128, dtype=dtype, device="cuda")
    q, k = qkv[:, : 32 * 128].view(tokens, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)
    cos, sin = _cos_sin(tokens, 128, dtype, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    for o, r in zip(fo.rotary_embedding(q, k, cos, sin), _hf_rope(q, k, cos, sin)):
        _close(o, r, dtype)
    torch.cuda.synchronize()
