"""One row of ``calls.jsonl``: a planned call joined with what happened to it, and the
counts of the agents' decisions over those rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from workloads.deepresearch.client import CallResult
from workloads.deepresearch.plan import PlannedCall
from workloads.facts import grade

SKIPPED = "SKIPPED"
"""Status of a planned call that was never sent because an earlier call of its agent
(or its lead's plan) failed, or because the agent had nothing to send. Counted as a
failure, never dropped."""


def call_record(
    call: PlannedCall,
    result: CallResult,
    t0_s: float,
    doc_ids: Sequence[str] = (),
    decision: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-ready record of ``call``.

    ``start_s``/``end_s`` are seconds since the run started (``t0_s`` on the
    monotonic clock). ``correct`` is the grade of an ok ``answer`` call, else None.
    ``doc_ids`` are the articles whose text the call sent and ``decision`` what its agent
    decided writing it and reading its reply (:mod:`workloads.deepresearch.agents`).
    """
    correct = None
    if call.expected_answer is not None and result.ok:
        correct = grade(result.text, call.expected_answer)
    record: dict[str, Any] = call.record_fields() | {
        "correct": correct, "doc_ids": list(doc_ids), "decision": dict(decision or {}),
    }
    record.update(result.as_dict())
    record["start_s"] = result.start_s - t0_s
    record["end_s"] = result.end_s - t0_s
    return record


def skipped_record(call: PlannedCall, reason: str, now_s: float, t0_s: float) -> dict[str, Any]:
    """The record of a call never sent (status ``SKIPPED``, zero duration at ``now_s``)."""
    result = CallResult(status=SKIPPED, start_s=now_s, end_s=now_s, error=reason)
    return call_record(call, result, t0_s)


def agent_counts(records: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How often the agents fell back and found their target, over ``calls.jsonl`` rows.

    Returns:
        ``plans``/``plan_fallbacks``: lead plans the agents read / of them, plans that gave
        fewer sub-questions than sub-agents; ``searches``/``query_fallbacks``: queries the
        agents ran / of them, not the model's own; ``answers``/``found_target``: answer
        calls sent / of them, by agents that had read the article holding the graded fact.
        Replayed calls (no decisions taken) count nowhere.
    """
    counts = dict.fromkeys(("plans", "plan_fallbacks", "searches", "query_fallbacks",
                            "answers", "found_target"), 0)  # fmt: skip
    for record in records:
        decision = record.get("decision") or {}
        if "plan_fallback" in decision:
            counts["plans"] += 1
            counts["plan_fallbacks"] += bool(decision["plan_fallback"])
        if "query_fallback" in decision:
            counts["searches"] += 1
            counts["query_fallbacks"] += bool(decision["query_fallback"])
        if "found_target" in decision and record.get("status") != SKIPPED:
            counts["answers"] += 1
            counts["found_target"] += bool(decision["found_target"])
    return counts
