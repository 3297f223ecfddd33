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
