"""``make demo --compare fcfs`` (issue 21): the same calls under two schedulers, side by side in
the first run's report.md, every figure read from the two reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_report import RECORDS, TENANTS, TIMESERIES, _rec, _recomputed
from workloads.deepresearch.compare import (
    COMPARE_COLUMNS,
    append_comparison,
    comparison_rows,
    comparison_sentences,
)
from workloads.deepresearch.metrics import compute_report
from workloads.deepresearch.report import write_report

# the same calls, later and slower under fcfs: A's two ok calls miss their 100 ms target
FCFS_RECORDS = [
    {**r, "ttft_ms": 400.0, "end_s": r["end_s"] + 1.0} if r["status"] == "ok" else r for r in RECORDS
]


def test_rows_pair_each_tenant_under_both_schedulers() -> None:
    first = compute_report(RECORDS, TIMESERIES, TENANTS, scheduler="kvstrata")
    second = compute_report(FCFS_RECORDS, TIMESERIES, TENANTS, scheduler="fcfs")
    rows = comparison_rows(first, second)
    assert [(r[0], r[2]) for r in rows] == [("A", "kvstrata"), ("A", "fcfs"), ("B", "kvstrata"), ("B", "fcfs"),
                                            ("overall", "kvstrata"), ("overall", "fcfs")]  # fmt: skip
    slo = COMPARE_COLUMNS.index("TTFT SLO")
    assert [rows[0][slo], rows[1][slo]] == ["50%", "0%"]  # 50 ms and 150 ms vs 100 ms; both 400 ms
    assert rows[0][COMPARE_COLUMNS.index("rejected")] == "1"
    assert rows[1][COMPARE_COLUMNS.index("TTFT p50/p95 ms")] == "400/400"
    assert comparison_sentences(first, second)[0] == (
        "A (interactive, target 100 ms): 50% of ok calls in time under kvstrata (p95 150 ms, 1 rejected), "
        "0% under fcfs (p95 400 ms, 1 rejected).")


def test_rows_refuse_reports_of_different_tenants() -> None:
    first = compute_report(RECORDS, TIMESERIES, TENANTS, scheduler="kvstrata")
    only_a = compute_report([r for r in RECORDS if r["tenant"] == "A"], [], TENANTS[:1], scheduler="fcfs")
    with pytest.raises(ValueError, match="tenants differ"):
        comparison_rows(first, only_a)


def test_report_md_gets_the_section_and_comparison_json_both_groups(tmp_path: Path) -> None:
    run_dir, first = write_report(RECORDS, TIMESERIES, TENANTS, root=tmp_path / "main", scheduler="kvstrata")
    other_dir, second = write_report(FCFS_RECORDS, TIMESERIES, TENANTS, root=tmp_path / "cmp", scheduler="fcfs")
    before = (run_dir / "report.md").read_text()
    append_comparison(run_dir, first, second, other_dir)
    markdown = (run_dir / "report.md").read_text()
    assert markdown.startswith(before)  # the run's own report is untouched above the section
    section = markdown[len(before):]
    assert "## Compared with fcfs" in section and str(other_dir) in section
    assert "| A | interactive | fcfs | 2/3 | 400/400 | 0% |" in section
    both = json.loads((run_dir / "comparison.json").read_text())
    assert set(both) == {"kvstrata", "fcfs"}
    assert both["fcfs"]["tenants"] == _recomputed(other_dir)["tenants"]
    assert both["kvstrata"]["overall"] == _recomputed(run_dir)["overall"]


def test_a_rejected_call_is_counted_not_dropped() -> None:
    """Early rejections show in the comparison's own column (attainment is over ok calls)."""
    records = [*RECORDS, _rec("A", "RESOURCE_EXHAUSTED", 5.0, 5.0, session_id="A/s3")]
    first = compute_report(records, TIMESERIES, TENANTS, scheduler="kvstrata")
    second = compute_report(FCFS_RECORDS, TIMESERIES, TENANTS, scheduler="fcfs")
    rows = comparison_rows(first, second)
    assert rows[0][COMPARE_COLUMNS.index("rejected")] == "2"
    assert rows[0][COMPARE_COLUMNS.index("ok/sent")] == "2/4"


def test_demo_compare_flag_names_a_known_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    from workloads.demo import parse_args

    assert parse_args(["--compare", "fcfs"]).compare == "fcfs"
    assert parse_args([]).compare == ""
    with pytest.raises(SystemExit):
        parse_args(["--compare", "fifo"])
    assert "--compare must be one of ['fcfs', 'kvstrata', 'priority', 'vtc'], got 'fifo'" in capsys.readouterr().err
