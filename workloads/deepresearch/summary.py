"""Human-readable views of a report dict: a Markdown page and a rich console table.

Percentages are floored, never rounded up (99.7% shows as 99%, so a figure short of a
target never reads as meeting it); every time is seconds since the run started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from workloads.deepresearch.client import TIERS
from workloads.deepresearch.findings import pct, what_to_look_at

COLUMNS = (
    "tenant", "class", "ok/sent", "TTFT p50/95/99 ms", "TPOT p50", "SLO", "floor",
    "tok/s", "acc", "hit d/h/s", "rej", "fail", "pre",
)  # fmt: skip
COLUMNS_NOTE = (
    "SLO = TTFT SLO attainment; floor = floor attainment; acc = answer accuracy; "
    "hit d/h/s = cache hit rate on device/host/spill tiers; rej = calls refused (RESOURCE_EXHAUSTED) "
    "on every attempt, +Nr = N more refused first and then admitted on a retry; "
    "fail = non-ok calls (SKIPPED included); pre = preempted calls."
)


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(name: str, g: Mapping[str, Any]) -> list[str]:
    ttft, hit = g["ttft_ms"], g["cache_hit_rate"]
    spill = None
    if hit["spill_ram"] is not None:
        spill = hit["spill_ram"] + hit["spill_disk"]
    return [
        name,
        g.get("slo_class", ""),
        f"{g['ok']}/{g['sent']}",
        "/".join(_num(ttft[p]) for p in ("p50", "p95", "p99")),
        _num(g["tpot_ms"]["p50"], 1),
        pct(g["ttft_slo_attainment"]),
        pct(g["floor"]["attainment"]),
        _num(g["output_tokens_per_s"], 2),
        pct(g["accuracy"]["accuracy"]),
        "/".join(pct(v) for v in (hit["device"], hit["host"], spill)),
        str(g["rejections"]) + (f" +{g['retried_calls']}r" if g.get("retried_calls") else ""),
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


def agents_line(report: Mapping[str, Any]) -> str:
    """What the agents made of the model's replies (``report["agents"]``, see
    :func:`workloads.deepresearch.records.agent_counts`)."""
    a = report.get("agents") or {}
    if not a.get("plans"):
        return "Agents: no decisions recorded (a replay re-sends recorded messages, or no plan succeeded)."
    return (
        f"Agents: {a['plans'] - a['plan_fallbacks']} of {a['plans']} lead plans gave every sub-agent "
        f"a question (the others fell back to the generator's); {a['searches'] - a['query_fallbacks']} "
        f"of {a['searches']} searches ran the model's own query; {a['found_target']} of {a['answers']} "
        "answers came from agents whose search found the article holding the graded fact."
    )


SETUP_COLUMNS = ("tenant", "class", "TTFT target", "TPOT target", "floor", "weight", "sessions/s")


def setup_line(report: Mapping[str, Any]) -> str:
    """``Scheduler: kvstrata. KV policy: ...`` as ``run.json`` stated them."""
    scheduler = report.get("scheduler") or "not reported"
    policy = report.get("policy") or "each node's default (no per-tenant policy)"
    return f"Scheduler: {scheduler}. KV policy: {policy}."


def setup_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """Each tenant's promises and offered load, in ``SETUP_COLUMNS`` order; a noisy
    neighbour's rate says how many times the others' lowest rate it offers."""
    tenants = report["tenants"]
    quiet = [g["sessions_per_s"] for g in tenants.values() if not g.get("noisy") and g.get("sessions_per_s")]
    out = []
    for name, g in tenants.items():
        rate = f"{g['sessions_per_s']:.3g}" if g.get("sessions_per_s") is not None else "-"
        if g.get("noisy") and quiet:
            rate += f" ({g['sessions_per_s'] / min(quiet):.1f}x the others': noisy neighbour)"
        out.append([name, g["slo_class"], f"{g['ttft_slo_ms']:g} ms", f"{g['tpot_slo_ms']:g} ms",
                    f"{g['min_tokens_per_s']:g} tok/s", _num(g.get("weight"), 1), rate])
    return out


def time_line(report: Mapping[str, Any]) -> str:
    """The run's one time base, as the text and every plot use it."""
    return (
        f"Times are seconds since the run started. Calls ran from {report['start_s']:.1f} s to "
        f"{report['end_s']:.1f} s (span {report['span_s']:.1f} s); each plot's time axis covers "
        f"exactly this interval. Floor windows of {report['window_s']:g} s; "
        f"{report['timeseries']['samples']} stats samples ({report['timeseries']['errors']} failed)."
    )


def _table(columns: tuple[str, ...], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(row) + " |" for row in body)]


def report_markdown(report: Mapping[str, Any], plots: tuple[str, ...] = ()) -> str:
    """The ``report.md`` page: scheduler, policy and each tenant's targets and floors; the time
    base; what to look at; the per-tenant results; definitions; plots."""
    lines = ["# DeepResearch workload report", "", setup_line(report), "",
             *_table(SETUP_COLUMNS, setup_rows(report)), "", time_line(report), "",
             "## What to look at", "", *what_to_look_at(report), "", "## Results per tenant", "",
             *_table(COLUMNS, rows(report)), "", _concurrency(report), "", agents_line(report), "",
             "Failures by status:", ""]
    lines += [f"- {line}" for line in failure_lines(report)] or ["- none"]
    overall = report["overall"]["cache_hit_rate"]
    lines += [
        "",
        "Cache hit rate per tier (overall): "
        + ", ".join(f"{tier} {pct(overall[tier])}" for tier in (*TIERS, "total"))
        + ".",
        "",
        f"Columns: {COLUMNS_NOTE} Percentages are floored (99.7% shows as 99%).",
        "",
        (
            "Definitions: see `workloads/deepresearch/metrics.py` and `floor.py`. "
            "TTFT SLO = ok calls with TTFT <= the tenant's target; floor = backlogged "
            "windows whose token rate (uncached prefill + output) reached the tenant's floor; "
            "SKIPPED = planned calls not sent because an earlier call of the agent failed."
        ),
        "",
    ]
    lines += [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def print_summary(report: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the setup, the summary table and what to look at with rich."""
    console = console or Console()
    console.print(setup_line(report))
    setup = Table(title="Tenants: targets and offered load", show_lines=False)
    for column in SETUP_COLUMNS:
        setup.add_column(column, overflow="fold")
    for row in setup_rows(report):
        setup.add_row(*row)
    console.print(setup)
    table = Table(title="DeepResearch workload", show_lines=False)
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows(report):
        table.add_row(*row, style="bold" if row[0] == "overall" else None)
    console.print(table)
    console.print(COLUMNS_NOTE, style="dim")
    console.print(_concurrency(report))
    for line in failure_lines(report):
        console.print(f"failures {line}")
    console.print(time_line(report), style="dim")
    for line in what_to_look_at(report):
        console.print(line)
