"""The refusals of a gateway's ``Authenticator`` made without asking the scheduler, and the
budgets that bound the scheduler's checks of keys whose id is not known here: a malformed key
(``_refuse_malformed``), a key of an id that exists nowhere (``_refuse_absent``), a key that
failed lately (``_refuse_known_bad``), an address over its failure limits, and the per-address
and per-gateway budget of checks (``_check_slot``), suspect key ids taking at most half of it.
``CheckLimits`` is a part of ``services.auth.Authenticator`` (see ``services.auth``'s module
docstring for the whole scheme).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from services.auth_header import other_scheme
from services.key_ids import KeyDirectory, SuspectKeyIds
from services.peers import peer_network
from tenants.keys import fingerprint, parse_key_id
from tenants.ratelimit import ExpiringSet, WindowLimiter

_PEER_CHECKS_IN_FLIGHT = 4
"""Checks of unknown key ids at once per client address (so its failures cannot overshoot
``failures_per_peer`` by more, nor one address hold the gateway's whole ``in_flight``)."""


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client network the failure limits count under (``services.peers.peer_network``: an
    IPv4 address, an IPv6 /64).

    Regression: the limits keyed on the whole address, so a client rotating through the IPv6
    addresses of its /64 (2^64 of them, one host's usual share) had each address's allowance of
    wrong secrets per key id and of checks of unknown key ids anew."""
    return peer_network(context.peer() or "")


_REFUSALS = {"tenant": "missing or unknown API key", "admin": "this call needs the admin key"}
"""UNAUTHENTICATED's message per role: the same for a key's first refusal and its cached ones."""
_NOT_BEARER = ": the authorization scheme must be Bearer (send 'Authorization: Bearer <key>')"
"""Added to a refusal when the call's ``authorization`` names another scheme (Basic, Token...)."""


class CheckLimits:
    """Refusals and check budgets of ``Authenticator`` (which provides these attributes)."""

    unknown_checks_in_flight: int
    directory: KeyDirectory
    _failed: ExpiringSet
    _failures: WindowLimiter
    _peer_failures: WindowLimiter
    _peer_in_flight: dict[str, int]
    _gateway_checks: WindowLimiter
    _in_flight: int
    _suspects: SuspectKeyIds

    if TYPE_CHECKING:  # services.auth_known.KnownKeys
        def _unknow(self, key_id: str) -> None: ...

        def _known_fingerprint(self, key_id: str) -> bytes | None: ...

    @staticmethod
    async def _refuse_malformed(context: grpc.aio.ServicerContext, role: str, key: str) -> None:
        """Abort with UNAUTHENTICATED, asking no one, when ``key`` is not a key's shape.

        Regression (secrev17 F2): every key not cached, malformed ones included, cost the
        GlobalScheduler (one actor, whose loop also admits every tenant's requests) one call,
        and the failure limit keyed on the key id, so 2000 distinct bad keys from one address
        made 2000 scheduler calls; now a malformed key makes none, a well-formed one of an id
        that exists nowhere none either (``_refuse_absent``), and one of an existing id not
        known here is checked only within ``_check_slot``'s per-address and per-gateway
        budgets.
        """
        if parse_key_id(key) is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role] + (_NOT_BEARER if other_scheme(context) else ""))

    async def _refuse_absent(self, context: grpc.aio.ServicerContext, role: str, key: str) -> None:
        """Abort with UNAUTHENTICATED when no key of the well-formed ``key``'s id exists (the
        key directory, refreshed once if the id is not in it): such a key costs no check and
        spends none of the budgets of ``_check_slot``. It is remembered as failed in both roles
        (no key of its id exists) and its id forgotten. Returns when the id exists, when the
        directory cannot tell (its refresh failed: today's budgeted check follows), for a key
        that failed lately (``_refuse_known_bad`` refuses it next) and, while the directory was
        never loaded, for a key known here.

        Regression: a key of an id not known here cost a check of the gateway's budget (100 a
        second, 16 at once), so a flood of well-formed bad keys with random ids from many
        addresses spent it, and a valid key never used at this gateway got RESOURCE_EXHAUSTED.
        """
        key_id, fp = parse_key_id(key) or "", fingerprint(key)
        if (role, fp) in self._failed:
            return
        if not self.directory.loaded and self._known_fingerprint(key_id) == fp:
            return
        if await self.directory.exists(key_id) is not False:
            return
        self._unknow(key_id)
        self._failed.add(("tenant", fp))
        self._failed.add(("admin", fp))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])

    @contextlib.asynccontextmanager
    async def _check_slot(self, context: grpc.aio.ServicerContext, role: str, key: str,
                          wait_s: float) -> AsyncIterator[bool]:
        """Admit one check of the well-formed ``key`` by the scheduler (yielding whether its key
        id is unknown here: a failure of it counts against the address and makes the id
        suspect), or abort without one.

        A key id known here: another secret is refused (``_refuse``: UNAUTHENTICATED, or
        RESOURCE_EXHAUSTED at ``wait_s`` > 0), its own key is admitted with no limit. Any other
        id (one the key directory holds, or any while it cannot tell): RESOURCE_EXHAUSTED while
        the address had ``failures_per_peer`` failed such checks in the window, or past
        ``_budget_wait_s``'s budget (then the key waits for a turn: ``SuspectKeyIds.refused``).

        Regression (secrev18 residue): wrong secrets for key ids that exist (ids are not
        secret), sent from many addresses, spent the whole gateway budget (100 checks a second,
        16 at once), and a valid key never used at this gateway (a new tenant, a rotated key,
        after a restart) got RESOURCE_EXHAUSTED for as long as the flood lasted, as did the
        owner of an attacked id. Keys of ids that failed here lately now take at most half the
        budget and one check at once per id, and within an id a key refused first is checked
        first (``SuspectKeyIds``).
        """
        fp, key_id = fingerprint(key), parse_key_id(key) or ""
        known_fp = self._known_fingerprint(key_id)
        if known_fp is not None:
            if known_fp != fp:
                await self._refuse(context, role, key, wait_s)
            yield False
            return
        host = _peer_host(context)
        peer_wait_s = self._peer_failures.retry_after_s(host)
        if peer_wait_s > 0:
            await self._abort_over_limit(context, peer_wait_s)
        suspect = key_id in self._suspects
        budget_wait_s = self._budget_wait_s(host, key_id, fp, suspect)
        if budget_wait_s > 0:
            self._suspects.refused(key_id, host, fp)
            await self._abort_over_limit(context, budget_wait_s, "too many API-key checks at this gateway")
        self._gateway_checks.try_acquire(None)
        self._in_flight += 1
        self._peer_in_flight[host] = self._peer_in_flight.get(host, 0) + 1
        self._suspects.start(key_id, host, suspect)
        try:
            yield True
        finally:
            self._in_flight -= 1
            self._peer_in_flight[host] -= 1
            if not self._peer_in_flight[host]:
                del self._peer_in_flight[host]
            if suspect:
                self._suspects.finish(key_id)

    def _budget_wait_s(self, host: str, key_id: str, fp: bytes, suspect: bool) -> float:
        """Seconds before a check of the key ``fp`` of ``key_id`` (not known here) from ``host``
        may start (0: now). It waits while the address has ``_PEER_CHECKS_IN_FLIGHT`` running,
        or the gateway ``unknown_checks_in_flight`` running or ``unknown_checks_per_s`` in the
        last second; a key of a suspect id also waits on ``SuspectKeyIds.wait_s`` (its share)."""
        gateway_wait_s = self._gateway_checks.retry_after_s(None)
        suspect_wait_s = self._suspects.wait_s(key_id, host, fp) if suspect else 0.0
        busy = (self._peer_in_flight.get(host, 0) >= _PEER_CHECKS_IN_FLIGHT
                or self._in_flight >= self.unknown_checks_in_flight)
        wait_s = max(gateway_wait_s, suspect_wait_s)
        return max(wait_s, 1.0) if busy or wait_s > 0 else 0.0

    def _count_unknown_failure(self, context: grpc.aio.ServicerContext, key: str) -> None:
        """A check of ``key``, its id not known here, failed: count it against the address
        (``failures_per_peer``), and its id is suspect (``SuspectKeyIds``)."""
        self._peer_failures.try_acquire(_peer_host(context))
        self._suspects.failed(parse_key_id(key) or "")

    def _wait_s(self, context: grpc.aio.ServicerContext, role: str, key: str) -> float:
        """Seconds this address stays over its failure limit for ``key``'s id as ``role`` (0:
        not over it)."""
        return self._failures.retry_after_s((role, _peer_host(context), parse_key_id(key)))

    async def _refuse_known_bad(self, context: grpc.aio.ServicerContext, role: str, key: str) -> float:
        """Abort, without asking the scheduler, for a key that failed lately as ``role``
        ("tenant" or "admin"): RESOURCE_EXHAUSTED while the address is over its failure limit
        for the key's id, else UNAUTHENTICATED. Otherwise return ``_wait_s`` (seconds)."""
        wait_s = self._wait_s(context, role, key)
        if (role, fingerprint(key)) in self._failed:
            if wait_s > 0:
                await self._abort_over_limit(context, wait_s)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])  # a first refusal's message
        return wait_s

    async def _refuse(self, context: grpc.aio.ServicerContext, role: str, key: str, wait_s: float,
                      unknown: bool = False) -> None:
        """Abort for a key that did not pass as ``role``: with RESOURCE_EXHAUSTED when it was
        checked over the failure limit (``wait_s`` > 0; without PBKDF2, so it may be valid: not
        remembered as failed), else record the failure and abort with UNAUTHENTICATED. A failed
        check of a key id ``unknown`` here counts against the address (``failures_per_peer``)."""
        if unknown:
            self._count_unknown_failure(context, key)
        if wait_s > 0:
            await self._abort_over_limit(context, wait_s)
        self._failed.add((role, fingerprint(key)))
        self._failures.try_acquire((role, _peer_host(context), parse_key_id(key)))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])

    @staticmethod
    async def _abort_over_limit(context: grpc.aio.ServicerContext, wait_s: float,
                                why: str = "too many failed API-key checks from this address") -> None:
        wait_ms = int(wait_s * 1000) + 1
        context.set_trailing_metadata((("retry-after-ms", str(wait_ms)),))
        # the whole seconds the HTTP API's Retry-After says for this trailer (rounded up, at least
        # 1); regression (review 25b N1): "retry in 0 s" beside Retry-After: 1 (rounded down)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry in {max(1, math.ceil(wait_ms / 1000))} s")
