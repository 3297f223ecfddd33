"""Admission of waiting sequences for the step scheduler: which of them start this step, with
how many tokens, and on what blocks.

Waiting sequences start in the policy's order while the step's token budget, sequence slots
and blocks allow (``_admit_waiting``); a sequence's first chunk reserves its blocks past its
prefix-cache hit, of which only the part its own prefill would have compressed the same way is
reused (``_admit``, ``_reusable_blocks``). A sequence whose blocks are on their way up from the
spill tier is passed over while waiting for them beats recomputing (``_awaits_prefetch``: ski
rental). A sequence that reuses a compressed prefix (``cache_node.compressed_prefix``) takes
its copy of the stored prefix when it starts, under the same block checks (``_fork_prefix``),
and is passed over while a running request of its class or a higher one computes that prefix
(``_awaits_prefix``). When nothing runs and nothing starts, the queue's head gets every block
that is not its own or is given up (``_unwedge``). ``WaitingAdmission`` is a part of
``cache_node.scheduler.Scheduler``; it preempts through ``Preemption``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from cache_node.scheduling.base import PREFETCH_TTFT_SHARE, order_by_priority
from cache_node.scheduling.preemption import Preemption
from cache_node.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from cache_node.model_runner import ScheduledBatch
    from cache_node.scheduling.admission import Ewma


class PrefixReuse(Protocol):
    """The engine's compressed prefixes as admission sees them
    (``cache_node.compressed_prefix.CompressedPrefixCache``)."""

    def computing(self, seq: Sequence) -> list[Sequence]:
        """Running sequences computing the prefix waiting ``seq`` would fork ([] if none)."""

    def started(self, seq: Sequence) -> None:
        """The scheduler started waiting ``seq`` (it runs now)."""

    def fork_blocks(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Blocks a fork of the stored prefix takes for waiting ``seq`` with ``num_new_tokens``
        laid out past it; None when ``seq`` forks nothing."""

    def fork(self, seq: Sequence) -> bool:
        """Copy the stored prefix into waiting ``seq``; False (nothing held) when it did not."""

    def unfork(self, seq: Sequence) -> None:
        """Give back what ``fork`` took."""


