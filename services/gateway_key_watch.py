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
id the store no longer holds (``NodeStreams.end_revoked``: its request aborted on its node and
released with its usage): UNAUTHENTICATED, or ABORTED when its tenant was deleted (the
scheduler no longer knows the tenant id: ``knows_tenant``, asked once per tenant whose streams
end so), the code its nodes' ``end_tenant`` ends a deleted tenant's streams with (whichever
comes first ends the stream; the other finds it ended). A change made through this gateway
(its own ``RotateKey``, ``DeleteTenant``, a key refused at admission or at a recheck:
``KnownKeys._keys_gone``) starts that check at once, and ids a refresh found removed (any
refresh, a key check's included) end their streams at once; a change made through another
gateway is seen here within ``KEY_CHECK_S`` (plus a refresh's round trip).

Regression (review R1 F2, session 36): every stream of a removed key ended UNAUTHENTICATED,
so a tenant deleted through a gateway (whose ``DeleteTenant`` starts a check at once, racing
its nodes' ``end_tenant``) had its streams there end UNAUTHENTICATED, not ABORTED as
documented and as before the watch.

Ids never come back (every key gets a fresh random id), so an id absent from the store is gone
for good; a stream is checked only against a refresh started after it was opened (its key was
checked before it opened), so a key made after that refresh's read is never taken for removed.
A refresh that fails (``KeyDirectory``: error, timeout, malformed reply) ends no stream for its
key; the next check tries again. A directory the scheduler answers but that cannot be used (more
key ids than ``_MAX_DIRECTORY_IDS``, malformed, a scheduler without ``key_ids_since``) is not a
failure to reach it: the open streams' key ids are then asked about alone (``key_ids_exist``,
``KeyDirectory.which_exist``), and if that cannot tell either, they are left alone (logged once).
Regression (review r1 F1, session 37): such a directory counted as unreachable, so on a healthy
cluster of more than 2**18 keys every stream ended UNAVAILABLE after ``staleness_max_s``.
But a gateway that cannot reach the scheduler's key directory
cannot see a key removed meanwhile, so the watch does not go on with unconfirmed keys for
longer than ``staleness_max_s`` (``ServiceConfig.key_staleness_max_s``, 120 s by default): a
check whose refresh fails, after the check before it failed too, ends UNAVAILABLE (retryable:
HTTP 503 with ``Retry-After``) each stream whose key was last confirmed longer ago than that
(when it was opened: its key was checked then, and its admission checked its key id; or the
start of the last of this watch's refreshes that answered). So such a stream ends within
``staleness_max_s + interval_s`` plus one refresh's timeout (``_DIRECTORY_TIMEOUT_S``, 5 s) of
its key's last confirmation: ~130 s by default. Ended, not left to run: a removed key's stream
would otherwise run for as long as the directory fails (up to ``max_tokens``), and its
retry asks the scheduler anew (admission checks its key), so a valid client loses the tokens
of one outage and a stolen key gains nothing. One failed refresh (a scheduler restart, a
timeout) ends nothing: two failures in a row are needed, and the bound counts from the last
answer. (A gateway's own stall, which may time its refresh out, is one failure: the next
check, ``interval_s`` later, answers.) New calls never authenticate on older knowledge than
the key cache's ``services.auth._CACHE_TTL_S`` (10 s, within every allowed
``key_staleness_max_s``): past it a key is checked at the scheduler, and a scheduler that does
not answer fails the call UNAVAILABLE (``services.actor_calls``).

Regression (gap left by session 36, fixed in session 37): a failed refresh ended nothing, ever,
so while the directory did not answer (the scheduler unreachable from this gateway, or its
replies malformed) the streams of keys removed meanwhile ran on to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from services.key_ids import APPLIED, UNREACHABLE

log = logging.getLogger(__name__)

KEY_CHECK_S = 5.0
"""How often a gateway with streams open checks that the keys which opened them still exist
(one ``key_ids_since`` call to the scheduler each time, a delta; none while no stream is open).
Within the gateway's key cache's own window (``services.auth._CACHE_TTL_S``, 10 s)."""

REVOKED_MESSAGE = ("the API key that opened this stream is no longer valid (rotated away, or its tenant deleted); "
                   "the request was cancelled")
"""What a stream ended for its key tells its client (UNAUTHENTICATED)."""

KEY_STALENESS_MAX_S = 120.0
"""The longest an open stream runs on with its API key unconfirmed while the key directory does
not answer (``ServiceConfig.key_staleness_max_s``'s default): twice the 60 s a killed scheduler
is allowed to come back in (tests/test_scheduler_restart.py ``RECOVERY_S``; 30 s ended a stream
there on a loaded 2-core host, session 37), so a scheduler restart ends no stream, while a key
removed during an outage stops working within ~130 s (see the module docstring). A key can only
be removed through a scheduler that answers, so the bound matters for a gateway cut off from a
scheduler that other gateways still reach."""

STALE_MESSAGE = ("this gateway could not confirm that the API key of this stream is still valid for {max_s:g} s "
                 "(the scheduler's key directory does not answer); the request was cancelled; retry")
"""What a stream ended for an unconfirmed key tells its client (UNAVAILABLE)."""

DELETED_MESSAGE = "this tenant was deleted; the request was cancelled"
"""What a stream ended for its tenant's deletion tells its client (ABORTED)."""

TENANT_CHECK_S = 2.0
"""How long the watch waits for the scheduler to say whether a tenant still exists
(``knows_tenant``) before ending its removed key's streams UNAUTHENTICATED all the same."""

MAX_PENDING_IDS = 1 << 18
"""Removed key ids (``keys_gone``) held for the next check at most (past it, the rest wait for
the check's own refresh: they are absent from the directory)."""


class KeyWatch:
    """Ends the open streams of ``streams`` whose API key was removed from the tenant store.

    Args:
        streams: the gateway's ``NodeStreams`` (``key_streams``, ``end_revoked``,
            ``cancel_at_shutdown``).
        auth: the gateway's ``Authenticator``: its ``directory`` (``KeyDirectory``) is
            refreshed for each check, its ``scheduler`` asked whether the tenants of removed
            keys still exist (``knows_tenant``), and its ``on_keys_gone`` is set to ``keys_gone``.
        interval_s: seconds between checks while streams are open (> 0).
        staleness_max_s: how long a stream may go on with its key unconfirmed while the
            directory's refreshes fail (> 0; see the module docstring).

    ``start`` (idempotent, on the running loop; ``InferenceServicer.generate`` calls it) runs
    the checks until ``streams`` shuts down; once it has (``NodeStreams.closed``) ``start``
    starts nothing. ``ended`` counts the streams ended so, ``aborted`` those of them ended
    ABORTED (their tenant deleted), ``unconfirmed`` those ended UNAVAILABLE for
    ``staleness_max_s`` (not in ``ended``). Times are the clock of ``streams`` (``clock``,
    monotonic seconds), which stamps each stream's ``opened_at``.

    Raises:
        ValueError: ``interval_s`` or ``staleness_max_s`` <= 0.
    """

    def __init__(self, streams: Any, auth: Any, interval_s: float = KEY_CHECK_S,
                 staleness_max_s: float = KEY_STALENESS_MAX_S) -> None:
        if not interval_s > 0 or not staleness_max_s > 0:
            raise ValueError(f"interval_s and staleness_max_s must be > 0, got {interval_s}, {staleness_max_s}")
        self.streams, self.auth, self.interval_s = streams, auth, interval_s
        self.staleness_max_s = staleness_max_s
        self.clock = getattr(streams, "clock", time.monotonic)
        self.ended = self.aborted = self.unconfirmed = 0
        self._confirmed_at = -math.inf  # when the last of this watch's refreshes that answered started
        self._failed_checks = 0  # checks in a row whose refresh failed
        self._unusable_logged = False  # the scheduler answered but could not tell which keys exist
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._gone_ids: set[str] = set()  # removed ids told by ``keys_gone``, for the next check
        auth.on_keys_gone = self.keys_gone

    def start(self) -> None:
        """Run the checks on the running loop, unless they run already or ``streams`` has shut
        down (``NodeStreams.closed``: nothing would cancel the task). Regression (review R1,
        session 36): a start after the shutdown ran a task for good."""
        if getattr(self.streams, "closed", False):
            return
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._task.get_loop() is loop:
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())
        self.streams.cancel_at_shutdown(self._task)

    def keys_gone(self, key_ids: set[str] | None) -> None:
        """``Authenticator.on_keys_gone``: the streams of ``key_ids`` (removed from the store,
        as a directory refresh found) end at the check this starts now (without a refresh of
        its own for them); None (some keys went, which is not known here) starts a check now.
        Nothing while the checks do not run (no stream was opened here: ``start``)."""
        if self._wake is None or self._task is None or self._task.done():
            return
        if key_ids and len(self._gone_ids) < MAX_PENDING_IDS:
            self._gone_ids |= set(list(key_ids)[:MAX_PENDING_IDS - len(self._gone_ids)])
        self._wake.set()

    async def check(self) -> int:
        """One check: the streams open now of the ids ``keys_gone`` was told, and then those
        whose key id is absent from the store as of a read started after this call
        (``KeyDirectory.which_exist``: a directory refresh, or, when the directory is
        unusable, the scheduler asked about just these ids), are ended (``_end``). When the
        scheduler does not answer (``UNREACHABLE``), after the check before did not either,
        the streams whose key is unconfirmed for longer than ``staleness_max_s`` end
        UNAVAILABLE (``_end_unconfirmed``); a scheduler that answers but cannot tell
        (``UNUSABLE``) ends nothing and counts as confirming (logged once). Returns the
        streams ended for their keys while it ran (0 when none is open with a key; those told
        alone when the check could not tell)."""
        gone_ids, self._gone_ids = self._gone_ids, set()
        before = self.ended
        if gone_ids:
            await self._end([s for s in self.streams.key_streams() if s[1] in gone_ids])
        opened = self.streams.key_streams()
        if not opened:
            return self.ended - before
        started = self.clock()
        outcome, existing = await self.auth.directory.which_exist({key_id for _, key_id, _, _ in opened})
        if outcome == UNREACHABLE:
            self._failed_checks += 1
            if self._failed_checks >= 2:
                self._end_unconfirmed(opened)
            return self.ended - before
        self._confirmed_at, self._failed_checks = max(self._confirmed_at, started), 0  # the scheduler answered
        if outcome == APPLIED:
            await self._end([s for s in opened if s[1] not in existing])
        elif not self._unusable_logged:
            self._unusable_logged = True
            log.warning("gateway: the scheduler answers but cannot tell which API keys exist (no usable key "
                        "directory, no key_ids_exist): open streams' keys are not rechecked")
        return self.ended - before

    def _end_unconfirmed(self, opened: list[tuple[str, str, str, Any]]) -> int:
        """End UNAVAILABLE each stream of ``opened`` whose key was last confirmed (its opening,
        or ``_confirmed_at``) more than ``staleness_max_s`` ago; returns how many ended."""
        now, message = self.clock(), STALE_MESSAGE.format(max_s=self.staleness_max_s)
        ended = 0
        for request_id, _, _, opening in opened:
            if now - max(opening.opened_at, self._confirmed_at) > self.staleness_max_s:
                ended += self.streams.end_revoked(request_id, opening, message, "UNAVAILABLE")
        if ended:
            self.unconfirmed += ended
            log.warning("gateway: ended %d stream(s) whose API key could not be confirmed for %g s (the key "
                        "directory does not answer)", ended, self.staleness_max_s)
        return ended

    async def _end(self, opened: list[tuple[str, str, str, object]]) -> int:
        """End the streams ``opened`` (``NodeStreams.key_streams``' entries, their keys removed):
        ABORTED those of a tenant the scheduler no longer knows (deleted: ``_deleted``),
        UNAUTHENTICATED the others. Returns how many ended (not closed or ended meanwhile)."""
        if not opened:
            return 0
        deleted = await self._deleted({tenant_id for _, _, tenant_id, _ in opened if tenant_id})
        ended = aborted = 0
        for request_id, _, tenant_id, opening in opened:
            code, message = (("ABORTED", DELETED_MESSAGE) if tenant_id in deleted
                             else ("UNAUTHENTICATED", REVOKED_MESSAGE))
            if self.streams.end_revoked(request_id, opening, message, code):
                ended += 1
                aborted += code == "ABORTED"
        if ended:
            self.ended += ended
            self.aborted += aborted
            log.info("gateway: ended %d stream(s) whose API key was removed (%d of deleted tenants)", ended, aborted)
        return ended

    async def _deleted(self, tenant_ids: set[str]) -> set[str]:
        """The ids of ``tenant_ids`` the scheduler no longer knows (``knows_tenant`` answered
        False: deleted; it forgets a tenant id as it ends the tenant's requests on its nodes).
        An answer that is not a bool, an error or no answer within ``TENANT_CHECK_S`` counts as
        known (its streams end UNAUTHENTICATED: their key is gone either way)."""
        if not tenant_ids:
            return set()
        ordered = sorted(tenant_ids)

        async def known(tenant_id: str) -> Any:
            return await self.auth.scheduler.knows_tenant.remote(tenant_id=tenant_id)

        try:
            replies = await asyncio.wait_for(asyncio.gather(*(known(t) for t in ordered), return_exceptions=True),
                                             TENANT_CHECK_S)
        except Exception as exc:  # noqa: BLE001 - a timeout, a scheduler without it: not known
            log.warning("gateway: asking which tenants were deleted failed: %s: %.200s", type(exc).__name__, exc)
            return set()
        return {tenant_id for tenant_id, reply in zip(ordered, replies) if reply is False}

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
