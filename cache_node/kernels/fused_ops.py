"""Fused element-wise Triton kernels for the decoder's non-GEMM work, with torch references.

Per Llama decoder layer, transformers' eager code launches ~7 small kernels for each RMSNorm,
two for the SiLU gate and ~10 for rotary embeddings of q and k; on an H200 those launches, not
the GEMMs, bound a short prefill step. Each op here is one launch:

- ``rms_norm``: RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS
  2019), with the casts of transformers' ``LlamaRMSNorm``.
- ``silu_and_mul``: the SiLU-gated linear unit of SwiGLU (Shazeer, "GLU Variants Improve
  Transformer", 2020), ``silu(gate) * up``; ``fused_mlp`` runs a whole gated MLP as one GEMM
  over concatenated gate/up weights, this kernel and the down projection.
- ``rotary_embedding``: rotary position embedding (Su et al., "RoFormer", 2021) of q and k in
  one launch, in the rotate-half layout of transformers' Llama.

The fusion follows vLLM's custom ops (``rms_norm``, ``silu_and_mul``, ``rotary_embedding``);
the kernels are written here from the math above. Each kernel rounds where transformers'
eager code rounds (to the input dtype) and computes in fp32 between, so in fp32 results equal
the references up to operation order and in bf16/fp16 within about one rounding step.

On CPU tensors the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which the tests use; otherwise they need CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

from cache_node.kernels.paged_attention import INTERPRETED

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_RMS_NORM_DIM = 65536  # one program holds a whole row in registers
SILU_BLOCK = 1024  # columns per silu_and_mul program


# ---- torch references ----------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``: fp32 ``x * rsqrt(mean(x^2) + eps)``, cast back
    to ``x``'s dtype, times ``weight`` (result dtype: torch's promotion of the two)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in the inputs' dtype, as transformers' ``LlamaMLP`` computes it."""
    return F.silu(gate) * up


def mlp_reference(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                  down_weight: torch.Tensor) -> torch.Tensor:
    """transformers' ``LlamaMLP.forward`` (no biases): ``down(silu(gate(x)) * up(x))``."""
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_embedding_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama ``apply_rotary_pos_emb`` on (tokens, heads, head_dim) q and k with
    (tokens, head_dim) cos/sin: ``x * cos + rotate_half(x) * sin``. Returns new tensors."""
    c, s = cos[:, None, :], sin[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


# ---- kernels -------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, out_row_stride, n_cols, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    y = (x * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)  # LlamaRMSNorm's cast
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * y.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_row_stride, up_row_stride,
                         out_row_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # F.silu's result, rounded
    tl.store(out_ptr + row * out_row_stride + cols, (act * u).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, src_head_stride, dst_head_stride, cos_lo, cos_hi, sin_lo,
                  sin_hi, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (d < HALF)
    src = src_ptr + heads * src_head_stride + d
    lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = dst_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product and the sum rounded as in eager torch
    out_lo = (lo * cos_lo).to(dtype).to(tl.float32) + (-hi * sin_lo).to(dtype).to(tl.float32)
    out_hi = (hi * cos_hi).to(dtype).to(tl.float32) + (lo * sin_hi).to(dtype).to(tl.float32)
    dst = dst_ptr + heads * dst_head_stride + d
    tl.store(dst, out_lo.to(dtype), mask=mask)
    tl.store(dst + HALF, out_hi.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, q_tok_stride,
                   q_head_stride, k_tok_stride, k_head_stride, qo_tok_stride, qo_head_stride,
                   ko_tok_stride, ko_head_stride, cos_tok_stride, sin_tok_stride,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    dmask = d < HALF
    cos_row, sin_row = cos_ptr + t * cos_tok_stride, sin_ptr + t * sin_tok_stride
    cos_lo = tl.load(cos_row + d, mask=dmask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row + d, mask=dmask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * q_tok_stride, q_out_ptr + t * qo_tok_stride, q_head_stride,
                  qo_head_stride, cos_lo, cos_hi, sin_lo, sin_hi, NUM_Q_HEADS, HALF, Q_HEADS_PAD,
                  HALF_PAD)
    _rotate_heads(k_ptr + t * k_tok_stride, k_out_ptr + t * ko_tok_stride, k_head_stride,
                  ko_head_stride, cos_lo, cos_hi, sin_lo, sin_hi, NUM_K_HEADS, HALF, K_HEADS_PAD,
                  HALF_PAD)


# ---- launchers -----------------------------------------------------------------------------


def _check_runnable(name: str, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"{name}: tensors on different devices: {[str(t.device) for t in tensors]}")
    if device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"{name} runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1 set "
                         f"before triton is imported); got {device}")
    for t in tensors:
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() == 0 or (t.numel() and t.stride(-1) != 1):
            raise ValueError(f"{name}: every tensor needs a contiguous last dimension")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim), a view where the leading dims allow one."""
    return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in one launch (Zhang & Sennrich 2019; fused as vLLM's).

    Args:
        x: (..., hidden) float32/float16/bfloat16, last dim contiguous (other strides free).
        weight: (hidden,) float32/float16/bfloat16 on x's device.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        A new contiguous tensor of x's shape and of dtype ``torch.promote_types(x.dtype,
        weight.dtype)`` (transformers' ``LlamaRMSNorm``): ``weight * (x_f32 * rsqrt(mean(x_f32^2)
        + eps)).to(x.dtype)``, the sum of squares accumulated in fp32.

    Raises:
        ValueError: weight not (hidden,), hidden > ``MAX_RMS_NORM_DIM``, another dtype, tensors on
            different devices, a non-contiguous last dim, or CPU tensors without the interpreter.
    """
    _check_runnable("rms_norm", x, weight)
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight must be ({hidden},), got {tuple(weight.shape)}")
    if hidden > MAX_RMS_NORM_DIM:
        raise ValueError(f"rms_norm: hidden size {hidden} > {MAX_RMS_NORM_DIM}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    x2, out2 = _rows(x), out.view(-1, hidden)
    if x2.shape[0] == 0 or hidden == 0:
        return out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out2, x2.stride(0), out2.stride(0), hidden,
                                     float(eps), BLOCK=block,
                                     num_warps=min(16, max(1, block // 512)))
    return out


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one launch (SwiGLU's gate, Shazeer 2020; vLLM's silu_and_mul).

    Args:
        gate, up: (..., intermediate), the same shape and dtype (float32/float16/bfloat16),
            last dim contiguous; e.g. the two halves ``gu[..., :n]``, ``gu[..., n:]`` of one GEMM.

    Returns:
        A new contiguous tensor of gate's shape and dtype; computed in fp32, SiLU's result
        rounded to the dtype before the product, as eager ``F.silu(gate) * up``.

    Raises:
        ValueError: shapes or dtypes differ, another dtype, devices differ, a non-contiguous
            last dim, or CPU tensors without the interpreter.
    """
    _check_runnable("silu_and_mul", gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} differ")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g2, u2 = _rows(gate), _rows(up)
    n = gate.shape[-1]
    if g2.shape[0] == 0 or n == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](
        g2, u2, out.view(-1, n), g2.stride(0), u2.stride(0), n, n, BLOCK=block,
        num_warps=4 if block >= 512 else 1)
    return out