class WaitingAdmission(Preemption):
    """Admission methods of ``Scheduler`` (its queues, policy, KV manager and speeds)."""

    step_s: Ewma
    clock: Callable[[], float]
    _step_left: Callable[[ScheduledBatch], int]

    def _start(self, seq: Sequence, n: int, batch: ScheduledBatch) -> None:
        """A waiting sequence admitted with ``n`` tokens (``_admit``) joins ``batch``."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.append((seq, n))
        if self.prefixes is not None:
            self.prefixes.started(seq)

    def _note_device_hits(self) -> None:
        """``device_hit_tokens`` of every waiting sequence: its device prefix hit (a lookup, no
        side effects), or the blocks a session turn or a preempted swap-in arrives with."""
        bs = self.kv_manager.block_size
        for seq in self.waiting:
            if seq.block_table:
                seq.device_hit_tokens = len(seq.block_table) * bs
            elif self._fork_need(seq, 0) is not None:  # a stored compressed prefix to fork
                seq.device_hit_tokens = seq.prefix_tokens
            else:
                hit = self.kv_manager.get_computed_blocks(seq)[1]
                seq.device_hit_tokens = min(hit, self._reusable_blocks(seq) * bs)

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
        not fit are passed over without aging. An aged one that does not fit holds the blocks
        it waits for: after it, only requests of its class whose tenants hold fewer running
        blocks per unit of weight than its tenant are admitted (``_passes_aged``).
        ``urgent_only``: interactive ones only. ``capped``: the most tokens non-interactive
        ones may start with (floor-sized step)."""
        head_blocked = False
        aged: Sequence | None = None  # the aged request that did not fit, holding the queue
        for seq in order_by_priority(self.policy.order(self.waiting, now)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if urgent_only and self.policy.rank(seq) > 0:
                continue
            if aged is not None and not self._passes_aged(seq, aged):
                continue
            if seq.grammar is not None and not seq.grammar.ready:  # its grammar compiles; it holds no KV
                continue
            if self._awaits_prefetch(seq, now):  # its blocks are on their way up; others go first
                continue
            if self._held(seq):  # preempted for one still waiting: that one goes first
                continue
            if self._awaits_prefix(seq):  # forks the prefix a running request computes
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
                if not self.policy.skip_blocked:
                    break
                aged = seq
                continue
            self._start(seq, n, batch)
            budget -= n
            if held_back:
                capped -= n

    def _passes_aged(self, seq: Sequence, aged: Sequence) -> bool:
        """True when waiting ``seq`` may start although ``aged`` (a request passed over
        ``aging_steps`` times, ahead of it in policy order) does not fit: ``seq`` is of
        ``aged``'s class, its tenant, another, holds fewer blocks in running requests per unit
        of its weight than ``aged``'s tenant does, and the blocks ``seq`` needs to start are
        spare: the free blocks plus those ``aged``'s tenant holds in running requests cover
        ``aged``'s need and ``seq``'s together.

        Such a tenant is below the aged tenant's share of the pool, so it never holds the aged
        request off for good: each request it starts raises its hold, and once it reaches the
        aged tenant's (which falls as that tenant's running requests end, as none of its new
        ones start) nothing more passes, and the blocks freed go to the aged request. It waits
        for its own tenant's blocks only: those of other tenants' running requests are not taken
        from it by passers.

        Regression (s41 review r3 of e6c3505): passers needed only to be below the aged tenant's
        hold, so when the aged request waited for blocks other tenants held, ten tenants in
        rotation, each sending a short request a step and each below the hold of the aged
        tenant's one long decode, kept the pool full: that decode was preempted 39 times by
        their growth (its recomputes raised its tenant's VTC counter, sending the aged request
        behind theirs), and the aged request started 1713 steps after it arrived, not 66.

        Regression (s41 tenancy, noisy neighbour): the aged request ended admission for every
        tenant, so a tenant flooding a node with prompts that filled the pool made its own
        next prompt age, and another tenant's 20-token requests of the same class, which fit,
        waited behind it until the flooder's running requests ended (tests/slo_sim: 275 steps
        in tests/test_aged_request_tenants.py, up to 87 steps in a steady flood). Found while
        the other tenant's served TTFT on a loaded 2-core CPU node rose from 12 ms to seconds
        under such a flood; that figure is mostly CPU contention, and stayed so after this fix."""
        if seq.tenant == aged.tenant or self.policy.rank(seq) != self.policy.rank(aged):
            return False
        held: dict[str, int] = {seq.tenant: 0, aged.tenant: 0}
        for s in self.running:
            if s.tenant in held:
                held[s.tenant] += s.num_held_blocks
        share = self.policy.share
        if held[seq.tenant] / share(seq).weight >= held[aged.tenant] / share(aged).weight:
            return False
        # only blocks ``aged`` does not wait for: those past its need once its own tenant's
        # running requests end (they are what it waits for; the others' are not its to take)
        spare = self.kv_manager.pool.num_free_blocks() + held[aged.tenant] - self._blocks_to_first_token(aged)
        return self._blocks_to_first_token(seq) <= spare

    def _unwedge(self, batch: ScheduledBatch, budget: int, now: float) -> None:
        """Nothing runs and nothing was admitted: give the queue's head (in policy order, past
        requests waiting on a prefetch) every block that is not its own and admit it; a head
        that still cannot start never will, and is given up (``rejected``)."""
        ready = [s for s in order_by_priority(self.policy.order(self.waiting, now))
                 if not self._awaits_prefetch(s, now) and (s.grammar is None or s.grammar.ready)]
        if not ready:
            return  # prefetches in flight, grammars compiling: they land and the queue moves
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
        if self.prefixes is not None:
            self.prefixes.started(head)

    def _admit(self, seq: Sequence, budget: int, step_left: int | None = None) -> int | None:
        """Reserve blocks for a waiting sequence's first chunk of at most ``budget`` tokens (a
        prompt span may take it up to ``step_left``, the step's tokens left), after its copy of
        a stored compressed prefix (``_fork_prefix``); None, with nothing held, when it cannot
        start."""
        forked = self._fork_prefix(seq, budget, step_left)
        if forked is None:
            return None
        n = self._admit_chunk(seq, budget, step_left)
        if n is None and forked:
            assert self.prefixes is not None
            self.prefixes.unfork(seq)
        return n

    def _admit_chunk(self, seq: Sequence, budget: int, step_left: int | None) -> int | None:
        """``_admit`` past the fork: the first chunk's blocks, past a device prefix-cache hit
        for a sequence that arrives with no blocks."""
        computed, num_cached = ([], 0)
        # a session turn arrives with its blocks attached (a fork has its copy); a request taking
        # prompt logprobs reuses no block of positions it has not taken (``_reusable_blocks``)
        if not seq.block_table and (seq.sampling_params.prompt_logprobs is None or self._reusable_blocks(seq)):
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

    def _fork_prefix(self, seq: Sequence, budget: int, step_left: int | None) -> bool | None:
        """A waiting sequence that reuses a stored compressed prefix takes its copy now, as
        the scheduler starts it, under admission's block checks: the copy (its charge blocks
        included) and the most its first chunk may take must fit the free blocks, and, under a
        policy that ``admits_whole_prompt``, its whole prompt past the copy
        (``_whole_prompt_fits``). True: forked; False: nothing to fork (it computes its prefix,
        or has none); None: it does not fit (nothing taken).

        Regression (review 26a, F2): the copy was taken when the request arrived at the node,
        before the scheduler saw it: queued requests each held a copy of the prefix (~57
        blocks), the pool went to 0 free, stored prefixes were evicted and running requests
        preempted, none of it counted by admission."""
        first = min(seq.num_prompt_tokens - seq.prefix_tokens, max(budget, step_left or 0))
        need = self._fork_need(seq, first)
        if need is None:
            return False
        if need > self.kv_manager.pool.num_free_blocks():
            return None
        if self.policy.admits_whole_prompt and not self._whole_prompt_fits(seq, []):
            return None
        assert self.prefixes is not None
        return self.prefixes.fork(seq)

    def _awaits_prefix(self, seq: Sequence) -> bool:
        """Waiting ``seq`` reuses a compressed prefix that a running request of its SLO class
        or a higher one is computing now: it is passed over and forks the prefix once stored
        (compressed once, however many requests share it). A request the scheduler has not
        started (queued, or preempted) computes nothing, so nothing waits for it: the first
        that starts computes the prefix (``_admit``: no stored prefix to fork). Nor does
        ``seq`` wait for a lower class's computation, which the policy may run behind its own
        (isolated interactive steps, capped prefills): it computes the prefix itself, and the
        first to reach the boundary stores it.

        Regression (review 26a, F1): a request was parked outside the scheduler behind the
        first request of its prefix, whatever that one's state: an interactive tenant's
        request (5 s TTFT target) waited 21.0 s behind a batch tenant's queued one (1.83 s
        without it), a priority -1000 request behind its tenant's queued priority 1000 one."""
        if self.prefixes is None:
            return False
        rank = self.policy.rank(seq)
        return any(self.policy.rank(p) <= rank for p in self.prefixes.computing(seq))

    def next_to_start(self) -> list[Sequence]:
        """The waiting sequences admission considers first, in its order (the policy's, then
        each tenant's priorities): as many as one step may start (``max_num_seqs``)."""
        now = self.clock()
        return order_by_priority(self.policy.order(self.waiting, now))[: self.config.max_num_seqs]

    def num_awaiting_prefix(self) -> int:
        """Waiting sequences passed over for a running computation of their prefix."""
        return sum(1 for seq in self.waiting if self._awaits_prefix(seq))

    def _reusable_blocks(self, seq: Sequence) -> int:
        """Blocks of a new sequence's tokens a prefix-cache hit may cover: a reusable prefix
        is compressed from its own prefill, its step ending at the boundary (at least its
        last token is computed), and a KV policy gets the queries its statistics need
        computed (``SequenceKV.reusable_prompt_tokens``); a request taking prompt logprobs
        computes each prompt position it has not taken (``cache_node.prompt_logprobs``)."""
        limit = seq.num_tokens
        if seq.prefix_stop:
            limit = seq.prefix_stop - 1
        if seq.kv is not None:
            limit = min(limit, seq.kv.reusable_prompt_tokens())
        if seq.isolate_at is not None:  # a batched step computes up to it (``compute_end``)
            limit = min(limit, max(0, seq.isolate_at - 1))
        if seq.sampling_params.prompt_logprobs is not None:  # every prompt position's logits are needed
            limit = min(limit, seq.prompt_logprobs_done)  # (those taken before a preemption: reusable)
        return limit // self.kv_manager.block_size
