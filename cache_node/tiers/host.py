"""The host tier: whole KV blocks in (pinned) host RAM, keyed by block hash, LRU per tenant.

One tensor is allocated once, in the device pool's block-major layout, so a demotion or a
promotion is one strided copy per run of blocks (``block_copy``)::

    data: (num_layers, 2, num_slots, block_size, num_kv_heads, head_dim)
    num_slots = budget_bytes // bytes_per_block

It is pinned (page-locked) when the pool is on CUDA, so device<->host copies run at PCIe
speed, asynchronously on the copier's stream (``device_copy.DeviceCopier``): ``put`` leaves
the event of its copy in ``last_put_event``, and every CPU read or write of ``data`` (victims,
reserved slots) waits for the copies in flight first. Entries keep their tokens (every hit is token-checked, as on the device) and their
cache namespace (recorded in spill file headers). Eviction takes the least recently used block
of the tenant holding the most slots per unit of its weight (``fair_lru``; the weights the
engine learns from the requests it runs, ``TierManager.weights``), so no tenant pushes out
another's blocks while it holds more per weight than they do; slots ``reserve``d by a policy
count as their tenant's holding but are never evicted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from cache_node.hashing import BlockHash
from cache_node.tiers.block_copy import view_to_stack
from cache_node.tiers.device_copy import CopyTicket, DeviceCopier
from cache_node.tiers.fair_lru import FairLRU, HolderWeights, holder_of

TIER_DEVICE = "device"
TIER_HOST = "host"


class TierEvent(NamedTuple):
    """``event`` "stored"|"removed" of ``block_hash`` in ``tier`` (feeds the global index)."""

    event: str
    block_hash: BlockHash
    tier: str


@dataclass
class HostEntry:
    slot: int
    token_ids: tuple[int, ...]
    namespace: str


class BlockMeta(NamedTuple):
    """What a block carries besides its bytes when it moves between tiers."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    namespace: str


class Victims(NamedTuple):
    """Blocks pushed out of the host tier: ``blocks`` (n, L, 2, block_size, H_kv, d), CPU."""

    metas: list[BlockMeta]
    blocks: torch.Tensor


