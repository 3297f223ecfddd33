"""Policy registry: ``name -> class``, and parsing of per-request policy specs.

A spec is what a tenant or request names (``SPEC_PATTERN``; the tenant ``policy`` pattern,
63 characters, at the network's entry points)::

    snapkv                  the policy with its defaults
    snapkv-0.25             budget: a fraction (<= 1) of the prompt's tokens per layer
    h2o-256-window_tokens_32  budget in tokens, then ``<field>_<value>`` overrides
    quant-bits_4

Idea: mini-sglang ``utils/registry.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

from cache_node.policies.base import Policy

REGISTRY: dict[str, type[Policy]] = {}
MAX_SPEC_CHARS = 256
SPEC_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,255}")
"""What a spec may be, checked before any parsing: the characters of the tenant ``policy``
pattern, at most ``MAX_SPEC_CHARS`` of them. A spec from the network is held to 63 at its
entry points (``tenants.model.POLICY_PATTERN``: gRPC, HTTP, the data plane); a caller of the
engine (benches, presets) may name longer ones."""


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` selectable by ``cls.name``."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    REGISTRY[cls.name] = cls
    return cls


def known_policies() -> list[str]:
    return sorted(REGISTRY)


def get_policy_class(spec: str) -> type[Policy]:
    """The class a spec names. Raises ValueError listing the known names when unknown."""
    name = spec.split("-", 1)[0]
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown KV policy {name!r}; known policies: {', '.join(known_policies())}")
    return cls


MAX_FIELD_INT = 2**31 - 1
"""Largest magnitude an integer field of a spec may have (a spec comes from the network)."""


def _number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def _typed(cls: type[Policy], key: str, text: str, spec: str) -> int | float | str:
    """``text`` as the type field ``key`` of ``cls`` declares: an ``int`` field takes an
    integer literal, a ``float`` field any finite number, a ``str`` field the text itself.

    Raises:
        ValueError: a value of another type, NaN or an infinity, or an integer beyond
            ``MAX_FIELD_INT`` (naming the part and the spec).
    """
    kind = _field_types(cls)[key]
    if kind == "str":
        return text
    number = _number(text)
    if kind == "int":
        if not isinstance(number, int):
            raise ValueError(f"{key} must be an integer in policy spec {spec!r}, got {text!r}")
        if abs(number) > MAX_FIELD_INT:
            raise ValueError(f"{key} must be at most {MAX_FIELD_INT} in magnitude in policy spec {spec!r}")
        return number
    if number is None or not math.isfinite(number) or abs(number) > MAX_FIELD_INT:
        raise ValueError(f"{key} must be a finite number of magnitude <= {MAX_FIELD_INT} in policy spec {spec!r}, "
                         f"got {text!r}")
    return float(number) if isinstance(number, float) else number


def _field_types(cls: type[Policy]) -> dict[str, str]:
    """Field name -> declared type name ("int", "float", "str") of a policy dataclass."""
    return {f.name: str(f.type).split("|")[0].strip() for f in fields(cls)}


def parse_spec(spec: str) -> tuple[type[Policy], dict[str, Any]]:
    """Split a spec into its class and constructor keyword arguments, each of its field's type.

    Raises:
        ValueError: a spec not matching ``SPEC_PATTERN`` (over ``MAX_SPEC_CHARS``; only its
            first 80 characters are echoed), unknown policy, unknown field, or a malformed part (with the part
            named): a value not of its field's type, not finite, or beyond ``MAX_FIELD_INT``.

    Regression (security review 19 H2): a spec had no length bound here, and parsing cost
    ~2 µs a character; a 1 MB valid spec (``snapkv-0.5-0.5-...``) sent over HTTP stalled the
    gateway's event loop 5.2 s and the cache node's step thread 6.2 s.
    """
    if not isinstance(spec, str) or SPEC_PATTERN.fullmatch(spec) is None:
        shown = spec[:80] if isinstance(spec, str) else spec
        raise ValueError(f"a KV policy spec must match {SPEC_PATTERN.pattern} (at most {MAX_SPEC_CHARS} characters), got {shown!r}"
                         + (f" ({len(spec)} characters)" if isinstance(spec, str) and len(spec) > 80 else ""))
    cls = get_policy_class(spec)
    allowed = set(_field_types(cls))
    kwargs: dict[str, Any] = {}
    for part in spec.split("-")[1:]:
        if _number(part) is not None:
            kwargs["budget"] = _typed(cls, "budget", part, spec)
            continue
        key, sep, value = part.rpartition("_")
        if not sep or key not in allowed:
            raise ValueError(f"bad part {part!r} in policy spec {spec!r}; fields: {sorted(allowed)}")
        kwargs[key] = _typed(cls, key, value, spec)
    return cls, kwargs


def make_policy(spec: str, **overrides: Any) -> Policy:
    """Build the policy a spec names; ``overrides`` win over the spec's fields.

    Raises:
        ValueError: anything ``parse_spec`` refuses, or a value the policy refuses (a range,
            a combination of fields); any other error from the policy's checks is turned into
            a ValueError as well, so a caller maps one exception type to a refusal.
    """
    cls, kwargs = parse_spec(spec)
    try:
        return cls(**(kwargs | overrides))
    except ValueError:
        raise
    except (TypeError, ArithmeticError) as exc:
        raise ValueError(f"policy spec {spec!r}: {exc}") from exc
