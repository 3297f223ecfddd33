"""Messages to a peer actor held by name (``actor_refs.NamedPeer``) that must reach it.

A fire-and-forget call (``handle.method.remote(...)`` with its ObjectRef dropped) to an actor
that died is lost unseen: Ray fails the ref (``ActorDiedError``, or ``ActorUnavailableError``
for one Ray is restarting) and nobody reads it. A cache node's calls to the global scheduler
were such calls through a handle looked up at most every ``relookup_s`` (5 s): after the
scheduler died and a new actor took its name, each call until the next look-up went to the
dead one, and while no actor had the name the calls were skipped (logged). An expired session
not told so kept its route at the scheduler (one its recovery rebuilt from the node's report,
or one the dead actor's successor loaded) until ``session_ttl_s``: the session's next turn
went to the node that no longer held it.

``PeerOutbox`` sends each message from its own daemon thread and waits for the call's answer;
a call that fails as its actor died (or Ray is restarting it), or finds no live actor of the
name, is sent again (``retry_s`` later, the name looked up again at once after a death:
``NamedPeer.forget``) until an actor of the name answers it. The messages are idempotent (a
repeat applies nothing more). A call not answered within ``timeout_s`` is logged and waited on,
not sent again: it is still queued or running at the peer, and Ray resolves it once the peer
answers or dies (then it is sent again). One call is in flight at a time and one message per
method waits at most: a later one replaces it, or joins it (``merge``). A call the peer itself
refused (it raised: a bug or a bad argument) is dropped, logged.

Regression (s40 review r3): a call not answered within ``timeout_s`` was sent again, a new
task queued at the peer each time while the one before still waited there: a scheduler alive
but silent (stopped, deadlocked) for an hour was queued ~120 ``sessions_ended`` calls by each
node, each with every expiry untold so far, all run (stale) once it answered again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from services.actor_refs import NamedPeer

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
"""How long one call may take before it is logged as not answered (and waited on further)."""

RETRY_S = 1.0
"""Wait before a message is sent again after a failed call, or while its peer has no live actor."""

Args = dict[str, Any]
"""A message's arguments, by the peer method's parameter names."""


class PeerOutbox:
    """Calls to ``peer`` (a ``NamedPeer``) sent until an actor of its name answered each.

    Args:
        peer: the peer actor, by name.
        timeout_s: the wait for one call's answer (``CALL_TIMEOUT_S``).
        retry_s: the wait before a failed call is sent again (``RETRY_S``).

    Attributes:
        counters: ``sent_calls`` (answered), ``failed_calls`` (the actor died or was
            unavailable, or no live actor of the name: each sent again), ``slow_calls`` (no
            answer within ``timeout_s``: waited on further, not sent again), ``refused_calls``
            (the peer raised: dropped).
    """

    def __init__(self, peer: NamedPeer, timeout_s: float = CALL_TIMEOUT_S, retry_s: float = RETRY_S) -> None:
        self.peer, self.timeout_s, self.retry_s = peer, timeout_s, retry_s
        # method -> (args, merge, check), oldest first; a message in flight is out of it
        self._pending: dict[str, tuple[Args, Callable[[Args, Args], Args] | None, Callable[[Args], Args | None] | None]] = {}
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.counters = {"sent_calls": 0, "failed_calls": 0, "slow_calls": 0, "refused_calls": 0}
        # failed calls since the peer last answered: logged at the 1st, 2nd, 4th, ... (s40 review r3:
        # counted over the outbox's life, a new outage's first failures went unlogged)
        self._failed_in_a_row = 0

    def tell(self, method: str, args: Args, *, merge: Callable[[Args, Args], Args] | None = None,
             check: Callable[[Args], Args | None] | None = None) -> None:
        """Queue ``peer.method(**args)``; never blocks. A message of ``method`` still waiting (or
        whose call fails meanwhile) is replaced by this one, or joined as ``merge(older, newer)``
        (arguments dicts). ``check(args)`` runs before each send (on the outbox's thread, once a
        live actor of the name was found): the arguments to send then, or None for nothing left
        to send (the message is dropped).

        The call passes its arguments by keyword: Ray checks them in this process against the
        peer's class as this process loaded it, and where that load failed once (the peer's
        module would not import here: an in-place upgrade, a node with other packages) it keeps
        a stand-in whose methods take keywords only. Regression (s40): ``remote(*args)`` failed
        there with ``TypeError`` every time, refused (dropped) without reaching the peer."""
        with self._cond:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstrata-tells", daemon=True)
                self._thread.start()
            older = self._pending.pop(method, None)
            self._pending[method] = (merge(older[0], args) if older is not None and merge is not None else args,
                                     merge, check)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every message was answered or dropped; False at ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self) -> None:
        """Stop the thread; what still waits is dropped (a call in flight ends on its own)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _take(self) -> tuple[str, tuple[Args, Any, Any]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending or self._closed)
            if self._closed:
                return None
            method = next(iter(self._pending))
            self._busy = True
            return method, self._pending.pop(method)

    def _run(self) -> None:
        while (message := self._take()) is not None:
            method, (args, merge, check) = message
            try:
                failed = not self._send(method, args, check)
            except Exception as exc:  # noqa: BLE001 - a check that raised: nothing sent, dropped
                log.warning("call %s to %s dropped: its check failed: %s: %.200s", method, self.peer.peer,
                            type(exc).__name__, exc)
                failed = False
            with self._cond:
                if failed and not self._closed:  # again, joined by what came meanwhile
                    newer = self._pending.pop(method, None)
                    joined = args if newer is None else merge(args, newer[0]) if merge is not None else newer[0]
                    self._pending = {method: (joined, merge, check), **self._pending}
                self._busy = False
                self._cond.notify_all()
                if failed:
                    self._cond.wait_for(lambda: self._closed, self.retry_s)

    def _send(self, method: str, args: Args, check: Callable[[Args], Args | None] | None) -> bool:
        """One call of ``method``; whether it is done with (answered, refused, or nothing to send)."""
        handle = self.peer.handle()
        if handle is None:  # no live actor of the name (``peer.missing`` says why): later
            self._failed(method, self.peer.missing)
            return False
        # (checked once there is a peer to send to: while none lives, what it leaves out could
        # change again before the send)
        sending = check(args) if check is not None else args
        if sending is None:
            return True
        try:
            if not self._answer(method, getattr(handle, method).remote(**sending)):
                return True  # (closed meanwhile: dropped)
        except RayActorError as exc:  # dead or restarting: sent again
            self.peer.forget(handle)  # (a new actor of the name is looked up at once)
            self._failed(method, f"{type(exc).__name__}: {str(exc).strip()[:200]}")
            return False
        except Exception as exc:  # noqa: BLE001 - the peer raised: its answer, not sent again
            self._failed_in_a_row = 0
            self.counters["refused_calls"] += 1
            log.warning("call %s to %s raised (dropped): %s: %.200s", method, self.peer.peer, type(exc).__name__, exc)
            return True
        self.counters["sent_calls"] += 1
        self._failed_in_a_row = 0  # (the peer answers: its next outage is logged from its 1st failure)
        return True

    def _answer(self, method: str, ref: Any) -> bool:
        """Wait for call ``ref``'s answer, logging each ``timeout_s`` without one (a silent
        peer: the call still waits there, so it is not sent again); whether it was answered
        (False: the outbox was closed meanwhile). Raises what ``ray.get`` raises for the call,
        but ``GetTimeoutError``."""
        while True:
            try:
                ray.get(ref, timeout=self.timeout_s)
                return True
            except GetTimeoutError:
                self.counters["slow_calls"] += 1
                slow = self.counters["slow_calls"]
                if slow & (slow - 1) == 0:  # the 1st, 2nd, 4th, ... (a peer silent for long)
                    log.warning("call %s to %s not answered for %g s (waited on, not sent again; %d such waits "
                                "so far)", method, self.peer.peer, self.timeout_s, slow)
                with self._cond:
                    if self._closed:
                        return False

    def _failed(self, method: str, why: str) -> None:
        self.counters["failed_calls"] += 1
        self._failed_in_a_row += 1
        failed = self._failed_in_a_row
        if failed & (failed - 1) == 0:  # the 1st, 2nd, 4th, ... since the peer last answered (gone for long)
            log.warning("call %s to %s not answered (sent again every %g s; %d failed calls in a row): %s",
                        method, self.peer.peer, self.retry_s, failed, why)
