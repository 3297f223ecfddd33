"""Deadlines on the gateway's calls to the global scheduler (``BoundedActor``).

A Ray actor call awaited with no deadline waits for as long as the actor does not answer: a
scheduler that is alive but silent (stopped, deadlocked, its event loop blocked) is no failure
Ray reports, so every such call hangs for the whole silence. Every awaited call the gateway
makes to the scheduler goes through ``BoundedActor``: past ``SCHEDULER_CALL_TIMEOUT_S`` it
fails with ``ActorSilent``, which the gateway answers as it answers a call Ray failed
(UNAVAILABLE / HTTP 503 with a retry hint: ``services.grpc_call_gate``, the OpenAI app).

Regression (review 29a F2): with the scheduler SIGSTOPped, every call whose key was not in the
gateway's 10-s key cache (``services.auth``), every CloseSession, every Tenant/Admin call
(``kvstrata status`` included) and the HTTP API for such keys waited, with no bound, until the
scheduler ran again (89 s of a 90-s stop; an hour's stop, an hour); only admissions, which have
their own deadline (``NodeStreams.admit_timeout_s``), ended at 30 s.

A call that is not awaited (a fire-and-forget ``release``) is sent as before: the call leaves
when ``.remote()`` runs, and only the wait for its answer is bounded.

A wait that passed its deadline while the gateway's own event loop stalled (SIGSTOP, a VM
pause, a long GC: ``services.loop_lag``) waits once more, ``timeout_s`` again, before the
actor counts as silent: its answer may be waiting unread (helper 29h, the kind of review 29a
F6: on resume every call in flight failed UNAVAILABLE, naming a scheduler that had answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from services.loop_lag import running_lag, wait_past_stall

SCHEDULER_CALL_TIMEOUT_S = 30.0
"""The most the gateway waits for the scheduler's answer to one call (as admissions wait,
``NodeStreams.admit_timeout_s``)."""


SCHEDULER_CHANGES = frozenset({"register_tenant", "update_tenant", "delete_tenant", "rotate_tenant_key",
                               "rotate_admin_key"})
"""The scheduler's methods that change what it stores: one the gateway stopped waiting for may
still be carried out when the scheduler runs again (``ActorSilent.may_apply``)."""


class ActorSilent(Exception):
    """An actor did not answer a call within its deadline (it may be stopped, deadlocked or
    overloaded, not dead): UNAVAILABLE, with a retry hint unless the call changes state
    (``may_apply``: the call was sent and may still be carried out when the actor runs again,
    so a blind retry could do it twice, and a rotated key's new value is lost: the message says
    to check first, and no ``retry-after-ms`` is given). Regression (review 29i F4): a key
    rotation cut at 30 s was answered "retry in 1 s", ran when the scheduler resumed, and the
    tenant's old key was refused with the new one never shown."""

    def __init__(self, message: str, may_apply: bool = False) -> None:
        super().__init__(message)
        self.may_apply = may_apply


class _TimedRef:
    """The answer of one call, awaitable once, within ``timeout_s`` (else ``ActorSilent``); at
    once ``ActorSilent`` when ``silent`` is set (``BoundedActor.silent``), and as soon as
    ``silent_now`` (that callable) says so while it waits."""

    __slots__ = ("_may_apply", "_ref", "_silent", "_silent_now", "_timeout_s", "_what")

    def __init__(self, ref: Any, timeout_s: float, what: str, may_apply: bool = False, silent: str = "",
                 silent_now: Callable[[], str] | None = None) -> None:
        self._ref, self._timeout_s, self._what, self._may_apply = ref, timeout_s, what, may_apply
        self._silent, self._silent_now = silent, silent_now

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        if self._silent:  # known silent: the call was not sent (``_BoundedMethod.remote``), nothing to wait for
            raise ActorSilent(self._silent)
        try:
            answer, _ = await wait_past_stall(asyncio.ensure_future(_answer_or_silence(self._ref, self._silent_now)),
                                              self._timeout_s, running_lag(), self._timeout_s)
        except asyncio.TimeoutError:
            raise self._silent_error(f"{self._what} did not answer in {self._timeout_s:g} s") from None
        if isinstance(answer, _Silence):
            raise self._silent_error(answer.why)
        return answer

    def _silent_error(self, why: str) -> ActorSilent:
        if self._may_apply:
            return ActorSilent(f"{why}; the change was sent and may still be made when it answers again: check (e.g. "
                               "kvstrata tenants list / GetTenant) before you repeat it", may_apply=True)
        return ActorSilent(why)