class HostTier:
    """Block store in host RAM, LRU within each tenant, largest holder per weight evicted first.

    Args:
        pool_shape: the device pool view's shape ``(L, 2, num_blocks, block_size, H_kv, d)``
            (only ``num_blocks`` is replaced by the slot count).
        dtype: KV dtype (same as the device pool).
        budget_bytes: host RAM budget; 0 disables the tier (every put becomes a victim).
        pin: page-lock the tensor; None = only when CUDA is available.
        copier: how blocks are copied in (async on CUDA); None = synchronous CPU copies.
        weights: each holder's weight (``fair_lru.HolderWeights``); None: every holder weighs 1.
    """

    def __init__(
        self, pool_shape: Sequence[int], dtype: torch.dtype, budget_bytes: int, pin: bool | None = None,
        copier: DeviceCopier | None = None, weights: HolderWeights | None = None,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host budget_bytes must be >= 0, got {budget_bytes}")
        L, two, _, bs, h, d = pool_shape
        self.block_nbytes = L * two * bs * h * d * torch.empty((), dtype=dtype).element_size()
        self.num_slots = budget_bytes // self.block_nbytes
        pin = torch.cuda.is_available() if pin is None else pin
        self.data = torch.zeros((L, two, self.num_slots, bs, h, d), dtype=dtype, pin_memory=pin)
        # Regression: one LRU over all tenants let a tenant streaming new prefixes push every
        # other tenant's host blocks out; eviction now takes the largest holder's LRU first,
        # largest per weight (regression: a weight-4 tenant kept no more than a weight-1 one).
        self.entries: FairLRU[BlockHash, HostEntry] = FairLRU(weights)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.num_reserved = 0  # slots a policy holds (``reserve``), outside the LRU index
        self.reserved_by: Counter[str] = Counter()  # those slots per holder (``holder_of``)
        self._events: list[TierEvent] = []
        self.copier = copier or DeviceCopier(torch.device("cpu"))
        self.last_put_event: CopyTicket | None = None  # of the last ``put``'s copy (CUDA)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> HostEntry | None:
        """Entry of ``block_hash`` whose tokens equal ``token_ids``; None on miss. No touch."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != tuple(token_ids):
            return None
        return entry

    def put(self, metas: Sequence[BlockMeta], src: torch.Tensor, src_ids: Sequence[int]) -> Victims:
        """Copy blocks ``src[:, :, src_ids[i]]`` (a pool view) in under ``metas[i]``.

        A hash already held is touched (moved to MRU), not copied. Room is made by the largest
        holder per weight first, counting the batch's blocks as their tenants' newest
        (``fair_lru.FairLRU.plan``): held entries so picked are evicted and returned, with their
        bytes, for the spill tier; incoming blocks so picked (a tenant's oldest in the batch
        first) are returned as victims straight from ``src``, as are the oldest of a batch
        larger than the free and evictable slots (``reserve``d slots are neither: regression,
        a demotion into a tier mostly reserved by SentenceKV sentences popped from an empty
        free list).
        """
        seen: set[BlockHash] = set()
        new = []
        for m, s in zip(metas, src_ids):
            if m.block_hash not in self.entries and m.block_hash not in seen:
                seen.add(m.block_hash)
                new.append((m, s))
        for m in metas:
            if m.block_hash in self.entries:
                self.entries.touch(m.block_hash)
        # Who goes: the largest holder's (per weight) LRU entries, counting each tenant's incoming blocks as
        # its newest; an incoming block so picked is not copied in but returned as a victim
        # straight from ``src`` (also when the batch exceeds the free and evictable slots).
        plan = self.entries.plan(
            len(new) - len(self._free_slots), Counter(holder_of(m.namespace) for m, _ in new), self.reserved_by)
        refused, kept = plan.refused, []
        overflow = []  # each holder's oldest incoming blocks, as many as it was refused
        for m, s in new:
            holder = holder_of(m.namespace)
            if refused.get(holder, 0) > 0:
                refused[holder] -= 1
                overflow.append((m, s))
            else:
                kept.append((m, s))
        new = kept
        victims = self._take_victims(plan.keys)
        # Slots in ascending order for ascending source ids: a run of consecutive device blocks
        # lands in consecutive slots, so demoting it and promoting it back are one copy each
        # (the free queue hands a prefix's blocks over tail first).
        slots = sorted(self._free_slots.pop() for _ in new)
        slot_by_src = dict(zip(sorted(s for _, s in new), slots))
        slot_of = [slot_by_src[s] for _, s in new]
        self.last_put_event = self.copier.demote(self.data, slot_of, src, [s for _, s in new])
        for (m, _), slot in zip(new, slot_of):
            self.entries.put(m.block_hash, HostEntry(slot, m.token_ids, m.namespace), holder_of(m.namespace))
            self._events.append(TierEvent("stored", m.block_hash, TIER_HOST))
        if overflow:
            extra = Victims([m for m, _ in overflow], view_to_stack(src, [s for _, s in overflow]))
            victims = _concat(extra, victims)
        return victims

    def take(self, hashes: Sequence[BlockHash]) -> list[HostEntry]:
        """Remove entries from the index (their slots stay reserved until ``release``)."""
        out = []
        for block_hash in hashes:
            out.append(self.entries.pop(block_hash))
            self._events.append(TierEvent("removed", block_hash, TIER_HOST))
        return out

    def release(self, entries: Sequence[HostEntry]) -> None:
        """Return the slots of entries handed out by ``take``."""
        self._free_slots.extend(e.slot for e in entries)

    def reserve(self, n: int, holder: str = "") -> tuple[list[int] | None, Victims]:
        """Hold ``n`` slots outside the LRU index for KV a policy owns (SentenceKV's demoted
        sentences) until ``release_slots``, counted as ``holder``'s (a cache namespace without
        its salt). Free slots are taken first; LRU entries are evicted for the rest as for a
        ``put`` of ``holder``'s (the largest holder per weight first, reserved slots counted as
        holdings, ``FairLRU.plan``) and returned as victims (for the spill tier). Returns (None,
        no victims), nothing evicted, when that eviction would pick any of the ``n`` (the holder
        would be over the others' holdings per weight) or even every entry would not free
        ``n`` slots.

        Regression: reserved slots belonged to no holder and a reservation evicted the LRU
        entries of every tenant alike, so one tenant's SentenceKV requests pushed the other
        tenants' host blocks out past their fair share (the tiers' fair eviction aside).
        """
        plan = self._reserve_plan(n, holder)
        if plan is None:
            return None, Victims([], torch.empty(0))
        victims = self._take_victims(plan)
        self.copier.host_barrier()  # a free slot may still be read by a promotion in flight
        slots = [self._free_slots.pop() for _ in range(n)]
        self.num_reserved += n
        self.reserved_by[holder] += n
        return slots, victims

    def can_reserve(self, n: int, holder: str = "") -> bool:
        """``reserve(n, holder)`` would succeed."""
        return self._reserve_plan(n, holder) is not None

    def _reserve_plan(self, n: int, holder: str) -> list[BlockHash] | None:
        short = n - len(self._free_slots)
        if short <= 0:
            return []
        if short > len(self.entries):
            return None
        plan = self.entries.plan(short, {holder: n}, self.reserved_by)
        return None if plan.refused else plan.keys

    def release_slots(self, slots: Sequence[int], holder: str = "") -> None:
        """Return slots ``holder`` held by ``reserve``."""
        self.num_reserved -= len(slots)
        self.reserved_by[holder] -= len(slots)
        if self.reserved_by[holder] <= 0:
            del self.reserved_by[holder]
        self._free_slots.extend(slots)

    def untake(self, hashes: Sequence[BlockHash], entries: Sequence[HostEntry]) -> None:
        """Put entries from ``take`` back (a promotion that could not get device blocks)."""
        for block_hash, entry in zip(hashes, entries):
            self.entries.put_lru(block_hash, entry, holder_of(entry.namespace))
            self._events.append(TierEvent("stored", block_hash, TIER_HOST))

    def evict_all(self) -> Victims:
        """Push every entry out (in eviction order), returning them with their bytes."""
        return self._evict(len(self.entries))

    def clear(self) -> int:
        """Drop every entry (Flush). Returns how many were dropped."""
        n = len(self.entries)
        self.release(self.take(list(self.entries)))
        return n

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        return {
            "host_blocks": len(self.entries),
            "host_slots": self.num_slots,
            "host_reserved_slots": self.num_reserved,
            "host_bytes_used": len(self.entries) * self.block_nbytes,
            "host_budget_bytes": self.num_slots * self.block_nbytes,
        }

    def _evict(self, n: int) -> Victims:
        return self._take_victims(self.entries.victims(n))

    def _take_victims(self, hashes: list[BlockHash]) -> Victims:
        entries = self.take(hashes)
        metas = [BlockMeta(h, e.token_ids, e.namespace) for h, e in zip(hashes, entries)]
        if entries:
            self.copier.host_barrier()  # a demotion in flight may still be writing them
        blocks = view_to_stack(self.data, [e.slot for e in entries])
        self.release(entries)
        return Victims(metas, blocks)


def _concat(a: Victims, b: Victims) -> Victims:
    if not b.metas:
        return a
    return Victims(a.metas + b.metas, torch.cat([a.blocks, b.blocks]))
