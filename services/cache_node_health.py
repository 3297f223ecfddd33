"""A cache node's health: ``ping``, ``health`` (a long poll a gateway waits on), a stalled
step loop, and what happens once the step loop fails (every stream ends with UNAVAILABLE).

A node is unhealthy while its step loop has failed (``failure``) or while it is stalled: it has
work (open streams, commands or admin calls for the step thread) and no turn of the loop has
begun for ``NodeConfig.step_stall_timeout_s`` (the loop stamps ``step_progress_s`` each turn;
an idle loop turns every ``step_idle_wait_s``). A stall is not a failure: the node is healthy
again once its steps resume, and its gateways' monitors rejoin it (``node_up``).
Regression (review 29a F5): only a loop that raised made the node unhealthy; a step thread
stuck in a forward pass, a driver call or a lock while the actor answered kept health
"healthy", and its streams and every request routed to it hung without bound (60 s observed).

``Health`` is a part of ``services.cache_node.CacheNode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

from services.data_plane_wire import _cut

log = logging.getLogger(__name__)

STALL_CHECK_S = 0.5
"""Most seconds a ``health`` long poll waits between looks at the step loop's heartbeat (less
with a ``step_stall_timeout_s`` under 2 s)."""


class Health:
    """The health part of ``CacheNode``."""

    def ping(self) -> bool:
        """True while the step loop runs; False once it has failed or while it is stalled
        (see ``health``)."""
        return not (self.failure or self.stalled())

    async def health(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The node's health, answered at once or, with ``wait_s`` > 0, as soon as the step
        loop fails or stalls (``stalled``; seen within ``STALL_CHECK_S``) and at the latest
        after ``wait_s`` seconds (a gateway's long poll).

        Returns:
            ``healthy`` (bool), ``failure`` (why not, "" when healthy), ``pid``, ``restarts``
            and ``data_address`` (the command inbox, "" until ``open_data_plane``).
        """
        if wait_s > 0 and not (self.failure or self.stalled()):
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._health_waiters.append(waiter)
            deadline = time.monotonic() + wait_s
            check_s = min(STALL_CHECK_S, self.config.step_stall_timeout_s / 4)
            try:
                while not waiter.done() and not self.stalled() and (left := deadline - time.monotonic()) > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(waiter), min(left, check_s))
            finally:
                self._health_waiters.remove(waiter)
        failure = self.failure or self.stalled()
        return {"healthy": not failure, "failure": failure, "pid": os.getpid(),
                "restarts": self.restarts(), "data_address": self.data_address}

    def stalled(self) -> str:
        """Why the step loop counts as stalled ("" when it does not): it has work and no turn
        of it began for ``step_stall_timeout_s``. Logged once per stall, and once it ends."""
        age = time.monotonic() - self.step_progress_s
        limit = self.config.step_stall_timeout_s
        if age < limit or self._stopped or not self._has_work():
            if self._stall_noted and age < limit:
                self._stall_noted = False
                log.warning("cache node %s: its step loop makes progress again", self.node_id)
            return ""
        why = (f"cache node {self.node_id}: its step loop has completed no step for {age:.0f} s while it has "
               f"work (step_stall_timeout_s {limit:g} s: a forward pass, driver call or lock that does not "
               "return); retry the request")
        if not self._stall_noted:
            self._stall_noted = True
            log.error("%s", why)
        return why

    def _has_work(self) -> bool:
        """Anything waits on the step thread: open streams, requests or aborts to start, or
        admin calls between steps."""
        return bool(self._streams or self._incoming or self._aborts or self._admin)

    def inject_step_fault(self) -> None:
        """Test hook: the step loop raises at its next iteration, as a bug in a step would.

        Raises:
            PermissionError: ``NodeConfig.fault_injection`` is off (the default).
        """
        if not self.config.fault_injection:
            raise PermissionError("fault injection is off (NodeConfig.fault_injection)")
        self._fault_injected = True
        self._wake.set()

    def _fail(self, reason: str) -> None:
        """Step thread, after the loop died: mark the node unhealthy, wake ``health`` waiters,
        then end every stream (open or arriving later) with UNAVAILABLE until ``shutdown``;
        ``_after_failure`` runs once the first streams are failed. ``reason`` (an exception's
        text) is cut to ``MAX_TEXT_CHARS``: past ``EVENT_LIMITS.max_str_len`` it made every
        UNAVAILABLE message undecodable at its gateway (review 25c 1).

        The failure gets an error id. ``failure`` (``health``, ``stats``: operators, the
        gateways' monitors and admin ``Stats``) and the log hold the id with ``reason``; the
        streams' UNAVAILABLE message, which goes to every tenant with a request here, names the
        node and the id only. Regression (review s35 C S1): the step loop's exception text went
        verbatim to every tenant, and such a text may name another tenant's request or session.
        """
        error_id = uuid.uuid4().hex[:12]
        self.failure = _cut(f"error id {error_id}: {reason}")
        log.error("cache node %s failed (error id %s): %s", self.node_id, error_id, _cut(reason))
        for_tenants = f"cache node {self.node_id} failed (error id {error_id}); retry the request"
        for waiter in list(self._health_waiters):
            waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
        first = True
        while not self._stopped:
            self._incoming.clear()  # their streams are in ``_streams`` too
            self._aborts.clear()
            while self._admin:
                self._admin.popleft()[1].set_exception(RuntimeError(self.failure))
            error = {"type": "error", "code": "UNAVAILABLE", "message": for_tenants}
            self._dispatch([(stream, dict(error)) for stream in list(self._streams.values())])
            self._send_outbox()
            if first:
                first = False
                self._after_failure()
            self._wake.wait(self.config.step_idle_wait_s)
            self._wake.clear()

    def _after_failure(self) -> None:
        """Hook run once a failed node has failed its streams (the actor exits here)."""


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
