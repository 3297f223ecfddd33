"""What importing a service module costs: modules only a built engine needs are imported when
it is built, not by every process that imports the module (the launcher, tests, a spill node).
"""

from __future__ import annotations

import subprocess
import sys


def modules_after_import(module: str, *names: str) -> dict[str, bool]:
    """Whether each of ``names`` is in ``sys.modules`` after a fresh interpreter imports ``module``."""
    code = f"import sys, {module}; print(*[n in sys.modules for n in {list(names)!r}])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return dict(zip(names, (word == "True" for word in out.stdout.split()), strict=True))


def test_importing_the_cache_node_service_leaves_transformers_modeling_to_the_engine_build() -> None:
    """Regression: ``import services.cache_node`` took 16-20 s on a loaded machine, ~10 s of
    it transformers' modeling (torch._dynamo, through transformers.integrations.deepgemm),
    paid by every process importing it though only ``CacheNode.__init__`` (its engine and
    model) needs it."""
    loaded = modules_after_import("services.cache_node", "transformers", "transformers.modeling_utils",
                                  "torch._dynamo", "cache_node.engine")
    assert loaded == dict.fromkeys(loaded, False)


def test_importing_the_spill_node_service_imports_no_torch() -> None:
    """Regression: a spill node imported torch (~5 s on a loaded machine) for the names of the
    tiers in the cache node's metrics, which it never builds."""
    assert modules_after_import("services.spill_node", "torch") == {"torch": False}


def test_importing_the_gateway_leaves_transformers_modeling_to_the_cache_nodes() -> None:
    """Regression: ``import services.gateway_server`` imported ``cache_node.model_loader`` for
    the default model's name and cache directory, and with it transformers' modeling code
    (~10 s of a 26.6 s import on a loaded machine), on every gateway start, restart and
    rejoin; the gateway never builds a model (its tokenizer needs no modeling code)."""
    loaded = modules_after_import("services.gateway_server", "transformers.modeling_utils",
                                  "torch._dynamo", "cache_node.model_loader")
    assert loaded == dict.fromkeys(loaded, False)


def test_importing_the_launcher_leaves_transformers_modeling_to_the_cache_nodes() -> None:
    """Regression: the launcher (``kvstrata up``) imported ``cache_node.model_loader`` for
    ``resolve_model_dir``, and with it transformers' modeling code, on every start."""
    loaded = modules_after_import("services.launcher", "transformers.modeling_utils",
                                  "torch._dynamo", "cache_node.model_loader")
    assert loaded == dict.fromkeys(loaded, False)


def test_model_files_imports_no_torch_and_model_loader_re_exports_it() -> None:
    """``cache_node.model_files`` (checkpoint paths, conversion, identity) is the light half of
    ``cache_node.model_loader``, whose old names still resolve to the same objects."""
    assert modules_after_import("cache_node.model_files", "torch", "transformers") == {
        "torch": False, "transformers": False}
    from cache_node import model_files, model_loader

    for name in ("DEFAULT_MODEL", "IDENTITY_FILE", "cache_dir", "resolve_model_dir",
                 "convert_default_model", "model_identity", "_gguf_dir", "_GGUF_FILE"):
        assert getattr(model_loader, name) is getattr(model_files, name)
