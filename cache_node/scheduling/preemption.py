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

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import cdiv
from cache_node.scheduling.base import order_by_priority
from cache_node.sequence import Sequence, SequenceStatus
from cache_node.tiers.fair_lru import holder_of

if TYPE_CHECKING:
    from cache_node.config import EngineConfig
    from cache_node.kv_cache_manager import KVCacheManager
    from cache_node.model_runner import ScheduledBatch
    from cache_node.scheduling.admission import SpeedMeter
    from cache_node.scheduling.base import SchedulingPolicy
    from cache_node.scheduling.waiting import PrefixReuse

DemoteFn = Callable[[list[KVBlock]], int]


class Preemption:
    """Preemption methods of ``Scheduler`` (its queues, policy, KV manager and speeds)."""

    config: EngineConfig
    kv_manager: KVCacheManager
    policy: SchedulingPolicy
    waiting: deque[Sequence]
    running: list[Sequence]
    reclaim: Callable[[int, str, bool], None] | None
    prefill_speed: SpeedMeter
    num_preemptions: int
    _demote: DemoteFn | None
    _bytes_per_block: int
    _swap_bytes_per_s: float
    _reusable_blocks: Callable[[Sequence], int]
    _awaits_prefix: Callable[[Sequence], bool]
    prefixes: PrefixReuse | None
    _held_for: dict[str, tuple[Sequence, int]]
    rejected: list[Sequence]

    def attach_swap(self, demote: DemoteFn, bytes_per_block: int, copy_bytes_per_s: float = 4e9) -> None:
        """Let preemption demote a victim's blocks below the device tier (``demote`` moves free
        cached blocks and returns how many moved) when the policy swaps and the round-trip copy
        at ``copy_bytes_per_s`` is cheaper than recomputing at the measured prefill speed."""
        self._demote, self._bytes_per_block, self._swap_bytes_per_s = demote, bytes_per_block, copy_bytes_per_s

    def _free_held_elsewhere(self, seq: Sequence, ready: Callable[[], bool], keep_kept: bool = False) -> bool:
        """Free blocks held outside the running batch for ``seq`` until ``ready()`` (called
        after each step, never again once True): first the blocks of waiting sequences but
        ``seq`` (they recompute, finding their KV in the prefix cache), one sequence at a
        time, then what ``reclaim`` frees for ``seq``'s holder (the engine's idle sessions and
        stored prefixes, largest holder first, then kept histories unless ``keep_kept``), one
        more block's worth at a time. Returns whether ``ready()`` held.

        Regression (hangs review 19 O1): a lone request one block short reclaimed the whole
        pool: every idle session's compacted state and every stored compressed prefix went
        (15 of 18 blocks freed for one), and the most recently used session then prefilled
        its history again and decoded other tokens than with its state kept.
        """
        if ready():
            return True
        for other in list(self.waiting):
            if other is not seq and other.block_table:
                self.kv_manager.free(other)
                other.restart()
                if ready():
                    return True
        if self.reclaim is None:
            return False
        pool = self.kv_manager.pool
        while True:
            free = pool.num_free_blocks()
            self.reclaim(free + 1, holder_of(seq.cache_namespace), keep_kept)
            if ready():
                return True
            if pool.num_free_blocks() == free:
                return False

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
            if self._held(seq) or self._awaits_prefix(seq):
                continue  # it waits for another: a slot freed for it would stay empty
            victim = self.policy.victim(self.running, seq)
            if victim is None:
                return
            if self._starts_after(seq, [victim]):
                self.preempt_for(victim, seq)

    def _fork_need(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Blocks waiting ``seq``'s fork of a stored compressed prefix takes with
        ``num_new_tokens`` laid out past it (``PrefixReuse.fork_blocks``); None when it forks
        none."""
        if seq.block_table or self.prefixes is None:
            return None
        return self.prefixes.fork_blocks(seq, num_new_tokens)

    def _blocks_to_first_token(self, seq: Sequence) -> int:
        """Blocks ``seq`` still has to allocate to hold its tokens plus the next output one
        (past the tokens a session's kept policy state already compacted away:
        ``num_evicted_tokens``; for a waiting sequence that forks a stored compressed prefix,
        its copy, charge blocks and the tokens past the prefix: ``_fork_need``)."""
        fork = self._fork_need(seq, seq.num_tokens - seq.prefix_tokens + 1)
        if fork is not None:
            return fork
        need = cdiv(seq.num_tokens - seq.num_evicted_tokens + 1, self.kv_manager.block_size)
        return max(0, need - len(seq.block_table))

    def _prefill_reserve(self, skip: Iterable[Sequence] = ()) -> int:
        """Free blocks the running prefills (but those in ``skip``) still need to reach their
        first output token: admission leaves them alone."""
        skipped = {id(s) for s in skip}
        return sum(self._blocks_to_first_token(s) for s in self.running
                   if id(s) not in skipped and s.num_uncomputed_tokens > 1)

    def _hit_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The device prefix-cache blocks ``_admit`` would reuse for waiting ``seq`` (a lookup,
        no side effects; none for one that arrives with its blocks attached, nor for one that
        forks a stored compressed prefix)."""
        if seq.block_table or self._fork_need(seq, 0) is not None:
            return []
        return self.kv_manager.get_computed_blocks(seq)[0][: self._reusable_blocks(seq)]

    def _whole_prompt_fits(self, seq: Sequence, hits: list[KVBlock],
                           victims: Iterable[Sequence] = ()) -> bool:
        """Once ``victims`` are preempted, the free blocks cover the rest of ``seq``'s prompt
        plus its first output token past its prefix ``hits`` (``_blocks_to_first_token``),
        beside what the other running prefills still need for theirs (``_prefill_reserve``).
        A hit that sits free (cached, no holder once the victims are gone) is not free room
        for the rest: reviving it takes a free block, as ``allocate_slots`` counts it.

        Regression: a request was admitted when its prompt fit the free blocks, though a
        running prefill needed them for the rest of its own prompt: the two prefills then
        preempted each other by turns (``_reserve``), each losing the KV it had computed
        (two pool-filling prompts: one was preempted with its 900-token prefill done, one
        token before its output; with a third tenant, 151 preemptions in 917 steps).

        Regression: a hit block that sat free was counted twice, as computed and as free:
        an interactive request that had preempted itself for want of blocks (``_reserve``)
        was readmitted with a prompt that could not fit beside the running one, preempting a
        batch request below its floor for it, then preempted itself again one step later,
        every other step (119 preemptions in 423 steps, the batch one readmitted between).
        """
        victims = list(victims)
        refs = Counter(id(b) for v in victims for b in v.block_table)
        released = {id(b): b for v in victims for b in v.block_table}
        freed = sum(1 for k, b in released.items() if b.ref_cnt <= refs[k])
        revived = sum(1 for b in hits if b.ref_cnt <= refs[id(b)])
        debt = seq.kv.charge_debt if seq.kv is not None else 0
        need = self._blocks_to_first_token(seq) - len(hits)
        if need <= 0 and not revived and not debt:
            return True
        free = self.kv_manager.pool.num_free_blocks() + freed - self._prefill_reserve(victims)
        return max(need, 0) + revived + debt <= free

    def _room_to_compact(self, seq: Sequence, hits: list[KVBlock]) -> bool:
        """Whether waiting ``seq`` may start as far as its first compaction goes: a compressing
        sequence whose prefix ``hits`` running sequences also hold copies the kept ones on write
        then (``compaction.rewrite_kv``), so the free blocks must cover those copies beside the
        rest of its prompt (``_blocks_to_first_token``) and the running prefills' needs
        (``_prefill_reserve``). True when there are none to copy.

        Regression: such a sequence was admitted, found no blocks for the copies at its prompt's
        end, was preempted for them (``_compact_due``) and admitted again, every other step
        for as long as the sequence sharing its prefix ran (15-57 preemptions of one request
        in the hangs review's R1/R1b runs).
        """
        kv = seq.kv
        if kv is None or not kv.policy.compresses or not hits:
            return True
        bs = self.kv_manager.block_size
        kept = cdiv(kv.policy.budget_tokens(seq.num_prompt_tokens) + kv.policy.evict_every + 1, bs)
        held = {id(b) for s in self.running for b in s.block_table}
        copies = sum(1 for b in hits[:kept] if id(b) in held)
        if not copies:
            return True
        need = max(0, self._blocks_to_first_token(seq) - len(hits))
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        return need + revived + copies <= self.kv_manager.pool.num_free_blocks() - self._prefill_reserve()

    def _starts_after(self, seq: Sequence, victims: list[Sequence]) -> bool:
        """Under a policy that ``admits_whole_prompt``: ``seq``'s whole prompt, past its
        device prefix hit, fits once ``victims`` are preempted (``_whole_prompt_fits``);
        always True under other policies."""
        if not self.policy.admits_whole_prompt:
            return True
        return self._whole_prompt_fits(seq, self._hit_blocks(seq), victims)

    def _victims_to_start(self, seq: Sequence) -> list[Sequence]:
        """The policy's victims for waiting ``seq`` in its order (each chosen from the running
        sequences the earlier ones leave), up to the first of them whose preemption together
        lets ``seq`` start (``_starts_after``); [] when even all of them would not.

        Regression: admission preempted the policy's victims one by one until the waiting
        request fit or none was left, so victims were thrown out for a request that still
        could not start (two interactive tenants with floors: a floor victim taken for a
        prompt that did not fit beside the rest, 9 preemptions in 424 steps where 4 in 338
        do)."""
        left, victims = list(self.running), []
        while (victim := self.policy.victim(left, seq)) is not None:
            victims.append(victim)
            left.remove(victim)
            if self._starts_after(seq, victims):
                return victims
        return []

    def _preempt_from_batch(self, victim: Sequence, batch: ScheduledBatch,
                            incoming: Sequence | None = None) -> int:
        """Preempt ``victim`` (for waiting ``incoming``, if given: ``preempt_for``); drop it
        from this step's batch. Returns the budget given back."""
        refund = sum(k for s, k in batch if s is victim)
        batch[:] = [(s, k) for s, k in batch if s is not victim]
        if incoming is None:
            self.preempt(victim)
        else:
            self.preempt_for(victim, incoming)
        return refund

    def preempt_for(self, victim: Sequence, incoming: Sequence) -> None:
        """Preempt ``victim`` to let waiting ``incoming`` start; ``victim`` then waits until
        ``incoming`` has started (or left), whatever the waiting order (``_held``).

        Regression: with one slot, a batch request below its floor, preempted for a
        standard request's slot, came first in the waiting order and took the slot back the
        same step, 13 steps in a row (13 preemptions, the standard request kept out)."""
        self.preempt(victim)
        self._held_for[victim.request_id] = (incoming, incoming.num_preemptions)

    def _held(self, seq: Sequence) -> bool:
        """``seq`` was preempted for a request that still waits in the same wait (not
        started since, nor finished, nor given up): the room it gave up is that request's."""
        hold = self._held_for.get(seq.request_id)
        if hold is None:
            return False
        incoming, preemptions = hold
        if (incoming.status is SequenceStatus.WAITING and incoming.num_preemptions == preemptions
                and incoming in self.waiting):
            return True
        del self._held_for[seq.request_id]
        return False

    def _compact_due(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Run the compaction ``seq``'s policy put off at its last step for want of free
        blocks (``SequenceKV.compaction_due``: copy-on-write of blocks another running request
        or a fork shares), before its next step lays out its tokens, preempting the policy's
        victims for the blocks as ``_reserve`` does; alone, ``seq`` first takes the blocks
        waiting sequences and idle sessions hold. False when ``seq`` itself was preempted (it
        waits for the others to give the blocks back). Should nothing free them (``seq``
        alone), it steps as deferred (counted, ``compactions_deferred``).

        A compaction put off for host-tier room (``SequenceKV.wait_for_host``) preempts the
        requests of the tenants holding the tier over their share instead
        (``TierManager.host_contenders``), largest holder per weight first, until it runs; the policy's
        victims would free pool blocks, not host slots. Only requests of ``seq``'s class or a
        lower one give way (``rank``): a batch tenant's compaction never preempts an
        interactive tenant's request (review of e3eb2b5, F2: it did, and the interactive
        request dropped 348 tokens on its restart instead of 24).

        Regression: a compaction put off was tried again only after the next forward pass, so
        a request whose prompt blocks another running request shared decoded step after step
        over its whole uncompressed prompt, and other tokens than alone (hangs review R1).
        """
        kv = seq.kv
        if kv is None or kv.retry_compaction():
            return True
        while kv.host_wait is not None:
            assert kv.host is not None and kv.host.host_contenders is not None
            victims = [s for s in kv.host.host_contenders(*kv.host_wait, seq) if s is not seq and s in self.running]
            if not victims:  # none left to give way: the compaction drops what does not fit
                kv.host_wait = None
                break
            self._preempt_from_batch(victims[0], batch)
            if kv.retry_compaction():
                return True
        if not self._preempt_until(seq, batch, lambda: kv.retry_compaction() or self.running == [seq]):
            return False
        if kv.compaction_due:  # alone
            self._free_held_elsewhere(seq, kv.retry_compaction)
        return True

    def settle_compaction(self, seq: Sequence) -> bool:
        """Run the compaction a finished session turn's policy put off at its last step
        (``SequenceKV.compaction_due``), before its session takes the state as the history's
        (``LLMEngine._finish``): as ``_compact_due`` would before a next step, the requests of
        tenants holding the host tier over their share give way for a host-tier wait (of
        ``seq``'s class or lower), running requests of its class or lower for pool blocks
        (newest first: the turn, which a running compaction might have preempted, is done;
        never a session turn under a compressing policy), then waiting requests
        and idle states (``_free_held_elsewhere``; kept histories stay). A host-tier
        wait that nothing can end drops what the tier cannot hold (counted, ``dropped_tokens``),
        as a running request's does. False when the compaction still cannot run (the pool
        has no blocks for its copy-on-write): the caller must not keep the state."""
        kv = seq.kv
        if kv is None or kv.retry_compaction():
            return True
        batch: ScheduledBatch = []  # nothing runs: the victims only give their blocks back
        while kv.host_wait is not None:
            assert kv.host is not None and kv.host.host_contenders is not None
            victims = [s for s in kv.host.host_contenders(*kv.host_wait, seq) if s in self.running]
            if not victims:
                kv.no_host_wait = True  # none can give way: drop what does not fit, counted
                kv.retry_compaction()
                kv.no_host_wait = False
                break
            self._preempt_from_batch(victims[0], batch)
            if kv.retry_compaction():
                return True
        rank = self.policy.rank
        while kv.compaction_due:  # newest first, as ``victim``; never a higher class
            # nor a session turn under a compressing policy: this step's output of it has not
            # reached the cache node yet, whose stop string could end it preempted, its session
            # then taking tokens whose KV it lacks (review of 29983c3, D2; a first turn too, L3)
            victims = [s for s in self.running if rank(s) >= rank(seq) and not (s.session_id and s.kv is not None)]
            if not victims:
                break
            self._preempt_from_batch(victims[-1], batch)
            kv.retry_compaction()
        if kv.compaction_due:  # kept histories stay: a higher class's may be among them (D5)
            self._free_held_elsewhere(seq, kv.retry_compaction, keep_kept=True)
        return not kv.compaction_due

    def _preempt_until(self, seq: Sequence, batch: ScheduledBatch, ready: Callable[[], bool]) -> bool:
        """Preempt the policy's victims for running ``seq`` until ``ready()``; False when
        ``seq`` itself was preempted (the policy's victim at worst)."""
        while not ready():
            victim = self.policy.victim(self.running, seq)
            assert victim is not None, "a running sequence always has a victim (itself at worst)"
            self._preempt_from_batch(victim, batch)
            if victim is seq:
                return False
        return True

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Allocate slots for a running sequence, preempting the policy's victims if needed.
        Alone, it first takes the blocks other waiting sequences and idle sessions hold; a
        sequence that then still cannot get them never will (nothing else holds a block) and
        is given up (``rejected``: the engine finishes it with "length", its output so far).

        Regression (hangs review H1): such a sequence preempted itself, was readmitted (its
        prompt fits) and preempted itself again at the same point, every step, forever: a
        SentenceKV request on a node without a host tier, whose demoted sentences are charged
        to the pool, past what the admission bound counts. Regression (review 23c, G1): the
        same when another request ran beside it: under fcfs and priority it preempted that one
        (another tenant's), then itself, both were readmitted, and so on for ever (249
        preemptions each in 2,000 steps, the other tenant's request never got a token). A
        sequence left alone by its preemptions now takes the alone path.
        """
        got = False

        def ready() -> bool:  # allocates once
            nonlocal got
            got = got or self.kv_manager.allocate_slots(seq, n) is not None
            return got

        if ready():
            return True
        if self.running != [seq]:
            if not self._preempt_until(seq, batch, lambda: ready() or self.running == [seq]):
                return False  # the policy's victim while others ran: it waits for them
            if got:
                return True
        if self._free_held_elsewhere(seq, ready):  # alone now
            return True
        self.running.remove(seq)
        self.kv_manager.free(seq)
        self.rejected.append(seq)
        return False

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
