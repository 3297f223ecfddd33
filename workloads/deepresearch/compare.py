"""The same run under two schedulers, side by side: a section of ``report.md`` and a table.

``make demo``'s ``--compare fcfs`` replays the first run's ``trace.jsonl`` (the same calls with
the same messages, arrivals and tool pauses) against a fresh deployment running the other
scheduler, then appends this section to the first run's ``report.md`` and writes both reports'
per-tenant figures to ``comparison.json`` beside it. Every number is read from the two report
dicts (:func:`workloads.deepresearch.metrics.compute_report`); percentages are floored
(:func:`workloads.deepresearch.findings.pct`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstrata.durable_files import write_file_atomic
from workloads.deepresearch.findings import pct

COMPARE_COLUMNS = ("tenant", "class", "scheduler", "ok/sent", "TTFT p50/p95 ms", "TTFT SLO", "floor",
                   "rejected", "tok/s")  # fmt: skip

Report = Mapping[str, Any]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def comparison_rows(first: Report, second: Report) -> list[list[str]]:
    """Two rows per tenant (then ``overall``): ``first``'s, then ``second``'s, in
    ``COMPARE_COLUMNS`` order, each labelled with its report's scheduler.

    Raises:
        ValueError: the reports do not have the same tenants.
    """
    if list(first["tenants"]) != list(second["tenants"]):
        raise ValueError(f"the reports' tenants differ: {list(first['tenants'])} vs {list(second['tenants'])}")
    out = []
    for name in [*first["tenants"], "overall"]:
        for report in (first, second):
            g = report["overall"] if name == "overall" else report["tenants"][name]
            out.append([
                name, g.get("slo_class", ""), report.get("scheduler") or "?", f"{g['ok']}/{g['sent']}",
                f"{_ms(g['ttft_ms']['p50'])}/{_ms(g['ttft_ms']['p95'])}", pct(g["ttft_slo_attainment"]),
                pct(g["floor"]["attainment"]), str(g["rejections"]),
                "-" if g["output_tokens_per_s"] is None else f"{g['output_tokens_per_s']:.2f}",
            ])  # fmt: skip
    return out


def comparison_sentences(first: Report, second: Report) -> list[str]:
    """Per tenant in a class with a TTFT target that matters most first (interactive, standard,
    batch): its TTFT attainment and p95 under each scheduler; then the run spans."""
    a, b = first.get("scheduler") or "first", second.get("scheduler") or "second"
    rank = {"interactive": 0, "standard": 1, "batch": 2}
    names = sorted(first["tenants"], key=lambda n: rank.get(first["tenants"][n]["slo_class"], 3))
    out = []
    for name in names:
        g, h = first["tenants"][name], second["tenants"][name]
        out.append(
            f"{name} ({g['slo_class']}, target {g['ttft_slo_ms']:g} ms): {pct(g['ttft_slo_attainment'])} of ok "
            f"calls in time under {a} (p95 {_ms(g['ttft_ms']['p95'])} ms, {g['rejections']} rejected), "
            f"{pct(h['ttft_slo_attainment'])} under {b} (p95 {_ms(h['ttft_ms']['p95'])} ms, "
            f"{h['rejections']} rejected)."
        )
    out.append(f"The calls ran for {first['span_s']:.0f} s under {a} and {second['span_s']:.0f} s under {b}.")
    return out


def comparison_markdown(first: Report, second: Report, second_dir: str | Path) -> str:
    """The ``## Compared with <scheduler>`` section (Markdown, ending with a newline)."""
    b = second.get("scheduler") or "the other scheduler"
    lines = [
        f"## Compared with {b}", "",
        (f"The same calls (this run's `trace.jsonl`: messages, arrivals and tool pauses) replayed "
         f"against a fresh deployment running the {b} scheduler; its own report is in `{second_dir}`."), "",
        *comparison_sentences(first, second), "",
        "| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS),
        *("| " + " | ".join(row) + " |" for row in comparison_rows(first, second)), "",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def append_comparison(run_dir: Path, first: Report, second: Report, second_dir: Path) -> None:
    """Append :func:`comparison_markdown` to ``run_dir/report.md`` and write
    ``run_dir/comparison.json`` (both schedulers' per-tenant and overall groups). Each file is
    replaced whole (``write_file_atomic``): a crash leaves ``report.md`` as it was or with the
    whole section, never cut short.

    Raises:
        OSError: ``run_dir/report.md`` cannot be read, or ``run_dir`` cannot be written."""
    report_md = (run_dir / "report.md").read_text(encoding="utf-8")
    write_file_atomic(run_dir / "report.md", report_md + "\n" + comparison_markdown(first, second, second_dir), 0o644)
    both = {r.get("scheduler") or str(i): {"report_dir": str(d), "tenants": r["tenants"], "overall": r["overall"]}
            for i, (r, d) in enumerate(((first, run_dir), (second, second_dir)))}  # fmt: skip
    write_file_atomic(run_dir / "comparison.json", json.dumps(both, indent=2, sort_keys=True) + "\n", 0o644)


def print_comparison(first: Report, second: Report, console: Console | None = None) -> None:
    """The comparison table and sentences on the console."""
    console = console or Console()
    table = Table(title=f"Same calls: {first.get('scheduler')} vs {second.get('scheduler')}")
    for column in COMPARE_COLUMNS:
        table.add_column(column, overflow="fold")
    for row in comparison_rows(first, second):
        table.add_row(*row)
    console.print(table)
    for line in comparison_sentences(first, second):
        console.print(line)
