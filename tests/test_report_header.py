"""The report a person trusts (issue 21): the scheduler, policy and each tenant's targets and
floors at the top of report.md; floored percentages (an overall floor of 99.7% was shown as
100%); one time base for text and plots (the text said a 144 s span, the plots ran to ~160 s);
tier capacities and the spill tier in the memory plot; a "What to look at" paragraph from the
run's numbers; no "noisy (noisy)" label."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstrata.v1 import admin_pb2
from tests.test_report import RECORDS, TENANTS, TIMESERIES, _rec, _recomputed
from workloads.deepresearch.config import TenantProfile
from workloads.deepresearch.findings import pct, what_to_look_at
from workloads.deepresearch.metrics import compute_report
from workloads.deepresearch.plots import memory_figure, throughput_figure
from workloads.deepresearch.report import write_report
from workloads.deepresearch.stats_probe import stats_sample
from workloads.deepresearch.summary import report_markdown


@pytest.mark.parametrize("value,shown", [(0.997, "99%"), (1.0, "100%"), (0.29, "29%"), (2 / 3, "66%"),
                                         (0.0, "0%"), (None, "-")])
def test_percentages_are_floored_never_rounded_up(value: float | None, shown: str) -> None:
    assert pct(value) == shown


def test_an_overall_floor_of_997_per_mille_is_not_shown_as_100() -> None:
    """1000 backlogged windows, 997 met: the overall floor column reads 99%."""
    tenant = TenantProfile("A", "interactive", ttft_slo_ms=100.0, tpot_slo_ms=10.0, min_tokens_per_s=1.0)
    # one call busy for 1000 s; tokens in every window but three (output spread over [0, 997])
    record = _rec("A", "ok", 0.0, 1000.0, ttft_ms=0.0, completion_tokens=997, prompt_tokens=0)
    late = _rec("A", "ok", 997.0, 1000.0, ttft_ms=3000.0, completion_tokens=0)
    report = compute_report([dict(record, end_s=997.0), late], [], [tenant])
    assert report["overall"]["floor"]["attainment"] == pytest.approx(0.997)
    row = next(line for line in report_markdown(report).splitlines() if line.startswith("| overall |"))
    assert row.split("|")[7].strip() == "99%"  # the floor column


def test_header_names_scheduler_policy_targets_and_floors(tmp_path: Path) -> None:
    run_dir, _ = write_report(RECORDS, TIMESERIES, TENANTS, root=tmp_path, scheduler="kvstrata",
                              policy="sentencekv-0.25")
    report = _recomputed(run_dir)  # every header figure from the folder's own files
    markdown = (run_dir / "report.md").read_text()
    head = markdown.split("## What to look at")[0]
    assert f"Scheduler: {report['scheduler']}. KV policy: {report['policy']}." in head
    for name, g in report["tenants"].items():
        assert (f"| {name} | {g['slo_class']} | {g['ttft_slo_ms']:g} ms | {g['tpot_slo_ms']:g} ms | "
                f"{g['min_tokens_per_s']:g} tok/s | {g['weight']:.1f} |") in head
    assert "| B | batch | 1000 ms | 50 ms | 0.5 tok/s | 1.0 | 0.05 (1.0x the others': noisy neighbour) |" in head
    assert "B (noisy)" not in markdown


def test_text_and_plots_share_one_time_base(tmp_path: Path) -> None:
    """The span the text states is every time axis; samples after the last call are cut."""
    late = [*TIMESERIES, {"t_s": 9.0, "used_blocks": 5.0, "num_blocks": 8.0}]
    run_dir, report = write_report(RECORDS, late, TENANTS, root=tmp_path)
    again = _recomputed(run_dir)
    text = (run_dir / "report.md").read_text()
    assert (f"Calls ran from {again['start_s']:.1f} s to {again['end_s']:.1f} s "
            f"(span {again['span_s']:.1f} s)") in text
    span = (report["start_s"], report["end_s"])
    assert span == (0.0, 4.5)
    for ax in memory_figure(late, span).axes:
        assert ax.get_xlim() == span
        assert all(max(line.get_xdata(), default=0.0) <= 4.5 for line in ax.get_lines())
    assert throughput_figure(RECORDS, TENANTS, 5.0, span).axes[0].get_xlim() == span


def test_memory_plot_has_every_tier_and_the_capacities() -> None:
    samples = [
        {"t_s": t, "used_blocks": 3.0 + t, "cached_blocks": 2.0, "num_blocks": 16.0, "host_blocks": t,
         "host_capacity_blocks": 32.0, "spill_ram_blocks": 2 * t, "spill_disk_blocks": t}
        for t in (0.0, 1.0, 2.0)
    ]
    top, bottom = memory_figure(samples, (0.0, 2.0)).axes
    labels = {line.get_label(): line for ax in (top, bottom) for line in ax.get_lines()}
    assert set(labels) == {"device: in use", "device: cached", "device capacity", "host", "host capacity",
                           "spill: RAM", "spill: disk"}
    assert list(labels["device capacity"].get_ydata()) == [16.0] * 3
    assert list(labels["host capacity"].get_ydata()) == [32.0] * 3
    assert labels["device capacity"].get_linestyle() == "--"


def test_stats_sample_reads_host_and_spill_blocks_from_stats_json() -> None:
    response = admin_pb2.StatsResponse(
        nodes=[admin_pb2.NodeStats(node_id="n0", num_blocks=10, used_blocks=4),
               admin_pb2.NodeStats(node_id="n1", num_blocks=10, used_blocks=1)],
        stats_json=json.dumps({
            "nodes": [{"node_id": "n0", "host_blocks": 3, "host_slots": 20},
                      {"node_id": "n1", "host_blocks": 1, "host_slots": 20},
                      {"node_id": "n2", "healthy": False, "failure": "down"}],
            "scheduler": {"indexed_blocks_by_tier": {"device": 5, "host": 4, "spill_ram": 7, "spill_disk": 2}},
        }))
    sample = stats_sample(response)
    assert (sample["num_blocks"], sample["used_blocks"]) == (20.0, 5.0)
    assert (sample["host_blocks"], sample["host_capacity_blocks"]) == (4.0, 40.0)
    assert (sample["spill_ram_blocks"], sample["spill_disk_blocks"]) == (7.0, 2.0)
    assert "host_blocks" not in stats_sample(admin_pb2.StatsResponse())  # an older gateway: left out


def test_what_to_look_at_is_written_from_the_numbers() -> None:
    report: dict[str, Any] = compute_report(RECORDS, TIMESERIES, TENANTS, scheduler="fcfs")
    lines = what_to_look_at(report)
    a = report["tenants"]["A"]
    assert lines[0] == (f"TTFT targets missed (under 95% of ok calls in time): A (interactive) "
                        f"{pct(a['ttft_slo_attainment'])} within 100 ms (p50 50 ms, p95 150 ms). "
                        "fcfs serves calls in arrival order whatever their class or target.")
    assert lines[1] == ("Floors missed (under 95%): A 66% of 3 backlogged windows at 2.5 tok/s; "
                        "B 0% of 3 backlogged windows at 0.5 tok/s.")
    assert lines[2] == ("The noisy neighbour B offered 1.0x the others' lowest session rate at weight 1 "
                        "(50% of the total weight) and got 6% of all output tokens. "  # 1 of 15 tokens
                        # B's 51 tokens: 0.05 of them (its output token, spread over [1, 4] s) while
                        # A's second call waited [1, 1.15) s
                        "99% of its tokens (uncached prefill + output) were computed while no other "
                        "tenant had a call waiting on its node: capacity the weights do not divide "
                        "(they share a node among the tenants waiting for it).")
    assert lines[3].startswith("Of 6 planned calls, 1 rejected at admission")
    assert "1 failed otherwise (UNAVAILABLE); 1 not sent (SKIPPED" in lines[3]
    assert lines[4] == ("28% of ok calls' prompt tokens came from the KV cache (device 16%, host 4%, spill 8%). "
                        "Device-tier blocks in use peaked at 50% of the pool.")
    good = compute_report([r for r in RECORDS if r["tenant"] == "B" and r["status"] == "ok"], [], TENANTS)
    assert what_to_look_at(good)[0] == "Every tenant with ok calls met its TTFT target on at least 95% of them."


def test_what_to_look_at_an_empty_run_says_nothing_was_measured() -> None:
    """An empty plan once read "All 0 sent calls succeeded."."""
    assert what_to_look_at(compute_report([], [], TENANTS)) == [
        "No tenant has an ok call, so no TTFT attainment was measured.",
        "No tenant was backlogged for a whole floor window, so no floor was tested.",
        "No call was planned.",
        "No ok call, so no cache hit rate.",
    ]
