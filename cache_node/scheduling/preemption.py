"""Preemption for the step scheduler: freeing running slots and blocks for waiting or running
sequences, and swapping a victim's KV to the host tier when copying beats recomputing.

The policy picks each victim (``SchedulingPolicy.victim``); these methods move the blocks and
the queues. A victim's blocks are freed, or demoted below the device tier when the policy
``swaps_on_preempt`` and the round trip copies faster than the node re-prefills (``attach_swap``),
and it re-queues at the front, where the prefix cache recovers its KV. ``Preemption`` is a part
of ``cache_node.scheduler.Scheduler``. Idea: vLLM's recompute vs swap preemption (Kwon et al.,
SOSP'23, §4.5).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import cdiv
from cache_node.scheduling.base import order_by_priority
from cache_node.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from cache_node.config import EngineConfig
    from cache_node.kv_cache_manager import KVCacheManager
    from cache_node.model_runner import ScheduledBatch
    from cache_node.scheduling.admission import SpeedMeter
    from cache_node.scheduling.base import SchedulingPolicy

DemoteFn = Callable[[list[KVBlock]], int]


class Preemption:
    """Preemption methods of ``Scheduler`` (its queues, policy, KV manager and speeds)."""

    config: EngineConfig
    kv_manager: KVCacheManager
    policy: SchedulingPolicy
    waiting: deque[Sequence]
    running: list[Sequence]
    reclaim: Callable[[int], None] | None
    prefill_speed: SpeedMeter
    num_preemptions: int
    _demote: DemoteFn | None
    _bytes_per_block: int
    _swap_bytes_per_s: float

    def attach_swap(self, demote: DemoteFn, bytes_per_block: int, copy_bytes_per_s: float = 4e9) -> None:
        """Let preemption demote a victim's blocks below the device tier (``demote`` moves free
        cached blocks and returns how many moved) when the policy swaps and the round-trip copy
        at ``copy_bytes_per_s`` is cheaper than recomputing at the measured prefill speed."""
        self._demote, self._bytes_per_block, self._swap_bytes_per_s = demote, bytes_per_block, copy_bytes_per_s

    def _free_held_elsewhere(self, seq: Sequence) -> None:
        """Free the blocks of every waiting sequence but ``seq`` (they recompute, finding their
        KV in the prefix cache) and let ``reclaim`` free the rest of the pool."""
        for other in self.waiting:
            if other is not seq and other.block_table:
                self.kv_manager.free(other)
                other.restart()
        if self.reclaim is not None:
            self.reclaim(self.kv_manager.pool.num_blocks)

    def _preempt_for_slots(self, now: float) -> None:
        """Free running slots for waiting sequences of a higher class than some running one,
        each only for a sequence that the victim's blocks let start (``_starts_after``).

        Regression: a standard request whose prompt did not fit the free blocks preempted a
        batch request for its slot every step; the batch tenant, below its floor, came first
        in the waiting order and was admitted back into the slot the same step, so it was
        preempted 66 times in 450 steps (each a demotion to the host tier under swapping)."""
        for seq in order_by_priority(self.policy.order(self.waiting, now)):
            if len(self.running) < self.config.max_num_seqs:
                return
            victim = self.policy.victim(self.running, seq)
            if victim is None:
                return
            if self._starts_after(seq, victim):
                self.preempt(victim)

    def _blocks_to_first_token(self, seq: Sequence) -> int:
        """Blocks ``seq`` still has to allocate to hold its tokens plus the next output one
        (past the tokens a session's kept policy state already compacted away:
        ``num_evicted_tokens``)."""
        need = cdiv(seq.num_tokens - seq.num_evicted_tokens + 1, self.kv_manager.block_size)
        return max(0, need - len(seq.block_table))

    def _prefill_reserve(self, skip: Sequence | None = None) -> int:
        """Free blocks the running prefills (but ``skip``) still need to reach their first
        output token: admission leaves them alone."""
        return sum(self._blocks_to_first_token(s) for s in self.running
                   if s is not skip and s.num_uncomputed_tokens > 1)

    def _starts_after(self, seq: Sequence, victim: Sequence) -> bool:
        """Under a policy that ``admits_whole_prompt``: ``seq``'s whole prompt, past its
        device prefix hit (``device_hit_tokens``), fits the free blocks plus ``victim``'s,
        beside the other running prefills' reserve; always True under other policies."""
        if not self.policy.admits_whole_prompt:
            return True
        hit = seq.device_hit_tokens // self.kv_manager.block_size - len(seq.block_table)
        need = self._blocks_to_first_token(seq) - max(0, hit)
        free = self.kv_manager.pool.num_free_blocks() + victim.num_held_blocks
        return need <= 0 or need <= free - self._prefill_reserve(skip=victim)

    def _preempt_from_batch(self, victim: Sequence, batch: ScheduledBatch) -> int:
        """Preempt ``victim``; drop it from this step's batch. Returns the budget given back."""
        refund = sum(k for s, k in batch if s is victim)
        batch[:] = [(s, k) for s, k in batch if s is not victim]
        self.preempt(victim)
        return refund

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocate slots for a running sequence, preempting the policy's victims if needed.
        Alone, it first takes the blocks other waiting sequences and idle sessions hold."""
        if self.kv_manager.allocate_slots(seq, n) is not None:
            return True
        if self.running == [seq]:
            self._free_held_elsewhere(seq)
        while self.kv_manager.allocate_slots(seq, n) is None:
            victim = self.policy.victim(self.running, seq)
            assert victim is not None, "a running sequence always has a victim (itself at worst)"
            self._preempt_from_batch(victim, batch)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the blocks (demoting them when swapping is cheaper) and re-queue at the front."""
        cached = [b for b in seq.block_table if b.block_hash is not None]
        self.running.remove(seq)
        self.kv_manager.free(seq)
        if cached and self._swap_cheaper(len(cached)):
            self._demote(cached)  # type: ignore[misc]
        seq.restart()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _swap_cheaper(self, num_blocks: int) -> bool:
        if self._demote is None or not self.policy.swaps_on_preempt:
            return False
        copy_s = 2 * num_blocks * self._bytes_per_block / self._swap_bytes_per_s
        recompute_s = num_blocks * self.kv_manager.block_size / self.prefill_speed.tokens_per_s
        return copy_s < recompute_s
