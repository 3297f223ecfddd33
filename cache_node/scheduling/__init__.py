"""Scheduling policies of a cache node, by name: fcfs, priority, vtc, kvstrata.

``make_policy(name)`` builds one; unknown names raise ``ValueError`` listing the known ones.
Admission estimates (TTFT from queue, cached tokens per tier and measured prefill speed) live
in ``cache_node.scheduling.admission``; fair-share counters in ``fair_share``.
"""

from __future__ import annotations

from cache_node.scheduling.base import DEFAULT_SHARE, SLO_CLASS_RANK, SchedulingPolicy, TenantShare
from cache_node.scheduling.fcfs import FcfsPolicy
from cache_node.scheduling.kvstrata import KvstrataPolicy
from cache_node.scheduling.priority import PriorityPolicy
from cache_node.scheduling.vtc import VtcPolicy

SCHEDULING_POLICIES: dict[str, type[SchedulingPolicy]] = {
    cls.name: cls for cls in (FcfsPolicy, PriorityPolicy, VtcPolicy, KvstrataPolicy)
}


def check_policy_name(name: str) -> str:
    """Return ``name`` if it is a known policy. Raises ValueError listing the known ones."""
    if name not in SCHEDULING_POLICIES:
        raise ValueError(
            f"unknown scheduling policy {name!r}; known: {sorted(SCHEDULING_POLICIES)}"
        )
    return name


def make_policy(name: str, **kwargs: float) -> SchedulingPolicy:
    return SCHEDULING_POLICIES[check_policy_name(name)](**kwargs)  # type: ignore[arg-type]


__all__ = [
    "DEFAULT_SHARE",
    "SCHEDULING_POLICIES",
    "SLO_CLASS_RANK",
    "SchedulingPolicy",
    "TenantShare",
    "check_policy_name",
    "make_policy",
]
