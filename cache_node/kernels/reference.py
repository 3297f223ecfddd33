"""Paged attention in plain torch: the reference the Triton kernel is tested against.

Same signature and contract as ``cache_node.kernels.paged_attention.paged_attention``. It pads
every sequence's queries and context to the longest, gathers the context's K/V through the
block table, and runs one masked softmax in fp32 over the padded batch: exact, simple to
read, and O(num_seqs * num_heads * max_q_len * max_seq_len) in memory, so it is for tests and
timing baselines, not serving. Unlike the kernel it synchronizes with the host (it reads the
longest lengths) and so checks the lengths' values too. Idea: PagedAttention (Kwon et al.,
SOSP'23, §4.1): a sequence's KV lives in fixed-size blocks found through its block table.
"""

from __future__ import annotations

import torch


def check_paged_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
) -> None:
    """Check shapes, dtypes and devices (no host sync; values are not read).

    Raises:
        ValueError: naming the argument that breaks the contract of ``paged_attention``.
    """
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(
            "q must be (num_tokens, num_heads, head_dim) and k_cache/v_cache "
            f"(num_slots, num_kv_heads, head_dim); got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "differ")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_cache head_dim {k_cache.shape[2]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype must be float32, float16 or bfloat16; got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    for name, t, dims in (("block_tables", block_tables, 2),
                          ("query_start_loc", query_start_loc, 1), ("seq_lens", seq_lens, 1)):
        if t.dtype != torch.int32 or t.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-d int32 tensor; got {t.dim()}-d {t.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"seq_lens has {num_seqs} sequences but block_tables has {block_tables.shape[0]} rows "
            f"and query_start_loc {query_start_loc.shape[0]} entries (want num_seqs + 1)"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive; got {block_size}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")


def _check_lengths(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, capacity: int,
                   num_tokens: int) -> torch.Tensor:
    """Validate the length values (host sync); returns q_lens: (num_seqs,) int64."""
    q_lens = query_start_loc.diff().long()
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to num_tokens={num_tokens}")
    if bool((q_lens < 1).any()):
        raise ValueError("every sequence needs at least one query token (query_start_loc "
                         "must be strictly increasing)")
    if bool((q_lens > seq_lens.long()).any()):
        raise ValueError("seq_lens must include the new tokens (seq_lens >= q_len per sequence)")
    if bool((seq_lens > capacity).any()):
        raise ValueError(f"a seq_len exceeds the block table's capacity {capacity} tokens")
    return q_lens


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """Causal varlen attention over a paged KV cache, in fp32 torch ops.

    Args:
        q: (num_tokens, num_heads, head_dim) new tokens' queries, sequences concatenated.
        k_cache, v_cache: (num_slots, num_kv_heads, head_dim); slot = block_id * block_size +
            offset; the new tokens' K/V are already written.
        block_tables: (num_seqs, max_blocks) int32; entries past a sequence's length unread.
        query_start_loc: (num_seqs + 1,) int32 offsets of each sequence's queries in ``q``.
        seq_lens: (num_seqs,) int32 context length per sequence, new tokens included.
        scale: softmax scale (usually head_dim ** -0.5).
        block_size: tokens per block.

    Returns:
        (num_tokens, num_heads, head_dim) in q's dtype. Query i of sequence s sits at position
        ``seq_lens[s] - q_len_s + i`` and attends to positions <= its own; query head h reads
        KV head ``h // (num_heads // num_kv_heads)``.

    Raises:
        ValueError: malformed shapes/dtypes, or lengths that break the contract.
    """
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 block_size)
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    q_lens = _check_lengths(query_start_loc, seq_lens, block_tables.shape[1] * block_size,
                            num_tokens)
    lens = seq_lens.long()
    dev = q.device
    max_q, max_len = int(q_lens.max()), int(lens.max())

    positions = torch.arange(max_len, device=dev)
    in_context = positions[None, :] < lens[:, None]  # (num_seqs, max_len)
    table = block_tables.long()[:, positions // block_size]
    slots = torch.where(in_context, table * block_size + positions % block_size, 0)
    keep = in_context[:, :, None, None]
    keys = torch.where(keep, k_cache[slots].float(), 0.0).repeat_interleave(group, dim=2)
    values = torch.where(keep, v_cache[slots].float(), 0.0).repeat_interleave(group, dim=2)

    q_idx = torch.arange(max_q, device=dev)
    q_valid = q_idx[None, :] < q_lens[:, None]  # (num_seqs, max_q)
    token = torch.where(q_valid, query_start_loc[:-1, None].long() + q_idx, 0)
    queries = torch.where(q_valid[:, :, None, None], q[token].float(), 0.0)
    q_pos = (lens - q_lens)[:, None] + q_idx  # (num_seqs, max_q)

    scores = torch.einsum("sqhd,slhd->shql", queries, keys) * scale
    allowed = (positions[None, None, :] <= q_pos[:, :, None]) & in_context[:, None, :]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    scores = scores.masked_fill(~q_valid[:, None, :, None], 0.0)  # padding rows: no NaN
    out = torch.einsum("shql,slhd->sqhd", scores.softmax(dim=-1), values)
    return out[q_valid].to(q.dtype)
