"""Frozen configuration of the DeepResearch workload: tenants, pauses, token budgets."""

from __future__ import annotations

from dataclasses import dataclass, field

SLO_CLASSES = ("interactive", "standard", "batch")
PAUSE_DISTRIBUTIONS = ("lognormal", "pareto")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class TenantProfile:
    """One tenant's promises and its offered load.

    Attributes:
        name: tenant name, unique in a config.
        slo_class: ``"interactive"``, ``"standard"`` or ``"batch"``.
        ttft_slo_ms: p95 time-to-first-token target.
        tpot_slo_ms: time-per-output-token target.
        min_tokens_per_s: output-token-rate floor while the tenant is backlogged.
        weight: share of what is left after floors (weighted fair sharing).
        cache_namespace: prefix sharing happens only between tenants naming the same one.
        sessions_per_s: mean arrival rate of research sessions.
        arrival_cv: coefficient of variation of inter-arrival gaps (1 = Poisson,
            > 1 bursty); the Gamma shape is ``1 / arrival_cv**2``.
        noisy: marks a noisy neighbour (it offers more than its share); reports only.
        kv_quota_bytes: guaranteed device-tier bytes, passed on at registration (0 = none).

    Raises:
        ValueError: empty name, unknown SLO class, or a non-positive number.
    """

    name: str
    slo_class: str
    ttft_slo_ms: float
    tpot_slo_ms: float
    min_tokens_per_s: float
    weight: float = 1.0
    cache_namespace: str = ""
    sessions_per_s: float = 0.05
    arrival_cv: float = 1.0
    noisy: bool = False
    kv_quota_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tenant name must be non-empty")
        if self.slo_class not in SLO_CLASSES:
            raise ValueError(f"slo_class must be one of {SLO_CLASSES}, got {self.slo_class!r}")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "weight", "sessions_per_s", "arrival_cv"):
            _positive(name, getattr(self, name))
        if self.min_tokens_per_s < 0 or self.kv_quota_bytes < 0:
            raise ValueError("min_tokens_per_s and kv_quota_bytes must be >= 0")
        if not self.cache_namespace:
            object.__setattr__(self, "cache_namespace", self.name)


@dataclass(frozen=True)
class ToolPauseConfig:
    """Heavy-tailed tool latency (search, fetch) drawn before a tool-using turn.

    ``lognormal``: ``median_s * exp(sigma * N(0, 1))``. ``pareto``: ``median_s *
    2**(-1/pareto_alpha) * (1 + Lomax(pareto_alpha))`` (a Pareto with that
    median). Both are capped at ``cap_s``.
    """

    distribution: str = "lognormal"
    median_s: float = 1.0
    sigma: float = 1.0
    pareto_alpha: float = 1.5
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.distribution not in PAUSE_DISTRIBUTIONS:
            raise ValueError(
                f"distribution must be one of {PAUSE_DISTRIBUTIONS}, got {self.distribution!r}"
            )
        for name in ("median_s", "sigma", "pareto_alpha", "cap_s"):
            _positive(name, getattr(self, name))


@dataclass(frozen=True)
class CallMaxTokens:
    """``max_tokens`` per call kind (kept small for a tiny CPU model)."""

    plan: int = 48
    search: int = 12
    read: int = 24
    answer: int = 32
    report: int = 48

    def __post_init__(self) -> None:
        for name in ("plan", "search", "read", "answer", "report"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"max_tokens.{name} must be a positive int, got {value!r}")

    def for_kind(self, kind: str) -> int:
        """The budget of call kind ``kind``. Raises ValueError for an unknown kind."""
        if kind not in ("plan", "search", "read", "answer", "report"):
            raise ValueError(f"unknown call kind {kind!r}")
        return int(getattr(self, kind))


@dataclass(frozen=True)
class WorkloadConfig:
    """The whole workload; with the corpus, it determines the plan exactly.

    Attributes:
        seed: the only source of randomness.
        duration_s: sessions arrive in ``[0, duration_s)``.
        tenants: at least one; names unique.
        min_subagents / max_subagents: sub-agents per session, drawn uniformly, within 2..6.
        max_reads: articles a sub-agent reads, drawn uniformly in ``1..max_reads`` (<= 3).
        max_article_words: articles are cut to whole sentences within this many words.
        search_top_k: hits returned by a search (>= max_reads: agents read only hits).
        zipf_exponent: document popularity ``p(rank) ~ rank**-zipf_exponent`` (> 0).
        max_sessions_per_tenant: cap on sessions per tenant (0 = no cap).
        temperature: sampling temperature for every call (0 = greedy).
        max_tokens: per call kind.
        tool_pause: tool latency distribution.
    """

    seed: int = 0
    duration_s: float = 60.0
    tenants: tuple[TenantProfile, ...] = ()
    min_subagents: int = 2
    max_subagents: int = 4
    max_reads: int = 2
    max_article_words: int = 150
    search_top_k: int = 3
    zipf_exponent: float = 1.1
    max_sessions_per_tenant: int = 0
    temperature: float = 0.0
    max_tokens: CallMaxTokens = field(default_factory=CallMaxTokens)
    tool_pause: ToolPauseConfig = field(default_factory=ToolPauseConfig)

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("a workload needs at least one tenant")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        if not 2 <= self.min_subagents <= self.max_subagents <= 6:
            raise ValueError(
                "need 2 <= min_subagents <= max_subagents <= 6, "
                f"got {self.min_subagents}..{self.max_subagents}"
            )
        if not 1 <= self.max_reads <= 3:
            raise ValueError(f"max_reads must be in 1..3, got {self.max_reads}")
        if self.search_top_k < self.max_reads:
            raise ValueError(
                f"search_top_k ({self.search_top_k}) must be >= max_reads ({self.max_reads}): "
                "an agent reads only search hits"
            )
        for name in ("duration_s", "max_article_words", "search_top_k", "zipf_exponent"):
            _positive(name, getattr(self, name))
        if self.max_sessions_per_tenant < 0 or self.temperature < 0:
            raise ValueError("max_sessions_per_tenant and temperature must be >= 0")

    def tenant(self, name: str) -> TenantProfile:
        """The tenant called ``name``. Raises KeyError listing the known names."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(f"unknown tenant {name!r}; known: {[t.name for t in self.tenants]}")
