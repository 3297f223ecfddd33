"""Writes a run's report folder: ``reports/deepresearch/<timestamp>/`` and ``reports/latest``.

Contents: ``calls.jsonl`` (one record per planned call), ``timeseries.jsonl``
(stats samples), ``report.json`` (exactly :func:`compute_report` of those two
files), ``report.md``, PNG plots, and, when given, ``trace.jsonl`` (what was sent)
and ``run.json`` (the config and run totals).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from kvstrata.durable_files import write_file_atomic
from workloads.deepresearch.config import TenantProfile, WorkloadConfig
from workloads.deepresearch.metrics import compute_report, exit_code
from workloads.deepresearch.plots import plot_memory, plot_throughput, plot_ttft_cdf
from workloads.deepresearch.summary import report_markdown
from workloads.deepresearch.trace import write_trace

__all__ = ["REPORT_FILE_MODE", "exit_code", "load_jsonl", "write_jsonl", "write_report"]

REPORT_FILE_MODE = 0o644
"""Every report file is written atomically and durably with these bits (``write_file_atomic``):
a crash leaves a file whole or absent, never cut short."""


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: Path) -> None:
    """One JSON object per line (keys sorted, UTF-8), written atomically (``write_file_atomic``)."""
    write_file_atomic(path, "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows),
                      REPORT_FILE_MODE)


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (blank lines ignored)."""
    with Path(path).open(encoding="utf-8") as rows:
        return [json.loads(line) for line in rows if line.strip()]


def _new_run_dir(root: Path, now: datetime) -> Path:
    """A new, empty ``root/deepresearch/<YYYYmmdd-HHMMSS>`` folder, or ``<timestamp>-<n>`` (the
    smallest n >= 1 free) when another run took that second: each name is taken with an
    exclusive ``mkdir``, so two runs (processes or threads) never get the same folder.

    Regression (s39): the name was checked (``exists``) and then created, so two runs started
    in the same second could both find it free; the second's ``mkdir`` raised FileExistsError
    after its whole run and its report was lost.

    Raises:
        OSError: ``root`` cannot be written."""
    parent = root / "deepresearch"
    parent.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        path = parent / (f"{stamp}-{n}" if n else stamp)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")  # itertools.count never ends


def _point_latest(root: Path, run_dir: Path) -> None:
    """Atomically make ``root/latest`` a relative symlink to ``run_dir`` (through a temp link of
    a name no other run, process or thread, uses)."""
    tmp = root / f".latest-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.symlink_to(run_dir.relative_to(root))
    try:
        os.replace(tmp, root / "latest")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_report(
    records: Sequence[Mapping[str, Any]],
    timeseries: Sequence[Mapping[str, Any]],
    tenants: Sequence[TenantProfile],
    *,
    root: str | Path = "reports",
    config: WorkloadConfig | None = None,
    trace: Sequence[Mapping[str, Any]] | None = None,
    run_info: Mapping[str, Any] | None = None,
    window_s: float = 1.0,
    now: datetime | None = None,
    scheduler: str = "",
    policy: str = "",
) -> tuple[Path, dict[str, Any]]:
    """Write the report folder and return ``(run_dir, report)``.

    Args:
        records / timeseries: from :class:`workloads.deepresearch.runner.RunResult`.
        tenants: the run's tenant profiles (SLO targets).
        root: the reports root; ``root/latest`` is repointed to the new folder.
        config / trace / run_info: optional; written to ``run.json`` and ``trace.jsonl``
            (trace: :attr:`RunResult.trace` rows, see :mod:`workloads.deepresearch.trace`).
        window_s: floor-attainment window.
        now: the folder's timestamp (default: local time now).
        scheduler / policy: the gateway's scheduler and the tenants' KV policy ("" = not
            known / each node's default); at the top of report.md and in ``run.json``.

    Raises:
        OSError: ``root`` or the new folder could not be written; a folder begun before
            report.md was written is removed again (regression, s40 diff review r7 of
            a8aaa40: the half-written ``root/deepresearch/<stamp>`` stayed, unnamed).
        ReportPartlyWritten: the report was written, a later file or ``root/latest`` not:
            the folder is kept and named.
    """
    root = Path(root)
    run_dir = _new_run_dir(root, now or datetime.now())
    try:
        report = _fill_run_dir(run_dir, records, timeseries, tenants, config=config, trace=trace,
                               run_info=run_info, window_s=window_s, scheduler=scheduler, policy=policy)
        _point_latest(root, run_dir)
    except OSError as exc:
        if not (run_dir / "report.md").is_file():  # nothing a reader can use: no half-written folder left
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        raise ReportPartlyWritten(f"{exc}; the report itself is in {run_dir} (run.json, trace.jsonl or "
                                  f"{root / 'latest'} not written)", run_dir) from exc
    return run_dir, report


class ReportPartlyWritten(OSError):
    """``write_report`` failed after the report itself (report.json, the plots, report.md) was
    written: ``run_dir`` (also ``args[1]``) keeps it; run.json, trace.jsonl or ``root/latest``
    is missing."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message, run_dir)
        self.run_dir = run_dir

    def __str__(self) -> str:
        return str(self.args[0])


def _fill_run_dir(
    run_dir: Path,
    records: Sequence[Mapping[str, Any]],
    timeseries: Sequence[Mapping[str, Any]],
    tenants: Sequence[TenantProfile],
    *,
    config: WorkloadConfig | None,
    trace: Sequence[Mapping[str, Any]] | None,
    run_info: Mapping[str, Any] | None,
    window_s: float,
    scheduler: str,
    policy: str,
) -> dict[str, Any]:
    """Write ``write_report``'s files into ``run_dir`` and return the report (``OSError``
    raised as it comes)."""
    write_jsonl(records, run_dir / "calls.jsonl")
    write_jsonl(timeseries, run_dir / "timeseries.jsonl")
    # Recompute from the files just written, so report.json is what a reader gets from them.
    report = compute_report(
        load_jsonl(run_dir / "calls.jsonl"),
        load_jsonl(run_dir / "timeseries.jsonl"),
        tenants,
        window_s=window_s,
        scheduler=scheduler,
        policy=policy,
    )
    span_s = (report["start_s"], report["end_s"]) if report["span_s"] > 0 else None  # the one time base
    write_file_atomic(run_dir / "report.json", json.dumps(report, indent=2, sort_keys=True) + "\n", REPORT_FILE_MODE)
    plots = (
        plot_ttft_cdf(records, tenants, run_dir / "ttft_cdf.png"),
        plot_memory(timeseries, run_dir / "memory.png", span_s),
        plot_throughput(records, tenants, run_dir / "throughput.png", span_s=span_s),
    )
    markdown = report_markdown(report, tuple(p.name for p in plots))
    write_file_atomic(run_dir / "report.md", markdown, REPORT_FILE_MODE)
    if trace is not None:
        write_trace(trace, run_dir / "trace.jsonl")
    info: dict[str, Any] = {"tenants": [dataclasses.asdict(t) for t in tenants], "scheduler": scheduler,
                            "policy": policy, "window_s": window_s}
    if config is not None:
        info["config"] = dataclasses.asdict(config)
    info.update(run_info or {})
    write_file_atomic(run_dir / "run.json", json.dumps(info, indent=2, sort_keys=True) + "\n", REPORT_FILE_MODE)
    return report
