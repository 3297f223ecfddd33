"""Every call the product makes on a Ray actor passes its arguments by keyword.

Ray checks a call's arguments in the caller, before the call leaves, against the callee's class
as the caller's process loaded it. When that load failed once (the class's module would not
import there: an in-place upgrade changed its files under the running process, a node with
other packages) Ray keeps, for the process's life, a stand-in class
(``FunctionActorManager._create_fake_actor_class``) whose methods take keywords only: every
positional call then fails in the caller with ``TypeError: too many positional arguments`` and
never reaches the live peer. Regression (s40, commit 4c1018b found it on a live ``kvstrata
up``): the scheduler counted a live gateway gone; 4c1018b fixed those two calls only, and cache
nodes (``PeerOutbox``, block reports, spill sweeps), gateways and spill clients still called
their peers positionally.

The check is static, so it covers call sites added later: it reads every product module's
``.remote(...)`` calls (not a test's). Left out: ``ray.remote(Class)`` and an actor's
construction (``Actor.options(...).remote(...)``: the creating process holds the class), and
the body of a method itself named ``remote`` (a forwarding wrapper, ``actor_calls``: its own
callers are checked). A call's keywords must also be parameters of the actor method of that name
(of one of the product's actor classes), so a renamed parameter is caught here, not by a live
cluster.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("services", "cache_node", "tenants", "workloads", "cli", "kvstrata")


def _product_calls() -> list[tuple[str, ast.Call, str]]:
    """Each product ``.remote(...)`` call to check: (where, the call, the method's name or "")."""
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            skipped: set[int] = set()
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == "remote":
                    skipped |= {id(n) for n in ast.walk(fn)}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "remote") or id(node) in skipped:
                    continue
                receiver = node.func.value
                if isinstance(receiver, ast.Name) and receiver.id == "ray":
                    continue  # ray.remote(Class)
                if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) \
                        and receiver.func.attr == "options":
                    continue  # Actor.options(...).remote(...): a construction
                if isinstance(receiver, ast.Name) and receiver.id == "options":
                    continue  # (spill_node: the same, its options held in a name)
                method = receiver.attr if isinstance(receiver, ast.Attribute) else ""
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", node, method))
    return found


def _actor_methods() -> dict[str, list[inspect.Signature]]:
    """Method name -> its signatures in the product's actor classes."""
    from services.cache_node import CacheNodeActor
    from services.gateway_server import RayGateway
    from services.global_scheduler_admission import GlobalSchedulerService
    from services.spill_node import SpillNode

    methods: dict[str, list[inspect.Signature]] = {}
    for cls in (GlobalSchedulerService, RayGateway, CacheNodeActor, SpillNode):
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            methods.setdefault(name, []).append(inspect.signature(fn))
    return methods


def test_product_actor_calls_pass_their_arguments_by_keyword() -> None:
    calls = _product_calls()
    assert len(calls) > 40  # (the scan found the product's calls)
    positional = [f"{where}: {ast.unparse(call)[:120]}" for where, call, _ in calls if call.args]
    assert positional == []


def test_each_keyword_is_a_parameter_of_the_actor_method_called() -> None:
    methods = _actor_methods()
    wrong = []
    for where, call, method in _product_calls():
        if method not in methods:
            continue  # (a method of no product actor class, or one named by a variable)
        given = {k.arg for k in call.keywords if k.arg is not None}
        if not any(given <= set(sig.parameters) - {"self"} for sig in methods[method]):
            wrong.append(f"{where}: {method}({', '.join(sorted(given))}) vs {[str(s) for s in methods[method]]}")
    assert wrong == []


def test_the_stand_in_refuses_positional_arguments_and_takes_keywords() -> None:
    """The premise, on this Ray: a process that failed to load ``GlobalSchedulerService`` checks
    ``release`` against a stand-in that refuses ``release("r", None)`` before the call leaves
    and takes ``release(request_id="r", usage=None)``."""
    from ray._common import signature
    from ray._private.function_manager import FunctionActorManager

    stand_in = FunctionActorManager._create_fake_actor_class(None, "GlobalSchedulerService", ["release"],
                                                             "import failed")
    checked = signature.extract_signature(stand_in.release, ignore_first=True)
    with pytest.raises(TypeError, match="positional"):
        signature.flatten_args(checked, ("r", None), {})
    signature.flatten_args(checked, (), {"request_id": "r", "usage": None})
