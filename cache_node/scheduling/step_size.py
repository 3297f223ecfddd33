"""The size of a scheduler step: token-rate floors, isolated interactive prefills, and the
step-time measurements both rest on.

A policy with decode floors (``SchedulingPolicy.step_target_s``) bounds a step to the time
that keeps each floored tenant's decode rate, sizing it with the measured step-time model
(``StepTimeModel``): ``_floor_sized_step``. A policy that ``isolates_urgent_prefill`` runs an
interactive prefill in a step of its own (``_urgent_prefill_pending``). ``_measure`` attributes
each step's time to its tokens (``step_s``, ``step_model``, ``prefill_speed``). ``StepSizing``
is a part of ``cache_node.scheduler.Scheduler``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.config import EngineConfig
    from cache_node.scheduling.admission import Ewma, SpeedMeter, StepTimeModel
    from cache_node.scheduling.base import SchedulingPolicy


class StepSizing:
    """Step-sizing methods of ``Scheduler`` (which provides these attributes)."""

    config: EngineConfig
    policy: SchedulingPolicy
    waiting: deque[Sequence]
    running: list[Sequence]
    session_tenants: Callable[[], Iterable[str]] | None
    prefill_speed: SpeedMeter
    step_s: Ewma
    step_model: StepTimeModel
    _last_decode_s: dict[str, float]
    _last_step: tuple[float, int, int] | None
    _awaits_prefetch: Callable[[Sequence, float], bool]
    _awaits_prefix: Callable[[Sequence], bool]

    def _urgent_prefill_pending(self, now: float) -> bool:
        """An interactive request waits (and may start) or has prompt tokens left, under a
        policy that isolates such prefills (``isolates_urgent_prefill``)."""
        if not self.policy.isolates_urgent_prefill:
            return False
        if any(self.policy.rank(s) == 0 and not self._awaits_prefetch(s, now) and not self._awaits_prefix(s)
               for s in self.waiting):
            return True
        return any(self.policy.rank(s) == 0 and s.num_uncomputed_tokens > 1
                   for s in self.running)

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
