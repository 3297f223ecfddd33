"""The scheduling-policy contract: how a cache node orders, admits and preempts requests.

A policy is one small class. ``order`` is its one required method; the rest have defaults
that give FCFS behaviour, so a policy overrides only what it changes. The ``Scheduler``
(``cache_node.scheduler``) does the moving (blocks, queues, batch); a policy only decides.

Tenants are known to a policy through ``TenantShare`` (what it was promised); requests of a
tenant it was never told about get ``DEFAULT_SHARE`` (standard class, weight 1, no floor).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from cache_node.sequence import Sequence

SLO_CLASS_RANK = {"interactive": 0, "standard": 1, "batch": 2}


@dataclass(frozen=True)
class TenantShare:
    """What one tenant was promised, as a cache node schedules it.

    See docs/architecture.md, 'Tenants and SLO promises'.

    Attributes:
        slo_class: "interactive", "standard" or "batch" (lower rank is served first).
        ttft_slo_ms: time-to-first-token target; a request's deadline is arrival + this.
        min_tokens_per_s: floor on uncached prefill + output tokens/s while backlogged.
        weight: share of what is left after floors (weighted fair sharing).
        kv_quota_blocks: guaranteed device-tier blocks (0 = borrow only).

    Raises:
        ValueError: unknown class, a value out of range, or one not finite (NaN, infinity).
    """

    slo_class: str = "standard"
    ttft_slo_ms: float = 5000.0
    min_tokens_per_s: float = 0.0
    weight: float = 1.0
    kv_quota_blocks: int = 0

    def __post_init__(self) -> None:
        if self.slo_class not in SLO_CLASS_RANK:
            raise ValueError(
                f"slo_class must be one of {sorted(SLO_CLASS_RANK)}, got {self.slo_class!r}"
            )
        values = (self.ttft_slo_ms, self.min_tokens_per_s, self.weight, self.kv_quota_blocks)
        if not all(math.isfinite(v) for v in values):
            # Regression (security review F6): NaN and infinity passed every check below
            # (a data-plane message's ``extra`` could set a NaN floor or an infinite weight)
            raise ValueError(f"tenant share values must be finite numbers, got {values!r}")
        if not self.ttft_slo_ms > 0 or not self.weight > 0:
            raise ValueError("ttft_slo_ms and weight must be positive")
        if self.min_tokens_per_s < 0 or self.kv_quota_blocks < 0:
            raise ValueError("min_tokens_per_s and kv_quota_blocks must be >= 0")

    @property
    def rank(self) -> int:
        return SLO_CLASS_RANK[self.slo_class]


DEFAULT_SHARE = TenantShare()

PREFETCH_TTFT_SHARE = 0.1
"""Under ``bounds_prefetch_wait``: the most of a request's TTFT target it spends waiting for a
spill prefetch (0.2 s of a 2 s interactive target)."""


class SchedulingPolicy(ABC):
    """Decides the order of the waiting queue, admission past a blocked request, and victims.

    Class attributes (switches the ``Scheduler`` reads):
        skip_blocked: a waiting request that cannot get its blocks is passed over (no
            head-of-line blocking) until it has been passed over ``aging_steps`` times;
            then nothing behind it is admitted until it fits but requests of other tenants of
            its class holding fewer running blocks per weight, with spare blocks
            (``_passes_aged``). False: the
            first request that does not fit ends admission for the step (vLLM/FCFS).
        preempts_for_class: a waiting request may preempt a running one of a lower class
            when the running slots or the blocks are full.
        swaps_on_preempt: a preempted request's computed blocks are demoted to the host tier
            (when one exists and the copy is cheaper than recomputing).
        admits_whole_prompt: a waiting request is admitted only when the free blocks cover its
            whole prompt (not only the first chunk), so admitted prefills do not thrash.
        prefill_chunk_share: while requests wait, one running prefill chunk takes at most this
            fraction of the step's token budget (the rest is left for admissions).
        demotes_over_quota_first: watermark demotion takes the free cached blocks of tenants
            over their device-tier quota first (most over first), then LRU.
        orders_by_value: the scheduler fills ``Sequence.device_hit_tokens`` for every waiting
            sequence before each ``order`` call (Apt-Serve's hit/miss distinction).
        bounds_prefetch_wait: a waiting request waits for its spill prefetch at most as long as
            recomputing its uncached prompt would take, and at most ``PREFETCH_TTFT_SHARE`` of
            its tenant's TTFT target (``Scheduler._awaits_prefetch``); False: until the
            prefetch lands or ``TierConfig.prefetch_wait_s`` passes.
        isolates_urgent_prefill: while an interactive (rank 0) request waits or has prompt
            tokens left, a step runs only interactive work; the other classes' decodes sit
            out that step (their TPOT targets are 2.5-10x looser), so the prefill runs in a
            short step instead of beside a full decode batch.
    """

    name: ClassVar[str] = ""
    skip_blocked: ClassVar[bool] = False
    preempts_for_class: ClassVar[bool] = False
    swaps_on_preempt: ClassVar[bool] = False
    admits_whole_prompt: ClassVar[bool] = False
    prefill_chunk_share: ClassVar[float] = 1.0
    demotes_over_quota_first: ClassVar[bool] = False
    isolates_urgent_prefill: ClassVar[bool] = False
    bounds_prefetch_wait: ClassVar[bool] = False
    orders_by_value: ClassVar[bool] = False

    def __init__(self, aging_steps: int = 64) -> None:
        self.tenants: dict[str, TenantShare] = {}
        self.aging_steps = aging_steps
        self._passed_over: dict[str, int] = {}

    # ---- tenants ----------------------------------------------------------------------------
    def set_tenant(self, tenant: str, share: TenantShare) -> None:
        self.tenants[tenant] = share

    def forget_tenant(self, tenant: str) -> None:
        """Drop what this policy keeps of ``tenant`` (its tenant was deleted and none of its
        requests is left on the node): its share and, in subclasses, its counters. A request
        of it arriving later is scheduled as an unknown tenant's (``DEFAULT_SHARE``) until its
        share is set again. Regression (s37): a node kept every deleted tenant's entries."""
        self.tenants.pop(tenant, None)

    def share(self, seq: Sequence) -> TenantShare:
        return self.tenants.get(seq.tenant, DEFAULT_SHARE)

    def quota_blocks_of(self, tenant: str) -> int:
        """The tenant's guaranteed device-tier blocks (0: everything it holds is borrowed)."""
        return self.tenants.get(tenant, DEFAULT_SHARE).kv_quota_blocks

    def weight_of(self, tenant: str) -> float:
        return self.tenants.get(tenant, DEFAULT_SHARE).weight

    def rank(self, seq: Sequence) -> int:
        return self.share(seq).rank

    # ---- the one required decision ----------------------------------------------------------
    @abstractmethod
    def order(self, waiting: Iterable[Sequence], now_s: float) -> list[Sequence]:
        """The waiting sequences in the order admission considers them (does not modify them)."""

    # ---- optional hooks (defaults = FCFS) ---------------------------------------------------
    def on_arrival(self, seq: Sequence, now_s: float, active: Mapping[str, int]) -> None:
        """A request joined the waiting queue; ``active``: waiting + running requests per
        tenant before it."""

    def on_scheduled(self, seq: Sequence, num_tokens: int, now_s: float) -> None:
        """``seq`` computes ``num_tokens`` uncached tokens this step (charge counters here)."""

    def step_target_s(self, running: list[Sequence], now_s: float) -> float | None:
        """The longest step (seconds) that keeps the running floors; None: no limit."""
        return None

    def floor_decodes(self, min_tokens_per_s: float, num_decodes: int, step_s: float) -> int:
        """Of a floor tenant's ``num_decodes`` decodes, how many a step of ``step_s`` must run
        to keep its floor (the others may sit out when the decode batch would overrun the
        step). Default: all of them."""
        return num_decodes

    def keep_active(self, tenants: Iterable[str], now_s: float) -> None:
        """``tenants`` have a session open on the node at ``now_s`` (their next turn comes here)."""

    def on_finished(self, seq: Sequence) -> None:
        self._passed_over.pop(seq.request_id, None)

    def on_idle(self, tenant: str) -> None:
        """``tenant``'s last waiting or running request left the node (finished, aborted or
        given up): it is no longer backlogged. Called before that request's ``on_finished``."""

    def victim(self, running: list[Sequence], incoming: Sequence | None) -> Sequence | None:
        """The running sequence to preempt so that ``incoming`` can proceed.

        ``incoming`` None or running: a running sequence needs a block; any running sequence
        (itself included) may be chosen. ``incoming`` waiting: only a strictly lower class
        may be chosen (None when there is none). Default: the newest running sequence.
        """
        if incoming is not None and incoming not in running:
            candidates = [s for s in running if self.rank(s) > self.rank(incoming)]
            return candidates[-1] if candidates else None
        return running[-1] if running else None

    # ---- aging (no head-of-line blocking, yet no starvation) --------------------------------
    def passed_over(self, seq: Sequence) -> bool:
        """Record that ``seq`` did not fit; True when admission may go on past it."""
        n = self._passed_over.get(seq.request_id, 0) + 1
        self._passed_over[seq.request_id] = n
        return self.skip_blocked and n <= self.aging_steps


def order_by_priority(ordered: list[Sequence]) -> list[Sequence]:
    """A policy's waiting order with each tenant's requests sorted by their ``priority``
    (lower first; stable, so equal priorities keep the policy's order) within the queue
    positions that tenant's requests hold: one tenant's priorities never move its requests
    past another tenant's, so the policy's fairness between tenants is untouched.

    Args:
        ordered: the waiting sequences in the policy's order (``SchedulingPolicy.order``).

    Returns:
        A new list of the same sequences; ``ordered`` itself when every priority is 0.

    The semantics follow vLLM's ``priority`` request field (lower value, served earlier),
    scoped to the tenant; O(n log n) in the waiting sequences.
    """
    if all(s.priority == 0 for s in ordered):
        return ordered
    positions: dict[str, list[int]] = {}
    for index, seq in enumerate(ordered):
        positions.setdefault(seq.tenant, []).append(index)
    result = list(ordered)
    for slots in positions.values():
        members = sorted((ordered[i] for i in slots), key=lambda s: s.priority)  # sorted() is stable
        for slot, seq in zip(slots, members):
            result[slot] = seq
    return result


def requeue_by_priority(waiting: deque[Sequence]) -> None:
    """Put ``waiting`` (the scheduler's queue, after an arrival) in ``order_by_priority``
    order, in place.

    Policies that order a tenant's requests by queue position (fcfs, priority, vtc) then hand
    out the tenant's earliest position to the request that is served in it: the request it
    displaced moves to the later position, so after the admission the tenant holds the
    positions it would have held without priorities (a post-processed order alone would leave
    the displaced request in the earlier position and let the tenant take two early turns).
    """
    ordered = order_by_priority(list(waiting))
    if any(a is not b for a, b in zip(ordered, waiting)):
        waiting.clear()
        waiting.extend(ordered)
