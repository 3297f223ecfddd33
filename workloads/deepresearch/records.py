"""One row of ``calls.jsonl``: a planned call joined with what happened to it."""

from __future__ import annotations

from typing import Any

from workloads.deepresearch.client import CallResult
from workloads.deepresearch.plan import PlannedCall
from workloads.facts import grade

SKIPPED = "SKIPPED"
"""Status of a planned call that was never sent because an earlier call of its agent
(or its lead's plan) failed. Counted as a failure, never dropped."""


def call_record(call: PlannedCall, result: CallResult, t0_s: float) -> dict[str, Any]:
    """The JSON-ready record of ``call``.

    ``start_s``/``end_s`` are seconds since the run started (``t0_s`` on the
    monotonic clock). ``correct`` is the grade of an ok ``answer`` call, else None.
    """
    correct = None
    if call.expected_answer is not None and result.ok:
        correct = grade(result.text, call.expected_answer)
    record: dict[str, Any] = call.record_fields() | {"correct": correct}
    record.update(result.as_dict())
    record["start_s"] = result.start_s - t0_s
    record["end_s"] = result.end_s - t0_s
    return record


def skipped_record(call: PlannedCall, reason: str, now_s: float, t0_s: float) -> dict[str, Any]:
    """The record of a call never sent (status ``SKIPPED``, zero duration at ``now_s``)."""
    result = CallResult(status=SKIPPED, start_s=now_s, end_s=now_s, error=reason)
    return call_record(call, result, t0_s)
