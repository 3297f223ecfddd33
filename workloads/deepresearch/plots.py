"""PNG plots of a run (matplotlib's Agg canvas; no global backend is switched).

- ``ttft_cdf.png``: empirical CDF of TTFT per tenant, with each tenant's target.
- ``memory.png``: KV blocks per tier (device, host, spill RAM and disk) with the device and
  host capacities, over time.
- ``throughput.png``: output tokens per second per tenant, per window.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvstrata.durable_files import write_file_atomic
from workloads.deepresearch.config import TenantProfile

Record = Mapping[str, Any]


def _save(figure: Figure, path: Path) -> Path:
    """Render ``figure`` as PNG and write it atomically (``write_file_atomic``, mode 0644)."""
    FigureCanvasAgg(figure)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    write_file_atomic(path, png.getvalue(), 0o644)
    return path


def _legend_or_note(ax: Any, loc: str, note: str) -> None:
    """A legend when something was drawn, else ``note`` in the middle of the axes."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc, fontsize="small")
    else:
        ax.text(0.5, 0.5, note, ha="center", transform=ax.transAxes)


def plot_ttft_cdf(records: Sequence[Record], tenants: Sequence[TenantProfile], path: Path) -> Path:
    """TTFT CDF per tenant (ok calls), dashed line at each tenant's ``ttft_slo_ms``."""
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for i, tenant in enumerate(tenants):
        ttfts = sorted(
            r["ttft_ms"] for r in records
            if r["tenant"] == tenant.name and r["status"] == "ok" and r["ttft_ms"] is not None
        )  # fmt: skip
        if not ttfts:
            continue
        color = f"C{i}"
        ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post",
                color=color, label=f"{tenant.name} ({tenant.slo_class})")  # fmt: skip
        ax.axvline(tenant.ttft_slo_ms, color=color, linestyle="--", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale); dashed: target")
    ax.set_ylabel("fraction of ok calls")
    ax.set_title("Time to first token per tenant")
    _legend_or_note(ax, "lower right", "no successful calls")
    return _save(figure, path)


def _series(ax: Any, good: Sequence[Mapping[str, Any]], key: str, label: str, **style: Any) -> None:
    """Plot ``key`` of the samples that have it (a sample without it is not a zero)."""
    points = [(s["t_s"], s[key]) for s in good if key in s]
    if points:
        ax.plot(*zip(*points), label=label, **style)


def plot_memory(
    timeseries: Sequence[Mapping[str, Any]], path: Path, span_s: tuple[float, float] | None = None
) -> Path:
    """Save :func:`memory_figure` to ``path``."""
    return _save(memory_figure(timeseries, span_s), path)


def memory_figure(
    timeseries: Sequence[Mapping[str, Any]], span_s: tuple[float, float] | None = None
) -> Figure:
    """KV blocks per tier over time, each tier with its capacity (dashed), over ``span_s``.

    Top: the device tier's blocks in use and cached (free but reusable) against its pool.
    Bottom: the host tier's blocks against its slots, and the spill tier's blocks in RAM and
    on disk (block copies the global index holds; the spill budgets are bytes in the
    service config, not sampled). Blocks are one size in every tier, so the panels compare.
    Samples outside ``span_s`` (the report's time base) are left out.
    """
    good = [s for s in timeseries if "error" not in s]
    if span_s is not None:
        good = [s for s in good if span_s[0] <= s["t_s"] <= span_s[1]]
    figure = Figure(figsize=(7, 6))
    top, bottom = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2, sharex=None)
    _series(top, good, "used_blocks", "device: in use", color="C0")
    _series(top, good, "cached_blocks", "device: cached", color="C1")
    _series(top, good, "num_blocks", "device capacity", color="C0", linestyle="--", linewidth=0.8)
    top.set_title("KV blocks per tier (dashed: capacity)")
    top.set_ylabel("device blocks")
    _series(bottom, good, "host_blocks", "host", color="C2")
    _series(bottom, good, "host_capacity_blocks", "host capacity", color="C2", linestyle="--", linewidth=0.8)
    _series(bottom, good, "spill_ram_blocks", "spill: RAM", color="C3")
    _series(bottom, good, "spill_disk_blocks", "spill: disk", color="C4")
    bottom.set_ylabel("host / spill blocks")
    bottom.set_xlabel("time since the run started (s)")
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        if span_s is not None:
            ax.set_xlim(*span_s)
        _legend_or_note(ax, "upper left", "no stats samples")
    return figure


def throughput_series(
    records: Sequence[Record], tenant: str, window_s: float, horizon_s: float
) -> np.ndarray:
    """Output tokens/s of ``tenant`` per window ``[k*W, (k+1)*W)``; tokens counted at ``end_s``."""
    bins = np.zeros(max(1, math.ceil(horizon_s / window_s)))
    for r in records:
        if r["tenant"] == tenant and r["status"] == "ok":
            bins[min(int(r["end_s"] // window_s), len(bins) - 1)] += r["completion_tokens"]
    return bins / window_s


def plot_throughput(
    records: Sequence[Record], tenants: Sequence[TenantProfile], path: Path, window_s: float = 5.0,
    span_s: tuple[float, float] | None = None,
) -> Path:
    """Save :func:`throughput_figure` to ``path``."""
    return _save(throughput_figure(records, tenants, window_s, span_s), path)


def throughput_figure(
    records: Sequence[Record], tenants: Sequence[TenantProfile], window_s: float = 5.0,
    span_s: tuple[float, float] | None = None,
) -> Figure:
    """Output tokens per second per tenant over time; the axis covers ``span_s`` when given
    (the report's time base: first call's start to last call's end)."""
    horizon_s = max((r["end_s"] for r in records), default=window_s)
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for i, tenant in enumerate(tenants):
        series = throughput_series(records, tenant.name, window_s, horizon_s)
        edges = np.arange(len(series) + 1) * window_s  # each window flat over [k*W, (k+1)*W)
        ax.stairs(series, edges, color=f"C{i}", label=tenant.name)
    ax.set_xlabel(f"time since the run started (s), {window_s:g} s windows")
    if span_s is not None:
        ax.set_xlim(*span_s)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per tenant")
    _legend_or_note(ax, "best", "no calls")
    return figure
