"""The default demo workload: four tenants in three SLO classes plus a noisy neighbour."""

from __future__ import annotations

from workloads.deepresearch.config import TenantProfile, WorkloadConfig

BASE_SESSIONS_PER_S = 0.02
"""One "fair share" of research sessions per second on a 2-core CPU box."""


def demo_tenants(base_sessions_per_s: float = BASE_SESSIONS_PER_S) -> tuple[TenantProfile, ...]:
    """Interactive, standard and batch tenants at one share each; a noisy batch tenant at 4x.

    ``chat`` and ``analyst`` name the same cache namespace, so their identical
    system prompts and shared articles may be served from one another's KV.
    """
    return (
        TenantProfile("chat", "interactive", ttft_slo_ms=2000.0, tpot_slo_ms=200.0,
                      min_tokens_per_s=4.0, weight=4.0, cache_namespace="wiki-shared",
                      sessions_per_s=base_sessions_per_s, arrival_cv=1.0),
        TenantProfile("analyst", "standard", ttft_slo_ms=5000.0, tpot_slo_ms=400.0,
                      min_tokens_per_s=2.0, weight=2.0, cache_namespace="wiki-shared",
                      sessions_per_s=base_sessions_per_s, arrival_cv=1.5),
        TenantProfile("indexer", "batch", ttft_slo_ms=30000.0, tpot_slo_ms=1000.0,
                      min_tokens_per_s=0.5, weight=1.0,
                      sessions_per_s=base_sessions_per_s, arrival_cv=1.0),
        TenantProfile("noisy", "batch", ttft_slo_ms=30000.0, tpot_slo_ms=1000.0,
                      min_tokens_per_s=0.5, weight=1.0,
                      sessions_per_s=4 * base_sessions_per_s, arrival_cv=2.0, noisy=True),
    )  # fmt: skip


def demo_config(seed: int = 0, duration_s: float = 120.0) -> WorkloadConfig:
    """The workload ``make demo`` runs: short prompts, 2-4 sub-agents, 1-2 reads each."""
    return WorkloadConfig(seed=seed, duration_s=duration_s, tenants=demo_tenants())
