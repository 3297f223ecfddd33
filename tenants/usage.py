"""Per-tenant usage accounting: tokens, cache hits per tier, blocks, request outcomes.

``UsageLedger`` keeps running counters keyed by ``tenant_id`` in memory; ``snapshot``
returns immutable ``TenantUsage`` values. Counters only grow, except ``blocks_held``,
which is a gauge the scheduler sets. The counters (``COUNTERS``, not the gauges) are made
durable by the tenant store: ``take_dirty`` hands over those changed since it was last
called, ``restore`` loads them at start (``services.global_scheduler``: a restarted or
restarted-up scheduler keeps counting where the last flush left them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace

TIERS = ("device", "host", "spill_ram", "spill_disk")
COUNTERS = ("prompt_tokens", "completion_tokens", "requests", "rejected", "preempted",
            *(f"cached_tokens_{tier}" for tier in TIERS))
"""The durable counters of a tenant's usage, flat (``UsageLedger.counters``): every field of
``TenantUsage`` but its id and its gauges (``blocks_held``, ``session_blocks_held``)."""


@dataclass(frozen=True)
class TierTokens:
    """Token counts split by the tier their KV came from (docs/architecture.md, 'Tiers').

    Raises:
        ValueError: a count is not a non-negative integer; the message names the tier.
    """

    device: int = 0
    host: int = 0
    spill_ram: int = 0
    spill_disk: int = 0

    def __post_init__(self) -> None:
        for tier in TIERS:
            _count(tier, getattr(self, tier))

    @classmethod
    def from_dict(cls, counts: Mapping[str, int]) -> TierTokens:
        """Build from ``{tier: tokens}``; absent tiers count 0.

        Raises:
            ValueError: an unknown tier name (the message lists the known ones) or a bad count.
        """
        unknown = sorted(set(counts) - set(TIERS))
        if unknown:
            raise ValueError(f"unknown tiers {unknown}; known tiers: {list(TIERS)}")
        return cls(**counts)

    def as_dict(self) -> dict[str, int]:
        return {tier: getattr(self, tier) for tier in TIERS}

    @property
    def total(self) -> int:
        return self.device + self.host + self.spill_ram + self.spill_disk

    def __add__(self, other: TierTokens) -> TierTokens:
        return TierTokens(**{tier: getattr(self, tier) + getattr(other, tier) for tier in TIERS})


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's usage since the ledger started (or since ``forget``).

    Attributes:
        tenant_id: whose usage this is.
        prompt_tokens: prompt tokens of admitted requests (cached ones included).
        completion_tokens: tokens generated.
        cached_tokens: prompt tokens whose KV was reused, per tier.
        blocks_held: KV pool blocks the tenant holds now, its requests' and its idle
            sessions' (a gauge; the gateway fills it from the cache nodes when asked,
            ``TenantServicer.GetUsage``).
        session_blocks_held: of ``blocks_held``, those its idle sessions hold.
        requests: requests admitted.
        rejected: requests rejected at admission.
        preempted: times a running request of the tenant was preempted.
    """

    tenant_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: TierTokens = field(default_factory=TierTokens)
    blocks_held: int = 0
    requests: int = 0
    rejected: int = 0
    preempted: int = 0
    session_blocks_held: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise ValueError(f"tenant_id must be a non-empty string, got {self.tenant_id!r}")
        for f in fields(self):
            if f.name not in ("tenant_id", "cached_tokens"):
                _count(f.name, getattr(self, f.name))
        if self.session_blocks_held > self.blocks_held:
            raise ValueError(f"session_blocks_held {self.session_blocks_held} exceeds blocks_held {self.blocks_held}")


