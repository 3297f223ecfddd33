"""TenantSpec / Tenant / SloClass: defaults per SLO class and validation messages."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from tenants.model import SLO_CLASS_DEFAULTS, SloClass, SloDefaults, Tenant, TenantSpec


def test_interactive_defaults() -> None:
    spec = TenantSpec("chat-app", SloClass.INTERACTIVE)

    assert spec.to_dict() == {
        "name": "chat-app",
        "slo_class": "interactive",
        "ttft_slo_ms": 1000.0,
        "tpot_slo_ms": 100.0,
        "min_tokens_per_s": 10.0,
        "weight": 4.0,
        "kv_quota_bytes": 0,
        "max_context_tokens": 8192,
        "cache_namespace": "",
        "policy": "",
        "allowed_policies": [],
    }


def test_defaults_table_per_class() -> None:
    assert dict(SLO_CLASS_DEFAULTS) == {
        SloClass.INTERACTIVE: SloDefaults(1000.0, 100.0, 10.0, 4.0),
        SloClass.STANDARD: SloDefaults(5000.0, 250.0, 4.0, 2.0),
        SloClass.BATCH: SloDefaults(60000.0, 1000.0, 0.0, 1.0),
    }
    batch = TenantSpec("nightly", "batch")
    assert (batch.slo_class, batch.ttft_slo_ms, batch.min_tokens_per_s, batch.weight) == (
        SloClass.BATCH,
        60000.0,
        0.0,
        1.0,
    )
    assert TenantSpec("plain").slo_class is SloClass.STANDARD


def test_explicit_values_override_class_defaults() -> None:
    spec = TenantSpec(
        "research",
        "INTERACTIVE",
        ttft_slo_ms=250,
        tpot_slo_ms=40.5,
        min_tokens_per_s=0,
        weight=0.5,
        kv_quota_bytes=1 << 30,
        max_context_tokens=4096,
        cache_namespace="shared-docs",
        policy="snapkv",
    )

    assert spec.slo_class is SloClass.INTERACTIVE
    assert spec.ttft_slo_ms == 250.0 and isinstance(spec.ttft_slo_ms, float)
    assert (spec.tpot_slo_ms, spec.min_tokens_per_s, spec.weight) == (40.5, 0.0, 0.5)
    assert (spec.kv_quota_bytes, spec.max_context_tokens) == (1073741824, 4096)
    assert (spec.cache_namespace, spec.policy) == ("shared-docs", "snapkv")


def test_tenants_do_not_share_a_namespace_by_default() -> None:
    """Guards against cross-tenant prefix sharing unless both tenants opt in, and against a
    tenant registered under a deleted tenant's name reaching the old tenant's KV (the default
    namespace was the name)."""
    a, b = Tenant("1a", TenantSpec("a"), 0.0), Tenant("2b", TenantSpec("b"), 0.0)
    assert a.kv_namespace != b.kv_namespace
    again = Tenant("3c", TenantSpec("a"), 1.0)  # "a" deleted, then registered again
    assert again.kv_namespace != a.kv_namespace
    shared = [Tenant(i, TenantSpec(n, cache_namespace="docs"), 0.0) for i, n in (("4d", "c"), ("5e", "d"))]
    assert shared[0].kv_namespace == shared[1].kv_namespace == "docs"
    with pytest.raises(ValueError, match="cache_namespace"):
        TenantSpec("e", cache_namespace=a.kv_namespace)  # nobody can name a tenant's own


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "Alpha"}, "name must match [a-z0-9][a-z0-9_-]{0,62}, got 'Alpha'"),
        ({"name": ""}, "name must match [a-z0-9][a-z0-9_-]{0,62}, got ''"),
        ({"name": "-lead"}, "name must match [a-z0-9][a-z0-9_-]{0,62}, got '-lead'"),
        ({"name": "a" * 64}, f"name must match [a-z0-9][a-z0-9_-]{{0,62}}, got '{'a' * 64}'"),
        (
            {"slo_class": "gold"},
            "slo_class must be one of interactive, standard, batch, got 'gold'",
        ),
        ({"ttft_slo_ms": 0}, "ttft_slo_ms must be a positive finite number, got 0"),
        ({"ttft_slo_ms": -5.0}, "ttft_slo_ms must be a positive finite number, got -5.0"),
        ({"ttft_slo_ms": math.inf}, "ttft_slo_ms must be a positive finite number, got inf"),
        ({"tpot_slo_ms": math.nan}, "tpot_slo_ms must be a positive finite number, got nan"),
        ({"tpot_slo_ms": "50"}, "tpot_slo_ms must be a positive finite number, got '50'"),
        ({"min_tokens_per_s": -1}, "min_tokens_per_s must be a finite number >= 0, got -1"),
        ({"weight": 0.0}, "weight must be a positive finite number, got 0.0"),
        ({"weight": True}, "weight must be a positive finite number, got True"),
        (
            {"kv_quota_bytes": -1},
            "kv_quota_bytes must be an integer in [0, 18446744073709551615], got -1",
        ),
        (
            {"kv_quota_bytes": 1.5},
            "kv_quota_bytes must be an integer in [0, 18446744073709551615], got 1.5",
        ),
        (
            {"max_context_tokens": 0},
            "max_context_tokens must be an integer in [1, 4294967295], got 0",
        ),
        (
            {"cache_namespace": "Docs"},
            "cache_namespace must match [a-z0-9][a-z0-9_-]{0,62}, got 'Docs'",
        ),
        ({"policy": "snap kv"}, "policy must match [A-Za-z0-9][A-Za-z0-9_.-]{0,62}, got 'snap kv'"),
    ],
)
def test_validation_errors_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    args = {"name": "ok", **kwargs}
    with pytest.raises(ValueError) as excinfo:
        TenantSpec(**args)
    assert str(excinfo.value) == message


def test_longest_valid_name() -> None:
    name = "a" + "-" * 62
    assert TenantSpec(name).name == name


def test_spec_is_frozen_and_replace_revalidates() -> None:
    spec = TenantSpec("frozen")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.weight = 3.0  # type: ignore[misc]
    assert dataclasses.replace(spec, weight=3.0).weight == 3.0
    with pytest.raises(ValueError, match="^weight must be a positive finite number, got -3.0$"):
        dataclasses.replace(spec, weight=-3.0)


def test_dict_round_trip_and_errors() -> None:
    spec = TenantSpec("round", "batch", kv_quota_bytes=4096, policy="h2o")
    assert TenantSpec.from_dict(spec.to_dict()) == spec
    assert TenantSpec.from_dict({"name": "mini"}) == TenantSpec("mini")

    with pytest.raises(ValueError) as excinfo:
        TenantSpec.from_dict({"name": "x", "ttft_ms": 5})
    assert str(excinfo.value) == (
        "unknown TenantSpec fields ['ttft_ms']; known fields: ['name', 'slo_class', "
        "'ttft_slo_ms', 'tpot_slo_ms', 'min_tokens_per_s', 'weight', 'kv_quota_bytes', "
        "'max_context_tokens', 'cache_namespace', 'policy', 'allowed_policies']"
    )
    with pytest.raises(ValueError, match="^TenantSpec needs a name$"):
        TenantSpec.from_dict({"weight": 2})


def test_slo_class_parse() -> None:
    assert SloClass.parse("Batch") is SloClass.BATCH
    assert SloClass.parse(SloClass.STANDARD) is SloClass.STANDARD
    with pytest.raises(ValueError, match="^slo_class must be one of interactive, standard, batch"):
        SloClass.parse("")


def test_tenant_record() -> None:
    tenant = Tenant("t1", TenantSpec("lead"), 1700000000.5)
    assert (tenant.name, tenant.tenant_id, tenant.created_at_s) == ("lead", "t1", 1700000000.5)
    with pytest.raises(ValueError, match="^tenant_id must be a non-empty string, got ''$"):
        Tenant("", TenantSpec("lead"), 0.0)
    with pytest.raises(ValueError, match="^created_at_s must be a finite number >= 0, got -1.0$"):
        Tenant("t1", TenantSpec("lead"), -1.0)


def test_tenants_package_is_plain_python() -> None:
    """Guards against protobuf/gRPC/Ray leaking into the core (docs/conventions.md, 'Protobuf
    stays at the edge'). Of the ``kvstrata`` package (the generated contracts, ``kvstrata.v1``)
    only ``kvstrata.durable_files``, plain Python beside them that cache_node and tenants share
    (a8a5e44), may be imported; ``kvstrata/__init__.py`` must stay free of imports for that."""
    forbidden = ("ray", "grpc", "google", "kvstrata")
    allowed = {"kvstrata.durable_files"}
    root = Path(__file__).resolve().parent.parent
    init = ast.parse(root.joinpath("kvstrata", "__init__.py").read_text())
    assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]
    offenders = []
    for path in [*sorted(root.joinpath("tenants").glob("*.py")), root / "kvstrata" / "durable_files.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in forbidden and n not in allowed]
    assert offenders == []
