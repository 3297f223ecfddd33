"""Step scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes take 1 token, unfinished prefills take a chunk),
then waiting sequences in the policy's order while budget, sequence slots and blocks allow (a
sequence whose prefetch is in flight is passed over until it lands, one whose compressed
prefix a running request computes until it is stored). When a running sequence
cannot get a block, the policy's victim is preempted (its blocks are freed, or demoted to the
host tier when the policy swaps, and it re-queues at the front; the prefix cache recovers its
KV). The policy (``cache_node.scheduling``, ``EngineConfig.scheduling_policy``) also decides
whether a blocked request holds the queue, and whether a higher class preempts a lower one
for a running slot or for blocks. ``fcfs`` (the default) is plain FCFS with head-of-line
blocking and newest-first preemption.

Progress is guaranteed under every policy: a request whose peak KV (``peak_tokens``) exceeds
the pool is refused at arrival, and when nothing runs and no waiting request could start, the
head of the queue gets every block that is not its own (other waiting requests' blocks are
freed, idle sessions unpinned through ``reclaim``); a head that still cannot start can never
start, and is given up (``take_rejected``: the engine finishes it with reason "length" when
it has output, else refuses it).
Idea: Orca iteration-level scheduling (Yu et al., OSDI'22), Sarathi chunked prefill (Agrawal et
al., OSDI'24), vLLM v1 scheduler.

``Scheduler`` holds the queues and the step's pick (``schedule``, ``_fill``); its parts live in
``cache_node.scheduling``: admission of waiting sequences (``waiting.WaitingAdmission``),
preemption (``preemption.Preemption``) and the step's size (``step_size.StepSizing``).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable

from cache_node.config import EngineConfig
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.model_runner import ScheduledBatch
from cache_node.scheduling import SchedulingPolicy, make_policy
from cache_node.scheduling.admission import Ewma, SpeedMeter, StepTimeModel
from cache_node.scheduling.base import requeue_by_priority
from cache_node.scheduling.preemption import DemoteFn
from cache_node.scheduling.step_size import StepSizing
from cache_node.scheduling.waiting import PrefixReuse, WaitingAdmission
from cache_node.sequence import Sequence, SequenceStatus


class Scheduler(WaitingAdmission, StepSizing):
    """Queues and the per-step pick.

    Args:
        config: step sizing and the scheduling policy's name.
        kv_manager: the pool's scheduler-facing API.
        policy: overrides ``config.scheduling_policy`` (tests pass configured instances).
        clock: monotonic seconds (tests inject a simulated clock).

    Attributes:
        rejected: sequences given up: refused at arrival (``peak_tokens`` over the pool) or a
            queue head that cannot start in an otherwise empty pool; the engine finishes them
            on its next step (``take_rejected``).
        max_seq_tokens: most tokens a sequence may reach (the engine's model context; None:
            no limit beyond max_tokens).
        reclaim: frees device blocks held outside the queues (the engine unpins idle
            sessions) until the first argument's number of blocks is free, for a request of
            the holder (cache namespace without its salt) given second, keeping the histories
            sessions keep for running turns when the third is True; None: nothing to free.
        session_tenants: the tenants with a session open on this node (its next turn comes
            here), handed to ``policy.keep_active`` each step; None: no sessions.
        prefixes: the engine's compressed prefixes (``waiting.PrefixReuse``): a waiting
            sequence forks a stored one when it starts (``_fork_prefix``) and waits for a
            running computation of one (``_awaits_prefix``); None: none.
        prefill_speed: prefill tokens per second of step time, measured online.
    """

    def __init__(
        self, config: EngineConfig, kv_manager: KVCacheManager, policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.kv_manager = kv_manager
        self.policy = policy or make_policy(config.scheduling_policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.rejected: list[Sequence] = []
        self.max_seq_tokens: int | None = None
        self.reclaim: Callable[[int, str, bool], None] | None = None
        self.session_tenants: Callable[[], Iterable[str]] | None = None
        self.prefixes: PrefixReuse | None = None
        self.prefill_speed = SpeedMeter()
        self.step_s = Ewma(prior=0.05)
        self.step_model = StepTimeModel()  # step seconds vs prefill tokens and decodes
        self._last_decode_s: dict[str, float] = {}  # request id -> when it last decoded
        # preempted request id -> (the waiting request it was preempted for, that one's
        # num_preemptions then): it waits until that one starts (``Preemption._held``)
        self._held_for: dict[str, tuple[Sequence, int]] = {}
        self.active_tenants: Counter[str] = Counter()  # waiting + running sequences per tenant
        self.num_preemptions = 0
        self._demote: DemoteFn | None = None
        self._swap_bytes_per_s = 0.0
        self._bytes_per_block = 0
        self._last_step: tuple[float, int, int] | None = None  # (start, prefill tokens, decodes)
        self._isolated_last = False  # the previous step ran interactive work only

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; one whose ``peak_tokens`` exceed the pool is given up at once."""
        if self.peak_tokens(seq) > self.pool_tokens:
            self.rejected.append(seq)
            return
        self.policy.on_arrival(seq, self.clock(), self.active_tenants)
        self.active_tenants[seq.tenant] += 1
        self.waiting.append(seq)
        requeue_by_priority(self.waiting)  # the tenant's own requests only (Sequence.priority)

    @property
    def pool_tokens(self) -> int:
        """The pool's capacity in tokens (blocks x block_size)."""
        return self.kv_manager.pool.num_blocks * self.kv_manager.block_size

    def peak_tokens(self, seq: Sequence) -> int:
        """Most KV slots ``seq`` holds at once when it runs alone: prompt + max_tokens (capped
        by ``max_seq_tokens``), or, under a compressing KV policy, at most the policy's
        ``max_pool_tokens`` (its whole prompt at the end of prefill, then what it keeps), but
        no less than the pool charge for what the policy keeps outside the pool once the prompt
        is compressed (``Policy.min_charge_tokens``: SentenceKV's demoted sentences on a node
        without a host tier). What decoding demotes later is not counted: a request whose
        charge then outgrows the pool is given up with "length" (``_reserve``), as at a
        context limit, so a request asking for all the pool leaves (``fill_context``) still
        runs.

        Regression (hangs review 18 H1): the charge was left out, so a SentenceKV request whose
        prompt's demoted sentences could never fit the pool beside what it keeps was admitted;
        it preempted itself every step, forever (since 6bb8353 it was given up "length" after
        its prefill; now it is refused at arrival)."""
        peak = seq.num_prompt_tokens + seq.sampling_params.max_tokens
        if self.max_seq_tokens is not None:
            peak = min(peak, self.max_seq_tokens)
        if seq.kv is not None:
            policy = seq.kv.policy
            peak = min(peak, policy.max_pool_tokens(seq.num_prompt_tokens))
            if seq.sampling_params.max_tokens > 1:  # one token: it ends before the charge is due
                peak = max(peak, policy.min_charge_tokens(seq.kv, seq.num_prompt_tokens))
        return peak

    def take_rejected(self) -> list[Sequence]:
        out, self.rejected = self.rejected, []
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.rejected)

    # ---- the step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: a list of (sequence, tokens to compute)."""
        now = self.clock()
        self._measure(now)
        if self.policy.orders_by_value:
            self._note_device_hits()
        if self.policy.preempts_for_class:
            self._preempt_for_slots(now)
        budget = self.config.max_num_batched_tokens
        running = list(self.running)
        urgent = self._urgent_prefill_pending(now)
        # never two isolated steps in a row: the other classes decode at least every other step
        urgent_only = not self._isolated_last and urgent
        self._isolated_last = urgent_only
        budget, decode_cap, capped, need = self._floor_sized_step(running, budget, urgent, now)
        batch = self._fill(running, budget, decode_cap, capped, need, urgent_only, now)
        if not batch and (decode_cap is not None or capped is not None or urgent_only):
            # a step's size bound or an isolated step never idles the node while work is
            # queued: run it unbounded (regression: with every chunk held back, nothing ran
            # for as long as an interactive tenant kept a session open, up to its 900 s TTL)
            batch = self._fill(running, self.config.max_num_batched_tokens, None, None, {}, False, now)
        if not batch and not self.running:
            self._unwedge(batch, self.config.max_num_batched_tokens, now)
        return self._scheduled(batch, now)

    def _scheduled(self, batch: ScheduledBatch, now: float) -> ScheduledBatch:
        """Tell the policy what ``batch`` runs and note the step for ``_measure``."""
        for seq, n in batch:
            self.policy.on_scheduled(seq, n, now)
        decodes = sum(n == 1 for _, n in batch)
        self._last_step = (now, sum(n for _, n in batch) - decodes, decodes) if batch else None
        return batch

    def schedule_alone(self, seq: Sequence) -> ScheduledBatch:
        """Only ``seq``'s next chunk, whatever the policy's order: the engine runs the step of
        a sequence that failed in a batch alone, to find whose it was (``LLMEngine._recover``);
        everything else waits this step. Empty when ``seq`` cannot get blocks."""
        now = self.clock()
        self._measure(now)
        budget = self.config.max_num_batched_tokens
        batch: ScheduledBatch = []
        if seq in self.running:
            n = min(seq.num_uncomputed_tokens, budget)
            n = seq.chunk_tokens(seq.num_computed_tokens, n, n, budget)  # a span is never split
            # a compaction put off at its last step runs first, as in ``_fill`` (regression,
            # hangs review 20 W4: the isolated step laid its tokens out over an uncompacted layout)
            if self._compact_due(seq, batch) and self._reserve(seq, n, batch):
                batch.append((seq, n))
        elif seq in self.waiting:
            n = self._admit(seq, budget)
            if n is not None:
                self._start(seq, n, batch)
        return self._scheduled(batch, now)

    def _fill(self, running: list[Sequence], budget: int, decode_cap: int | None, capped: int | None,
              need: dict[str, int], urgent_only: bool, now: float) -> ScheduledBatch:
        """One step's batch: ``running`` sequences first (decodes within ``decode_cap``,
        non-interactive prefill chunks within ``capped``: ``_floor_sized_step``), then waiting
        ones admitted in policy order, within ``budget`` tokens. ``urgent_only``: an isolated
        step, interactive work only."""
        batch: ScheduledBatch = []
        chunk_cap = budget
        # a running prefill leaves room for waiting requests that may join this step (in an
        # isolated step, only interactive ones may)
        joinable = any(not urgent_only or self.policy.rank(s) == 0 for s in self.waiting)
        if joinable and self.policy.prefill_chunk_share < 1.0:
            chunk_cap = max(1, int(budget * self.policy.prefill_chunk_share))
        for seq in running:
            if budget <= 0:  # (a prompt span may have taken it past 0)
                break
            if seq not in self.running:  # preempted by an earlier iteration
                continue
            if urgent_only and self.policy.rank(seq) > 0:
                continue  # sits out one short step for an interactive prefill
            n = min(seq.num_uncomputed_tokens, budget, chunk_cap)
            decode = seq.num_uncomputed_tokens == 1
            if decode and decode_cap is not None:
                if need.get(seq.tenant, 0) > 0:
                    need[seq.tenant] -= 1
                elif decode_cap <= 0:
                    continue  # not needed for a floor: sits out this step, first in line for the next
                decode_cap -= 1
            held_back = capped is not None and not decode and self.policy.rank(seq) > 0
            if held_back:
                n = min(n, capped)
                if n == 0:
                    continue
            # a compaction put off at its last step runs before the chunk is sized: it may give
            # the sequence its prompt spans (review 21c, F5)
            if not self._compact_due(seq, batch):
                continue
            hard = min(seq.num_uncomputed_tokens, self._step_left(batch))  # a span may pass ``budget``
            n = seq.chunk_tokens(seq.num_computed_tokens, n, max(hard, n), self.config.max_num_batched_tokens)
            if not self._reserve(seq, n, batch):
                continue
            batch.append((seq, n))
            budget -= n
            if held_back:
                capped = max(0, capped - n)
            if decode:
                self._last_decode_s[seq.request_id] = now
        self._admit_waiting(batch, budget, now, urgent_only, capped)
        return batch

    def _step_left(self, batch: ScheduledBatch) -> int:
        """Tokens the step can still take: ``max_num_batched_tokens`` less its batch's."""
        return self.config.max_num_batched_tokens - sum(n for _, n in batch)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues (blocks are the caller's)."""
        self._last_decode_s.pop(seq.request_id, None)
        self._held_for.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.status is not SequenceStatus.FINISHED and self.active_tenants[seq.tenant] > 0:
            self.active_tenants[seq.tenant] -= 1
            if not self.active_tenants[seq.tenant]:  # (regression s37: every tenant ever seen stayed)
                del self.active_tenants[seq.tenant]
                self.policy.on_idle(seq.tenant)
        seq.status = SequenceStatus.FINISHED
        self.policy.on_finished(seq)