class UsageLedger:
    """Running usage counters for all tenants; safe to call from several threads.

    Every ``record_*`` method raises ``ValueError`` for an empty ``tenant_id`` or a
    negative/non-integer count, and changes nothing in that case.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage: dict[str, TenantUsage] = {}
        self._dirty: set[str] = set()  # tenants whose counters changed since ``take_dirty``

    def counters(self, tenant_id: str) -> dict[str, int]:
        """``tenant_id``'s durable counters (``COUNTERS``), flat."""
        with self._lock:
            return _counters(self._get(tenant_id))

    def take_dirty(self) -> dict[str, dict[str, int]]:
        """The counters of every tenant changed since the last call (tenant id -> ``counters``),
        now marked clean. A caller that failed to store them hands them back (``mark_dirty``)."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            return {tid: _counters(self._usage[tid]) for tid in sorted(dirty) if tid in self._usage}

    def mark_dirty(self, tenant_ids: Iterable[str]) -> None:
        """Mark ``tenant_ids`` changed again (their counters were not stored)."""
        with self._lock:
            self._dirty.update(tid for tid in tenant_ids if tid in self._usage)

    def restore(self, rows: Mapping[str, Mapping[str, int]]) -> int:
        """Set the counters of each tenant in ``rows`` (tenant id -> ``counters``, as stored),
        keeping its gauges; returns the tenants restored. A row naming an unknown counter or a
        bad count is skipped whole, never half applied (``TenantStore.load_usage`` hands over
        only ``COUNTERS`` of rows it could read: it keeps the rest out of this ledger's reach)."""
        restored = 0
        for tenant_id, row in rows.items():
            try:
                usage = _from_counters(tenant_id, row)
            except (TypeError, ValueError):
                continue
            with self._lock:
                held = self._get(tenant_id)
                self._usage[tenant_id] = replace(usage, blocks_held=held.blocks_held,
                                                 session_blocks_held=held.session_blocks_held)
            restored += 1
        return restored

    def record_request(
        self,
        tenant_id: str,
        *,
        prompt_tokens: int = 0,
        cached_tokens: TierTokens | Mapping[str, int] | None = None,
    ) -> None:
        """Count one admitted request with its prompt size and prompt cache hits, where known.

        Raises:
            ValueError: the cached tokens exceed ``prompt_tokens``.
        """
        self._record(tenant_id, 1, prompt_tokens, cached_tokens)

    def record_prompt(
        self,
        tenant_id: str,
        *,
        prompt_tokens: int,
        cached_tokens: TierTokens | Mapping[str, int] | None = None,
    ) -> None:
        """Add a finished request's prompt size and cache hits (the request was counted at
        admission with ``record_request``; a session turn's prompt, history included, is only
        known once the node has run it).

        Raises:
            ValueError: the cached tokens exceed ``prompt_tokens``.
        """
        self._record(tenant_id, 0, prompt_tokens, cached_tokens)

    def _record(
        self,
        tenant_id: str,
        requests: int,
        prompt_tokens: int,
        cached_tokens: TierTokens | Mapping[str, int] | None,
    ) -> None:
        cached = _tier_tokens(cached_tokens)
        if cached.total > _count("prompt_tokens", prompt_tokens):
            raise ValueError(
                f"cached_tokens total {cached.total} exceeds prompt_tokens {prompt_tokens}"
            )
        with self._lock:
            usage = self._get(tenant_id)
            self._usage[tenant_id] = replace(
                usage,
                requests=usage.requests + requests,
                prompt_tokens=usage.prompt_tokens + prompt_tokens,
                cached_tokens=usage.cached_tokens + cached,
            )
            self._dirty.add(tenant_id)

    def record_completion_tokens(self, tenant_id: str, tokens: int) -> None:
        """Count ``tokens`` generated tokens (call per delta or once at the end)."""
        self._add(tenant_id, completion_tokens=_count("tokens", tokens))

    def record_rejected(self, tenant_id: str) -> None:
        """Count one request rejected at admission."""
        self._add(tenant_id, rejected=1)

    def record_preempted(self, tenant_id: str) -> None:
        """Count one preemption of a running request."""
        self._add(tenant_id, preempted=1)

    def set_blocks_held(self, tenant_id: str, blocks: int) -> None:
        """Set the gauge of KV blocks the tenant holds now."""
        blocks = _count("blocks", blocks)
        with self._lock:
            self._usage[tenant_id] = replace(self._get(tenant_id), blocks_held=blocks)

    def snapshot(self, tenant_id: str) -> TenantUsage:
        """Usage of one tenant; all zeros for a tenant never recorded."""
        with self._lock:
            return self._get(tenant_id)

    def snapshot_all(self) -> dict[str, TenantUsage]:
        """Usage of every recorded tenant, keyed by tenant id, in id order."""
        with self._lock:
            return dict(sorted(self._usage.items()))

    def forget(self, tenant_id: str) -> None:
        """Drop a tenant's counters (e.g. after it is deleted); unknown ids are a no-op."""
        with self._lock:
            self._usage.pop(tenant_id, None)
            self._dirty.discard(tenant_id)

    def _add(self, tenant_id: str, **deltas: int) -> None:
        with self._lock:
            usage = self._get(tenant_id)
            changes = {name: getattr(usage, name) + delta for name, delta in deltas.items()}
            self._usage[tenant_id] = replace(usage, **changes)
            self._dirty.add(tenant_id)

    def _get(self, tenant_id: str) -> TenantUsage:
        """Current usage (zeros if unseen); validates the id. Caller holds the lock."""
        usage = self._usage.get(tenant_id)
        return usage if usage is not None else TenantUsage(tenant_id)


def _counters(usage: TenantUsage) -> dict[str, int]:
    flat = {name: getattr(usage, name) for name in COUNTERS if not name.startswith("cached_tokens_")}
    return flat | {f"cached_tokens_{tier}": n for tier, n in usage.cached_tokens.as_dict().items()}


def _from_counters(tenant_id: str, row: Mapping[str, int]) -> TenantUsage:
    """The ``TenantUsage`` of stored ``counters`` (absent ones 0).

    Raises:
        ValueError: an unknown counter or a bad count; TypeError: ``row`` is not a mapping.
    """
    unknown = set(row) - set(COUNTERS)
    if unknown:
        raise ValueError(f"unknown usage counters {sorted(unknown)}")
    cached = TierTokens(**{tier: row.get(f"cached_tokens_{tier}", 0) for tier in TIERS})
    return TenantUsage(tenant_id, cached_tokens=cached,
                       **{name: row.get(name, 0) for name in COUNTERS if not name.startswith("cached_tokens_")})


def _tier_tokens(value: TierTokens | Mapping[str, int] | None) -> TierTokens:
    if value is None:
        return TierTokens()
    return value if isinstance(value, TierTokens) else TierTokens.from_dict(value)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value
