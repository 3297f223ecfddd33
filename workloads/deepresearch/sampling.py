"""Random draws of the workload: Gamma arrivals, heavy-tailed pauses, Zipf popularity.

Every function takes an explicit ``numpy.random.Generator``; nothing reads
global random state, so a plan is a pure function of its seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workloads.deepresearch.config import ToolPauseConfig


def gamma_arrival_times(
    rate_per_s: float, cv: float, duration_s: float, rng: np.random.Generator
) -> list[float]:
    """Arrival times in ``[0, duration_s)`` of a Gamma renewal process.

    Inter-arrival gaps are i.i.d. Gamma with shape ``k = 1 / cv**2`` and scale
    ``1 / (rate_per_s * k)``: mean gap ``1 / rate_per_s``, coefficient of
    variation ``cv`` (``cv = 1`` is Poisson; larger is burstier). The first
    arrival is one gap after 0.

    Raises:
        ValueError: a non-positive rate, CV or duration.
    """
    if rate_per_s <= 0 or cv <= 0 or duration_s <= 0:
        raise ValueError(
            f"need rate_per_s, cv, duration_s > 0, got {rate_per_s}, {cv}, {duration_s}"
        )
    shape = 1.0 / cv**2
    scale = 1.0 / (rate_per_s * shape)
    times: list[float] = []
    t = 0.0
    while True:
        t += float(rng.gamma(shape, scale))
        if t >= duration_s:
            return times
        times.append(t)


def tool_pause_s(config: ToolPauseConfig, rng: np.random.Generator) -> float:
    """One tool latency in seconds, heavy-tailed and capped at ``config.cap_s``.

    ``lognormal``: ``median_s * exp(sigma * Z)``. ``pareto``: a Pareto with
    shape ``pareto_alpha`` and median ``median_s`` (its minimum is
    ``median_s * 2**(-1/alpha)``).
    """
    if config.distribution == "lognormal":
        value = config.median_s * float(np.exp(config.sigma * rng.standard_normal()))
    else:
        minimum_s = config.median_s * 2.0 ** (-1.0 / config.pareto_alpha)
        value = minimum_s * (1.0 + float(rng.pareto(config.pareto_alpha)))
    return min(value, config.cap_s)


class ZipfSampler:
    """Draws items with probability proportional to ``rank**-exponent``.

    Ranks are a seeded shuffle of ``items``, so which items are popular depends
    on the seed but not on the order they were given in.

    Args:
        items: the population (non-empty, distinct).
        exponent: Zipf exponent (> 0); 1.1 puts ~10% of draws on the top item of 5,000.
        rng: used once, to shuffle the ranking.
    """

    def __init__(self, items: Sequence[str], exponent: float, rng: np.random.Generator) -> None:
        if not items:
            raise ValueError("ZipfSampler needs at least one item")
        if exponent <= 0:
            raise ValueError(f"exponent must be positive, got {exponent}")
        order = rng.permutation(len(items))
        self.ranked: tuple[str, ...] = tuple(items[i] for i in order)
        weights = np.arange(1, len(items) + 1, dtype=np.float64) ** -exponent
        self._cdf = np.cumsum(weights / weights.sum())

    def draw(self, rng: np.random.Generator) -> str:
        """One item."""
        rank = int(np.searchsorted(self._cdf, rng.random(), side="right"))
        return self.ranked[min(rank, len(self.ranked) - 1)]

    def draw_distinct(self, n: int, rng: np.random.Generator, exclude: set[str]) -> list[str]:
        """``n`` distinct items, none in ``exclude``, in draw order.

        Raises:
            ValueError: fewer than ``n`` items are left to draw from.
        """
        if n > len(self.ranked) - len(exclude):
            raise ValueError(f"cannot draw {n} distinct items from {len(self.ranked)}")
        chosen: list[str] = []
        while len(chosen) < n:
            item = self.draw(rng)
            if item not in exclude and item not in chosen:
                chosen.append(item)
        return chosen
