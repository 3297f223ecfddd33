"""API-key authentication at the gateway, with short-lived caches in front of the scheduler.

- A key that worked is remembered for ``_CACHE_TTL_S``. A change of one tenant (its spec, its
  keys, its deletion) forgets that tenant's cached keys alone (``forget_tenant``); a new admin
  key forgets the cached admin key alone (``forget_admin``).
- A key that failed is remembered for ``_CACHE_TTL_S`` and refused with UNAUTHENTICATED
  without asking the scheduler.
- A key that does not match ``tenants.keys.KEY_PATTERN`` (a missing one included) is refused
  with UNAUTHENTICATED without asking the scheduler: it cannot be anyone's key.
- The key id of a key that passed is *known* here for ``_KNOWN_ID_TTL_S`` with that key's
  fingerprint (a key id is the primary key of the store's keys, and every key, rotated ones
  too, gets a fresh random id, so an id has one secret). Another secret for a known id is
  refused here without asking the scheduler (counted for its address and key id, as below).
  Each owner (a tenant, the admin key) keeps its newest ``_KNOWN_IDS_PER_OWNER`` known ids, so
  one tenant's keys (its rotations) never push another's out.
- At most ``failures_per_peer_key`` failed checks per (client address, key id, role) in any
  ``failure_window_s``. Past that the address is over its limit for that key id: a key of that
  id is still checked, but with ``allow_pbkdf2=False`` (``tenants.store``: a SHA-256 row costs
  microseconds; an earlier version's PBKDF2 row is checked only if that key was verified since
  the scheduler started), and one that does not pass is refused with RESOURCE_EXHAUSTED (and a
  ``retry-after-ms`` trailer). So a flood of wrong secrets costs the scheduler at most a few
  PBKDF2 runs per address and key id, not one per attempt, and another client's failures from
  the same address (a NAT, a proxy) never lock out a valid key of that id.
- The gateway keeps a directory of the key ids that exist (``KeyDirectory``: tenants' keys and
  the admin key's, from the scheduler's ``key_ids_since``). A well-formed key whose id is not
  in it waits for one directory refresh started after it arrived (all such calls share it;
  at most ``directory_refreshes_per_s`` refreshes a second), and is refused with
  UNAUTHENTICATED, without a check and without spending any budget below, when its id is still
  absent (remembered as failed, in both roles). So a key registered or rotated through another
  gateway passes on its first use here, and a deleted tenant's or rotated-away key is refused
  after the next refresh, which forgets its id and its cached success. A refresh that fails
  (an error, a timeout, a malformed reply: it is checked as untrusted) changes nothing, and
  its callers go on to the checks below as if there were no directory.
- A key whose id exists but is not known here costs the scheduler a check, so those checks are
  bounded before they are made, across all key ids: an address with ``failures_per_peer``
  failed such checks in the last ``failure_window_s`` (or ``_PEER_CHECKS_IN_FLIGHT`` running)
  gets none, and the gateway runs at most ``unknown_checks_per_s`` a second and
  ``unknown_checks_in_flight`` at once (all addresses together); past any of them the key is
  refused with RESOURCE_EXHAUSTED (and ``retry-after-ms``) without a check. A key that passes
  becomes known and costs its address nothing, and a key whose id is known here is checked
  whatever its address's failures (one tenant's flood does not lock out another tenant already
  seen here at the same address). The scheduler's load from unauthenticated clients is thus
  bounded by the refresh rate plus the gateway's budget, not by their rate or their number of
  addresses. Random key ids never reach that budget, so a valid key never seen here waits for
  one refresh, not on a flood of them.
- Wrong secrets for key ids that exist (ids are not secret) do reach that budget, so the budget
  is shared by key id (``SuspectKeyIds``): an id whose check failed here in the last
  ``SUSPECT_TTL_S`` is *suspect*, and the checks of suspect ids take at most half the budget,
  one at once per id; within an id a key refused for want of budget is checked before any
  newer key of it (its retry from the same address keeps its turn). A flood of wrong secrets,
  from any number of addresses, thus spends the other half at most once per existing key id
  per ``SUSPECT_TTL_S`` (its first failure), and a valid key of an id that did not fail here
  finds that half free; the owner of an attacked id is checked on its retry. Regression
  (secrev18 residue): such a flood spent the whole budget, and a valid key never used at this
  gateway (a new tenant, a rotated key, after a restart) got RESOURCE_EXHAUSTED while it
  lasted. (A gateway could verify every secret itself only with the store's digests, which
  ``key_ids_since`` does not give it.)

The client address is the connection's (gRPC's peer; for the HTTP API, uvicorn's client, which
honours X-Forwarded-For only from the proxies named in ``http_forwarded_allow_ips``). The HTTP
API authenticates through this same class (``services.openai_api.context.HttpCallContext``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.key_ids import SUSPECT_TTL_S, KeyDirectory, SuspectKeyIds
from tenants.keys import fingerprint, parse_key_id
from tenants.model import Tenant
from tenants.ratelimit import ExpiringSet, WindowLimiter

log = logging.getLogger(__name__)

_CACHE_TTL_S = 10.0
_KNOWN_ID_TTL_S = 3600.0
"""How long a key id stays known after its key last passed a check here."""
_KNOWN_IDS_PER_OWNER = 4
"""Key ids known here per owner (a tenant, or the admin key), its newest first kept: a tenant has
one live key (``RotateKey`` replaces them all), so its own rotations evict only its own ids."""
_MAX_KNOWN_IDS = 65536
"""Known key ids at most, all owners together (a memory guard: past it the owner holding the
most loses its oldest, so it bites only past ``_MAX_KNOWN_IDS / _KNOWN_IDS_PER_OWNER`` owners)."""
_ADMIN_OWNER = ""
"""The owner of the admin key's id in the known ids (a tenant's is its name, never empty)."""
_PEER_CHECKS_IN_FLIGHT = 4
"""Checks of unknown key ids at once per client address (so its failures cannot overshoot
``failures_per_peer`` by more, nor one address hold the gateway's whole ``in_flight``)."""
def bearer_key(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return ""


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """The client's address without its port (``ipv4:10.0.0.1:53412`` -> ``ipv4:10.0.0.1``)."""
    peer = context.peer() or ""
    return peer.rpartition(":")[0] or peer


_REFUSALS = {"tenant": "missing or unknown API key", "admin": "this call needs the admin key"}
"""UNAUTHENTICATED's message per role: the same for a key's first refusal and its cached ones."""


class Authenticator:
    """Resolves API keys to tenants and checks the admin key, via the GlobalScheduler.

    Args:
        scheduler: the GlobalScheduler actor handle (``authenticate``, ``verify_admin_key``,
            ``key_ids_since``; without the last, every well-formed key goes to the budgeted
            checks).
        failures_per_peer_key: failed checks allowed per (client address, key id) per window
            (>= 1).
        failure_window_s: that window, seconds (> 0).
        failures_per_peer: failed checks of keys whose id is not known here, per client
            address per window, all key ids together (>= 1).
        unknown_checks_per_s: such checks per second at this gateway, all addresses (>= 1).
        unknown_checks_in_flight: such checks at once at this gateway (>= 1).
        directory_refreshes_per_s: key-directory refreshes a second at most (> 0; see
            ``KeyDirectory``).
        clock: monotonic seconds, for the caches and limits (tests inject one; the key
            directory's refresh rate keeps ``time.monotonic``).

    Of the budget of checks of unknown key ids, keys of suspect ids (``SuspectKeyIds``: a check
    failed here lately) take at most half (``unknown_checks_per_s // 2`` a second,
    ``unknown_checks_in_flight // 2`` at once, at least 1 each).

    Raises:
        ValueError: a count < 1, ``failure_window_s`` <= 0 or ``directory_refreshes_per_s`` <= 0.
    """

    def __init__(self, scheduler: Any, failures_per_peer_key: int = 10, failure_window_s: float = 10.0,
                 failures_per_peer: int = 50, unknown_checks_per_s: int = 100,
                 unknown_checks_in_flight: int = 16, directory_refreshes_per_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if unknown_checks_in_flight < 1:
            raise ValueError(f"unknown_checks_in_flight must be >= 1, got {unknown_checks_in_flight}")
        self.scheduler, self.clock = scheduler, clock
        self.failures_per_peer_key = failures_per_peer_key
        self.failures_per_peer = failures_per_peer
        self.unknown_checks_per_s = unknown_checks_per_s
        self.unknown_checks_in_flight = unknown_checks_in_flight
        self._tenants: dict[bytes, tuple[Tenant, float, str]] = {}  # fingerprint -> (tenant, until, key id)
        self._admins: dict[bytes, tuple[float, str]] = {}  # fingerprint -> (until, key id)
        self._known: dict[str, tuple[bytes, float, str]] = {}  # key id -> (fingerprint, until, owner)
        self._known_by_owner: dict[str, OrderedDict[str, None]] = {}  # owner -> its known key ids, oldest first
        self._failed = ExpiringSet(_CACHE_TTL_S, clock)
        self._failures = WindowLimiter(failures_per_peer_key, failure_window_s, clock)
        self._peer_failures = WindowLimiter(failures_per_peer, failure_window_s, clock)
        self._peer_in_flight: dict[str, int] = {}
        self._gateway_checks = WindowLimiter(unknown_checks_per_s, 1.0, clock, max_keys=1)
        self._in_flight = 0
        self._suspects = SuspectKeyIds(max(1, unknown_checks_per_s // 2), max(1, unknown_checks_in_flight // 2),
                                       SUSPECT_TTL_S, clock)
        self._pending: dict[bytes, asyncio.Future[Tenant | None]] = {}  # fingerprint -> its check
        self.directory = KeyDirectory(scheduler, directory_refreshes_per_s, self._forget_key_ids)

    async def tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant; aborts the call with UNAUTHENTICATED (RESOURCE_EXHAUSTED for a
        key that does not pass while its address is over the failure limit for its key id, or
        for a key of an id not known here past the budget of such checks) otherwise."""
        key = bearer_key(context)
        fp = fingerprint(key)
        hit = self._cached_tenant(fp)
        if hit is not None:
            return hit
        await self._refuse_malformed(context, "tenant", key)
        await self._refuse_absent(context, "tenant", key)  # before the sharing: a refresh may be awaited
        # Regression: a tenant's burst of concurrent first calls with one key took one check
        # each and ran into the address's limit of checks at once (RESOURCE_EXHAUSTED for a
        # valid key); concurrent calls with one key now share its one check.
        pending = self._pending.get(fp)
        if pending is not None:
            shared = await asyncio.shield(pending)
            if shared is not None:
                return shared
        wait_s = await self._refuse_known_bad(context, "tenant", key)
        mine: asyncio.Future[Tenant | None] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(fp, mine)
        tenant = None
        try:
            async with self._check_slot(context, "tenant", key, wait_s) as unknown:
                tenant = await self.scheduler.authenticate.remote(key, allow_pbkdf2=wait_s == 0)
            if tenant is not None:
                self._remember_tenant(key, tenant)
        finally:
            if self._pending.get(fp) is mine:
                del self._pending[fp]
            mine.set_result(tenant)
        if tenant is None:
            await self._refuse(context, "tenant", key, wait_s, unknown)
        return tenant

    async def admin(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts unless the call carries the admin key: PERMISSION_DENIED for a tenant's own
        key (authenticated, not allowed; a fresh-user trial got UNAUTHENTICATED for its valid
        key), else UNAUTHENTICATED (or RESOURCE_EXHAUSTED, as ``tenant``)."""
        key = bearer_key(context)
        fp = fingerprint(key)
        if self._cached_admin(fp):
            return
        await self._refuse_malformed(context, "admin", key)
        await self._refuse_absent(context, "admin", key)
        wait_s = await self._refuse_known_bad(context, "admin", key)
        is_tenant, unknown = self._cached_tenant(fp) is not None, False
        if not is_tenant:
            async with self._check_slot(context, "admin", key, wait_s) as unknown:
                if await self._is_admin(key, allow_pbkdf2=wait_s == 0):
                    return
                is_tenant = await self._is_tenant_key(key, allow_pbkdf2=wait_s == 0)
        if is_tenant:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this call needs the admin key; a tenant's key may not make it")
        await self._refuse(context, "admin", key, wait_s, unknown)

    async def _is_tenant_key(self, key: str, allow_pbkdf2: bool) -> bool:
        tenant = await self.scheduler.authenticate.remote(key, allow_pbkdf2=allow_pbkdf2)
        if tenant is not None:
            self._remember_tenant(key, tenant)
        return tenant is not None

    async def admin_or_tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """``None`` for the admin key, the calling tenant for a tenant key; aborts with
        UNAUTHENTICATED (or RESOURCE_EXHAUSTED) otherwise. The admin check spends no PBKDF2
        while the address is over its limit for the key id as either role (failures here
        count as the tenant role's). Both checks together take one check of the budget for
        key ids not known here."""
        key = bearer_key(context)
        fp = fingerprint(key)
        if self._cached_admin(fp):
            return None
        hit = self._cached_tenant(fp)
        if hit is not None:
            return hit
        await self._refuse_malformed(context, "tenant", key)
        await self._refuse_absent(context, "tenant", key)
        try_admin = ("admin", fp) not in self._failed
        if not try_admin:  # refused from the cache if it failed as a tenant's key too
            wait_s = await self._refuse_known_bad(context, "tenant", key)
        else:
            wait_s = self._wait_s(context, "tenant", key)
        try_tenant = ("tenant", fp) not in self._failed
        over = wait_s > 0 or self._wait_s(context, "admin", key) > 0
        tenant: Any = None  # a Tenant once one passed
        async with self._check_slot(context, "tenant", key, wait_s) as unknown:
            if try_admin and await self._is_admin(key, allow_pbkdf2=not over):
                return None
            if try_tenant:
                tenant = await self.scheduler.authenticate.remote(key, allow_pbkdf2=wait_s == 0)
        if tenant is None:
            if unknown:  # a failed check of an unknown key id, whichever refusal follows
                self._count_unknown_failure(context, key)
            if not try_tenant:
                await self._refuse_known_bad(context, "tenant", key)
            await self._refuse(context, "tenant", key, wait_s)
        self._remember_tenant(key, tenant)
        return tenant

    def is_verified(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call's key passed a check here lately (a cached tenant or admin key)."""
        fp = fingerprint(bearer_key(context))
        return self._cached_tenant(fp) is not None or self._cached_admin(fp)

    async def refuse_unknown_key(self, context: grpc.aio.ServicerContext, role: str) -> None:
        """Abort with UNAUTHENTICATED (``role``'s message: "tenant" or "admin") a call whose key
        is missing, malformed, or of an id that exists nowhere (``_refuse_malformed``,
        ``_refuse_absent``), asking the scheduler nothing; returns for any other key (its
        handler's ``tenant``/``admin`` check follows). Regression (secrev19 H5): the gateway's
        interceptor (``services.grpc_bounds.CallGate``) runs this on a call's headers, before
        its request message, which a keyless call held unchecked by never sending."""
        if self.is_verified(context):
            return
        key = bearer_key(context)
        await self._refuse_malformed(context, role, key)
        await self._refuse_absent(context, role, key)

    def forget_tenant(self, name: str, keys_gone: bool = False) -> None:
        """Drop the cached keys of tenant ``name`` (after its spec or keys changed, or it was
        deleted); every other tenant's cached keys stay. With ``keys_gone`` (its keys were
        rotated away, or it was deleted) its known key ids go too; otherwise (a spec change:
        its key still works) they stay, and keep exempting it from the failure limits. (Ids
        of keys removed through another gateway go at this one's next directory refresh.)

        Regression (secrev16 fault B): ``forget`` dropped every tenant's cached key and the
        exemption of keys that passed lately, so a tenant that sent wrong secrets for another
        tenant's key id from their shared address and then rotated its own key had the other
        tenant refused RESOURCE_EXHAUSTED there. (A valid key now passes over the failure
        limit anyway: see the module docstring.)
        """
        for fp in [fp for fp, (tenant, _, _) in self._tenants.items() if tenant.spec.name == name]:
            del self._tenants[fp]
        if keys_gone:
            for key_id in list(self._known_by_owner.get(name, ())):
                self._unknow(key_id)

    def forget_tenant_id(self, tenant_id: str) -> None:
        """Drop the cached keys of the tenant whose id is ``tenant_id``, and its known key ids:
        admission answered that no such tenant exists (``tenant_deleted``, ``unknown_tenant``).

        Regression (secrev18 E residue): a key of a tenant deleted through another gateway (or
        before the scheduler restarted) stayed cached here for its TTL, each call refused at
        admission instead of at the key check."""
        gone = [(fp, tenant.spec.name) for fp, (tenant, _, _) in self._tenants.items() if tenant.tenant_id == tenant_id]
        for fp, _ in gone:
            del self._tenants[fp]
        for name in {name for _, name in gone}:
            for key_id in list(self._known_by_owner.get(name, ())):
                self._unknow(key_id)

    def forget_admin(self) -> None:
        """Drop the cached admin key (after the admin key changed); tenants' keys stay."""
        self._admins.clear()

    def _forget_key_ids(self, key_ids: set[str]) -> None:
        """Forget every key of ``key_ids`` (the key directory found them removed: a deleted
        tenant's or a rotated key's): known ids, cached tenant and admin keys."""
        for key_id in key_ids:
            self._unknow(key_id)
            self._suspects.cleared(key_id)
        for fp in [fp for fp, (_, _, key_id) in self._tenants.items() if key_id in key_ids]:
            del self._tenants[fp]
        for fp in [fp for fp, (_, key_id) in self._admins.items() if key_id in key_ids]:
            del self._admins[fp]

    def _cached_tenant(self, fp: bytes) -> Tenant | None:
        hit = self._tenants.get(fp)
        return hit[0] if hit is not None and hit[1] > self.clock() else None

    def _cached_admin(self, fp: bytes) -> bool:
        hit = self._admins.get(fp)
        return hit is not None and hit[0] > self.clock()

    def _remember_tenant(self, key: str, tenant: Tenant) -> None:
        self._tenants[fingerprint(key)] = (tenant, self.clock() + _CACHE_TTL_S, parse_key_id(key) or "")
        self._know(key, tenant.spec.name)

    def _know(self, key: str, owner: str) -> None:
        """Remember ``key``'s id as known here, with ``key``'s fingerprint (it just passed), as
        one of ``owner``'s (a tenant's name, or ``_ADMIN_OWNER``): each owner keeps its newest
        ``_KNOWN_IDS_PER_OWNER`` ids, and past ``_MAX_KNOWN_IDS`` in all the owner holding the
        most loses its oldest.

        Regression (secrev18 A): the known ids were one LRU of 65,536 for all tenants, so a
        tenant that rotated its own key 65,536 times evicted every other tenant's id, and a
        NAT-mate's 50 wrong keys then got the other tenant's valid key RESOURCE_EXHAUSTED. A
        tenant's keys now evict only its own ids.
        """
        key_id = parse_key_id(key)
        if key_id is None:
            return
        self._unknow(key_id)
        self._suspects.cleared(key_id)
        ids = self._known_by_owner.setdefault(owner, OrderedDict())
        ids[key_id] = None
        self._known[key_id] = (fingerprint(key), self.clock() + _KNOWN_ID_TTL_S, owner)
        while len(ids) > _KNOWN_IDS_PER_OWNER:
            self._unknow(next(iter(ids)))
        if len(self._known) > _MAX_KNOWN_IDS:
            self._shed_known()

    def _unknow(self, key_id: str) -> None:
        """Forget that ``key_id`` is known here (no-op when it is not)."""
        entry = self._known.pop(key_id, None)
        if entry is None:
            return
        ids = self._known_by_owner[entry[2]]
        del ids[key_id]
        if not ids:
            del self._known_by_owner[entry[2]]

    def _shed_known(self) -> None:
        """Bring the known ids back to ``_MAX_KNOWN_IDS``: expired ones first, then the oldest
        of the owner holding the most (never one owner's for another's, while any holds more)."""
        now = self.clock()
        for key_id in [k for k, (_, until, _) in self._known.items() if until <= now]:
            self._unknow(key_id)
        while len(self._known) > _MAX_KNOWN_IDS:
            largest = max(self._known_by_owner.values(), key=len)
            self._unknow(next(iter(largest)))

    async def _is_admin(self, key: str, allow_pbkdf2: bool) -> bool:
        """Ask the scheduler whether ``key`` is the admin key (cached when it is)."""
        if not await self.scheduler.verify_admin_key.remote(key, allow_pbkdf2=allow_pbkdf2):
            return False
        self._admins[fingerprint(key)] = (self.clock() + _CACHE_TTL_S, parse_key_id(key) or "")
        self._know(key, _ADMIN_OWNER)
        return True

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
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])

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

    def _known_fingerprint(self, key_id: str) -> bytes | None:
        """The fingerprint of the key of ``key_id`` that passed here lately, if any."""
        known = self._known.get(key_id)
        return known[0] if known is not None and known[1] > self.clock() else None

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
        context.set_trailing_metadata((("retry-after-ms", str(int(wait_s * 1000) + 1)),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{why}; retry in {wait_s:.0f} s")
