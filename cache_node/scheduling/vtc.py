"""Virtual token counter fair sharing (Sheng et al., OSDI'24) across tenants, by weight.

Waiting requests are served in VTC order (the tenant with the least weighted service first,
its requests in queue order); counters are charged with the tokens each step computes.
No class priority, no preemption for class, head-of-line blocking kept (the paper's setting).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from cache_node.scheduling.base import SchedulingPolicy
from cache_node.scheduling.fair_share import VirtualTokenCounters

if TYPE_CHECKING:
    from cache_node.sequence import Sequence


def remaining_prefill(seq: Sequence) -> float:
    """Tokens still to compute before ``seq`` samples (an upper bound: cache hits not known)."""
    return max(1, seq.num_uncomputed_tokens)


class VtcPolicy(SchedulingPolicy):
    name = "vtc"

    def __init__(self, aging_steps: int = 64) -> None:
        super().__init__(aging_steps)
        self.vtc = VirtualTokenCounters()

    def order(self, waiting: Iterable[Sequence], now_s: float) -> list[Sequence]:
        return self.vtc.interleave(waiting, remaining_prefill, self.weight_of)

    def forget_tenant(self, tenant: str) -> None:
        super().forget_tenant(tenant)
        self.vtc.forget(tenant)

    def on_arrival(self, seq: Sequence, now_s: float, active: Mapping[str, int]) -> None:
        if not active.get(seq.tenant):
            self.vtc.lift(seq.tenant, [t for t, n in active.items() if n > 0])

    def on_scheduled(self, seq: Sequence, num_tokens: int, now_s: float) -> None:
        self.vtc.charge(seq.tenant, num_tokens, self.share(seq).weight)

    def on_idle(self, tenant: str) -> None:
        self.vtc.leave(tenant)
