"""``compute_report``: every number of the DeepResearch report, from records alone.

Pure: the same records, time series and tenants always give the same dict, so
``report.json`` can be recomputed from ``calls.jsonl`` and ``timeseries.jsonl``.
Undefined values (a percentile of nothing, a rate over zero tokens) are None.

Per group (each tenant, and ``overall``):

- ``ttft_ms`` / ``tpot_ms``: p50, p95, p99 over ok calls, by nearest rank (each is a value
  some call had; p95 <= a target exactly when at least 95% of the calls met it).
- ``ttft_slo_attainment``: fraction of ok calls with ``ttft_ms <= ttft_slo_ms``
  (each call against its own tenant's target); ``tpot_slo_attainment`` likewise
  over ok calls with a ``tpot_ms``.
- ``floor``: see :mod:`workloads.deepresearch.floor`; overall sums the windows.
- ``tokens`` / ``tokens_while_others_waited``: delivered tokens (uncached prefill + output
  of ok calls), and those computed while a call of another tenant waited on the same node:
  see :mod:`workloads.deepresearch.contention` (weights divide a node among the tenants
  waiting for it; the rest is capacity no other tenant asked for). Overall sums the tenants.
- ``output_tokens_per_s``: completion tokens of ok calls over the run span
  (first ``start_s`` to last ``end_s`` of all records).
- ``accuracy``: correct / graded answers (ok ``answer`` calls).
- ``cache_hit_rate``: per tier, cached prompt tokens / prompt tokens of ok calls.
- ``rejections``: calls with status ``RESOURCE_EXHAUSTED`` (refused on every attempt).
- ``admission_retries``: refusals at admission that the agent retried after the hint;
  ``retried_calls``: calls with at least one. A retried call's ``ttft_ms`` is its admitted
  attempt's; ``ttft_slo_attainment_from_first_send`` counts each ok call's TTFT from its
  first attempt instead (refusal and wait included).
- ``failures_by_status``: every non-ok status (``SKIPPED`` included) with its count.
- ``preemptions``: calls the server preempted at least once.
- ``max_concurrent_agents``: most agents active at one instant; an agent (one
  ``session_id``) is active from its first sent call's ``start_s`` to its last
  sent call's ``end_s`` (tool pauses between its calls included).
- ``max_inflight_calls``: most sent calls between ``start_s`` and ``end_s`` at one instant.

For the whole run, ``agents`` counts the agents' decisions
(:func:`workloads.deepresearch.records.agent_counts`): plans and plan fallbacks, searches and
query fallbacks, answers and how many came from agents whose search found their target.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workloads.deepresearch.client import OK, TIERS
from workloads.deepresearch.config import TenantProfile
from workloads.deepresearch.contention import tokens_while_others_waited
from workloads.deepresearch.floor import floor_windows
from workloads.deepresearch.records import SKIPPED, agent_counts

REPORT_SCHEMA = 4  # 2: scheduler, policy, start_s, end_s; tenants' weight and sessions_per_s
# 3: percentiles by nearest rank (were linearly interpolated); 4: tokens, tokens_while_others_waited
PERCENTILES = (50, 95, 99)

Record = Mapping[str, Any]


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50": .., "p95": .., "p99": ..}`` by nearest rank (the smallest value with at least
    q% of ``values`` at or below it); all None for no values.

    Regression: linear interpolation between calls printed, for 11 calls, a p95 under a
    TTFT target that one call in eleven (9%) had missed.
    """
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": float(np.percentile(values, q, method="inverted_cdf")) for q in PERCENTILES}


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _max_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals ``[start, end)`` covering one instant (an end before a start at a tie)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    best = current = 0
    for _, step in events:
        current += step
        best = max(best, current)
    return best


def _ttft_from_first_send(r: Record) -> float:
    """An ok call's TTFT from its first attempt (records before retries: its ``ttft_ms``)."""
    first = r.get("first_start_s")
    return r["ttft_ms"] + (1000.0 * (r["start_s"] - first) if first is not None else 0.0)


def _agent_spans(records: Sequence[Record]) -> list[tuple[float, float]]:
    spans: dict[str, tuple[float, float]] = {}
    for r in records:
        if r["status"] == SKIPPED or r["end_s"] is None:
            continue
        start, end = spans.get(r["session_id"], (r["start_s"], r["end_s"]))
        spans[r["session_id"]] = (min(start, r["start_s"]), max(end, r["end_s"]))
    return list(spans.values())


