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
"""Why every call that needs the scheduler fails once Ray says it died for good (``NodeMonitor``:
``scheduler_max_restarts`` 0, or its restarts used up)."""

SCHEDULER_RESTARTING = ("the global scheduler is unreachable: its process died or is being restarted; "
                        "retry shortly")
"""Why a call that needs the scheduler fails while it is unreachable and may come back
(``NodeMonitor``; Ray restarts it: ``scheduler_max_restarts``)."""


RESTART_RETRY_MS = 1000
"""The ``retry-after-ms`` hint of a call failed by an actor Ray may still bring back
(``retry_after_ms``): the gateway's own hint while the scheduler is restarting."""


class SchedulerRestarting(RuntimeError):
    """An admission failed because the scheduler is unreachable and may come back: UNAVAILABLE
    with a retry hint (a plain RuntimeError, a fault no wait undoes, has none)."""


def actor_died(exc: BaseException) -> bool:
    """Ray says the actor is dead for good (``ActorDiedError``); any other failure (restarting,
    unreachable for a moment, a slow loop) may pass."""
    return isinstance(exc, ActorDiedError)


def retry_after_ms(exc: BaseException) -> int | None:
    """The retry hint of a call failed by ``exc`` (a ``RayActorError``): ``RESTART_RETRY_MS``
    while the actor may come back (Ray raises ``ActorUnavailableError`` for calls to an actor it
    is restarting), None once Ray says it died for good (``actor_died``) or the call changes
    state and may still be carried out (``services.actor_calls.ActorSilent.may_apply``)."""
    return None if actor_died(exc) or getattr(exc, "may_apply", False) else RESTART_RETRY_MS
