"""Where a demoted sentence's raw K/V waits in host RAM: the engine's host tier
(``TierHostKV``) or, without one, the sequence's own CPU tensors (``PrivateHostKV``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cache_node.tiers.manager import TierManager


class PrivateHostKV:
    """Sentence K/V in the sequence's own CPU tensors (used when the engine has no host tier)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []

    def add(self, kv: torch.Tensor, extra_bytes: int = 0) -> int | None:
        """Store ``kv`` (L, n, 2, H_kv, d); returns its handle. ``extra_bytes`` (host RAM the
        caller keeps beside it) needs no reservation here."""
        self.parts.append(kv.to("cpu", copy=True))
        return len(self.parts) - 1

    def read(self, handle: int, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) of one stored sentence in ``layer``; (n, 2, d) for one ``head``."""
        kv = self.parts[handle][layer]
        return kv if head is None else kv[:, :, head]

    def fork(self) -> PrivateHostKV:
        out = PrivateHostKV()
        out.parts = list(self.parts)  # never mutated in place
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    num_held_slots = 0  # holds no host-tier slot

    def release(self) -> None:
        self.parts = []


class SharedSlots:
    """Host-tier slots that forks of one state hold together (never written again); the last
    holder to release them gives them back to the tier."""

    def __init__(self, tiers: TierManager, slots: list[int], holder: str = "") -> None:
        self.tiers, self.slots, self.holders, self.holder = tiers, slots, 1, holder

    def drop(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.tiers.release_host(self.slots, self.holder)


class TierHostKV:
    """Sentence K/V in host-tier slots the sequence reserves (``TierManager.reserve_host``),
    packed token after token: stored token ``t`` lives in slot ``slots[t // block_size]`` at
    offset ``t % block_size``. Host RAM the sequence keeps beside them (the recall region's
    codes) is charged as whole slots more (``charge_slots``, left empty). All of them count
    against the host tier's budget and leave it when the sequence's KV is released.

    A fork shares what is stored so far (``shared``: the first ``num_shared_slots`` of
    ``slots`` and ``num_shared_charge`` charge slots, refcounted ``SharedSlots``) instead of
    copying it: stored K/V is never rewritten, and each side stores its later tokens from a
    fresh slot of its own (the last shared slot's free offsets stay unused). A compressed
    prefix forked by many requests is thus held in the host tier once. Every slot counts as
    ``holder``'s (the sequence's cache namespace without its salt: ``fair_lru.holder_of``), so
    the tier's fair eviction weighs it against that tenant's share."""

    def __init__(self, tiers: TierManager, holder: str = "") -> None:
        self.tiers, self.holder = tiers, holder
        self.block_size = tiers.pool.block_size
        data = tiers.host.data  # (L, 2, slots, block_size, H_kv, d)
        self.slot_bytes = data[:, :, :1].numel() * data.element_size()
        self.slots = torch.zeros(0, dtype=torch.long)
        self.charge_slots: list[int] = []
        self.charged_bytes = 0
        self.num_tokens = 0
        self.shared: list[SharedSlots] = []
        self.num_shared_slots = self.num_shared_charge = 0

    def slots_for(self, num_tokens: int, extra_bytes: int = 0) -> int:
        """Slots ``add`` would reserve to store ``num_tokens`` more tokens and charge
        ``extra_bytes`` more beside them."""
        need = max(0, math.ceil((self.num_tokens + num_tokens) / self.block_size) - len(self.slots))
        charged = len(self.charge_slots) + self.num_shared_charge
        return need + max(0, math.ceil((self.charged_bytes + extra_bytes) / self.slot_bytes) - charged)

    def add(self, kv: torch.Tensor, extra_bytes: int = 0) -> torch.Tensor | None:
        """Store ``kv`` (L, n, 2, H_kv, d) and charge ``extra_bytes`` of host RAM kept beside it;
        returns its handle (the stored token indices), or None when the host tier cannot hold
        both (nothing stored or charged)."""
        n = kv.shape[1]
        need = self.slots_for(n)
        charge = self.slots_for(n, extra_bytes) - need
        if need + charge > 0:
            got = self.tiers.reserve_host(need + charge, self.holder)
            if got is None:
                self.tiers.counters["policy_dropped_tokens"] += n
                return None
            self.slots = torch.cat([self.slots, torch.tensor(got[:need], dtype=torch.long)])
            self.charge_slots.extend(got[need:])
        self.charged_bytes += extra_bytes
        t = torch.arange(self.num_tokens, self.num_tokens + n)
        self.num_tokens += n
        data = self.tiers.host.data  # (L, 2, slots, block_size, H_kv, d)
        data[:, :, self.slots[t // self.block_size], t % self.block_size] = kv.transpose(1, 2).to(data)
        return t

    def read(self, handle: torch.Tensor, layer: int, head: int | None = None) -> torch.Tensor:
        """(n, 2, H_kv, d) of the stored tokens ``handle`` in ``layer``; (n, 2, d) for one
        ``head`` (only that head's bytes are gathered)."""
        data = self.tiers.host.data[layer]  # (2, slots, block_size, H_kv, d)
        slots, offsets = self.slots[handle // self.block_size], handle % self.block_size
        kv = data[:, slots, offsets] if head is None else data[:, slots, offsets, head]
        return kv.transpose(0, 1)

    def read_heads(self, handle: torch.Tensor, layer: int, heads: torch.Tensor) -> torch.Tensor:
        """(n, 2, d) of the stored tokens ``handle`` (n,) in ``layer``, token ``i`` in KV head
        ``heads[i]``: one gather for several heads."""
        data = self.tiers.host.data[layer]  # (2, slots, block_size, H_kv, d)
        return data[:, self.slots[handle // self.block_size], handle % self.block_size, heads].transpose(0, 1)

    def fork(self) -> TierHostKV:
        """A copy sharing every slot held so far (same handles, same charge; see the class
        docstring). Reserves nothing."""
        own = self.slots[self.num_shared_slots :].tolist() + self.charge_slots
        if own:  # what this side stored becomes shared, read-only
            self.shared.append(SharedSlots(self.tiers, own, self.holder))
            self.num_shared_charge += len(self.charge_slots)
            self.num_shared_slots, self.charge_slots = len(self.slots), []
        self.num_tokens = len(self.slots) * self.block_size  # later tokens: a fresh slot
        out = TierHostKV(self.tiers, self.holder)
        out.slots, out.num_tokens, out.charged_bytes = self.slots.clone(), self.num_tokens, self.charged_bytes
        out.num_shared_slots, out.num_shared_charge = self.num_shared_slots, self.num_shared_charge
        out.shared = list(self.shared)
        for run in out.shared:
            run.holders += 1
        return out

    @property
    def num_held_slots(self) -> int:
        """Host-tier slots this holder alone gives back on ``release`` (its own slots and
        charge slots; shared runs go back with their last holder)."""
        own = len(self.slots) - self.num_shared_slots + len(self.charge_slots)
        return own + sum(len(run.slots) for run in self.shared if run.holders == 1)

    def release(self) -> None:
        held = self.slots[self.num_shared_slots :].tolist() + self.charge_slots
        if held:
            self.tiers.release_host(held, self.holder)
        for run in self.shared:
            run.drop()
        self.slots, self.num_tokens = torch.zeros(0, dtype=torch.long), 0
        self.charge_slots, self.charged_bytes = [], 0
        self.shared, self.num_shared_slots, self.num_shared_charge = [], 0, 0
