"""Per-sequence KV layout under a policy: which token each physical slot holds, per layer.

Physical slot ``i`` of a sequence (its ``i``-th slot through the block table) holds, in layer
``l``, the token at absolute position ``positions[l, i]`` (-1 = a hole, masked out). Token
range diagram after a compaction::

    logical:  | 0 ............................ num_computed_tokens |
    physical: | kept (per layer, <= budget) | new tokens ... |
              |<------ frontier = num_computed_tokens - num_evicted_tokens ------>|

Keys are post-RoPE, so attention needs no positions beyond the causal mask; new tokens keep
their true absolute positions.

``SequenceKV`` holds the layout, the step's bookkeeping, the charge blocks and forking; its
attention (``attend``) lives in ``cache_node.kv_state_attention`` and its compaction (plans,
rewrites, deferral when the pool or the host tier is short) in ``cache_node.kv_state_compaction``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from cache_node.attention_stats import AttentionStats
from cache_node.block import KVBlock
from cache_node.block_pool import BlockPool
from cache_node.kv_pool import KVPool
from cache_node.kv_state_attention import SequenceKVAttention
from cache_node.kv_state_compaction import SequenceKVCompaction
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.policies.base import Policy, PolicyEnv
    from cache_node.tiers.manager import TierManager

log = logging.getLogger(__name__)


class SequenceKV(SequenceKVAttention, SequenceKVCompaction):
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
        if self.stats is not None:  # a compressed prefix's boundary ends a unit (review 22c)
            self.stats.begin_step(self.frontier, start, num_new, self.seq.prefix_stop or self.seq.num_prompt_tokens)

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
