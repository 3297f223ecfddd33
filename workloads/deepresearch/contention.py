"""Which of a tenant's tokens were computed while another tenant waited for its node.

A tenant's weight (docs/architecture.md, 'Scheduling': VTC within an SLO class, classes in
order) divides a node's service among the tenants waiting for it; capacity no other tenant is
waiting for goes to whoever has work (work conservation), whatever the weights. So a tenant's
share of all tokens says nothing about the weights by itself: a tenant that offers more load
than the others gets more, mostly while they have nothing queued.

Definition (times are seconds since the run started):

1. A call **waits** during ``[start_s, start_s + ttft_ms / 1000)`` on its node (``node_id``;
   a record without one counts as on one unnamed node): sent, its first token not yet out.
   Only ok calls count (a refused call never reached a node's queue).
2. A tenant's **tokens** are its delivered tokens, as the floor counts them
   (:func:`workloads.deepresearch.floor.tokens_in`: uncached prefill + output of ok calls,
   spread over their prefill and decode).
3. Its tokens **while others waited** are those delivered, on a call's node, while a call
   of another tenant waited on that node; the rest used capacity no other tenant was
   waiting for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from workloads.deepresearch.client import OK
from workloads.deepresearch.floor import merged, tokens_in


def _wait(record: Mapping[str, Any]) -> tuple[float, float]:
    start_s = float(record["start_s"])
    return start_s, start_s + float(record.get("ttft_ms") or 0.0) / 1000.0


def tokens_while_others_waited(records: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per tenant with an ok call: ``(tokens, tokens while others waited)`` (module docstring),
    both in tokens (fractions: a call's tokens are spread over time)."""
    ok = [r for r in records if r["status"] == OK]
    waits: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (node, tenant) -> its calls' waits
    for r in ok:
        waits.setdefault((r.get("node_id") or "", r["tenant"]), []).append(_wait(r))
    others: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (node, tenant) -> others' waits
    out: dict[str, tuple[float, float]] = {}
    for r in ok:
        key = (r.get("node_id") or "", r["tenant"])
        if key not in others:
            others[key] = merged([w for (node, tenant), ws in waits.items()
                                  if node == key[0] and tenant != key[1] for w in ws])
        total, contended = out.get(r["tenant"], (0.0, 0.0))
        total += tokens_in(r, -math.inf, math.inf)
        contended += sum(tokens_in(r, w0, w1) for w0, w1 in others[key] if w1 > w0)
        out[r["tenant"]] = (total, contended)
    return out
