"""Token-rate floor attainment, computed from per-call records.

Definition (times are seconds since the run started; ``W = window_s``):

1. The run is cut into windows ``[k*W, (k+1)*W)`` for ``k = 0 .. ceil(horizon_s / W) - 1``.
2. A tenant is **busy** during ``[start_s, end_s)`` of every call it sent
   (any status except ``SKIPPED``): queued, prefilling or decoding.
3. A window is **backlogged** for the tenant when the union of its busy
   intervals covers the whole window.
4. The tenant's **delivered tokens** are those the floor counts (docs/architecture.md,
   'Admission and SLO floors': uncached prefill tokens plus output tokens) of its ok calls:
   ``completion_tokens`` spread uniformly over ``[start_s + ttft_ms / 1000, end_s]``, and the
   uncached prompt tokens (``prompt_tokens`` minus the cached tokens of every tier) spread
   uniformly over the prefill, ``[start_s + queue_ms / 1000, start_s + ttft_ms / 1000]``
   (each all at its interval's end when the interval is empty; a None ``ttft_ms`` or
   ``queue_ms`` counts as 0).
5. A backlogged window is **met** when delivered tokens in it divided by ``W``
   is at least the tenant's ``min_tokens_per_s``.
6. **Floor attainment** = met windows / backlogged windows (None when none is backlogged).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from workloads.deepresearch.client import TIERS
from workloads.deepresearch.records import SKIPPED

_COVER_TOLERANCE = 1e-9


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` (start, end), sorted, with overlapping or touching ones joined."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def _spread(n: float, t0: float, t1: float, w0: float, w1: float) -> float:
    """Of ``n`` tokens spread uniformly over ``[t0, t1]`` (all at ``t1`` when empty), those
    in ``[w0, w1)``."""
    if t1 <= t0:
        return n if w0 <= t1 < w1 else 0.0
    return n * _overlap(t0, t1, w0, w1) / (t1 - t0)


def tokens_in(record: Mapping[str, Any], w0: float, w1: float) -> float:
    """Of an ok ``record``'s delivered tokens (step 4 of the module's definition), those in
    ``[w0, w1)`` (seconds since the run started)."""
    start_s = float(record["start_s"])
    first_s = start_s + float(record.get("ttft_ms") or 0.0) / 1000.0
    prefill_s = min(first_s, start_s + float(record.get("queue_ms") or 0.0) / 1000.0)
    cached = sum(int(record.get(f"cached_{tier}_tokens") or 0) for tier in TIERS)
    uncached = max(0, int(record.get("prompt_tokens") or 0) - cached)
    return (_spread(float(record["completion_tokens"]), first_s, float(record["end_s"]), w0, w1)
            + _spread(float(uncached), prefill_s, first_s, w0, w1))


def floor_windows(
    records: Sequence[Mapping[str, Any]], min_tokens_per_s: float, horizon_s: float,
    window_s: float,
) -> tuple[int, int]:  # fmt: skip
    """``(backlogged_windows, met_windows)`` of one tenant's records.

    Raises:
        ValueError: ``window_s`` is not positive.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    sent = [r for r in records if r["status"] != SKIPPED]
    busy = merged([(r["start_s"], r["end_s"]) for r in sent if r["end_s"] > r["start_s"]])
    ok = [r for r in sent if r["status"] == "ok"]
    backlogged = met = 0
    for k in range(math.ceil(horizon_s / window_s)):
        w0, w1 = k * window_s, (k + 1) * window_s
        covered = sum(_overlap(b0, b1, w0, w1) for b0, b1 in busy)
        if covered < window_s * (1.0 - _COVER_TOLERANCE):
            continue
        backlogged += 1
        delivered = sum(tokens_in(r, w0, w1) for r in ok)
        met += delivered / window_s >= min_tokens_per_s
    return backlogged, met
