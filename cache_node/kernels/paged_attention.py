"""Triton paged attention: prefill chunks and decodes of many sequences in one launch.

``paged_attention`` reads one layer of the KV pool in place through the block tables.

- **Unified varlen kernel** (any mix of prefill chunks and decodes): the grid is (query tiles,
  KV heads). A program takes ``BLOCK_Q`` consecutive queries of one sequence and, as rows of
  its tiles, every query head that shares the KV head (``BLOCK_Q * group`` rows), so K/V read
  once serve the whole GQA group. It walks the context in tiles of ``BLOCK_N`` positions,
  mapping position -> block table entry -> slot, with the online softmax of FlashAttention-2
  (Dao 2023, §3.1, Algorithm 1) in fp32 and exp2. The grid is sized from shapes alone,
  ``num_tokens // BLOCK_Q + num_seqs`` (an upper bound on the tiles), and a program finds its
  sequence by binary search over ``query_start_loc``, the scheme of vLLM's Triton unified
  attention; no host sync, so a decode step can be captured in a CUDA graph.
- **Split-KV decode** (every sequence has one query, long contexts, few sequences): each
  (sequence, KV head) context is cut into ``num_kv_splits`` ranges attended in parallel, each
  writing its normalized partial output and log-sum-exp; a second kernel merges them
  (Flash-Decoding, Dao, Haziza, Massa and Sizov, 2023), as SGLang's ``decode_attention.py``.

Paging follows PagedAttention (Kwon et al., SOSP'23). On CPU tensors the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which the tests use.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from cache_node.kernels.reference import check_paged_attention_inputs

LOG2_E = 1.4426950408889634
SPLIT_MIN_CONTEXT = 1024  # tokens of block-table capacity before split-KV decode pays off
SPLIT_MIN_TOKENS = 256  # fewest context tokens per split
MAX_KV_SPLITS = 16


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence s whose first tile ``query_start_loc[s] // BLOCK_Q + s`` is <= tile."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, table_row_ptr, positions, valid, kv_head, stride_k_slot,
                  stride_k_head, stride_v_slot, stride_v_head, dims, dim_valid,
                  BLOCK_SIZE: tl.constexpr):
    """K and V for context ``positions`` (BLOCK_N,): each (BLOCK_N, HEAD_DIM_PAD); 0 if invalid."""
    block_ids = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=valid, other=0)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
    mask = valid[:, None] & dim_valid[None, :]
    k = tl.load(k_ptr + slots[:, None] * stride_k_slot + kv_head * stride_k_head + dims[None, :],
                mask=mask, other=0.0)
    v = tl.load(v_ptr + slots[:, None] * stride_v_slot + kv_head * stride_v_head + dims[None, :],
                mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, allowed, qk_scale,
                         DOT_PRECISION: tl.constexpr):
    """One KV tile of FlashAttention-2's forward pass (Dao 2023, Algorithm 1, lines 8-10).

    ``acc``: (M, HEAD_DIM_PAD) fp32 unnormalized output; ``m_i``/``l_i``: (M,) running max and
    sum in log2 units; ``allowed``: (M, BLOCK_N). Rows with nothing allowed yet keep m = -inf.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale, num_seqs,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (tile, kv_head): BLOCK_Q queries of one sequence x the GROUP heads of kv_head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_valid = dims < HEAD_DIM
        token = (q_start + q_idx).to(tl.int64)
        io_mask = row_valid[:, None] & dim_valid[None, :]
        q = tl.load(q_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head
                    + dims[None, :], mask=io_mask, other=0.0)
        q_pos = context_len + q_idx
        kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
        table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
        for start in range(0, kv_end, BLOCK_N):
            positions = start + tl.arange(0, BLOCK_N)
            kv_valid = positions < kv_end
            k, v = _load_kv_tile(k_ptr, v_ptr, table_row_ptr, positions, kv_valid, kv_head,
                                 stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                                 dims, dim_valid, BLOCK_SIZE)
            allowed = (row_valid[:, None] & kv_valid[None, :]
                       & (positions[None, :] <= q_pos[:, None]))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, allowed, qk_scale,
                                                 DOT_PRECISION)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _split_kv_decode_kernel(
    partial_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, qk_scale,
    stride_q_token, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_table,
    GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, split): one query, GROUP heads, one range of the context.

    Writes ``partial``: (num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD) fp32, normalized, and
    ``lse``: (num_tokens, num_heads, NUM_SPLITS) fp32 log2-sum-exp, -inf for an empty range.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = split * split_len
    kv_end = tl.minimum(seq_len, kv_start + split_len)
    rows = tl.arange(0, GROUP_ROWS)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + token * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_ROWS], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(kv_start, kv_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        kv_valid = positions < kv_end
        k, v = _load_kv_tile(k_ptr, v_ptr, table_row_ptr, positions, kv_valid, kv_head,
                             stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                             dims, dim_valid, BLOCK_SIZE)
        allowed = row_valid[:, None] & kv_valid[None, :]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, allowed, qk_scale,
                                             DOT_PRECISION)
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    head_split = (token * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
    tl.store(lse_ptr + head_split, lse, mask=row_valid)
    tl.store(partial_ptr + head_split[:, None] * HEAD_DIM_PAD + dims[None, :], out,
             mask=row_valid[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, partial_ptr, lse_ptr, stride_o_token, stride_o_head,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Program (token, head): out = sum_s 2^(lse_s - max) * partial_s / sum_s 2^(lse_s - max)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, SPLITS_PAD)
    lse = tl.load(lse_ptr + base + splits, mask=splits < NUM_SPLITS, other=float("-inf"))
    present = lse > float("-inf")
    weights = tl.where(present, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    partial = tl.load(partial_ptr + (base + splits)[:, None] * HEAD_DIM_PAD + dims[None, :],
                      mask=present[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_scalar_index() -> None:
    """Let Triton's interpreter use a loaded scalar as a ``range`` bound under numpy >= 2.4.

    Triton 3.6's interpreter holds a scalar as a 1-element array and converts it with
    ``int(array)``, which numpy 2.4 rejects ("only 0-dimensional arrays can be converted");
    triton-lang/triton#9171, fixed upstream by squeezing. Applied only when interpreting.
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_scalars", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if _interpreting():
    _patch_interpreter_scalar_index()


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200's count, so the interpreter exercises the GPU's choices
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many context ranges a decode batch's (sequence, KV head) pairs are cut into.

    1 (no split) when the pairs already fill the GPU's SMs or the block tables hold fewer than
    ``SPLIT_MIN_CONTEXT`` tokens; else enough ranges to give every SM about two programs, each
    of at least ``SPLIT_MIN_TOKENS`` tokens of capacity, at most ``MAX_KV_SPLITS``. Uses shapes
    only (``max_context`` = block-table width * block_size), so it needs no host sync.
    """
    pairs = num_seqs * num_kv_heads
    if pairs >= num_sms or max_context < SPLIT_MIN_CONTEXT:
        return 1
    wanted = math.ceil(2 * num_sms / pairs)
    return max(1, min(MAX_KV_SPLITS, wanted, max_context // SPLIT_MIN_TOKENS))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs use exact fp32 products, not TF32, so fp32 runs match torch to ~1e-6.
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_unified(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, qk_scale: float,
                    block_size: int) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Mostly decodes (<= 4 queries per sequence on average): 16 rows waste less than 64.
    block_m = max(16, group_pad) if num_tokens <= 4 * num_seqs else max(64, group_pad)
    block_q = block_m // group_pad
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, qk_scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=64 if head_dim <= 64 else 32,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=4, num_stages=2,
    )


def _launch_split_kv_decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            qk_scale: float, block_size: int, num_splits: int) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[1]
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    partial = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                          device=q.device)
    lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _split_kv_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial, lse, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, qk_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_ROWS=max(16, triton.next_power_of_2(group)), NUM_SPLITS=num_splits,
        BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, DOT_PRECISION=_dot_precision(q.dtype), num_warps=4,
        num_stages=2,
    )
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, partial, lse, out.stride(0), out.stride(1), NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, num_warps=4,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over a paged KV cache, on the GPU (Triton).

    Args:
        q: (num_tokens, num_heads, head_dim) queries of num_seqs sequences, concatenated.
        k_cache, v_cache: (num_slots, num_kv_heads, head_dim), one layer of the pool (e.g.
            ``KVPool.kv[layer, 0]``); slot = block_id * block_size + offset; the new tokens'
            K/V are already written (``KVPool.write``). Last dim contiguous; other strides free.
        block_tables: (num_seqs, max_blocks) int32; entries past a sequence's length are
            never read.
        query_start_loc: (num_seqs + 1,) int32, strictly increasing from 0 to num_tokens
            (every sequence has >= 1 query).
        seq_lens: (num_seqs,) int32 context length per sequence, new tokens included.
        scale: softmax scale (usually head_dim ** -0.5).
        block_size: tokens per block.
        num_kv_splits: decode-only batches (num_tokens == num_seqs): context ranges per
            sequence for split-KV decode; None chooses by ``choose_num_kv_splits``, 1 uses the
            unified kernel. Ignored when any sequence has more than one query.

    Returns:
        (num_tokens, num_heads, head_dim), q's dtype. Query i of sequence s sits at position
        ``seq_lens[s] - q_len_s + i`` and attends to positions <= its own; query head h reads
        KV head ``h // (num_heads // num_kv_heads)``. Accumulates in fp32 (fp32/fp16/bf16 in).
        Never synchronizes with the host; the length values are trusted (see the reference,
        ``paged_attention_reference``, which checks them).

    Raises:
        ValueError: malformed shapes/dtypes/devices (``check_paged_attention_inputs``), a last
            dim that is not contiguous, num_kv_splits < 1, or CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 block_size)
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"paged_attention runs on CUDA tensors (or on CPU under "
                         f"TRITON_INTERPRET=1 set before triton is imported); got {q.device}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1; got {num_kv_splits}")
    block_tables, query_start_loc, seq_lens = (t.contiguous() for t in
                                               (block_tables, query_start_loc, seq_lens))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    qk_scale = float(scale) * LOG2_E
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    splits = 1
    if q.shape[0] == num_seqs:  # every sequence has exactly one query: a decode batch
        splits = num_kv_splits or choose_num_kv_splits(
            num_seqs, k_cache.shape[1], block_tables.shape[1] * block_size, _num_sms(q.device))
    if splits > 1:
        _launch_split_kv_decode(out, q, k_cache, v_cache, block_tables, query_start_loc,
                                seq_lens, qk_scale, block_size, splits)
    else:
        _launch_unified(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                        qk_scale, block_size)
    return out
