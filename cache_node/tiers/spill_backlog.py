"""The spill-put backlog: host victims waiting for the transfer worker, bounded in blocks.

Every host-tier eviction hands its victims (a CPU copy of their KV) to the transfer worker,
which writes them to the spill tier one put at a time. While spill puts are slower than
evictions (a stalled or restarting spill node, a disk slower than the tenants' prefills) the
victims wait here, in the cache node's RAM; ``TierConfig.spill_put_backlog_bytes`` bounds them
(docs/architecture.md, 'Tiers'). The bound counts the batch being written too, so the KV
bytes this backlog keeps alive never exceed it.

Over the bound, queued blocks are dropped as ``fair_lru.FairLRU`` evicts: from the holder
(cache namespace without its salt) with the most blocks queued or being written per unit of its
weight, oldest first within it; an arriving batch counts as its holder's newest blocks, so a
holder flooding the node drops its own queued writes, never another holder's while it has more
queued per weight than they do. A dropped write is only a later spill miss: nothing claims the block is in the spill tier
until a spill node stores it (its own events), and the host tier already reported it removed.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from cache_node.tiers.fair_lru import FairLRU, HolderWeights, holder_of
from cache_node.tiers.host import BlockMeta, Victims
from cache_node.tiers.spill_api import SPILL_HASH_BYTES

_Key = tuple[int, int]  # (batch id, row id): one queued block


@dataclass
class _Batch:
    """Queued victims: ``blocks[i]`` is the KV of ``metas[i]``, queued as ``keys[i]``."""

    metas: list[BlockMeta]
    blocks: torch.Tensor  # (n, L, 2, block_size, H_kv, d), CPU
    keys: list[_Key]


class SpillBacklog:
    """Victims queued for spill puts, at most ``max_blocks`` blocks queued and in flight.

    Not thread-safe: the transfer worker calls it under its own lock.

    Args:
        max_blocks: blocks this backlog may hold, the batch being written included
            (``spill_put_backlog_bytes // block_nbytes``); 0 drops every write.
        weights: each holder's weight (``fair_lru.HolderWeights``); None: every holder weighs 1.

    Raises ValueError for a negative ``max_blocks``.
    """

    def __init__(self, max_blocks: int, weights: HolderWeights | None = None) -> None:
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._batches: OrderedDict[int, _Batch] = OrderedDict()  # oldest first
        self._queued: FairLRU[_Key, None] = FairLRU(weights)  # every queued block, by holder
        self._in_flight: Counter[str] = Counter()  # holder -> blocks of the batch being written
        self._ids = itertools.count()

    @property
    def num_blocks(self) -> int:
        """Blocks queued or being written."""
        return len(self._queued) + sum(self._in_flight.values())

    @property
    def num_queued_batches(self) -> int:
        return len(self._batches)

    def add(self, victims: Victims) -> int:
        """Queue ``victims``' spillable blocks (32-byte hashes; the others are never written)
        as their holders' newest; over ``max_blocks``, drop queued or arriving blocks, largest
        holder per weight first, oldest first within it. Returns blocks dropped."""
        rows = [i for i, m in enumerate(victims.metas) if len(m.block_hash) == SPILL_HASH_BYTES]
        holders = [holder_of(victims.metas[i].namespace) for i in rows]
        need = self.num_blocks + len(rows) - self.max_blocks
        dropped = 0
        if need > 0:
            plan = self._queued.plan(need, Counter(holders), self._in_flight)
            self._drop(plan.keys)
            refused = dict(plan.refused)
            dropped = len(plan.keys) + sum(refused.values())
            # an arriving holder's refused blocks are its first rows: a chain's tail leaves
            # first (``HostTier`` victims), so the heads a prefix hit needs stay queued
            kept = []
            for i, holder in zip(rows, holders):
                if refused.get(holder, 0) > 0:
                    refused[holder] -= 1
                else:
                    kept.append(i)
            rows = kept
        if rows:
            batch_id = next(self._ids)
            keys = [(batch_id, i) for i in rows]
            for key, i in zip(keys, rows):
                self._queued.put(key, None, holder_of(victims.metas[i].namespace))
            blocks = victims.blocks if len(rows) == len(victims.metas) else victims.blocks[rows]
            self._batches[batch_id] = _Batch([victims.metas[i] for i in rows], blocks, keys)
        return dropped

    def take(self) -> Victims | None:
        """The oldest queued batch, counted as in flight until ``done``; None when empty."""
        if not self._batches:
            return None
        _, batch = self._batches.popitem(last=False)
        for key in batch.keys:
            self._in_flight[self._queued.holder(key)] += 1
            self._queued.pop(key)
        return Victims(batch.metas, batch.blocks)

    def done(self) -> None:
        """The batch ``take`` returned was written (or failed): it no longer counts."""
        self._in_flight.clear()

    def clear(self) -> int:
        """Drop every queued batch (a flush); returns blocks dropped."""
        n = len(self._queued)
        self._batches.clear()
        self._queued.clear()
        return n

    def queued_by_holder(self) -> dict[str, int]:
        """Blocks queued (not in flight) per holder."""
        return self._queued.held()

    def _drop(self, keys: list[_Key]) -> None:
        """Remove queued blocks; a batch keeps a copy of its remaining rows only, so the KV of
        the dropped ones is released at once."""
        gone: dict[int, set[_Key]] = {}
        for key in keys:
            self._queued.pop(key)
            gone.setdefault(key[0], set()).add(key)
        for batch_id, keys_gone in gone.items():
            batch = self._batches[batch_id]
            keep = [j for j, key in enumerate(batch.keys) if key not in keys_gone]
            if not keep:
                del self._batches[batch_id]
                continue
            self._batches[batch_id] = _Batch([batch.metas[j] for j in keep], batch.blocks[keep],
                                             [batch.keys[j] for j in keep])
