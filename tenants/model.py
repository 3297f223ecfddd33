"""Tenants and their service-level promises (docs/architecture.md, 'Tenants and SLO promises').

A ``TenantSpec`` is what an operator sets; a ``Tenant`` is a registered spec with its id.
Fields left unset take the defaults of the tenant's SLO class (``SLO_CLASS_DEFAULTS``),
and an unset ``cache_namespace`` ("") is the tenant's own, keyed by its immutable id
(``Tenant.kv_namespace``), so two tenants share prefix blocks only when both name the same
namespace, and a tenant registered under a deleted tenant's name never reaches its KV.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import Enum
from types import MappingProxyType
from typing import Any

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
POLICY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
DEFAULT_MAX_CONTEXT_TOKENS = 8192
MAX_ALLOWED_POLICIES = 64
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1


class SloClass(str, Enum):
    """Service-level class; decides admission and preemption order (interactive first)."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @classmethod
    def parse(cls, value: SloClass | str) -> SloClass:
        """Return the class named ``value`` (case-insensitive).

        Raises:
            ValueError: unknown name; the message lists the known ones.
        """
        if isinstance(value, SloClass):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            known = ", ".join(member.value for member in cls)
            raise ValueError(f"slo_class must be one of {known}, got {value!r}") from None


@dataclass(frozen=True)
class SloDefaults:
    """Per-class defaults for the fields a tenant spec may leave unset."""

    ttft_slo_ms: float
    tpot_slo_ms: float
    min_tokens_per_s: float
    weight: float


SLO_CLASS_DEFAULTS: Mapping[SloClass, SloDefaults] = MappingProxyType(
    {
        SloClass.INTERACTIVE: SloDefaults(
            ttft_slo_ms=1000.0, tpot_slo_ms=100.0, min_tokens_per_s=10.0, weight=4.0
        ),
        SloClass.STANDARD: SloDefaults(
            ttft_slo_ms=5000.0, tpot_slo_ms=250.0, min_tokens_per_s=4.0, weight=2.0
        ),
        SloClass.BATCH: SloDefaults(
            ttft_slo_ms=60000.0, tpot_slo_ms=1000.0, min_tokens_per_s=0.0, weight=1.0
        ),
    }
)


@dataclass(frozen=True, init=False)
class TenantSpec:
    """What an operator sets for one tenant. Immutable; validated at construction.

    Attributes:
        name: unique tenant name, ``[a-z0-9][a-z0-9_-]{0,62}``.
        slo_class: interactive, standard or batch.
        ttft_slo_ms: p95 time-to-first-token target (> 0).
        tpot_slo_ms: time-per-output-token target (> 0).
        min_tokens_per_s: token-rate floor while backlogged (>= 0; 0 = no floor).
        weight: share of what is left after floors (> 0).
        kv_quota_bytes: guaranteed device-tier bytes (>= 0; 0 = borrow only).
        max_context_tokens: longest prompt + completion accepted (> 0).
        cache_namespace: prefix blocks are shared only inside one namespace; same
            pattern as ``name``; "" (the default) = the tenant's own (``Tenant.kv_namespace``).
        policy: default KV policy name, ``""`` = the cache node's default.
        allowed_policies: KV policies the tenant's requests may name (at most
            ``MAX_ALLOWED_POLICIES``); an entry without parameters (``snapkv``) allows
            every spec of that policy (``snapkv-0.25``), one with parameters only itself.
            Empty = every policy. ``policy`` must be allowed; ``""`` (the node's default)
            always is (see ``allows_policy``).

    ``None`` for an SLO field means the class default (``SLO_CLASS_DEFAULTS``);
    ``None`` or ``""`` for ``cache_namespace`` means the tenant's own namespace.

    Raises:
        ValueError: a field is out of range or malformed; the message names the field.
    """

    name: str
    slo_class: SloClass
    ttft_slo_ms: float
    tpot_slo_ms: float
    min_tokens_per_s: float
    weight: float
    kv_quota_bytes: int
    max_context_tokens: int
    cache_namespace: str
    policy: str
    allowed_policies: tuple[str, ...]

    def __init__(
        self,
        name: str,
        slo_class: SloClass | str = SloClass.STANDARD,
        *,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
        min_tokens_per_s: float | None = None,
        weight: float | None = None,
        kv_quota_bytes: int = 0,
        max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
        cache_namespace: str | None = None,
        policy: str = "",
        allowed_policies: tuple[str, ...] | list[str] = (),
    ) -> None:
        slo = SloClass.parse(slo_class)
        defaults = SLO_CLASS_DEFAULTS[slo]
        values = {
            "name": _pattern("name", name, NAME_PATTERN),
            "slo_class": slo,
            "ttft_slo_ms": _positive("ttft_slo_ms", _or(ttft_slo_ms, defaults.ttft_slo_ms)),
            "tpot_slo_ms": _positive("tpot_slo_ms", _or(tpot_slo_ms, defaults.tpot_slo_ms)),
            "min_tokens_per_s": _non_negative(
                "min_tokens_per_s", _or(min_tokens_per_s, defaults.min_tokens_per_s)
            ),
            "weight": _positive("weight", _or(weight, defaults.weight)),
            "kv_quota_bytes": _int_in("kv_quota_bytes", kv_quota_bytes, 0, MAX_UINT64),
            "max_context_tokens": _int_in("max_context_tokens", max_context_tokens, 1, MAX_UINT32),
            "cache_namespace": _pattern("cache_namespace", cache_namespace, NAME_PATTERN)
            if cache_namespace else "",
            "policy": _policy(policy),
            "allowed_policies": _allowed_policies(allowed_policies),
        }
        for field_name, value in values.items():
            object.__setattr__(self, field_name, value)
        if not self.allows_policy(self.policy):
            raise ValueError(f"policy {self.policy!r} is not in allowed_policies {list(self.allowed_policies)}")

    def allows_policy(self, policy: str) -> bool:
        """True when the tenant's requests may run under KV policy spec ``policy``: it is
        ``""`` (the node's default), ``allowed_policies`` is empty, or an entry equals the
        spec or names its policy (the part before the first ``-``)."""
        if not policy or not self.allowed_policies:
            return True
        return any(entry in (policy, policy.split("-", 1)[0]) for entry in self.allowed_policies)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field (``slo_class`` as its string value)."""
        data = asdict(self)
        data["slo_class"] = self.slo_class.value
        data["allowed_policies"] = list(self.allowed_policies)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TenantSpec:
        """Build a spec from ``to_dict()`` output or user JSON; absent fields take defaults.

        Raises:
            ValueError: ``name`` is missing, a key is unknown, or a value is invalid.
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown TenantSpec fields {unknown}; known fields: {known}")
        if "name" not in data:
            raise ValueError("TenantSpec needs a name")
        return cls(**data)


