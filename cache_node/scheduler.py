"""Step scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes take 1 token, unfinished prefills take a chunk),
then waiting sequences in queue order while budget, sequence slots and blocks allow (a
sequence whose prefetch is in flight is passed over until it lands). When a
running sequence cannot get a block, the newest running sequence is preempted (its blocks are
freed and it re-queues at the front; the prefix cache usually recovers its KV). Ordering of the
waiting queue is the engine's FCFS default; the SLO scheduler reorders it from outside.
Idea: Orca iteration-level scheduling (Yu et al., OSDI'22), Sarathi chunked prefill (Agrawal et
al., OSDI'24), vLLM v1 scheduler.
"""

from __future__ import annotations

import time
from collections import deque

from cache_node.config import EngineConfig
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.model_runner import ScheduledBatch
from cache_node.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: a list of (sequence, tokens to compute)."""
        budget = self.config.max_num_batched_tokens
        batch: ScheduledBatch = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier iteration
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, batch):
                continue
            batch.append((seq, n))
            budget -= n
        now = time.monotonic()
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.prefetch_until_s > now:  # its blocks are on their way up; others go first
                continue
            n = self._admit(seq, budget)
            if n is None:
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocate slots for a running sequence, preempting the newest others if needed."""
        while self.kv_manager.allocate_slots(seq, n) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
            if any(s is victim for s, _ in batch):
                batch[:] = [(s, k) for s, k in batch if s is not victim]
        return True

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Reserve blocks for a waiting sequence's first chunk; None when it cannot start."""
        computed, num_cached = ([], 0)
        if not seq.block_table:  # a session turn arrives with its blocks attached
            computed, num_cached = self.kv_manager.get_computed_blocks(seq)
            computed = computed + self.kv_manager.promote_blocks(seq, computed)
            num_cached = len(computed) * self.kv_manager.block_size
        start = seq.num_computed_tokens + num_cached
        n = min(seq.num_tokens - start, budget)
        if self.kv_manager.allocate_slots(seq, n, computed) is None:
            return None
        seq.num_computed_tokens = start
        if seq.num_preemptions == 0 and not seq.output_token_ids:
            seq.num_cached_tokens = max(seq.num_cached_tokens, start)
        return n

    def preempt(self, seq: Sequence) -> None:
        """Recompute-preemption: free the blocks and put the sequence at the queue front."""
        self.running.remove(seq)
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues (blocks are the caller's)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
