"""What importing a service module costs: modules only a built engine needs are imported when
it is built, not by every process that imports the module (the launcher, tests, a spill node).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IMPORT_ORDER = ("cache_node.model_files", "services.spill_node", "tests.ray_actors", "services.global_scheduler_admission",
                "services.cache_node", "services.gateway_server", "services.launcher")
"""The modules checked, as one fresh interpreter imports them one after another (none of them
imports torch or transformers: the launcher's test checks that after all of them)."""

WATCHED = ("torch", "transformers", "transformers.modeling_utils", "torch._dynamo", "cache_node.engine",
           "cache_node.model_loader")


@pytest.fixture(scope="module")
def loaded_after() -> dict[str, dict[str, bool]]:
    """Module of ``IMPORT_ORDER`` -> whether each of ``WATCHED`` is in ``sys.modules`` once a fresh
    interpreter has imported it and every module before it. Imports only add to ``sys.modules``,
    so a name missing there is missing after importing that module alone, in a fresh interpreter
    of its own (each test's subprocess before: five interpreters, ~15 s of CPU, ~5 s as one). A
    module that loads a name a later module's test forbids fails that test too: then check that
    one alone, or order it later."""
    code = ("import importlib, json, sys\nafter = {}\n"
            f"for module in {list(IMPORT_ORDER)!r}:\n    importlib.import_module(module)\n"
            f"    after[module] = {{n: n in sys.modules for n in {list(WATCHED)!r}}}\nprint(json.dumps(after))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_the_cache_node_service_leaves_transformers_modeling_to_the_engine_build(loaded_after) -> None:
    """Regression: ``import services.cache_node`` took 16-20 s on a loaded machine, ~10 s of
    it transformers' modeling (torch._dynamo, through transformers.integrations.deepgemm),
    paid by every process importing it though only ``CacheNode.__init__`` (its engine and
    model) needs it."""
    loaded = {n: loaded_after["services.cache_node"][n]
              for n in ("transformers", "transformers.modeling_utils", "torch._dynamo", "cache_node.engine")}
    assert loaded == dict.fromkeys(loaded, False)


def test_importing_the_spill_node_service_imports_no_torch(loaded_after) -> None:
    """Regression: a spill node imported torch (~5 s on a loaded machine) for the names of the
    tiers in the cache node's metrics, which it never builds."""
    assert loaded_after["services.spill_node"]["torch"] is False


def test_the_ray_tests_actor_classes_import_no_torch(loaded_after) -> None:
    """Regression: the fake actors of the Ray tests (spill node subclasses, stand-in nodes)
    were defined in their test modules, so each actor's worker process imported the whole test
    module (cloudpickle pickles an importable class by reference): torch, and for
    tests/test_tier_ray.py transformers' modeling code, 4.5-7.5 s of CPU per actor start."""
    assert {n: loaded_after["tests.ray_actors"][n] for n in ("torch", "transformers")} == {
        "torch": False, "transformers": False}


def test_importing_the_global_scheduler_imports_no_torch(loaded_after) -> None:
    """Regression: the global scheduler's actor module imported torch (~6 s of a 10 s import on
    a loaded machine, on every stack start and every scheduler restart) for
    ``session_scope_chars``, a string function it reads node reports' session ids with
    (``services.recovery_report``), through ``cache_node.sessions`` and its KV cache manager."""
    assert loaded_after["services.global_scheduler_admission"]["torch"] is False


def test_importing_the_gateway_leaves_transformers_modeling_to_the_cache_nodes(loaded_after) -> None:
    """Regression: ``import services.gateway_server`` imported ``cache_node.model_loader`` for
    the default model's name and cache directory, and with it transformers' modeling code
    (~10 s of a 26.6 s import on a loaded machine), on every gateway start, restart and
    rejoin; the gateway never builds a model (its tokenizer needs no modeling code)."""
    loaded = {n: loaded_after["services.gateway_server"][n]
              for n in ("transformers.modeling_utils", "torch._dynamo", "cache_node.model_loader")}
    assert loaded == dict.fromkeys(loaded, False)


def test_importing_the_launcher_leaves_transformers_modeling_to_the_cache_nodes(loaded_after) -> None:
    """Regression: the launcher (``kvstrata up``) imported ``cache_node.model_loader`` for
    ``resolve_model_dir``, and with it transformers' modeling code, on every start."""
    loaded = {n: loaded_after["services.launcher"][n]
              for n in ("transformers.modeling_utils", "torch._dynamo", "cache_node.model_loader")}
    assert loaded == dict.fromkeys(loaded, False)


def test_importing_the_launcher_imports_no_torch_or_transformers(loaded_after) -> None:
    """Regression (s39): ``import services.launcher`` (``kvstrata up``, library callers) took
    ~5 s of CPU, 25.7 s on a loaded 2-core host, for torch and transformers, which only the
    actors it starts use, each in its own process: the launcher read the model's KV geometry
    with ``AutoConfig`` and a dtype with ``torch``, and imported the cache node's and the
    gateway's actor modules (``CacheNodeRemote``, ``GatewayActor``), which imported torch (the
    KV cache manager, tiers, policies, spill API) and transformers (the gateway's tokenizer)
    at module level."""
    assert {n: loaded_after["services.launcher"][n] for n in ("torch", "transformers")} == {
        "torch": False, "transformers": False}


def test_model_files_imports_no_torch_and_model_loader_re_exports_it(loaded_after) -> None:
    """``cache_node.model_files`` (checkpoint paths, conversion, identity) is the light half of
    ``cache_node.model_loader``, whose old names still resolve to the same objects."""
    assert {n: loaded_after["cache_node.model_files"][n] for n in ("torch", "transformers")} == {
        "torch": False, "transformers": False}
    from cache_node import model_files, model_loader

    for name in ("DEFAULT_MODEL", "IDENTITY_FILE", "cache_dir", "resolve_model_dir",
                 "convert_default_model", "model_identity", "_gguf_dir", "_GGUF_FILE"):
        assert getattr(model_loader, name) is getattr(model_files, name)
