"""First come, first served (vLLM-like): queue order, head-of-line blocking, newest is preempted."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from cache_node.scheduling.base import SchedulingPolicy

if TYPE_CHECKING:
    from cache_node.sequence import Sequence


class FcfsPolicy(SchedulingPolicy):
    """Arrival order; a preempted request goes back to the front of the queue."""

    name = "fcfs"

    def order(self, waiting: Iterable[Sequence], now_s: float) -> list[Sequence]:
        return list(waiting)
