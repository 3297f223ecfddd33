"""Policy registry: ``name -> class``, and parsing of per-request policy specs.

A spec is what a tenant or request names (it fits the tenant ``policy`` pattern
``[A-Za-z0-9][A-Za-z0-9_.-]*``)::

    snapkv                  the policy with its defaults
    snapkv-0.25             budget: a fraction (<= 1) of the prompt's tokens per layer
    h2o-256-window_tokens_32  budget in tokens, then ``<field>_<value>`` overrides
    quant-bits_4

Idea: mini-sglang ``utils/registry.py``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from cache_node.policies.base import Policy

REGISTRY: dict[str, type[Policy]] = {}


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


def _number(text: str) -> int | float | None:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def parse_spec(spec: str) -> tuple[type[Policy], dict[str, Any]]:
    """Split a spec into its class and constructor keyword arguments.

    Raises:
        ValueError: unknown policy, unknown field, or a malformed part (with the part named).
    """
    cls = get_policy_class(spec)
    allowed = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for part in spec.split("-")[1:]:
        number = _number(part)
        if number is not None:
            kwargs["budget"] = number
            continue
        key, sep, value = part.rpartition("_")
        if not sep or key not in allowed:
            raise ValueError(f"bad part {part!r} in policy spec {spec!r}; fields: {sorted(allowed)}")
        parsed = _number(value)
        kwargs[key] = parsed if parsed is not None else value
    return cls, kwargs


def make_policy(spec: str, **overrides: Any) -> Policy:
    """Build the policy a spec names; ``overrides`` win over the spec's fields."""
    cls, kwargs = parse_spec(spec)
    return cls(**(kwargs | overrides))
