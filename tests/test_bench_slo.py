"""bench.slo's trace and summary on hand-made records (the Ray run itself is the bench)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from bench.slo import TENANTS, Unloaded, peak_load, profiles, summarize, trace
from workloads.deepresearch.client import CallResult
from workloads.deepresearch.metrics import compute_report


def test_trace_splits_the_rate_by_share_and_is_sorted() -> None:
    arrivals = trace(rate_rps=7.0, duration_s=200.0, n_prompts=5, seed=1)
    assert [a[0] for a in arrivals] == sorted(a[0] for a in arrivals)
    counts = {name: sum(a[1] == name for a in arrivals) for name, *_ in TENANTS}
    assert counts["live"] == pytest.approx(200, rel=0.3)  # 1/7 of 7 req/s for 200 s
    assert counts["noisy"] > 2.5 * counts["std"]  # the noisy neighbour offers 4x
    assert {a[2] for a in arrivals} <= set(range(5))


def record(tenant: str, i: int, start_s: float, ttft_ms: float | None, status: str = "ok") -> dict:
    res = CallResult(status, completion_tokens=8 if status == "ok" else 0, ttft_ms=ttft_ms,
                     start_s=start_s, end_s=start_s + 2.0)
    # the same fields bench.slo.play adds to each result
    return asdict(res) | {"tenant": tenant, "correct": None, "session_id": f"{tenant}-{i}"}


def test_summary_counts_goodput_per_tenant_target() -> None:
    slo = {t.name: t.ttft_slo_ms for t in profiles(None)}  # live 1000 ms, std 5000 ms, bulk 60000 ms
    records = [
        record("live", 0, 0.0, 800.0),  # within 1 s
        record("live", 1, 1.0, 1500.0),  # late
        record("std", 2, 2.0, 4000.0),  # within 5 s
        record("noisy", 3, 3.0, None, status="RESOURCE_EXHAUSTED"),  # rejected
        record("bulk", 4, 8.0, 30000.0),  # within 60 s
    ]
    out = summarize(compute_report(records, [], profiles(None)), records, slo)
    assert out["live"]["ttft_slo_attainment"] == 0.5
    assert out["live"]["requests"] == 2 and out["noisy"]["ok"] == 0 and out["noisy"]["rejected"] == 1
    assert out["goodput_rps"] == pytest.approx(3 / 10.0)  # 3 good over the 0-10 s span


def test_calibrated_slos_are_multiples_of_the_unloaded_latency() -> None:
    """--slo calibrated: TTFT 4x / 20x / 240x the isolated TTFT, floors 0.25x / 0.1x / 0 of the
    lone decode rate (TPOT 80 ms -> 12.5 tok/s), weights from the class."""
    by_name = {t.name: t for t in profiles(Unloaded(ttft_ms=300.0, tpot_ms=80.0))}
    assert [by_name[n].ttft_slo_ms for n in ("live", "std", "bulk", "noisy")] == [1200.0, 6000.0, 72000.0, 6000.0]
    assert [by_name[n].min_tokens_per_s for n in ("live", "std", "bulk")] == [3.12, 1.25, 0.0]
    assert by_name["live"].tpot_slo_ms == 200.0 and by_name["live"].weight == 4.0
    assert {t.name: t.ttft_slo_ms for t in profiles(None)}["live"] == 1000.0  # class defaults


def test_peak_load_counts_the_busiest_window() -> None:
    arrivals = [(t, "live", 0) for t in (0.0, 1.0, 2.0, 30.0, 31.0, 32.0, 33.0, 34.0)]
    assert peak_load(arrivals, capacity_rps=0.25, window_s=10.0) == 2.0  # 5 in [30, 40) = 0.5/s
