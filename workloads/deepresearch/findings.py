"""The report's "What to look at" paragraph: sentences written from a report dict's numbers.

Each sentence states a number of the report and what it is measured against (the tenant's
target, the 95% goal, the tenants' weights), so a reader knows where to look first: missed
TTFT targets and floors, what the noisy neighbour got, rejections and failures, the cache
and the device tier's peak. Percentages are floored, here and in the tables (:func:`pct`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

SLO_GOAL = 0.95
"""The attainment a TTFT target or floor is held to (issue 21's acceptance: >= 0.95)."""


def pct(value: float | None) -> str:
    """``value`` (a fraction) as a whole percentage, floored, never rounded up: 0.997 ->
    ``"99%"``, 1.0 -> ``"100%"``; ``"-"`` for None. (1e-9 absorbs float error: 0.29 * 100
    is 28.999...)"""
    return "-" if value is None else f"{math.floor(100 * value + 1e-9)}%"


def _slo_sentence(report: Mapping[str, Any]) -> str:
    tenants = report["tenants"]
    missed = [(name, g) for name, g in tenants.items()
              if g["ttft_slo_attainment"] is not None and g["ttft_slo_attainment"] < SLO_GOAL]
    if not missed:
        measured = [g for g in tenants.values() if g["ttft_slo_attainment"] is not None]
        return (f"Every tenant with ok calls met its TTFT target on at least {pct(SLO_GOAL)} of them."
                if measured else "No tenant has an ok call, so no TTFT attainment was measured.")
    parts = [f"{name} ({g['slo_class']}) {pct(g['ttft_slo_attainment'])} within {g['ttft_slo_ms']:g} ms "
             f"(p50 {g['ttft_ms']['p50']:.0f} ms, p95 {g['ttft_ms']['p95']:.0f} ms)" for name, g in missed]
    sentence = f"TTFT targets missed (under {pct(SLO_GOAL)} of ok calls in time): " + "; ".join(parts) + "."
    if report.get("scheduler") == "fcfs":
        sentence += " fcfs serves calls in arrival order whatever their class or target."
    return sentence


def _floor_sentence(report: Mapping[str, Any]) -> str:
    floors = [(name, g) for name, g in report["tenants"].items() if g["floor"]["attainment"] is not None]
    missed = [(name, g) for name, g in floors if g["floor"]["attainment"] < SLO_GOAL]
    if not floors:
        return "No tenant was backlogged for a whole floor window, so no floor was tested."
    if not missed:
        return f"Every floor held in at least {pct(SLO_GOAL)} of its tenant's backlogged windows."
    parts = [f"{name} {pct(g['floor']['attainment'])} of {g['floor']['backlogged_windows']} backlogged "
             f"windows at {g['min_tokens_per_s']:g} tok/s" for name, g in missed]
    return f"Floors missed (under {pct(SLO_GOAL)}): " + "; ".join(parts) + "."


def _noisy_sentences(report: Mapping[str, Any]) -> list[str]:
    tenants = report["tenants"]
    total_out = report["overall"]["output_tokens"]
    total_weight = sum(g.get("weight") or 0.0 for g in tenants.values())
    quiet = [g["sessions_per_s"] for g in tenants.values() if not g.get("noisy") and g.get("sessions_per_s")]
    out = []
    for name, g in tenants.items():
        if not g.get("noisy") or not total_out or not total_weight or not quiet:
            continue
        sentence = (
            f"The noisy neighbour {name} offered {g['sessions_per_s'] / min(quiet):.1f}x the others' lowest "
            f"session rate at weight {g['weight']:g} ({pct(g['weight'] / total_weight)} of the total weight) "
            f"and got {pct(g['output_tokens'] / total_out)} of all output tokens."
        )
        if g.get("tokens"):  # (a report of schema 3 has none)
            idle = 1.0 - g["tokens_while_others_waited"] / g["tokens"]
            sentence += (
                f" {pct(idle)} of its tokens (uncached prefill + output) were computed while no other "
                "tenant had a call waiting on its node: capacity the weights do not divide (they share "
                "a node among the tenants waiting for it)."
            )
        out.append(sentence)
    return out


def _failure_sentence(report: Mapping[str, Any]) -> str:
    overall = report["overall"]
    failures = overall["failures_by_status"]
    if not overall["calls"]:
        return "No call was planned."
    if not failures:
        return f"All {overall['sent']} sent calls succeeded."
    rejected = overall["rejections"]
    skipped = failures.get("SKIPPED", 0)
    other = sum(failures.values()) - rejected - skipped
    parts = []
    if rejected:
        parts.append(f"{rejected} rejected at admission (RESOURCE_EXHAUSTED: the scheduler expected to miss "
                     "the target or its queue was full)")
    if other:
        statuses = ", ".join(s for s in failures if s not in ("SKIPPED", "RESOURCE_EXHAUSTED"))
        parts.append(f"{other} failed otherwise ({statuses})")
    if skipped:
        parts.append(f"{skipped} not sent (SKIPPED: an earlier call of the agent failed)")
    return f"Of {overall['calls']} planned calls, " + "; ".join(parts) + "."


def _cache_sentence(report: Mapping[str, Any]) -> str:
    hit = report["overall"]["cache_hit_rate"]
    if hit["total"] is None:
        return "No ok call, so no cache hit rate."
    spill = (hit["spill_ram"] or 0.0) + (hit["spill_disk"] or 0.0)
    sentence = (f"{pct(hit['total'])} of ok calls' prompt tokens came from the KV cache (device "
                f"{pct(hit['device'])}, host {pct(hit['host'])}, spill {pct(spill)}).")
    peak = report["timeseries"].get("device_used_fraction_max")
    if peak is not None:
        sentence += f" Device-tier blocks in use peaked at {pct(peak)} of the pool."
    return sentence


def what_to_look_at(report: Mapping[str, Any]) -> list[str]:
    """The sentences of the paragraph, in reading order (one per line of Markdown)."""
    return [_slo_sentence(report), _floor_sentence(report), *_noisy_sentences(report),
            *_retry_sentences(report), _failure_sentence(report), _cache_sentence(report)]


def _retry_sentences(report: Mapping[str, Any]) -> list[str]:
    """Calls admission refused first (its TTFT estimate missed the target) and the agent sent
    again after the hint: their TTFT counts from the admitted attempt; from the first one,
    attainment is lower, and the sentence says by how much."""
    out = []
    for name, g in report["tenants"].items():
        retried = g.get("retried_calls", 0)
        if not retried:
            continue
        first = g.get("ttft_slo_attainment_from_first_send")
        out.append(
            f"Admission refused {retried} of {name}'s calls at first ({g['admission_retries']} refusals: "
            f"their estimated TTFT missed the target) and the agents sent them again after the retry hint; "
            f"their TTFT counts from the admitted attempt. Counted from each call's first attempt, "
            f"{name}'s TTFT attainment is {pct(first) if first is not None else 'n/a'}."
        )
    return out
