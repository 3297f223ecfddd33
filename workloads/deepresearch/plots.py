"""PNG plots of a run (matplotlib's Agg canvas; no global backend is switched).

- ``ttft_cdf.png``: empirical CDF of TTFT per tenant, with each tenant's target.
- ``memory.png``: device/host bytes and device-tier block occupancy over time.
- ``throughput.png``: output tokens per second per tenant, per window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from workloads.deepresearch.config import TenantProfile

Record = Mapping[str, Any]


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
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


def plot_memory(timeseries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Device/host bytes (top) and device-tier occupancy fractions (bottom) over time."""
    good = [s for s in timeseries if "error" not in s]
    figure = Figure(figsize=(7, 5.5))
    top, bottom = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2, sharex=None)
    t = [s["t_s"] for s in good]
    for key, label in (("device_bytes_used", "device tier"), ("host_bytes_used", "host tier")):
        if any(key in s for s in good):
            top.plot(t, [s.get(key, 0.0) / 2**20 for s in good], label=label)
    top.set_ylabel("MiB")
    top.set_title("KV bytes per tier over time")
    for key, label in (("device_used_fraction", "in use"), ("device_cached_fraction", "cached")):
        if any(key in s for s in good):
            bottom.plot(t, [s.get(key, 0.0) for s in good], label=label)
    bottom.set_ylabel("fraction of device blocks")
    bottom.set_xlabel("time since start (s)")
    bottom.set_ylim(0.0, 1.05)
    for ax in (top, bottom):
        _legend_or_note(ax, "upper left", "no stats samples")
    return _save(figure, path)


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
    records: Sequence[Record], tenants: Sequence[TenantProfile], path: Path, window_s: float = 5.0
) -> Path:
    """Output tokens per second per tenant over time."""
    horizon_s = max((r["end_s"] for r in records), default=window_s)
    figure = Figure(figsize=(7, 4.5))
    ax = figure.add_subplot()
    for i, tenant in enumerate(tenants):
        series = throughput_series(records, tenant.name, window_s, horizon_s)
        ax.plot(np.arange(len(series)) * window_s, series, color=f"C{i}", label=tenant.name)
    ax.set_xlabel(f"time since start (s), {window_s:g} s windows")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput per tenant")
    _legend_or_note(ax, "upper right", "no calls")
    return _save(figure, path)
