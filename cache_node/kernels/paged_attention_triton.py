"""The Triton programs behind ``cache_node.kernels.paged_attention`` (which launches them).

``_unified_attention_kernel``: grid (query tiles, KV heads, KV splits), prefill chunks and
decodes alike; with more than one split each program attends one range of its tile's context
and ``_merge_splits_kernel`` merges the ranges (Flash-Decoding, generalized to query tiles).
All accumulate in fp32 with the online softmax of FlashAttention-2 (Dao 2023, §3.1) in base 2
(``qk_scale`` = softmax scale * log2(e)). Block tables map a context position p to slot
``block_tables[seq, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE`` (PagedAttention, Kwon et
al., SOSP'23); slots are 64-bit so pools over 2^31 elements index correctly.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]


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
                         DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One KV tile of FlashAttention-2's forward pass (Dao 2023, Algorithm 1, lines 8-10).

    ``acc``: (M, HEAD_DIM_PAD) fp32 unnormalized output; ``m_i``/``l_i``: (M,) running max and
    sum in log2 units; ``allowed``: (M, BLOCK_N). Rows with nothing allowed yet keep m = -inf.
    ``UPCAST_DOT``: multiply in fp32 (Triton 3.6's interpreter multiplies bf16 as raw bits).
    """
    if UPCAST_DOT:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
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
def _attend_range(q, q_pos, row_valid, kv_start, kv_end, k_ptr, v_ptr, table_row_ptr, kv_head,
                  stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, dims, dim_valid,
                  qk_scale, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  UPCAST_DOT: tl.constexpr):
    """Attend ``q`` (ROWS, HEAD_DIM_PAD) at positions ``q_pos`` (ROWS,) to context positions
    [kv_start, kv_end), causally; returns FlashAttention-2's unnormalized (acc, m_i, l_i)."""
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        kv_valid = positions < kv_end
        k, v = _load_kv_tile(k_ptr, v_ptr, table_row_ptr, positions, kv_valid, kv_head,
                             stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                             dims, dim_valid, BLOCK_SIZE)
        allowed = (row_valid[:, None] & kv_valid[None, :]
                   & (positions[None, :] <= q_pos[:, None]))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, allowed, qk_scale,
                                             DOT_PRECISION, UPCAST_DOT)
    return acc, m_i, l_i


@triton.jit
def _unified_attention_kernel(
    out_ptr, partial_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr,
    seq_lens_ptr, qk_scale, num_seqs,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """Program (tile, kv_head, split): BLOCK_Q queries of one sequence x the GROUP heads of
    kv_head, over the split-th of NUM_SPLITS ranges of the tile's causal context.

    NUM_SPLITS == 1 writes ``out``; else (Flash-Decoding, generalized to query tiles) it writes
    ``partial``: (num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD) fp32, normalized, and
    ``lse``: (num_tokens, num_heads, NUM_SPLITS) fp32 log2-sum-exp, -inf where a row's range
    holds nothing it may attend to, for ``_merge_splits_kernel``.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
        tile_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
        # ranges of whole KV tiles; one range (NUM_SPLITS == 1) covers [0, tile_end)
        split_len = tl.cdiv(tl.cdiv(tile_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_start = split * split_len
        kv_end = tl.minimum(tile_end, kv_start + split_len)
        table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
        acc, m_i, l_i = _attend_range(
            q, context_len + q_idx, row_valid, kv_start, kv_end, k_ptr, v_ptr, table_row_ptr,
            kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, dims,
            dim_valid, qk_scale, BLOCK_Q * GROUP_PAD, BLOCK_N, BLOCK_SIZE, HEAD_DIM_PAD,
            DOT_PRECISION, UPCAST_DOT)
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head
                     + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
        else:
            lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            # (token, head, split) = the tile's first token's rows (64-bit, scalar) + this row's
            # offset within the tile (32-bit: < BLOCK_Q * num_heads * NUM_SPLITS)
            num_heads = tl.num_programs(1) * GROUP
            first = (q_start + q_tile * BLOCK_Q).to(tl.int64) * num_heads * NUM_SPLITS
            row = ((rows // GROUP_PAD) * num_heads + head) * NUM_SPLITS + split
            tl.store(lse_ptr + first + row, lse, mask=row_valid)
            tl.store(partial_ptr + first * HEAD_DIM_PAD + row[:, None] * HEAD_DIM_PAD
                     + dims[None, :], out, mask=row_valid[:, None])


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
