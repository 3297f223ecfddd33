"""Peers of a restartable actor passed by name, not by handle.

Ray counts an actor handle inside an actor's constructor arguments as an object-store
reference owned by the creating driver; for an actor with ``max_restarts != 0`` it then logs,
at error level, once per driver (``core_worker.cc``): "Actor ... has constructor arguments in
the object store and max_restarts > 0. If the arguments in the object store go out of scope
or are lost, the actor restart will fail" (ray-project/ray#53727). Every ``make demo`` printed
it for the SpillNode, the first restartable actor the launcher creates with a handle (the
GlobalScheduler's, for its block events).

An :class:`ActorRef` (name and namespace) keeps the constructor arguments plain values: the
actor looks its peers up itself (``ray.get_actor``), on its first start and on each restart,
so a restart never depends on references the creating driver owned.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class ActorRef:
    """A named actor: ``name`` in Ray namespace ``namespace``."""

    name: str
    namespace: str

    def resolve(self) -> Any:
        """The actor's handle.

        Raises:
            ValueError: no live actor of that name in that namespace (Ray's error).
        """
        return ray.get_actor(self.name, namespace=self.namespace)


def resolve(peer: Any) -> Any:
    """``peer`` looked up when it is an :class:`ActorRef`, else ``peer`` itself (a handle, or
    None)."""
    return peer.resolve() if isinstance(peer, ActorRef) else peer


def resolve_or_none(peer: Any) -> Any:
    """``resolve(peer)``, but None when ``peer`` is an :class:`ActorRef` with no live actor of
    its name (a spill node dead for good that the global scheduler has not created again yet:
    ``services.spill_recreate``)."""
    try:
        return resolve(peer)
    except ValueError:
        return None


def actor_restarts() -> int:
    """How often Ray restarted the current actor: 0 for a first start and outside an actor;
    its GCS record's count after a restart (1 when that record is unreadable)."""
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    if actor_id is None or not context.was_current_actor_reconstructed:
        return 0
    try:
        from ray._private import state  # no public API reads an actor's restart count

        return max(1, int(state.actors(actor_id).get("NumRestarts", 1)))
    except Exception:  # noqa: BLE001 - an internal API: fall back to the public flag
        return 1


def kill_gone(name: str, namespace: str, timeout_s: float) -> None:
    """Kill actor ``name`` of ``namespace`` and wait (up to ``timeout_s``) until Ray no longer
    lists it alive (``ray.kill`` returns before the actor is dead); nothing when no actor has
    that name. ``kvstrata down`` and the launcher kill the global scheduler so before the spill
    nodes, which its spill watch creates again (``services.spill_recreate``)."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(ValueError):  # gone meanwhile
        ray.kill(ray.get_actor(name, namespace=namespace))
        while time.monotonic() < deadline:
            ray.get_actor(name, namespace=namespace)  # ValueError once it is dead
            time.sleep(0.05)
