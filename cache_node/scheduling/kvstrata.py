"""kvstrata's SLO scheduler: floors first, then class, then weighted fair sharing.

docs/architecture.md, 'Scheduling' and 'Admission and SLO floors'.

Waiting order, as nested groups:

1. tenants below their token-rate floor (backlogged, served < ``min_tokens_per_s`` over the
   meter's window) before everyone else;
2. SLO class (interactive, standard, batch);
3. preempted requests before newer work of the same class (they keep their place), oldest
   first;
4. the rest interleaved across tenants by VTC (weighted, charged on uncached prefill and
   output tokens; one virtual time per class, ``on_arrival``), each tenant's requests by
   scheduling value, highest first: pending time over memory cost (Apt-Serve, arXiv
   2504.07494, its value-based request scheduling over a hybrid cache), where the cost is the
   prompt tokens still to compute beyond the device prefix hit. A request whose KV is on the
   device runs before an equal one that misses; one whose KV sits below the device is
   prefetched first (the scheduler skips it meanwhile, but no longer than recomputing its
   uncached prompt would take: ``bounds_prefetch_wait``); a long request gains value while it
   waits, so it is not starved.

While a tenant with a floor has requests decoding, the step is sized so it lasts at most
``k / (floor * headroom)`` seconds for its ``k`` decodes (``step_target_s``; the scheduler's
step-time model, fitted online with separate costs per decode and per prefill token, turns
seconds into decodes and prefill tokens). Decodes go first, the floors' first; other tenants'
prefill chunks shrink rather than slow its decode below the floor, and when the decodes alone
would overrun the step, decodes of tenants without a floor take turns sitting out (the one
that waited longest goes first).
While an interactive tenant is active (a request of it arrived or ran in the last
``INTERACTIVE_ACTIVE_S``), every step is also sized to at most ``interactive_step_share`` of its
TTFT target, so its next request, which waits for the step in progress, never waits behind a
long prefill step of another class.
An interactive request's prefill is exempt (its TTFT target): while one waits or prefills, only
the other classes' prefill chunks are held to the floor-sized budget. An interactive prefill
runs in a step of its own every other step (the other classes decode in between).
While requests that may join the step wait, a running prefill chunk takes at most half the
step's token budget, so a long prompt being prefilled does not hold new short requests out of
the batch (Sarathi-style stall-free batching); in an isolated step only interactive requests
may join, so a running interactive prefill otherwise takes the whole budget. A request is admitted only when its whole prompt fits the free blocks. Admission passes over
a request that does not fit (no head-of-line blocking) until it has
been passed over ``aging_steps`` times; then it holds the queue until it fits, except against
tenants of its class holding fewer running blocks per weight than its own whose blocks are
spare (``WaitingAdmission._passes_aged``). A waiting
request preempts a running one of a lower class when slots or blocks are full; the victim is
the lowest class, then the tenant most over its device quota, then the largest VTC counter,
then the newest, and only victims whose blocks let it start; a request preempted for a waiting
one is readmitted only after that one has started. A waiting request whose tenant is below its floor may also preempt one of its
own class whose tenant is not, but only one that has had its turn: since it was (re)admitted
it has finished its prefill and decoded for as long as that prefill took, at most one floor
window (``KvstrataPolicy.victim``), so every admission ends in output tokens and two floor
tenants that cannot fit together take turns instead of preempting each other's prefills
forever. Preempted blocks are demoted to the host tier when copying is cheaper than
recomputing. (Requests that can never fit the pool are refused at arrival under every
policy: ``Scheduler.peak_tokens``.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from cache_node.scheduling.base import DEFAULT_SHARE, SchedulingPolicy, TenantShare
from cache_node.scheduling.fair_share import RateMeter, VirtualTokenCounters
from cache_node.scheduling.vtc import remaining_prefill

if TYPE_CHECKING:
    from cache_node.sequence import Sequence


VALUE_PENDING_FLOOR_S = 1.0
"""Added to every request's pending time in ``KvstrataPolicy.value`` (seconds)."""

INTERACTIVE_ACTIVE_S = 10.0
"""An interactive tenant counts as active for this long after its latest request arrived or
last ran in a step (an agent's next turn follows its tool pause, capped at 10 s in the
DeepResearch workload, and the pause starts when the previous turn ends, not when it arrived)."""


