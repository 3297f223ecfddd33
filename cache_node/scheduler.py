"""Step scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step: running sequences first (decodes take 1 token, unfinished prefills take a chunk),
then waiting sequences in the policy's order while budget, sequence slots and blocks allow (a
sequence whose prefetch is in flight is passed over until it lands). When a running sequence
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
from cache_node.scheduling.base import PREFETCH_TTFT_SHARE, order_by_priority, requeue_by_priority
from cache_node.scheduling.preemption import DemoteFn, Preemption
from cache_node.sequence import Sequence, SequenceStatus


class Scheduler(Preemption):
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

    def _start(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        """A waiting sequence admitted with ``n`` tokens (``_admit``) joins ``batch``."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.append((seq, n))

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

    def _note_device_hits(self) -> None:
        """``device_hit_tokens`` of every waiting sequence: its device prefix hit (a lookup, no
        side effects), or the blocks a session turn or a preempted swap-in arrives with."""
        bs = self.kv_manager.block_size
        for seq in self.waiting:
            if seq.block_table:
                seq.device_hit_tokens = len(seq.block_table) * bs
            else:
                hit = self.kv_manager.get_computed_blocks(seq)[1]
                seq.device_hit_tokens = min(hit, self._reusable_blocks(seq) * bs)

    def _urgent_prefill_pending(self, now: float) -> bool:
        """An interactive request waits (and may start) or has prompt tokens left, under a
        policy that isolates such prefills (``isolates_urgent_prefill``)."""
        if not self.policy.isolates_urgent_prefill:
            return False
        if any(self.policy.rank(s) == 0 and not self._awaits_prefetch(s, now) for s in self.waiting):
            return True
        return any(self.policy.rank(s) == 0 and s.num_uncomputed_tokens > 1
                   for s in self.running)

    def _awaits_prefetch(self, seq: Sequence, now: float) -> bool:
        """``seq``'s blocks are on their way up from the spill tier and it waits for them: until
        ``prefetch_until_s``, or, under a policy that ``bounds_prefetch_wait``, only while it has
        waited (since its arrival, when its prefetch started) less than recomputing its prompt
        past its device prefix hit would take at the measured prefill speed, and less than
        ``PREFETCH_TTFT_SHARE`` of its TTFT target. Ski rental (the 2-competitive rule: wait at
        most what the alternative costs): a prefetch that has not landed by then can only lose
        against recomputing, and a slow spill read (a busy spill node, a put ahead of it) no
        longer spends a request's TTFT target. (The recompute cost counts host-tier tokens too,
        which come back by copy; the TTFT share bounds the wait of a long turn whose history
        sits in the host tier.) A request passed over waits for the whole step about to run,
        so it waits only while its next chance, a step (``step_s``) later, is still within
        the bound: a bound shorter than a step is never waited (issue 21: the interactive
        tenant's short first turns and its reads waited a 0.2-0.5 s step for a spill lookup
        worth 0.1-0.2 s of recompute)."""
        if seq.prefetch_until_s <= now:
            return False
        if not self.policy.bounds_prefetch_wait:
            return True
        tokens = seq.num_tokens - max(seq.num_computed_tokens, seq.device_hit_tokens)
        limit_s = min(tokens / self.prefill_speed.tokens_per_s,
                      PREFETCH_TTFT_SHARE * self.policy.share(seq).ttft_slo_ms / 1000.0)
        return now - seq.arrival_time_s + self.step_s.value < limit_s

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, now: float,
                       urgent_only: bool = False, capped: int | None = None) -> None:
        """Admit waiting sequences in policy order. The first one that does not fit either ends
        admission, or (``skip_blocked``) is passed over until it has aged; later ones that do
        not fit are passed over without aging. ``urgent_only``: interactive ones only.
        ``capped``: the most tokens non-interactive ones may start with (floor-sized step)."""
        head_blocked = False
        for seq in order_by_priority(self.policy.order(self.waiting, now)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if urgent_only and self.policy.rank(seq) > 0:
                continue
            if self._awaits_prefetch(seq, now):  # its blocks are on their way up; others go first
                continue
            if self._held(seq):  # preempted for one still waiting: that one goes first
                continue
            held_back = capped is not None and self.policy.rank(seq) > 0
            if held_back and capped == 0:
                continue
            limit = (lambda b, c=capped: min(b, c)) if held_back else (lambda b: b)
            n = self._admit(seq, limit(budget), self._step_left(batch))
            while n is None and self.policy.preempts_for_class:
                victims = self._victims_to_start(seq)  # only victims that let it start
                if not victims:
                    break
                for victim in victims:
                    budget += self._preempt_from_batch(victim, batch, seq)
                n = self._admit(seq, limit(budget), self._step_left(batch))
            if n is None:
                if head_blocked and self.policy.skip_blocked:
                    continue
                head_blocked = True
                if self.policy.passed_over(seq):
                    continue
                break
            self._start(seq, n, batch)
            budget -= n
            if held_back:
                capped -= n

    def _floor_sized_step(self, running: list[Sequence], budget: int, urgent: bool,
                          now: float) -> tuple[int, int | None, int | None, dict[str, int]]:
        """Size the step to a decoding tenant's token-rate floor, if any: returns the token
        budget, the decodes the step has room for, the tokens left for other prefills (both
        None when no floor applies), and per tenant the decodes its floor needs this step
        (``policy.floor_decodes``; the others may sit out). Sorts ``running`` decodes first:
        floors, then by class, the one that waited longest first."""
        if self.session_tenants is not None:
            self.policy.keep_active(self.session_tenants(), now)
        target_s = self.policy.step_target_s(self.running, now)
        if target_s is None:
            return budget, None, None, {}
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        floors: dict[str, tuple[int, float]] = {}
        for seq in decodes:
            floor = self.policy.share(seq).min_tokens_per_s
            if floor > 0:
                floors[seq.tenant] = (floors.get(seq.tenant, (0, floor))[0] + 1, floor)
        need = {t: self.policy.floor_decodes(floor, k, target_s) for t, (k, floor) in floors.items()}
        plan = self.step_model.step_budget(target_s, len(decodes), sum(need.values()), budget)
        running.sort(key=lambda s: (s.num_uncomputed_tokens > 1,
                                    self.policy.share(s).min_tokens_per_s <= 0,
                                    self.policy.rank(s), self._last_decode_s.get(s.request_id, 0.0)))
        if plan is None:
            return budget, None, None, need
        decode_cap, capped = plan
        if not urgent:  # an interactive prefill is exempt (its TTFT): not capped
            budget = min(budget, decode_cap + capped)
        return budget, decode_cap, capped, need

    def _unwedge(self, batch: ScheduledBatch, budget: int, now: float) -> None:
        """Nothing runs and nothing was admitted: give the queue's head (in policy order, past
        requests waiting on a prefetch) every block that is not its own and admit it; a head
        that still cannot start never will, and is given up (``rejected``)."""
        ready = [s for s in order_by_priority(self.policy.order(self.waiting, now)) if not self._awaits_prefetch(s, now)]
        if not ready:
            return  # prefetches in flight: their blocks land and the queue moves
        head = ready[0]
        pool, need = self.kv_manager.pool, self._blocks_to_first_token(head)
        self._free_held_elsewhere(head, lambda: pool.num_free_blocks() >= need)
        n = self._admit(head, budget)
        if n is None:  # the estimate fell short (e.g. a hit it counted went): free the rest
            self._free_held_elsewhere(head, lambda: False)
            n = self._admit(head, budget)
        self.waiting.remove(head)
        if n is None:
            self.rejected.append(head)
            return
        head.status = SequenceStatus.RUNNING
        self.running.append(head)
        batch.append((head, n))

    def _step_left(self, batch: ScheduledBatch) -> int:
        """Tokens the step can still take: ``max_num_batched_tokens`` less its batch's."""
        return self.config.max_num_batched_tokens - sum(n for _, n in batch)

    def _admit(self, seq: Sequence, budget: int, step_left: int | None = None) -> int | None:
        """Reserve blocks for a waiting sequence's first chunk of at most ``budget`` tokens (a
        prompt span may take it up to ``step_left``, the step's tokens left); None when it
        cannot start."""
        computed, num_cached = ([], 0)
        if not seq.block_table:  # a session turn arrives with its blocks attached
            computed, num_cached = self.kv_manager.get_computed_blocks(seq)
            computed = computed + self.kv_manager.promote_blocks(seq, computed)
            computed = computed[: self._reusable_blocks(seq)]
            num_cached = len(computed) * self.kv_manager.block_size
        start = seq.num_computed_tokens + num_cached
        soft = min(seq.compute_end(start) - start, budget)
        n = seq.chunk_tokens(start, soft, max(soft, step_left if step_left is not None else budget),
                             self.config.max_num_batched_tokens)  # a prompt span is not split if it fits
        if self.policy.admits_whole_prompt and not self._whole_prompt_fits(seq, computed):
            return None
        if not self._room_to_compact(seq, computed):
            return None
        if self.kv_manager.allocate_slots(seq, n, computed) is None:
            return None
        seq.num_computed_tokens = start
        if seq.num_preemptions == 0 and not seq.output_token_ids:
            seq.num_cached_tokens = max(seq.num_cached_tokens, start)
        return n

    def _reusable_blocks(self, seq: Sequence) -> int:
        """Blocks of a new sequence's tokens a prefix-cache hit may cover: a reusable prefix
        is compressed from its own prefill, its step ending at the boundary (at least its
        last token is computed), and a KV policy gets the queries its statistics need
        computed (``SequenceKV.reusable_prompt_tokens``)."""
        limit = seq.num_tokens
        if seq.prefix_stop:
            limit = seq.prefix_stop - 1
        if seq.kv is not None:
            limit = min(limit, seq.kv.reusable_prompt_tokens())
        if seq.isolate_at is not None:  # a batched step computes up to it (``compute_end``)
            limit = min(limit, max(0, seq.isolate_at - 1))
        return limit // self.kv_manager.block_size

    def _measure(self, now: float) -> None:
        """Attribute the time since the last non-empty schedule to that step's tokens.

        Only steps of at least a quarter of the token budget feed the prefill speed (small
        steps are dominated by fixed costs and would understate a queue's drain rate).
        """
        if self._last_step is not None:
            start, prefill_tokens, decodes = self._last_step
            num_tokens = prefill_tokens + decodes
            self.step_s.update(now - start)
            self.step_model.observe(prefill_tokens, decodes, now - start)
            if 4 * num_tokens >= self.config.max_num_batched_tokens:
                self.prefill_speed.observe(num_tokens, now - start)
        self._last_step = None

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
        seq.status = SequenceStatus.FINISHED
        self.policy.on_finished(seq)