@dataclass(frozen=True)
class Tenant:
    """A registered tenant.

    Attributes:
        tenant_id: stable id assigned at registration (never reused for another tenant).
        spec: the tenant's current spec.
        created_at_s: registration time, unix seconds.
    """

    tenant_id: str
    spec: TenantSpec
    created_at_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_id, str) or not self.tenant_id:
            raise ValueError(f"tenant_id must be a non-empty string, got {self.tenant_id!r}")
        _non_negative("created_at_s", self.created_at_s)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kv_namespace(self) -> str:
        """The namespace the tenant's KV blocks are hashed in: ``spec.cache_namespace`` when it
        names one (shared with every tenant naming it), else ``tenant:<tenant_id>``: its own,
        which no other tenant can name (":" is outside the namespace pattern), not even one
        registered later under the same name (regression: the default was the name, so a new
        tenant "alice" saw the cached prompts of a deleted "alice" in its ``cached_tokens``)."""
        return self.spec.cache_namespace or own_namespace(self.tenant_id)


SPEC_DIGEST_CHARS = 16
"""Length of ``spec_digest``'s answer (hex characters)."""


@functools.lru_cache(maxsize=4096)
def spec_digest(spec: TenantSpec) -> str:
    """A short digest of every field of ``spec`` (``SPEC_DIGEST_CHARS`` lowercase hex
    characters of the SHA-256 of its ``to_dict`` as canonical JSON): equal specs have equal
    digests, and any change of a field (a namespace, a policy, a bound, an SLO value) changes
    it. A gateway sends the digest of the spec it prepared a request with; the scheduler,
    which holds each tenant's current spec, refuses a stale one (``tenant_changed``)."""
    text = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:SPEC_DIGEST_CHARS]


def own_namespace(tenant_id: str) -> str:
    """The cache namespace of the tenant ``tenant_id`` when its spec names no shared one
    (``Tenant.kv_namespace``); a deleted tenant's is purged on every tier
    (``services.cache_node_commands.end_tenant``)."""
    return f"tenant:{tenant_id}"


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _number(field_name: str, value: Any, requirement: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{field_name} must be {requirement}, got {value!r}")
    return float(value)


def _positive(field_name: str, value: Any) -> float:
    number = _number(field_name, value, "a positive finite number")
    if number <= 0:
        raise ValueError(f"{field_name} must be a positive finite number, got {value!r}")
    return number


def _non_negative(field_name: str, value: Any) -> float:
    number = _number(field_name, value, "a finite number >= 0")
    if number < 0:
        raise ValueError(f"{field_name} must be a finite number >= 0, got {value!r}")
    return number


def _int_in(field_name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{field_name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _pattern(field_name: str, value: Any, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise ValueError(f"{field_name} must match {pattern.pattern}, got {value!r}")
    return value


def _policy(value: Any) -> str:
    if value == "":
        return ""
    return _pattern("policy", value, POLICY_PATTERN)


def _allowed_policies(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        raise ValueError(f"allowed_policies must be a list of policy names, got {value!r}")  # noqa: TRY004 - bad input
    if len(value) > MAX_ALLOWED_POLICIES:
        raise ValueError(f"allowed_policies holds {len(value)} names; at most {MAX_ALLOWED_POLICIES} are allowed")
    return tuple(_pattern("allowed_policies", v, POLICY_PATTERN) for v in value)