class KvstrataPolicy(SchedulingPolicy):
    name = "kvstrata"
    skip_blocked = True
    preempts_for_class = True
    swaps_on_preempt = True
    prefill_chunk_share = 0.5
    admits_whole_prompt = True
    demotes_over_quota_first = True
    isolates_urgent_prefill = True
    orders_by_value = True
    bounds_prefetch_wait = True

    def __init__(
        self, aging_steps: int = 64, floor_window_s: float = 2.0, floor_headroom: float = 1.2,
        interactive_step_share: float = 0.25,
    ) -> None:
        super().__init__(aging_steps)
        if not 0.0 <= interactive_step_share <= 1.0:
            raise ValueError(f"interactive_step_share must be in [0, 1], got {interactive_step_share}")
        self.interactive_step_share = interactive_step_share
        self._interactive_seen: dict[str, float] = {}  # interactive tenant -> latest arrival or run (s)
        self._backlogged: set[str] = set()  # tenants with a request waiting or running
        self.vtc = VirtualTokenCounters()
        self.rates = RateMeter(floor_window_s)
        self.floor_headroom = (
            floor_headroom  # aim above the floor: windows of the report are not ours
        )
        self._now_s = 0.0  # time of the latest ``order`` call (floor checks in ``victim``)
        self._floor_preempted_s: dict[str, float] = {}  # tenant -> step time of its floor victim
        # request id -> (its num_preemptions, when its current run was first scheduled, when
        # that run first sampled a token or None)
        self._runs: dict[str, tuple[int, float, float | None]] = {}

    def set_tenant(self, tenant: str, share: TenantShare) -> None:
        """Set ``tenant``'s share; when its SLO class (its VTC group) changes, move its counter
        to the new class's virtual time (``VirtualTokenCounters.move``: the smallest counter of
        the class's other backlogged tenants, else the class's last leaver's), recording it as
        the old class's last leaver first when it was backlogged, as ``on_idle`` would (VTC,
        OSDI'24, Algorithm 2, kept per class). Regression (s37 review r4, F5): a tenant promoted
        while backlogged carried its batch counter into the interactive class."""
        old_rank = self._rank_of(tenant)
        super().set_tenant(tenant, share)
        if share.rank == old_rank:
            return
        if tenant in self._backlogged:
            self.vtc.leave(tenant, group=old_rank)
        peers = [t for t in self._backlogged if t != tenant and self._rank_of(t) == share.rank]
        self.vtc.move(tenant, peers, group=share.rank)

    def forget_tenant(self, tenant: str) -> None:
        super().forget_tenant(tenant)
        self.vtc.forget(tenant)
        self._backlogged.discard(tenant)
        self.rates.forget(tenant)
        self._interactive_seen.pop(tenant, None)
        self._floor_preempted_s.pop(tenant, None)

    def order(self, waiting: Iterable[Sequence], now_s: float) -> list[Sequence]:
        self._now_s = now_s
        groups: dict[tuple[bool, int], list[Sequence]] = {}
        for seq in waiting:
            share = self.share(seq)
            above = not self.rates.below_floor(
                seq.tenant, share.min_tokens_per_s * self.floor_headroom, now_s
            )
            groups.setdefault((above, share.rank), []).append(seq)
        out: list[Sequence] = []
        for key in sorted(groups):
            out += self._order_group(groups[key])
        return out

    def _order_group(self, seqs: list[Sequence]) -> list[Sequence]:
        preempted = sorted((s for s in seqs if s.num_preemptions), key=lambda s: s.arrival_time_s)
        fresh = sorted((s for s in seqs if not s.num_preemptions), key=lambda s: -self.value(s))
        return preempted + self.vtc.interleave(fresh, remaining_prefill, self.weight_of)

    def value(self, seq: Sequence) -> float:
        """Apt-Serve's scheduling value of a waiting request: pending seconds (plus
        ``VALUE_PENDING_FLOOR_S``, so fresh arrivals compare by cost) per prompt token still to
        compute beyond its device prefix hit (``Sequence.device_hit_tokens``)."""
        pending = max(0.0, self._now_s - seq.arrival_time_s) + VALUE_PENDING_FLOOR_S
        cost = max(1, seq.num_tokens - max(seq.num_computed_tokens, seq.device_hit_tokens))
        return pending / cost

    def on_arrival(self, seq: Sequence, now_s: float, active: Mapping[str, int]) -> None:
        if self.rank(seq) == 0:
            self._interactive_seen[seq.tenant] = now_s
        if not active.get(seq.tenant):  # VTC within its class: lifted against its class only
            rank = self.rank(seq)
            peers = [t for t, n in active.items() if n > 0 and self._rank_of(t) == rank]
            self.vtc.lift(seq.tenant, peers, group=rank)
        self._backlogged.add(seq.tenant)

    def on_scheduled(self, seq: Sequence, num_tokens: int, now_s: float) -> None:
        self.vtc.charge(seq.tenant, num_tokens, self.share(seq).weight)
        self.rates.add(seq.tenant, num_tokens, now_s)
        run = self._runs.get(seq.request_id)
        if run is None or run[0] != seq.num_preemptions:  # its first step since its admission
            run = (seq.num_preemptions, now_s, None)
        if run[2] is None and seq.num_computed_tokens + num_tokens >= seq.num_tokens:
            run = (run[0], run[1], now_s)  # this step samples its run's first token
        self._runs[seq.request_id] = run

    def on_finished(self, seq: Sequence) -> None:
        super().on_finished(seq)
        self._runs.pop(seq.request_id, None)

    def on_idle(self, tenant: str) -> None:
        self._backlogged.discard(tenant)
        self.vtc.leave(tenant, group=self._rank_of(tenant))

    def _rank_of(self, tenant: str) -> int:
        """``tenant``'s SLO class rank (its VTC group: classes are served in order, VTC within
        each, so each class keeps its own virtual time)."""
        return self.tenants.get(tenant, DEFAULT_SHARE).rank

    def victim(self, running: list[Sequence], incoming: Sequence | None) -> Sequence | None:
        """Lowest class, then most over its tenant's device quota, then largest VTC counter,
        then newest. For a running ``incoming`` (it needs blocks for its next chunk, token or
        compaction): a strictly lower class, a request of its class that has had its turn
        (``_had_its_turn``) or that has computed fewer tokens than ``incoming`` and was never
        preempted (so the least work is thrown away, and a request loses a run before its turn
        this way at most once), or ``incoming`` itself. For a waiting ``incoming``: a
        strictly lower class, or, when
        ``incoming``'s tenant is below its floor, a sequence of the same class whose tenant is
        not below its floor (floors come first; at most one such victim per tenant per step,
        recorded when returned, so a tenant climbs to its floor without emptying the batch),
        and only one that has had its turn (``_had_its_turn``: since its latest admission, its
        prefill done and as long again of decoding, at most one floor window).

        Progress: a class preemption only takes a strictly lower class, which never takes the
        higher one back, and a floor victim has sampled at least one token in the run it loses,
        so each admission of a request ends in output (at most ``max_tokens`` floor preemptions
        of it) and every admitted request finishes in bounded steps. The turn is the project's
        own rule (Apt-Serve, arXiv 2504.07494, has no floors and does not bound preemption),
        the ski-rental bound ``Scheduler._awaits_prefetch`` also uses: a run decodes as long as
        its (re)prefill took before a floor may throw it away, so recomputation is at most
        half of a floor victim's time, while floors still come first: the tenant below its
        floor waits for a victim at most one prefill plus one floor window, and a victim of
        short prompts (its prefill one step) is taken as soon as it has sampled.

        Regression: two standard tenants (4 tok/s floors), each with one request whose prompt
        nearly filled the pool, preempted each other forever: the waiting one fell below its
        floor after the 2 s window and preempted the other before its prefill (longer than the
        window) ended, whose KV the new allocation then evicted (310 preemptions and nothing
        finished in 600 simulated seconds; 72 preemptions in 555 steps of the tiny engine
        without a host tier). Regression (review 22a, F3): a running request in prefill that
        needed blocks took the other tenant's request that had just finished its prefill (its
        demoted sentences, charged to the pool on a node without a host tier, made it the most
        over quota), which re-prefilled and took the first back the same way: 3,978 and 3,972
        preemptions in 12,000 steps with 2 and 1 tokens out, both tenants' queued requests never
        admitted. Now it takes only a run that has had its turn, or itself."""
        if not running:
            return None
        held: dict[str, int] = {}
        for s in running:
            held[s.tenant] = held.get(s.tenant, 0) + s.num_held_blocks

        def badness(s: Sequence) -> tuple[int, int, float, int]:
            over = held[s.tenant] - self.share(s).kv_quota_blocks
            return (self.rank(s), over, self.vtc.counter(s.tenant), running.index(s))

        if incoming is None:
            return max(running, key=badness)
        if incoming in running:  # it needs blocks: never take a run of its class before its turn
            def lesser(s: Sequence) -> bool:  # holds less work, and never lost a run before
                return s.num_preemptions == 0 and s.num_computed_tokens < incoming.num_computed_tokens

            return max((s for s in running if s is incoming or self.rank(s) > self.rank(incoming)
                        or self._had_its_turn(s) or lesser(s)), key=badness)
        lower = [s for s in running if self.rank(s) > self.rank(incoming)]
        if lower:
            return max(lower, key=badness)
        if (
            self._below_floor(incoming)
            and self._floor_preempted_s.get(incoming.tenant) != self._now_s
        ):
            same = [
                s
                for s in running
                if self.rank(s) == self.rank(incoming)
                and not self._below_floor(s)
                and self._had_its_turn(s)
            ]
            if same:
                self._floor_preempted_s[incoming.tenant] = self._now_s
                return max(same, key=badness)
        return None

    def step_target_s(self, running: list[Sequence], now_s: float) -> float | None:
        """Floor-sized steps: a tenant with a floor and ``k`` decoding requests gains ``k``
        tokens a step, so a step may last ``k / (floor * headroom)`` seconds for its decodes
        alone to keep the floor; the shortest such bound over those tenants, or None. Decodes
        count, not the rate meter: the meter lags a prefill burst by its window. The scheduler
        caps the step's tokens to fit the bound (a token budget sized from a latency target,
        as in Sarathi-Serve, Agrawal et al., OSDI'24, §4.3)."""
        decoding: dict[str, tuple[int, float]] = {}
        for seq in running:
            if seq.num_uncomputed_tokens == 1 and self.share(seq).min_tokens_per_s > 0:
                k, floor = decoding.get(seq.tenant, (0, self.share(seq).min_tokens_per_s))
                decoding[seq.tenant] = (k + 1, floor)
        bounds = [k / (floor * self.floor_headroom) for k, floor in decoding.values()]
        for seq in running:  # a running interactive request keeps its tenant active
            if self.rank(seq) == 0:
                self._interactive_seen[seq.tenant] = now_s
        interactive = self._interactive_step_s(now_s)
        if interactive is not None:
            bounds.append(interactive)
        return min(bounds) if bounds else None

    def floor_decodes(self, min_tokens_per_s: float, num_decodes: int, step_s: float) -> int:
        """A tenant keeps its floor with ``ceil(floor * headroom * step_s)`` tokens a step;
        its other decodes may sit out (taking turns) when the decode batch would overrun the
        step. Regression (issue 21, make demo): the batch tenants' 0.5 tok/s floors made every
        one of their decodes count as floored, so a step could never be shorter than all of
        them, and the interactive tenant's lone decode ran at 262 ms a token against its
        4 tok/s floor (3.94 tokens in three 1 s windows)."""
        return min(num_decodes, math.ceil(min_tokens_per_s * self.floor_headroom * step_s))

    def keep_active(self, tenants: Iterable[str], now_s: float) -> None:
        """An interactive tenant with a session open on the node stays active (steps sized to
        its TTFT) between its turns, however long its agent waits: a lead agent waits for its
        sub-agents (tens of seconds), then its report turn comes back to this node, which
        otherwise ran unbounded batch-prefill steps by then (issue 21: the report waited
        720 ms for the step in progress)."""
        for tenant in tenants:
            share = self.tenants.get(tenant)
            if share is not None and share.rank == 0:
                self._interactive_seen[tenant] = now_s

    def _interactive_step_s(self, now_s: float) -> float | None:
        """While an interactive tenant is active (a request of it arrived or ran in the last
        ``INTERACTIVE_ACTIVE_S``), a step may last ``interactive_step_share`` of its TTFT target
        (the tightest such tenant's): its next request waits for the step in progress before
        its own prefill can start, so the other classes' prefill chunks are sized to that wait
        (the chunk size follows the TTFT target, as DistServe and Sarathi-Serve size it from the
        SLO). None: no interactive tenant is active, or ``interactive_step_share`` is 0."""
        if not self.interactive_step_share:
            return None
        targets = [self.tenants[t].ttft_slo_ms for t, seen in self._interactive_seen.items()
                   if now_s - seen < INTERACTIVE_ACTIVE_S and t in self.tenants]
        return min(targets) / 1000.0 * self.interactive_step_share if targets else None

    def _had_its_turn(self, seq: Sequence) -> bool:
        """In its current run (since its latest admission) ``seq`` has sampled a token, and
        has run since then as long as it took to get there, or one floor window
        (``rates.window_s``) if that is shorter: a floor preemption never throws away a run
        that produced nothing, nor one that spent most of its time recomputing."""
        run = self._runs.get(seq.request_id)
        if run is None or run[0] != seq.num_preemptions or run[2] is None:
            return False
        _, started_s, sampled_s = run
        return self._now_s - sampled_s >= min(sampled_s - started_s, self.rates.window_s)

    def _below_floor(self, seq: Sequence) -> bool:
        floor = self.share(seq).min_tokens_per_s * self.floor_headroom
        return self.rates.below_floor(seq.tenant, floor, self._now_s)
