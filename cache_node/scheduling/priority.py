"""Strict SLO-class priority: interactive before standard before batch, FCFS within a class.

A waiting request of a higher class preempts the newest running request of the lowest class
when the running slots or the blocks are full. Head-of-line blocking within the order stays
(the vLLM priority scheduler's behaviour).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from cache_node.scheduling.base import SchedulingPolicy

if TYPE_CHECKING:
    from cache_node.sequence import Sequence


class PriorityPolicy(SchedulingPolicy):
    name = "priority"
    preempts_for_class = True

    def order(self, waiting: Iterable[Sequence], now_s: float) -> list[Sequence]:
        queue = list(waiting)  # stable sort keeps queue order (preempted first) within a class
        return sorted(queue, key=self.rank)

    def victim(self, running: list[Sequence], incoming: Sequence | None) -> Sequence | None:
        """The newest running sequence of the lowest class (strictly lower than a waiting
        ``incoming``)."""
        if not running:
            return None
        worst = max(self.rank(s) for s in running)
        if incoming is not None and incoming not in running and worst <= self.rank(incoming):
            return None
        return [s for s in running if self.rank(s) == worst][-1]
