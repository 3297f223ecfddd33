"""The gateway's open streams end when the API key that opened them stops working
(``KeyWatch``).

A key is checked when a call is made (``services.auth``) and when its request is admitted (the
scheduler refuses a removed key's id: ``key_revoked``), never again while the call streams. So a
stolen key that its owner rotated away (``kvstrata tenant rotate-key``, ``RotateKey``), or a
deleted tenant's key, kept every stream it had opened: generating on its node and holding its
blocks up to ``max_tokens``, a session's turn included, and its place in the tenant's
``max_streams_per_tenant``. Now each stream is opened with its key's id
(``NodeStreams.open``), and a gateway with such streams open checks, every ``KEY_CHECK_S``,
that their keys still exist: it refreshes its key directory (``KeyDirectory.refresh``: one
``key_ids_since`` delta, shared with the key checks' refreshes) and ends each stream whose key
id the store no longer holds (``NodeStreams.end_revoked``: UNAUTHENTICATED, its request aborted
on its node and released with its usage). A change made through this gateway (its own
``RotateKey``, ``DeleteTenant``, a key refused at admission or at a recheck:
``KnownKeys._keys_gone``) starts that check at once, and ids a refresh found removed (any
refresh, a key check's included) end their streams at once; a change made through another
gateway is seen here within ``KEY_CHECK_S`` (plus a refresh's round trip).

Ids never come back (every key gets a fresh random id), so an id absent from the store is gone
for good; a stream is checked only against a refresh started after it was opened (its key was
checked before it opened), so a key made after that refresh's read is never taken for removed.
A refresh that fails (``KeyDirectory``: error, timeout, malformed reply) ends nothing; the next
check tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KEY_CHECK_S = 5.0
"""How often a gateway with streams open checks that the keys which opened them still exist
(one ``key_ids_since`` call to the scheduler each time, a delta; none while no stream is open).
Within the gateway's key cache's own window (``services.auth._CACHE_TTL_S``, 10 s)."""

REVOKED_MESSAGE = ("the API key that opened this stream is no longer valid (rotated away, or its tenant deleted); "
                   "the request was cancelled")
"""What a stream ended for its key tells its client (UNAUTHENTICATED)."""


class KeyWatch:
    """Ends the open streams of ``streams`` whose API key was removed from the tenant store.

    Args:
        streams: the gateway's ``NodeStreams`` (``key_streams``, ``end_revoked``,
            ``cancel_at_shutdown``).
        auth: the gateway's ``Authenticator``: its ``directory`` (``KeyDirectory``) is
            refreshed for each check, and its ``on_keys_gone`` is set to ``keys_gone``.
        interval_s: seconds between checks while streams are open (> 0).

    ``start`` (idempotent, on the running loop; ``InferenceServicer.generate`` calls it) runs
    the checks until ``streams`` shuts down. ``ended`` counts the streams ended so.

    Raises:
        ValueError: ``interval_s`` <= 0.
    """

    def __init__(self, streams: Any, auth: Any, interval_s: float = KEY_CHECK_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.streams, self.auth, self.interval_s = streams, auth, interval_s
        self.ended = 0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        auth.on_keys_gone = self.keys_gone

    def start(self) -> None:
        """Run the checks on the running loop, unless they run already."""
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())
        self.streams.cancel_at_shutdown(self._task)

    def keys_gone(self, key_ids: set[str] | None) -> None:
        """``Authenticator.on_keys_gone``: the streams of ``key_ids`` (removed from the store,
        as a directory refresh found) end now; None (some keys went, which is not known here)
        starts a check now."""
        if key_ids:
            self._end(self.streams.key_streams(), lambda key_id: key_id in key_ids)
        elif self._wake is not None:
            self._wake.set()

    async def check(self) -> int:
        """One check: the streams open now whose key id is absent from the store as of a key
        directory refresh started after this call are ended (those of ids the refresh found
        removed at once, through ``keys_gone``); returns the streams ended while it ran (0
        when none is open with a key, or the refresh failed)."""
        opened = self.streams.key_streams()
        if not opened:
            return 0
        before, directory = self.ended, self.auth.directory
        if await directory.refresh():
            ids = directory.ids
            self._end(opened, lambda key_id: key_id not in ids)
        return self.ended - before

    def _end(self, opened: list[tuple[str, str, object]], gone: Callable[[str], bool]) -> int:
        ended = 0
        for request_id, key_id, opening in opened:
            if gone(key_id) and self.streams.end_revoked(request_id, opening, REVOKED_MESSAGE):
                ended += 1
        if ended:
            self.ended += ended
            log.info("gateway: ended %d stream(s) whose API key was removed", ended)
        return ended

    async def _run(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), self.interval_s)
            wake.clear()
            try:
                await self.check()
            except Exception:  # a bug here must not end the watch
                log.exception("gateway: checking open streams' API keys failed")
