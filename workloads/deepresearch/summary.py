"""Human-readable views of a report dict: a Markdown page and a rich console table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from workloads.deepresearch.client import TIERS

COLUMNS = (
    "tenant", "class", "ok/sent", "TTFT p50/95/99 ms", "TPOT p50", "SLO", "floor",
    "tok/s", "acc", "hit d/h/s", "rej", "fail", "pre",
)  # fmt: skip
COLUMNS_NOTE = (
    "SLO = TTFT SLO attainment; floor = floor attainment; acc = answer accuracy; "
    "hit d/h/s = cache hit rate on device/host/spill tiers; rej = RESOURCE_EXHAUSTED; "
    "fail = non-ok calls (SKIPPED included); pre = preempted calls."
)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(name: str, g: Mapping[str, Any]) -> list[str]:
    ttft, hit = g["ttft_ms"], g["cache_hit_rate"]
    spill = None
    if hit["spill_ram"] is not None:
        spill = hit["spill_ram"] + hit["spill_disk"]
    return [
        name + (" (noisy)" if g.get("noisy") else ""),
        g.get("slo_class", ""),
        f"{g['ok']}/{g['sent']}",
        "/".join(_num(ttft[p]) for p in ("p50", "p95", "p99")),
        _num(g["tpot_ms"]["p50"], 1),
        _pct(g["ttft_slo_attainment"]),
        _pct(g["floor"]["attainment"]),
        _num(g["output_tokens_per_s"], 2),
        _pct(g["accuracy"]["accuracy"]),
        "/".join(_pct(v) for v in (hit["device"], hit["host"], spill)),
        str(g["rejections"]),
        str(sum(g["failures_by_status"].values())),
        str(g["preemptions"]),
    ]


def rows(report: Mapping[str, Any]) -> list[list[str]]:
    """One row per tenant, then ``overall``, in ``COLUMNS`` order."""
    out = [_row(name, g) for name, g in report["tenants"].items()]
    return [*out, _row("overall", report["overall"])]


def failure_lines(report: Mapping[str, Any]) -> list[str]:
    """``"<group>: STATUS n, ..."`` for every group with a failure."""
    groups = {**report["tenants"], "overall": report["overall"]}
    return [
        f"{name}: " + ", ".join(f"{status} {n}" for status, n in g["failures_by_status"].items())
        for name, g in groups.items()
        if g["failures_by_status"]
    ]


def _concurrency(report: Mapping[str, Any]) -> str:
    overall = report["overall"]
    return (
        f"At most {overall['max_concurrent_agents']} agents active and "
        f"{overall['max_inflight_calls']} calls in flight at once."
    )


def report_markdown(report: Mapping[str, Any], plots: tuple[str, ...] = ()) -> str:
    """The ``report.md`` page: summary table, definitions pointer, plots."""
    lines = [
        "# DeepResearch workload report",
        "",
        (
            f"Run span {report['span_s']:.1f} s; floor windows of {report['window_s']:g} s; "
            f"{report['timeseries']['samples']} stats samples "
            f"({report['timeseries']['errors']} failed). {_concurrency(report)}"
        ),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(report)]
    lines += ["", "Failures by status:", ""]
    lines += [f"- {line}" for line in failure_lines(report)] or ["- none"]
    overall = report["overall"]["cache_hit_rate"]
    lines += [
        "",
        "Cache hit rate per tier (overall): "
        + ", ".join(f"{tier} {_pct(overall[tier])}" for tier in (*TIERS, "total"))
        + ".",
        "",
        f"Columns: {COLUMNS_NOTE}",
        "",
        (
            "Definitions: see `workloads/deepresearch/metrics.py` and `floor.py`. "
            "TTFT SLO = ok calls with TTFT <= the tenant's target; floor = backlogged "
            "windows whose output-token rate reached the tenant's floor; SKIPPED = "
            "planned calls not sent because an earlier call of the agent failed."
        ),
        "",
    ]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def print_summary(report: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the summary table with rich."""
    table = Table(title="DeepResearch workload", show_lines=False)
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows(report):
        table.add_row(*row, style="bold" if row[0] == "overall" else None)
    console = console or Console()
    console.print(table)
    console.print(COLUMNS_NOTE, style="dim")
    console.print(_concurrency(report))
    for line in failure_lines(report):
        console.print(f"failures {line}")
