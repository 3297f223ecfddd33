"""Rewrite a sequence's KV in place of its blocks: the pool-side half of every compressing policy.

A compressed sequence keeps, per layer, a chosen set of token KV compacted into the front of
its own blocks (all layers share one block table, so bytes held = blocks x bytes_per_block and
the layer with the most tokens sets the block count). Blocks shared with the prefix cache or
another sequence are copied on write; blocks past the new end are freed tail first.
Compressed blocks are never prefix-cached (their contents no longer match a token prefix).
"""

from __future__ import annotations

import torch

from cache_node.block_pool import BlockPool
from cache_node.kv_pool import KVPool, block_slots
from cache_node.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sequence_slots(seq: Sequence, block_size: int, num_slots: int, device: torch.device) -> torch.Tensor:
    """(num_slots,) int64 pool slots of the sequence's first ``num_slots`` physical slots, on
    ``device`` (one host->device copy)."""
    slots = torch.from_numpy(block_slots([b.block_id for b in seq.block_table], block_size, num_slots))
    return slots.to(device, non_blocking=True)


def gather_kv(pool: KVPool, seq: Sequence, src: torch.Tensor) -> torch.Tensor:
    """Copy out KV by physical slot index per layer.

    Args:
        src: (L, m) int64 physical slot indices of the sequence (-1 = padding, returns zeros),
            on the pool's device.

    Returns:
        (L, m, 2, H_kv, d) KV in the pool's dtype, on the pool's device.
    """
    num_slots = int(src.max()) + 1 if src.numel() else 0
    slots = sequence_slots(seq, pool.block_size, max(num_slots, 1), pool.kv.device)
    pool_slots = slots[src.clamp(min=0)]
    layers = torch.arange(pool.num_layers, device=pool.kv.device).unsqueeze(1)
    data = pool.kv[layers, :, pool_slots]  # (L, m, 2, H, d)
    return data.masked_fill((src < 0).view(*src.shape, 1, 1, 1), 0.0)


def can_rewrite(block_pool: BlockPool, seq: Sequence, num_slots: int, block_size: int) -> bool:
    """True when the pool has the blocks a rewrite of the first ``num_slots`` slots needs: one
    per block shared with another holder (copy on write) and one per block the layout grows by.
    A block only the prefix cache shares needs none: ``rewrite_kv`` copies it on write while a
    block is free and else rewrites it in place, its hash released.

    Regression: every prefix-cached block counted as shared, and the engine caches a prompt's
    full blocks before its policy's first compaction, so on a full pool that compaction was
    skipped step after step and the request attended its whole prompt, decoding other tokens
    than alone."""
    need = cdiv(num_slots, block_size)
    shared = sum(1 for b in seq.block_table[:need] if b.ref_cnt > 1)
    grow = max(0, need - len(seq.block_table))
    freed = sum(1 for b in seq.block_table[need:] if b.ref_cnt == 1)
    return shared + grow <= block_pool.num_free_blocks() + freed


def rewrite_kv(pool: KVPool, block_pool: BlockPool, seq: Sequence, data: torch.Tensor) -> None:
    """Lay ``data`` (L, m, 2, H_kv, d) out from the sequence's physical slot 0.

    Blocks past ``ceil(m / block_size)`` are released (tail first), missing ones allocated (a
    layout may grow, e.g. a recall region). No cached block ever holds compacted KV: a kept
    block shared with another holder is replaced by a fresh exclusive block (copy on write); a
    block only the prefix cache shares is copied on write too while the pool has a block to
    spare (its uncompressed KV stays cached), else rewritten in place with its hash released
    (``BlockPool.release_hashes``: the tiers below keep a copy). Call ``can_rewrite`` first:
    raises RuntimeError otherwise.
    """
    bs = pool.block_size
    need = cdiv(data.shape[1], bs)
    tail = seq.block_table[need:]
    del seq.block_table[need:]
    block_pool.free(list(reversed(tail)))
    grow = need - len(seq.block_table)
    if grow > 0:
        fresh_blocks = block_pool.allocate(grow)
        if fresh_blocks is None:
            raise RuntimeError("no free blocks to grow the layout: call can_rewrite first")
        seq.block_table.extend(fresh_blocks)
    shared_left = sum(1 for b in seq.block_table if b.ref_cnt > 1)
    for i, block in enumerate(seq.block_table):
        if block.ref_cnt > 1:
            shared_left -= 1
        elif block.block_hash is None:
            continue
        elif block_pool.num_free_blocks() <= shared_left:  # no block to spare: in place
            block_pool.release_hashes([block])
            continue
        fresh = block_pool.allocate(1)
        if fresh is None:
            raise RuntimeError("copy-on-write found no free block: call can_rewrite first")
        block_pool.free([block])
        seq.block_table[i] = fresh[0]
    dest = sequence_slots(seq, bs, data.shape[1], pool.kv.device)
    layers = torch.arange(pool.num_layers, device=pool.kv.device).unsqueeze(1)
    pool.kv[layers, :, dest.unsqueeze(0).expand(pool.num_layers, -1)] = data.to(pool.kv.dtype)


def merge_kv(
    data: torch.Tensor, support: torch.Tensor, dst: torch.Tensor, src_data: torch.Tensor,
    src_support: torch.Tensor,
) -> None:
    """Fold entries into kept ones as support-weighted means, in place (one layer).

    Args:
        data: (m, 2, H, d) kept KV; support: (m,) their support counts.
        src_data: (k, 2, H, d) merged-away KV with support ``src_support`` (k,), going to
            kept index ``dst`` (k,).
    """
    total = support.clone().index_add_(0, dst, src_support)
    acc = (data * support.view(-1, 1, 1, 1)).index_add_(0, dst, src_data * src_support.view(-1, 1, 1, 1))
    data.copy_(acc / total.view(-1, 1, 1, 1))
    support.copy_(total)
