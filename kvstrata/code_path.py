"""Where kvstrata's actors import code from: kvstrata's installed location and the worker's own
``sys.path``, never the directory a driver happens to run in.

Ray puts the driver's working directory (and its script's directory) at the front of every
worker's ``sys.path`` when the worker runs its first task (``JobConfig.py_driver_sys_path``,
filled by ``ray.init``; the worker inserts each at index 0, ahead of the standard library and
site-packages). kvstrata's top-level packages have generic names (``services``, ``tenants``...),
so a driver run from a folder holding a ``services/`` package of its own (``kvstrata up`` in a
user's project, in a second checkout) had its actors unpickle kvstrata's classes from that
folder's modules: broken actors, or foreign code run in a cache node (s41 trial finding F5).
Any other top-level module such a folder holds (``secrets.py``, ``utils/``, ``yaml.py``) would
likewise shadow the standard library's or a dependency's in the actor.

The fix is on the worker side, so that it holds whoever called ``ray.init`` (the CLI, the
launcher, a user's driver, the tests' cluster): every kvstrata actor is created with
``actor_runtime_env``, whose setup hook ``keep_own_imports`` runs when the worker process
starts, before its first task and so before Ray inserts the driver's paths. It imports
kvstrata's top-level packages from the installed location (their submodules are then found
through the packages' ``__path__``, not ``sys.path``) and puts ``OwnPathFinder`` ahead of
Python's path finder: a top-level import is looked up on the worker's own path first.

The render and grammar children (``python -m services.render_worker`` ...) need none of this:
they run in a private empty directory (``process_temp.process_temp_dir``), which is all ``-m``
puts in front, with the node's own code root first on ``PYTHONPATH``
(``grammar_process.child_env``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import ray
from ray._private import ray_constants

WORKER_PROCESS_SETUP_HOOK_ENV_VAR: str = getattr(
    ray_constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR")
"""Ray's (private) variable naming a worker's setup hook; a Ray without the constant gets its
2.x name, so importing the launcher never fails on it (review r8)."""

PACKAGES = ("kvstrata", "services", "cache_node", "tenants")
"""kvstrata's top-level packages that its actors import (``cli``, ``workloads`` and ``bench``
are driver-side only; ``cli``'s ``__init__`` sets environment defaults a worker must not get)."""

CODE_ROOT = str(Path(__file__).resolve().parent.parent)
"""The directory holding kvstrata's top-level packages as this process imported them (the
repository for an editable install, site-packages for a wheel's)."""

SETUP_HOOK = f"{__name__}.keep_own_imports"

NEXT_HOOK_ENV_VAR = "KVSTRATA_NEXT_SETUP_HOOK"
"""The Ray job's own worker setup hook (its ``worker_process_setup_hook``, as Ray's hook variable
holds it: a module path or an exported function's key), which ``keep_own_imports`` runs after
its own: an actor has one hook variable, and kvstrata's replaces the job's there."""


class OwnPathFinder(importlib.abc.MetaPathFinder):
    """Finds top-level modules on a fixed path (the worker's ``sys.path`` at its start) before
    Python's path finder looks at ``sys.path`` as it is now. Submodules (``path`` given) are
    left to their package's ``__path__``; a module not on the fixed path falls through to the
    finders after this one."""

    def __init__(self, path: Sequence[str]) -> None:
        self.path = list(path)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None:
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, self.path, target)


def keep_own_imports() -> None:
    """Ray worker setup hook (``actor_runtime_env``): import kvstrata's top-level packages
    (``PACKAGES``) now, while ``sys.path`` is still the worker's own (its interpreter's,
    ``PYTHONPATH``, site-packages), and put an ``OwnPathFinder`` on that path just ahead of
    Python's path finder, so that the driver's directories Ray inserts at the front later
    shadow neither kvstrata's code nor the standard library's or a dependency's.

    Raises:
        ImportError: a package resolved outside ``CODE_ROOT`` (a same-named one earlier on the
            worker's own path, e.g. in ``PYTHONPATH``): Ray ends the worker with this error
            rather than run foreign code as kvstrata's.
        RuntimeError: the job's own setup hook (``NEXT_HOOK_ENV_VAR``) failed; Ray's message.
    """
    for name in PACKAGES:
        module = importlib.import_module(name)
        where = str(Path(module.__file__ or "").resolve())
        if not where.startswith(CODE_ROOT + "/"):
            del sys.modules[name]
            raise ImportError(f"kvstrata package {name!r} resolved to {where}, not under {CODE_ROOT}")
    if not any(isinstance(finder, OwnPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder), OwnPathFinder(sys.path))
    following = os.environ.get(NEXT_HOOK_ENV_VAR)
    if following:  # the job's own hook (NEXT_HOOK_ENV_VAR), run as Ray would have
        from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

        error = load_and_execute_setup_hook(following)
        if error is not None:
            raise RuntimeError(error)


def actor_runtime_env(env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``runtime_env`` every kvstrata actor is created with: ``env_vars`` (the caller's) and
    the setup hook ``keep_own_imports``, set through Ray's hook variable, which the worker
    reads at its start (the ``worker_process_setup_hook`` field itself is honoured only in
    ``ray.init``'s runtime_env, which the launcher does not own: an actor's is ignored). A
    hook the Ray job set (``ray.init(runtime_env={"worker_process_setup_hook": ...})``) would be
    replaced: it is kept in ``NEXT_HOOK_ENV_VAR`` and run after kvstrata's."""
    env = {**(env_vars or {}), WORKER_PROCESS_SETUP_HOOK_ENV_VAR: SETUP_HOOK}
    if ray.is_initialized():  # the job's (or, in an actor, the actor's) runtime_env
        current = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        job_hook = current.get(NEXT_HOOK_ENV_VAR) or current.get(WORKER_PROCESS_SETUP_HOOK_ENV_VAR)
        if job_hook and job_hook != SETUP_HOOK:
            env[NEXT_HOOK_ENV_VAR] = job_hook
    return {"env_vars": env}
