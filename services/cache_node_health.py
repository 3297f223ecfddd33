"""A cache node's health: ``ping``, ``health`` (a long poll a gateway waits on), and what
happens once the step loop fails (every stream ends with UNAVAILABLE).

``Health`` is a part of ``services.cache_node.CacheNode``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from services.data_plane_wire import _cut


class Health:
    """The health part of ``CacheNode``."""

    def ping(self) -> bool:
        """True while the step loop runs; False once it has failed (see ``health``)."""
        return not self.failure

    async def health(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The node's health, answered at once or, with ``wait_s`` > 0, as soon as the step
        loop fails and at the latest after ``wait_s`` seconds (a gateway's long poll).

        Returns:
            ``healthy`` (bool), ``failure`` (why not, "" when healthy), ``pid``, ``restarts``
            and ``data_address`` (the command inbox, "" until ``open_data_plane``).
        """
        if wait_s > 0 and not self.failure:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._health_waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except asyncio.TimeoutError:
                pass
            finally:
                self._health_waiters.remove(waiter)
        return {"healthy": not self.failure, "failure": self.failure, "pid": os.getpid(),
                "restarts": self.restarts(), "data_address": self.data_address}

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
        UNAVAILABLE message undecodable at its gateway (review 25c 1)."""
        reason = _cut(reason)
        self.failure = reason
        for waiter in list(self._health_waiters):
            waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
        first = True
        while not self._stopped:
            self._incoming.clear()  # their streams are in ``_streams`` too
            self._aborts.clear()
            while self._admin:
                self._admin.popleft()[1].set_exception(RuntimeError(reason))
            error = {"type": "error", "code": "UNAVAILABLE", "message": reason}
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