def fused_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor,
              gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A SiLU-gated MLP (SwiGLU, Shazeer 2020) as one gate/up GEMM, ``silu_and_mul``, down GEMM.

    Args:
        x: (..., hidden).
        gate_up_weight: (2 * intermediate, hidden): gate's rows, then up's
            (``torch.cat([gate_proj.weight, up_proj.weight])``); ``gate_up_bias``: (2 *
            intermediate,) or None.
        down_weight: (hidden, intermediate); ``down_bias``: (hidden,) or None.

    Returns:
        (..., hidden) in x's dtype: ``down(silu(gate(x)) * up(x))``.

    Raises:
        ValueError: gate_up_weight's rows are odd, or as ``silu_and_mul``.
    """
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"fused_mlp: gate_up_weight needs an even row count, got "
                         f"{tuple(gate_up_weight.shape)}")
    n = gate_up_weight.shape[0] // 2
    gate_up = F.linear(x, gate_up_weight, gate_up_bias)
    return F.linear(silu_and_mul(gate_up[..., :n], gate_up[..., n:]), down_weight, down_bias)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     *, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k in one launch (Su et al. 2021; as vLLM's op), in
    transformers' Llama convention: ``x * cos + rotate_half(x) * sin`` over the whole head dim,
    ``rotate_half(x) = cat(-x[d/2:], x[:d/2])``.

    Args:
        q: (tokens, num_heads, head_dim); k: (tokens, num_kv_heads, head_dim); head_dim even;
            last dim contiguous, token and head strides free (e.g. views of a fused QKV GEMM).
        cos, sin: (tokens, head_dim) per token, as transformers' ``LlamaRotaryEmbedding``
            returns them for the tokens' positions (a leading batch dim of 1 is flattened).
        q, k, cos and sin share one dtype (float32/float16/bfloat16).
        inplace: write the results into q and k; else into new contiguous tensors.

    Returns:
        (q_rotated, k_rotated), q's and k's shapes and dtype; each product and the sum rounded
        to the dtype as eager ``apply_rotary_pos_emb`` does, fp32 in between.

    Raises:
        ValueError: mismatched token counts, head dims or dtypes, an odd head_dim, cos/sin not
            (tokens, head_dim), devices differ, a non-contiguous last dim, or CPU tensors
            without the interpreter.
    """
    _check_runnable("rotary_embedding", q, k, cos, sin)
    cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"rotary_embedding: q and k must be (tokens, heads, head_dim), got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    tokens, head_dim = q.shape[0], q.shape[2]
    if k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)} and k {tuple(k.shape)} need equal "
                         "token counts and an equal, even head_dim")
    if cos.shape != (tokens, head_dim) or sin.shape != (tokens, head_dim):
        raise ValueError(f"rotary_embedding: cos/sin must be ({tokens}, {head_dim}), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        raise ValueError(f"rotary_embedding: q, k, cos and sin dtypes differ: "
                         f"{[t.dtype for t in (q, k, cos, sin)]}")
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
        sin.stride(0), NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], HALF=half,
        Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF_PAD=triton.next_power_of_2(half),
        num_warps=4)
    return q_out, k_out