@dataclass(frozen=True)
class _Silence:
    """The actor was found silent (``BoundedActor.silent``) before it answered: ``why``."""

    why: str


SILENCE_POLL_S = 0.25
"""How often a waiting call reads ``BoundedActor.silent``."""


async def _answer_or_silence(ref: Any, silent_now: Callable[[], str] | None) -> Any:
    """The call's answer, or ``_Silence`` once ``silent_now`` names the actor silent first: a
    call in flight when the gateway's monitor finds the scheduler silent ends then, not at its
    own deadline or the grace after it. Regression (s41, live SIGSTOP of the scheduler on a
    loaded host): a wait across a 1-s stall of the gateway's own loop got its one more
    ``timeout_s`` (``wait_past_stall``), so calls sent just before the scheduler was found silent
    ended 60 s after they began, 30 s after every later call was refused at once."""
    call = asyncio.ensure_future(_awaited(ref))
    if silent_now is None:
        return await call
    watch = asyncio.ensure_future(_silence(silent_now))
    try:
        done, _ = await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        return call.result() if call in done else _Silence(watch.result())
    finally:
        call.cancel()  # nothing when done
        watch.cancel()


async def _awaited(ref: Any) -> Any:
    return await ref


async def _silence(silent_now: Callable[[], str]) -> str:
    while not (why := silent_now()):
        await asyncio.sleep(SILENCE_POLL_S)
    return why


class _BoundedMethod:
    __slots__ = ("_actor", "_may_apply", "_method", "_name")

    def __init__(self, method: Any, actor: BoundedActor, may_apply: bool, name: str = "") -> None:
        self._method, self._actor, self._may_apply, self._name = method, actor, may_apply, name

    def remote(self, *args: Any, **kwargs: Any) -> _TimedRef:
        """Send the call now (as the handle's ``remote``); awaiting the result waits at most
        the deadline (not at all while the actor is known to be silent: ``BoundedActor.silent``)."""
        actor = self._actor
        silent = actor.silent() if actor.silent is not None else ""
        if silent and self._name not in actor.unawaited:  # known silent: not sent (nothing may apply later)
            return _TimedRef(None, actor._timeout_s, actor._what, False, silent)
        return _TimedRef(self._method.remote(*args, **kwargs), actor._timeout_s, actor._what, self._may_apply, silent,
                         actor.silent)


class BoundedActor:
    """An actor handle whose calls' answers are awaited at most ``timeout_s`` seconds
    (``ActorSilent`` past it); ``what`` names the actor in that error ("the global scheduler");
    ``changes`` are its methods that change state (their ``ActorSilent`` has ``may_apply``).

    ``handle.method.remote(...)`` sends the call at once, as the plain handle does; only the
    wait for its answer is bounded. Attributes other than methods are the handle's own.

    ``silent``, when set, says why the actor is known not to answer now ("" while it answers:
    ``NodeMonitor.scheduler_silence``); a call made meanwhile is not sent and fails
    ``ActorSilent`` with that message at once instead of after ``timeout_s`` (trial 29k P5), so
    nothing queues up at the silent actor and no change is made when it answers again (review
    29o F1/F6); only the ``unawaited`` methods (``release``, fire-and-forget) are still sent.
    """

    silent: Callable[[], str] | None = None
    unawaited: frozenset[str] = frozenset({"release"})  # sent even while silent (fire-and-forget)

    def __init__(self, handle: Any, timeout_s: float = SCHEDULER_CALL_TIMEOUT_S,
                 what: str = "the global scheduler", changes: frozenset[str] = SCHEDULER_CHANGES) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._handle, self._timeout_s, self._what, self._changes = handle, timeout_s, what, changes

    @property
    def handle(self) -> Any:
        """The plain handle (for what must pass it on, e.g. to another actor)."""
        return self._handle

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._handle, name)
        if hasattr(attr, "remote"):
            return _BoundedMethod(attr, self, name in self._changes, name)
        return attr
