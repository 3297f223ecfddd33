"""Gamma arrivals, heavy-tailed tool pauses and Zipf popularity."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.deepresearch.config import ToolPauseConfig
from workloads.deepresearch.sampling import ZipfSampler, gamma_arrival_times, tool_pause_s


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_gamma_interarrival_mean_and_cv_match_the_config(cv: float) -> None:
    rng = np.random.default_rng(7)
    times = gamma_arrival_times(rate_per_s=2.0, cv=cv, duration_s=20_000.0, rng=rng)
    gaps = np.diff([0.0, *times])
    assert len(gaps) > 30_000
    assert gaps.mean() == pytest.approx(0.5, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert all(0.0 < t < 20_000.0 for t in times)
    assert times == sorted(times)


def test_gamma_arrivals_reject_bad_parameters() -> None:
    with pytest.raises(ValueError, match="rate_per_s, cv, duration_s"):
        gamma_arrival_times(0.0, 1.0, 10.0, np.random.default_rng(0))


def test_lognormal_pause_has_its_median_and_is_capped() -> None:
    config = ToolPauseConfig(distribution="lognormal", median_s=1.0, sigma=1.5, cap_s=8.0)
    rng = np.random.default_rng(1)
    pauses = np.array([tool_pause_s(config, rng) for _ in range(20_000)])
    assert np.median(pauses) == pytest.approx(1.0, rel=0.05)
    assert pauses.max() == 8.0  # exp(1.5 * z) > 8 for z > 1.39: ~8% of draws are capped
    assert (pauses == 8.0).mean() == pytest.approx(0.082, abs=0.01)


def test_pareto_pause_has_its_median_and_floor() -> None:
    config = ToolPauseConfig(distribution="pareto", median_s=2.0, pareto_alpha=1.5, cap_s=50.0)
    rng = np.random.default_rng(2)
    pauses = np.array([tool_pause_s(config, rng) for _ in range(20_000)])
    assert np.median(pauses) == pytest.approx(2.0, rel=0.05)
    assert pauses.min() >= 2.0 * 2 ** (-1 / 1.5)
    with pytest.raises(ValueError, match="distribution must be one of"):
        ToolPauseConfig(distribution="uniform")


def test_zipf_top_rank_frequency() -> None:
    items = [f"doc{i}" for i in range(100)]
    sampler = ZipfSampler(items, exponent=1.0, rng=np.random.default_rng(3))
    rng = np.random.default_rng(4)
    draws = [sampler.draw(rng) for _ in range(20_000)]
    harmonic_100 = sum(1 / k for k in range(1, 101))
    top_share = draws.count(sampler.ranked[0]) / len(draws)
    assert top_share == pytest.approx(1 / harmonic_100, rel=0.05)
    assert sorted(sampler.ranked) == sorted(items)
    distinct = sampler.draw_distinct(5, rng, exclude={sampler.ranked[0]})
    assert len(set(distinct)) == 5 and sampler.ranked[0] not in distinct
