"""A cache node's grammar-compile settings come from its ``NodeConfig`` (``kvstrata up --config``'s
``node:``): ``grammar_compile_timeout_s``, ``grammar_compile_workers``,
``grammar_compile_queue_per_tenant``, ``grammar_cache_bytes``, ``grammar_worker_memory_bytes``,
``grammar_step_budget_ms``, ``grammar_max_active_per_tenant`` and ``grammar_request_budget_ms`` reach the engine's ``EngineConfig`` (the compile settings also its
compiler's ``CompileLimits``); out-of-range values are
refused when the config is read, naming the field.

Regression: ``NodeConfig`` had none of them (``extra="forbid"``: a YAML setting one was refused as
an unknown key), so every node ran ``EngineConfig``'s defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pydantic
import pytest

from bench.chaos_stack import tiny_checkpoint
from cache_node.config import EngineConfig
from services.config import NodeConfig, load_config

GRAMMAR_FIELDS = ("grammar_compile_timeout_s", "grammar_compile_workers", "grammar_compile_queue_per_tenant",
                  "grammar_cache_bytes", "grammar_worker_memory_bytes", "grammar_step_budget_ms",
                  "grammar_max_active_per_tenant", "grammar_request_budget_ms")
SETTINGS = {"grammar_compile_timeout_s": 2.5, "grammar_compile_workers": 1, "grammar_compile_queue_per_tenant": 3,
            "grammar_cache_bytes": 1 << 20, "grammar_worker_memory_bytes": 512 << 20, "grammar_step_budget_ms": 5.5,
            "grammar_max_active_per_tenant": 5, "grammar_request_budget_ms": 250.0}


def test_node_defaults_are_the_engines() -> None:
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert {name: getattr(NodeConfig(), name) for name in GRAMMAR_FIELDS} == {name: engine[name]
                                                                               for name in GRAMMAR_FIELDS}


def test_yaml_node_settings_are_read(tmp_path: Path) -> None:
    path = tmp_path / "kvstrata.yaml"
    path.write_text("node:\n" + "".join(f"  {k}: {v}\n" for k, v in SETTINGS.items()))
    node = load_config(path).node
    assert {name: getattr(node, name) for name in GRAMMAR_FIELDS} == SETTINGS


@pytest.mark.parametrize(("field", "value"), [
    ("grammar_compile_timeout_s", 0), ("grammar_compile_timeout_s", 3601), ("grammar_compile_workers", 0),
    ("grammar_compile_workers", 65), ("grammar_compile_queue_per_tenant", 0), ("grammar_cache_bytes", -1),
    ("grammar_worker_memory_bytes", -1), ("grammar_step_budget_ms", 0), ("grammar_step_budget_ms", 60001),
    ("grammar_max_active_per_tenant", 0), ("grammar_request_budget_ms", 0), ("grammar_request_budget_ms", 3600001),
])
def test_out_of_range_settings_are_refused_naming_the_field(tmp_path: Path, field: str, value: float) -> None:
    """The bounds are ``EngineConfig``'s own (which would otherwise refuse them in the node's
    actor, after ``kvstrata up`` started it)."""
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(EngineConfig(), **{field: value})
    path = tmp_path / "kvstrata.yaml"
    path.write_text(f"node:\n  {field}: {value}\n")
    with pytest.raises(pydantic.ValidationError) as err:
        load_config(path)
    assert err.value.errors()[0]["loc"] == ("node", field)


@pytest.mark.slow
def test_a_node_builds_its_engine_and_compiler_with_them() -> None:
    """A ``CacheNode`` (the tiny Llama with SmolLM2's tokenizer): its engine's config and its
    grammars' ``CompileLimits`` hold the node's values."""
    pytest.importorskip("xgrammar")
    from services.cache_node import CacheNode

    node = CacheNode("n", NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20, host_bytes=0,
                                     **SETTINGS), num_threads=1)
    try:
        assert {name: getattr(node.engine.config, name) for name in GRAMMAR_FIELDS} == SETTINGS
        limits = node.engine.grammars.limits
        assert (limits.timeout_s, limits.workers, limits.queue_per_tenant, limits.cache_bytes,
                limits.worker_memory_bytes) == tuple(SETTINGS.values())[:5]
        assert len(node.engine.grammars.processes) == 1
    finally:
        node.shutdown()
