"""Ray's actor errors as the gateway answers them: a call that failed because a kvstrata process
it needed (the global scheduler, a cache node) died or is being restarted is UNAVAILABLE with a
plain message (``PROCESS_UNREACHABLE``), never an UNKNOWN or an HTTP 500 carrying Ray's
exception text (its class, the actor's internals).

Ray is imported where it is installed; without it (the GPU check's machine runs no Ray) the
names stand for errors nothing raises.
"""

from __future__ import annotations

try:
    from ray.exceptions import ActorDiedError, RayActorError
except ImportError:  # no Ray here: no actor calls to fail
    class RayActorError(Exception):  # type: ignore[no-redef]
        """Stands for Ray's, which nothing raises without Ray."""

    class ActorDiedError(RayActorError):  # type: ignore[no-redef]
        """Stands for Ray's, which nothing raises without Ray."""

PROCESS_UNREACHABLE = "a kvstrata process this call needs is unreachable (it died or is being restarted)"
"""The message of a call failed by a ``RayActorError``."""

SCHEDULER_DOWN = ("the global scheduler is down: its process died and is not restarted; "
                  "the service must be started again (kvstrata up)")
"""Why every call that needs the scheduler fails once the gateway saw it die (``NodeMonitor``)."""


def actor_died(exc: BaseException) -> bool:
    """Ray says the actor is dead for good (``ActorDiedError``); any other failure (restarting,
    unreachable for a moment, a slow loop) may pass."""
    return isinstance(exc, ActorDiedError)
