"""Compaction of a sequence's policy-managed layout: the part of
``cache_node.kv_state.SequenceKV`` that moves each layer's kept (and merged) entries to the
front of its slots.

A policy plans each layer (``view``, ``compress_by_plans``) and ``apply_plans`` rewrites the
KV (``cache_node.compaction``); evicted entries go to the cold tier when the policy keeps
their codes (``_to_cold_tier``). A rewrite that lacks free blocks (``can_rewrite``) or host-tier
room other tenants hold (``wait_for_host``) marks the compaction due, and the scheduler runs it
before the sequence's next step (``cache_node.scheduling.preemption``). ``set_layout`` replaces
the whole layout. ``SequenceKVCompaction`` is mixed into ``SequenceKV``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from cache_node.compaction import can_rewrite, gather_kv, merge_kv, rewrite_kv, sequence_slots

if TYPE_CHECKING:
    from cache_node.attention_stats import AttentionStats
    from cache_node.block_pool import BlockPool
    from cache_node.kv_pool import KVPool
    from cache_node.policies.base import LayerPlan, LayerView, Policy
    from cache_node.sequence import Sequence
    from cache_node.tiers.manager import TierManager


class SequenceKVCompaction:
    """Compaction methods of ``SequenceKV`` (which provides these attributes and is what
    ``_to_cold_tier`` hands to the policy: hence its ``type: ignore[arg-type]``)."""

    seq: Sequence
    policy: Policy
    pool: KVPool
    block_pool: BlockPool
    host: TierManager | None
    scaling: float
    extra: dict[str, Any]
    positions: torch.Tensor
    support: torch.Tensor
    dense: bool
    stats: AttentionStats | None
    budget: int | None
    num_compactions: int
    compaction_due: bool
    _deferring: bool
    host_wait: tuple[int, str] | None
    no_host_wait: bool

    if TYPE_CHECKING:
        @property
        def frontier(self) -> int: ...

    def view(self, layer_idx: int) -> LayerView:
        """The layer's valid entries as a ``LayerView`` (copies; safe to keep)."""
        from cache_node.policies.base import LayerView

        slots = (self.positions[layer_idx] >= 0).nonzero().squeeze(1)
        pool_slots = sequence_slots(self.seq, self.pool.block_size, self.frontier, self.pool.kv.device)[slots]
        k, v = self.pool.kv[layer_idx, 0, pool_slots].float(), self.pool.kv[layer_idx, 1, pool_slots].float()
        return LayerView(
            layer_idx, self.pool.num_layers, k, v, self.positions[layer_idx, slots],
            slots, self.support[layer_idx, slots], self.stats, self.scaling,
        )

    def over_budget(self) -> bool:
        assert self.budget is not None
        budgets = self.policy.layer_budgets(self.budget, self.pool.num_layers)
        counts = (self.positions >= 0).sum(1).tolist()
        slack = self.policy.evict_every
        return any(c > b + slack for c, b in zip(counts, budgets))

    def compress_by_plans(self, policy: Policy) -> bool:
        """Plan every layer with ``policy.plan`` and apply the plans (if any layer is over)."""
        if not self.over_budget():
            return False
        assert self.budget is not None
        budgets = policy.layer_budgets(self.budget, self.pool.num_layers)
        plans = [policy.plan(self.view(layer), b) for layer, b in enumerate(budgets)]
        return self.apply_plans(plans)

    def apply_plans(self, plans: list[LayerPlan]) -> bool:
        """Move each layer's kept (and merged) entries to the front. False when the pool is
        too full for copy-on-write (nothing changes)."""
        L = self.pool.num_layers
        m = max(len(p.keep) for p in plans)
        if not self.can_rewrite(m):
            return False
        valid = [(self.positions[layer] >= 0).nonzero().squeeze(1) for layer in range(L)]
        dev = self.pool.kv.device
        src = torch.full((L, m), -1, dtype=torch.long, device=dev)
        for layer, p in enumerate(plans):
            src[layer, : len(p.keep)] = valid[layer][p.keep]
        data = gather_kv(self.pool, self.seq, src).float()
        positions = torch.full((L, m), -1, dtype=torch.long, device=dev)
        support = torch.zeros((L, m), device=dev)
        for layer, p in enumerate(plans):
            k = len(p.keep)
            positions[layer, :k] = self.positions[layer, src[layer, :k]]
            support[layer, :k] = self.support[layer, src[layer, :k]]
            if p.merge_src is not None and len(p.merge_src):
                msrc = valid[layer][p.merge_src]
                mdata = gather_kv(self.pool, self.seq, msrc.unsqueeze(0).expand(L, -1))[layer].float()
                merge_kv(data[layer, :k], support[layer, :k], p.merge_dst, mdata, self.support[layer, msrc])
        if self.policy.cold_bits:
            self._to_cold_tier(plans, valid)
        if self.stats is not None:
            self.stats.compact([src[layer, : len(p.keep)] for layer, p in enumerate(plans)])
        self.set_layout(data, positions, support)
        return True

    def _to_cold_tier(self, plans: list[LayerPlan], valid: list[torch.Tensor]) -> None:
        """Quantize each layer's evicted (neither kept nor merged) entries into the cold tier."""
        from cache_node.policies.quant import ColdTier

        cold = self.extra.get("cold")
        if cold is None:
            bits, group = self.policy.evicted_codes(self) or (self.policy.cold_bits, min(32, self.pool.head_dim))  # type: ignore[arg-type]
            cold = self.extra["cold"] = ColdTier(self.pool.num_layers, bits, group)
        pool_slots = sequence_slots(self.seq, self.pool.block_size, self.frontier, self.pool.kv.device)
        for layer, p in enumerate(plans):
            gone = torch.ones(len(valid[layer]), dtype=torch.bool, device=pool_slots.device)
            gone[p.keep] = False
            if p.merge_src is not None:
                gone[p.merge_src] = False
            slots = valid[layer][gone]
            if len(slots):
                kv = self.pool.kv[layer, :, pool_slots[slots]].transpose(0, 1)  # (n, 2, H_kv, d)
                cold.append(layer, kv, self.positions[layer, slots])

    def can_rewrite(self, num_slots: int) -> bool:
        """The pool has the blocks a rewrite of the first ``num_slots`` slots needs
        (``compaction.can_rewrite``). When short, a session turn first frees the history KV
        its session keeps for it (``Sequence.kept``): its blocks are then its own, rewritten
        in place. A False (the pool still too full: blocks another running request or a fork
        shares, or a layout that grows) marks the compaction due (``compaction_due``): the
        scheduler runs it before the sequence's next step, preempting for the blocks
        (``Scheduler._compact_due``), so the sequence never decodes over a layout its policy
        has not compacted. Each such deferral is counted: the request's
        ``policy_stats["deferred_compactions"]`` and the engine's ``compactions_deferred``.

        Regression: the kept history's blocks, shared with the turn, had to be copied on
        write; on a full pool the turn's compaction was skipped and it decoded other tokens
        than when its session kept nothing.
        """
        if can_rewrite(self.block_pool, self.seq, num_slots, self.pool.block_size):
            return True
        if self.seq.kept is not None:
            self.seq.kept.drop()
            if can_rewrite(self.block_pool, self.seq, num_slots, self.pool.block_size):
                return True
        self._defer()
        return False

    def wait_for_host(self, num_slots: int, holder: str) -> bool:
        """Whether the compaction must wait for ``num_slots`` host-tier slots (the sentences
        a SentenceKV compaction demotes) that ``holder`` (its cache namespace without the
        salt) cannot reserve now, even after idle holders gave theirs back, while running
        requests of other holders hold more of the tier per weight than ``holder`` would with
        them (``TierManager.host_contenders``). True marks the compaction due
        (``compaction_due``, ``host_wait``, counted as ``can_rewrite``'s deferrals): the
        scheduler preempts those requests, largest holder per weight first, and runs it again before
        this sequence's next step (``Scheduler._compact_due``). False (room enough, or no
        such request: the tier is too small for ``holder``'s share) lets the compaction
        go on, dropping what the tier cannot hold (``dropped_tokens``).

        Regression (security review 18 C): a tenant's running SentenceKV requests that had
        filled the host tier never gave way; another tenant's request, within its share,
        dropped the sentences it demoted and silently decoded other tokens than alone
        (``dropped_tokens`` 380 of them in the review's case).
        """
        tiers = self.host
        if tiers is None or num_slots <= 0 or self.no_host_wait or tiers.can_reserve_host(num_slots, holder):
            return False
        if tiers.host_contenders is None or not tiers.host_contenders(num_slots, holder, self.seq):
            return False
        self.host_wait = (num_slots, holder)
        self._defer()
        return True

    def _defer(self) -> None:
        """Mark the compaction due, counted once until it runs."""
        self.compaction_due = True
        if not self._deferring:
            self._deferring = True
            self.block_pool.num_deferred_rewrites += 1  # the engine's "compactions_deferred"
            stats = self.seq.policy_stats
            stats["deferred_compactions"] = stats.get("deferred_compactions", 0.0) + 1

    def set_layout(self, data: torch.Tensor, positions: torch.Tensor, support: torch.Tensor,
                   dense: bool = False) -> None:
        """Replace the whole layout: ``data`` (L, m, 2, H_kv, d) with ``positions``/``support``
        (L, m). Call ``can_rewrite`` first. Statistics are the caller's to re-index.
        ``dense``: the caller vouches that every position is >= 0 and every support 1 (no
        holes, no merged entries), so decode steps skip the mask and the support weights
        (adding log 1 = 0 and masking nothing change no bit); not checked on the device, to
        keep a compaction free of host syncs."""
        rewrite_kv(self.pool, self.block_pool, self.seq, data)
        self.compaction_due = self._deferring = False
        self.host_wait = None
        self.seq.num_evicted_tokens = self.seq.num_computed_tokens - data.shape[1]
        self.positions, self.support, self.dense = positions, support, dense
        self.num_compactions += 1