def _group(
    records: Sequence[Record],
    slo: Mapping[str, TenantProfile],
    span_s: float,
    floor: tuple[int, int],
    contention: tuple[float, float],
) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == OK]
    with_ttft = [r for r in ok if r["ttft_ms"] is not None]
    with_tpot = [r for r in ok if r["tpot_ms"] is not None]
    graded = [r for r in ok if r["correct"] is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    output = sum(r["completion_tokens"] for r in ok)
    cached = {tier: sum(r[f"cached_{tier}_tokens"] for r in ok) for tier in TIERS}
    return {
        "calls": len(records),
        "sent": sum(r["status"] != SKIPPED for r in records),
        "ok": len(ok),
        "ttft_ms": percentiles([r["ttft_ms"] for r in with_ttft]),
        "tpot_ms": percentiles([r["tpot_ms"] for r in with_tpot]),
        "ttft_slo_attainment": _ratio(
            sum(r["ttft_ms"] <= slo[r["tenant"]].ttft_slo_ms for r in with_ttft), len(with_ttft)
        ),
        "ttft_slo_attainment_from_first_send": _ratio(
            sum(_ttft_from_first_send(r) <= slo[r["tenant"]].ttft_slo_ms for r in with_ttft), len(with_ttft)
        ),
        "tpot_slo_attainment": _ratio(
            sum(r["tpot_ms"] <= slo[r["tenant"]].tpot_slo_ms for r in with_tpot), len(with_tpot)
        ),
        "floor": {
            "backlogged_windows": floor[0],
            "met_windows": floor[1],
            "attainment": _ratio(floor[1], floor[0]),
        },
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_per_s": _ratio(output, span_s),
        "tokens": contention[0],
        "tokens_while_others_waited": contention[1],
        "accuracy": {
            "graded": len(graded),
            "correct": sum(bool(r["correct"]) for r in graded),
            "accuracy": _ratio(sum(bool(r["correct"]) for r in graded), len(graded)),
        },
        "cache_hit_rate": {
            **{tier: _ratio(cached[tier], prompt) for tier in TIERS},
            "total": _ratio(sum(cached.values()), prompt),
        },
        "rejections": sum(r["status"] == "RESOURCE_EXHAUSTED" for r in records),
        "admission_retries": sum(int(r.get("admission_retries", 0)) for r in records),
        "retried_calls": sum(int(r.get("admission_retries", 0)) > 0 for r in records),
        "failures_by_status": dict(
            sorted(Counter(r["status"] for r in records if r["status"] != OK).items())
        ),
        "preemptions": sum(bool(r["preempted"]) for r in records),
        "max_concurrent_agents": _max_overlap(_agent_spans(records)),
        "max_inflight_calls": _max_overlap(
            [(r["start_s"], r["end_s"]) for r in records if r["status"] != SKIPPED and r["end_s"] is not None]
        ),
    }


def _timeseries_summary(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    good = [s for s in samples if "error" not in s]
    summary: dict[str, Any] = {"samples": len(samples), "errors": len(samples) - len(good)}
    for key in ("device_bytes_used", "host_bytes_used", "device_used_fraction"):
        values = [float(s[key]) for s in good if key in s]
        summary[f"{key}_max"] = max(values) if values else None
        summary[f"{key}_mean"] = float(np.mean(values)) if values else None
    return summary


def compute_report(
    records: Sequence[Record],
    timeseries: Sequence[Mapping[str, Any]],
    tenants: Sequence[TenantProfile],
    *,
    window_s: float = 1.0,
    scheduler: str = "",
    policy: str = "",
) -> dict[str, Any]:
    """The report dict (JSON-ready) for one run.

    Times are seconds since the run started (the runner's clock): ``start_s`` / ``end_s``
    are the first call's start and the last call's end, ``span_s`` their difference.

    Args:
        records: call records (``calls.jsonl`` rows, see :mod:`.records`).
        timeseries: stats samples (``timeseries.jsonl`` rows).
        tenants: the run's tenants; a tenant without records still gets a row.
        window_s: floor-attainment window.
        scheduler / policy: the gateway's scheduler and the KV policy the tenants were
            registered with, as ``run.json`` states them ("" = not known / the node default).

    Raises:
        ValueError: a record names a tenant not in ``tenants``.
    """
    slo = {t.name: t for t in tenants}
    unknown = sorted({r["tenant"] for r in records} - set(slo))
    if unknown:
        raise ValueError(f"records name tenants {unknown} that are not in {sorted(slo)}")
    start_s = min((r["start_s"] for r in records), default=0.0)
    horizon_s = max((r["end_s"] for r in records), default=0.0)
    span_s = horizon_s - start_s
    per_tenant: dict[str, Any] = {}
    total_floor = [0, 0]
    contention = tokens_while_others_waited(records)
    for tenant in tenants:
        mine = [r for r in records if r["tenant"] == tenant.name]
        floor = floor_windows(mine, tenant.min_tokens_per_s, horizon_s, window_s)
        total_floor = [total_floor[0] + floor[0], total_floor[1] + floor[1]]
        per_tenant[tenant.name] = {
            "slo_class": tenant.slo_class,
            "ttft_slo_ms": tenant.ttft_slo_ms,
            "tpot_slo_ms": tenant.tpot_slo_ms,
            "min_tokens_per_s": tenant.min_tokens_per_s,
            "weight": tenant.weight,
            "sessions_per_s": tenant.sessions_per_s,
            "noisy": tenant.noisy,
            **_group(mine, slo, span_s, floor, contention.get(tenant.name, (0.0, 0.0))),
        }
    return {
        "schema": REPORT_SCHEMA,
        "scheduler": scheduler,
        "policy": policy,
        "window_s": window_s,
        "start_s": start_s,
        "end_s": horizon_s,
        "span_s": span_s,
        "tenants": per_tenant,
        "overall": _group(records, slo, span_s, (total_floor[0], total_floor[1]),
                          (sum(t for t, _ in contention.values()), sum(c for _, c in contention.values()))),
        "timeseries": _timeseries_summary(timeseries),
        "agents": agent_counts(records),
    }


def exit_code(report: Mapping[str, Any]) -> int:
    """0 when at least one call succeeded, else 1 (a run with no success is a failure)."""
    return 0 if report["overall"]["ok"] > 0 else 1
