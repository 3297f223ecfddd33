"""Per-sequence KV layout under a policy: which token each physical slot holds, per layer.

Physical slot ``i`` of a sequence (its ``i``-th slot through the block table) holds, in layer
``l``, the token at absolute position ``positions[l, i]`` (-1 = a hole, masked out). Token
range diagram after a compaction::

    logical:  | 0 ............................ num_computed_tokens |
    physical: | kept (per layer, <= budget) | new tokens ... |
              |<------ frontier = num_computed_tokens - num_evicted_tokens ------>|

Keys are post-RoPE, so attention needs no positions beyond the causal mask; new tokens keep
their true absolute positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cache_node.attention_stats import AttentionStats
from cache_node.block import KVBlock
from cache_node.block_pool import BlockPool
from cache_node.compaction import can_rewrite, gather_kv, merge_kv, rewrite_kv, sequence_slots
from cache_node.kv_pool import KVPool
from cache_node.query_spans import attend_spans
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.policies.base import (
        DenseExtraKV,
        ExtraKV,
        LayerPlan,
        LayerView,
        Policy,
        PolicyEnv,
    )
    from cache_node.tiers.manager import TierManager

log = logging.getLogger(__name__)


class SequenceKV:
    """The policy-managed KV state of one sequence (``seq.kv``).

    Attributes:
        positions: (L, frontier) int64 absolute position per physical slot and layer; -1 = hole.
        support: (L, frontier) float32 original tokens an entry stands for (merging policies).
        stats: attention statistics when the policy needs them.
        budget: tokens per layer, fixed at the first compression.
        extra: policy-owned state (host-tier sentences, quantized segments).
        charge_blocks: pool blocks held (never written) to pay for the bytes the policy keeps
            outside the pool blocks (``outside_pool_bytes``): ``ceil(bytes / bytes_per_block)``
            of them, so the pool's byte budget bounds everything the sequence holds and the
            blocks count against its tenant's quota (``Sequence.num_held_blocks``).
        charge_debt: blocks the charge still lacks (the pool was full when it grew); the
            sequence's next slot allocation takes them first (``KVCacheManager.allocate_slots``).
        inherited_lost_tokens: tokens the state this one was forked from had lost
            (``Policy.lost_tokens``; ``fork``).
    """

    def __init__(self, seq: Sequence, policy: Policy, pool: KVPool, block_pool: BlockPool,
                 env: PolicyEnv | None = None, host: TierManager | None = None) -> None:
        from cache_node.policies.base import PolicyEnv

        self.seq, self.policy, self.pool, self.block_pool = seq, policy, pool, block_pool
        self.env = env or PolicyEnv()
        self.host = host  # the engine's tiers, when it has a host tier (SentenceKV keeps KV there)
        self.scaling = pool.head_dim**-0.5
        self.extra: dict[str, Any] = {}
        self.charge_blocks: list[KVBlock] = []
        self.reset()

    def reset(self) -> None:
        """Forget everything (the sequence's blocks were freed: preemption, finish); the
        policy releases what it holds in lower tiers, and the charge blocks go back (also when
        the release raises: the pool never loses a block to a failing policy)."""
        try:
            self.policy.release(self)
        except Exception:  # the request has failed already (SequenceFault) or is ending
            log.exception("policy %s: release failed for request %s", self.policy.name, self.seq.request_id)
        self.block_pool.free(self.charge_blocks[::-1])
        self.charge_blocks, self.charge_debt = [], 0
        L, dev = self.pool.num_layers, self.pool.kv.device  # the layout lives on the pool's device
        self.positions = torch.zeros((L, 0), dtype=torch.long, device=dev)
        self.support = torch.zeros((L, 0), device=dev)
        # every slot valid (position >= 0) with support 1: what ``begin_step`` appends, and what
        # a ``set_layout`` caller may vouch for; a decode query then needs no mask or weights
        self.dense = True
        needs = self.policy.needs
        self.stats = (AttentionStats(needs, L, self.pool.num_kv_heads, self.policy.decay, dev)
                      if needs.any else None)
        self.budget: int | None = None
        self.num_compactions = 0
        self.inherited_lost_tokens = 0  # ``Policy.lost_tokens`` of the state this one forked
        # a compaction that ``can_rewrite`` put off for want of free blocks, run again before
        # this sequence's next step (``retry_compaction``, from the scheduler)
        self.compaction_due = self._deferring = False
        self.retry: Callable[[], object] | None = None  # what reruns it (default ``after_step``)
        # (slots, holder) when the compaction was put off for host-tier room that other
        # tenants' running requests hold over their share (``wait_for_host``)
        self.host_wait: tuple[int, str] | None = None
        self.no_host_wait = False  # set while a compaction that must run now may not wait (``wait_for_host``)
        self.extra: dict[str, Any] = {}
        self.seq.num_evicted_tokens = 0

    def reusable_prompt_tokens(self) -> int:
        """How many of the prompt's first tokens a prefix-cache hit may supply before this
        state's first compression; the rest are computed so that the statistics the policy
        reads there cover the queries its source defines them over.

        A policy reading cumulative attention (``needs.attention``: H2O, G-KV, SpindleKV)
        sums it over every query of the prompt, so none may come from the cache; one reading
        an observation window (``needs.window_queries`` = w: SnapKV, SentenceKV) needs the
        window's w queries before the compression point (``prefix_stop``, else the prompt's
        end). Other policies, and a state that compressed already, take any hit.

        Regression: an H2O or G-KV request whose prompt a plain request had cached
        compressed from the attention of its last few computed tokens only, and decoded
        other tokens than the same request on a cold cache.
        """
        needs = self.policy.needs
        seq = self.seq
        if not self.policy.compresses or not needs.any or self.budget is not None:
            return seq.num_tokens
        if needs.attention:
            return 0
        end = seq.prefix_stop or seq.num_prompt_tokens
        return max(0, end - needs.window_queries)

    # ---- the step ---------------------------------------------------------------------------
    @property
    def frontier(self) -> int:
        return self.positions.shape[1]

    @property
    def compacted(self) -> bool:
        return self.num_compactions > 0

    def begin_step(self, start: int, num_new: int) -> None:
        """Lay out ``num_new`` tokens at absolute positions [start, start + num_new)."""
        phys, dev = start - self.seq.num_evicted_tokens, self.pool.kv.device
        if self.frontier < phys:  # prefix-cache hit or session: uncompressed tokens
            fill = torch.arange(self.frontier, phys, device=dev).expand(self.pool.num_layers, -1)
            self.positions = torch.cat([self.positions, fill], 1)
            self.support = torch.cat([self.support, torch.ones(fill.shape, device=dev)], 1)
        new = torch.arange(start, start + num_new, device=dev).expand(self.pool.num_layers, -1)
        self.positions = torch.cat([self.positions[:, :phys], new], 1)
        self.support = torch.cat([self.support[:, :phys], torch.ones(new.shape, device=dev)], 1)
        if self.stats is not None:
            self.stats.begin_step(self.frontier)

    def attend(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx_slots: torch.Tensor) -> torch.Tensor:
        """Attention of this step's queries over the layer's valid slots (+ extra KV).

        A decode query over a dense layout (``set_layout``'s ``dense``) whose probabilities no
        statistic needs, with no extra KV or extra KV that hands over plain K/V
        (``DenseExtraKV``), takes one fused call (``attend_decode``); everything else
        ``attend_all``.

        Args:
            q: (n, H, d) queries of the new tokens (the last n physical slots).
            k_cache, v_cache: (pool_slots, H_kv, d) the layer's pool.
            ctx_slots: (S,) pool slots of physical slots [0, S).

        Returns:
            (n, H, d).
        """
        n = q.shape[0]
        s = ctx_slots.shape[0]
        q_pos = self.positions[layer_idx, s - n : s]
        stats = self.stats
        cuts = self.policy.query_spans(self, n)
        if cuts is not None:  # a prompt step under a query-dependent policy: span by span
            out, probs = attend_spans(self, layer_idx, q, q_pos, k_cache, v_cache, ctx_slots, cuts)
            if stats is not None:
                stats.record(layer_idx, probs, q.float(), q_pos)
            return out
        self.policy.before_attend(self, layer_idx, q, q_pos)
        extra = self.policy.extra_kv(self, layer_idx)
        probs = None
        if (self.dense and n == 1 and (stats is None or not stats.needs.attention)
                and (extra is None or hasattr(extra, "dense_kv"))):
            out = self.attend_decode(q, k_cache, v_cache, ctx_slots, extra)  # type: ignore[arg-type]
        else:
            out, probs = self.attend_all(layer_idx, q, q_pos, k_cache, v_cache, ctx_slots, extra)
        if stats is not None:
            stats.record(layer_idx, probs, q.float(), q_pos)
        return out

    def attend_all(self, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, ctx_slots: torch.Tensor, extra: ExtraKV | None, causal: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend``'s general path: logits over the pool's valid slots (causal mask, the
        support's log added) and ``extra``'s, one softmax, the outputs summed. Returns the
        output (n, H, d) and the pool part's probabilities (H_kv, g, n, S) float32.
        ``causal``: mask even a lone query over a dense layout (a span of a step's queries,
        not necessarily in the last slot: ``attend_spans``)."""
        n, h, d = q.shape
        s = ctx_slots.shape[0]
        pos = self.positions[layer_idx, :s]
        k, v = k_cache[ctx_slots].to(q.dtype), v_cache[ctx_slots].to(q.dtype)
        h_kv = k.shape[1]
        qh = q.view(n, h_kv, h // h_kv, d).permute(1, 2, 0, 3)  # (H_kv, g, n, d)
        logits = qh @ k.permute(1, 2, 0).unsqueeze(1) * self.scaling  # (H_kv, g, n, S)
        if causal or not (self.dense and n == 1):  # a lone query in the last slot sees every earlier slot
            allowed = (pos.view(1, -1) >= 0) & (pos.view(1, -1) <= q_pos.view(-1, 1))  # (n, S)
            logits = logits + self.support[layer_idx, :s].clamp(min=1e-6).log().to(q.dtype)
            logits = logits.masked_fill(~allowed, float("-inf"))
        if extra is not None:
            logits = torch.cat([logits, extra.logits(qh, self.scaling).to(q.dtype)], -1)
        probs = torch.softmax(logits, dim=-1)
        out = probs[..., :s] @ v.permute(1, 0, 2).unsqueeze(1)  # (H_kv, g, n, d)
        if extra is not None:
            out = out + extra.output(probs[..., s:]).to(q.dtype)
        return out.permute(2, 0, 1, 3).reshape(n, h, d), probs[..., :s].float()

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      ctx_slots: torch.Tensor, extra: DenseExtraKV | None) -> torch.Tensor:
        """``attend`` for one query (1, H, d) over a dense layout (every slot valid, support 1,
        the query in the last slot: no mask on the pool part): the pool's K/V and the extra
        KV's (``DenseExtraKV.dense_kv``; its skipped slots masked) side by side in one
        ``scaled_dot_product_attention`` call, the ``g`` query heads of each KV head taken as
        its ``g`` queries (GQA). The same attention as ``attend_all`` up to float rounding, in a
        few ops instead of separate logits, softmax and outputs per part (on this CPU a step's
        attention is a few hundred small ops). Returns (1, H, d)."""
        _, h, d = q.shape
        s = ctx_slots.shape[0]
        k, v = k_cache[ctx_slots].to(q.dtype).transpose(0, 1), v_cache[ctx_slots].to(q.dtype).transpose(0, 1)
        h_kv = k.shape[0]
        mask = None
        if extra is not None:
            ek, ev, skip = extra.dense_kv(q.dtype)  # (H_kv, m, d), (H_kv, m)
            k, v = torch.cat([k, ek], 1), torch.cat([v, ev], 1)
            if skip is not None:  # additive, per KV head, broadcast over its query heads
                mask = q.new_zeros((1, h_kv, 1, k.shape[1]))
                mask[..., s:].masked_fill_(skip[None, :, None], float("-inf"))
        # 4-d (batch 1): CPU's fused (flash) kernel; 3-d inputs fall back to the unfused math path
        out = F.scaled_dot_product_attention(q.reshape(1, h_kv, h // h_kv, d), k.unsqueeze(0), v.unsqueeze(0),
                                             attn_mask=mask, scale=self.scaling)
        return out.reshape(1, h, d)

    def after_step(self) -> bool:
        """Compress when the prompt is done and a layer is over budget; True if compacted."""
        seq = self.seq
        if not self.policy.compresses or seq.num_computed_tokens < seq.num_prompt_tokens:
            return False
        if self.budget is None:
            self.budget = self.policy.budget_tokens(seq.num_prompt_tokens)
        # ``can_rewrite`` / ``wait_for_host`` set it again if the pool / host tier is still short
        self.compaction_due, self.host_wait = False, None
        compacted = self.policy.compress(self)
        self.settle_charge()
        return compacted

    def retry_compaction(self) -> bool:
        """Run the compaction put off (``compaction_due``) now, before the sequence's next
        step lays out its tokens: ``retry`` when its caller set one (a compressed prefix's
        boundary compression: ``LLMEngine._store_prefix``), else ``after_step``. True when
        none is due any more."""
        if self.compaction_due:
            retry, self.retry = self.retry, None
            self.compaction_due = False
            (retry or self.after_step)()
        return not self.compaction_due

    # ---- memory held outside the pool blocks ------------------------------------------------
    def outside_pool_bytes(self) -> int:
        """Bytes the policy holds for this sequence outside its pool blocks and outside the host
        tier's budget: device extras (codes, sentence index, recall region) plus host RAM no
        tier budget counts (``Policy.private_host_bytes``)."""
        return self.policy.extra_device_bytes(self) + self.policy.private_host_bytes(self)

    def settle_charge(self) -> None:
        """Hold ``ceil(outside_pool_bytes / bytes_per_block)`` charge blocks: give back the
        surplus, take what is missing from the free blocks, and record what the pool could
        not give as ``charge_debt``."""
        nbytes = self.outside_pool_bytes()
        self.seq.peak_policy_bytes = max(self.seq.peak_policy_bytes, nbytes)
        want = -(-nbytes // self.pool.bytes_per_block)
        surplus = len(self.charge_blocks) - want
        if surplus > 0:
            self.block_pool.free(self.charge_blocks[want:][::-1])
            del self.charge_blocks[want:]
        missing = max(0, want - len(self.charge_blocks))
        got = self.block_pool.allocate(missing) if missing else []
        if got is None:
            got = self.block_pool.allocate(self.block_pool.num_free_blocks()) or []
        self.charge_blocks += got
        self.charge_debt = missing - len(got)

    def hand_charge_over(self) -> None:
        """Give the charge blocks back: a fork running from this state pays for the bytes
        the two share (a session's kept history: ``cache_node.sessions``)."""
        self.block_pool.free(self.charge_blocks[::-1])
        self.charge_blocks, self.charge_debt = [], 0

    def pay_debt(self, blocks: list[KVBlock]) -> None:
        """Take ``blocks`` (``charge_debt`` of them, freshly allocated) as charge blocks."""
        self.charge_blocks += blocks
        self.charge_debt -= len(blocks)

    # ---- compaction -------------------------------------------------------------------------
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
            bits, group = self.policy.evicted_codes(self) or (self.policy.cold_bits, min(32, self.pool.head_dim))
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
        requests of other holders hold more of the tier than ``holder`` would with them
        (``TierManager.host_contenders``). True marks the compaction due
        (``compaction_due``, ``host_wait``, counted as ``can_rewrite``'s deferrals): the
        scheduler preempts those requests, largest holder first, and runs it again before
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

    # ---- accounting and forking -------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device-tier bytes this sequence holds: its blocks plus policy extras."""
        blocks = len(self.seq.block_table) * self.pool.bytes_per_block
        return blocks + self.policy.extra_device_bytes(self)

    def kept_counts(self) -> list[int]:
        """Valid (non-hole) entries per layer."""
        return (self.positions >= 0).sum(1).tolist()

    def fork(self, child: Sequence, policy: Policy | None = None) -> SequenceKV:
        """This state for ``child``, whose block table holds a copy of this sequence's blocks:
        layout, statistics, budget and the policy's extras copied (``extra`` values with a
        ``fork`` method are forked, e.g. host-tier sentences, whose slots the two then share;
        the rest are never mutated in place and are shared), under ``policy`` (default: this
        one; the quality harness forks a full-cache context under each policy). The child
        holds no charge blocks yet: call ``settle_charge``.

        What this state lost for want of room (``Policy.lost_tokens``) the child has lost too,
        and its ``policy_stats["inherited_dropped_tokens"]`` say so. Regression (hangs review
        20 W5): turns continuing a session whose history had dropped sentences reported nothing."""
        kv = SequenceKV(child, policy or self.policy, self.pool, self.block_pool, self.env, self.host)
        kv.positions, kv.support, kv.dense = self.positions.clone(), self.support.clone(), self.dense
        if self.stats is not None:  # else the new state's own (fresh) statistics
            kv.stats = self.stats.clone()
        kv.budget, kv.num_compactions = self.budget, self.num_compactions
        kv.extra = {k: (v.fork() if hasattr(v, "fork") else v) for k, v in self.extra.items()}
        child.num_evicted_tokens = self.seq.num_evicted_tokens
        kv.inherited_lost_tokens = self.policy.lost_tokens(self)
        if kv.inherited_lost_tokens:
            child.policy_stats["inherited_dropped_tokens"] = float(kv.inherited_lost_tokens)
        return kv
