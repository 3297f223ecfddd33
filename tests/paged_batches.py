"""Paged-attention test batches: a KV cache, shuffled block tables and a dense SDPA oracle.

Shared by the kernel tests (``tests/test_kernels_paged_attention.py``). A batch is a list of
``(seq_len, q_len)`` pairs: q_len == 1 is a decode, q_len == seq_len a prefill from scratch,
anything between a prefill chunk after cached context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PagedBatch:
    """Arguments of ``paged_attention`` (see its docstring for shapes), plus the layout.

    Every slot of ``k_cache``/``v_cache`` outside the sequences' contexts holds NaN, and
    every padding entry of ``block_tables`` names a NaN-filled block, so a kernel that reads
    anything it must not (a padding entry, a slot past seq_len) returns NaN.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    block_size: int
    specs: list[tuple[int, int]]

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale, self.block_size)


def make_batch(specs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               device: str = "cpu", seed: int = 0) -> PagedBatch:
    """Random queries and context K/V for ``specs``, stored in shuffled (non-contiguous) blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks) + 2  # one spare, one poison block
    order = torch.randperm(num_blocks, generator=g)
    poison = int(order[-1])
    width = max(blocks) + 1  # at least one padding column per row
    table = torch.full((len(specs), width), poison, dtype=torch.int32)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    used = 0
    for s, (seq_len, _) in enumerate(specs):
        table[s, :blocks[s]] = order[used:used + blocks[s]].int()
        used += blocks[s]
        pos = torch.arange(seq_len)
        slots = table[s, pos // block_size].long() * block_size + pos % block_size
        k_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
        v_cache[slots] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    q_lens = torch.tensor([q_len for _, q_len in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    q = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=g)
    seq_lens = torch.tensor([seq_len for seq_len, _ in specs], dtype=torch.int32)
    return PagedBatch(
        q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
        table.to(device), query_start_loc.to(device), seq_lens.to(device), head_dim ** -0.5,
        block_size, specs,
    )


def dense_sdpa(batch: PagedBatch) -> torch.Tensor:
    """The oracle: per sequence, gather its context in order and run SDPA in fp32.

    Returns (num_tokens, num_heads, head_dim) fp32. Causality: query i of a sequence with
    q_len new tokens sits at position seq_len - q_len + i and sees positions <= its own.
    """
    outs = []
    for s, (seq_len, q_len) in enumerate(batch.specs):
        pos = torch.arange(seq_len, device=batch.q.device)
        slots = batch.block_tables[s, pos // batch.block_size].long() * batch.block_size
        slots = slots + pos % batch.block_size
        k = batch.k_cache[slots].float().transpose(0, 1)[None]  # (1, H_kv, L, D)
        v = batch.v_cache[slots].float().transpose(0, 1)[None]
        start = int(batch.query_start_loc[s])
        q = batch.q[start:start + q_len].float().transpose(0, 1)[None]  # (1, H, q_len, D)
        q_pos = seq_len - q_len + torch.arange(q_len, device=q.device)
        mask = pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale,
                                             enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
