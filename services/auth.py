"""API-key authentication at the gateway, with short-lived caches in front of the scheduler.

- A key that worked is remembered for ``_CACHE_TTL_S``. A change of one tenant (its spec, its
  keys, its deletion) forgets that tenant's cached keys alone (``forget_tenant``); a new admin
  key forgets the cached admin key alone (``forget_admin``).
- So a key deleted or rotated away through *another* gateway may pass here from the cache for
  up to ``_CACHE_TTL_S`` (until the key directory's next refresh, below, forgets it sooner).
  The calls that change state or reach a tenant by name (``services.gateway_admin``) therefore
  confirm their key at the scheduler past the cache (``recheck``), by tenant id, never by name;
  an inference request's admission, and a session's close, carry its key's id, and the
  scheduler refuses one rotated away or removed through it (UNAUTHENTICATED ``key_revoked``,
  or ``StaleKeyError`` on a close: ``TenantStore.key_removed``), this gateway then forgetting
  the tenant's cached keys.
- A cached key holds its ``Tenant``, spec included, so a spec changed through another gateway
  is also up to ``_CACHE_TTL_S`` old here. An admission carries the digest of the spec the
  request was prepared with (``tenants.model.spec_digest``); the scheduler refuses a stale one
  (``tenant_changed``), and ``services.gateway`` forgets the tenant's cached keys
  (``forget_tenant_id`` without ``keys_gone``), authenticates the key again and prepares the
  request anew. What the HTTP API reads of the spec before admission (``OpenAIEdge.model_card``:
  ``max_model_len``) may stay that old (docs/architecture.md, "API keys").
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
  id is still checked, but with ``allow_pbkdf2=False`` (``tenants.store_keys``: a SHA-256 row
  costs microseconds; an earlier version's PBKDF2 row is checked only if that key was verified
  since the scheduler started), and one that does not pass is refused with RESOURCE_EXHAUSTED
  (and a ``retry-after-ms`` trailer). So a flood of wrong secrets costs the scheduler at most a few
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

``Authenticator`` is here with its checks and its cache of keys that passed; the key ids known
here and the forgetting of cached keys are ``services.auth_known.KnownKeys``, the refusals
made without a check and the budgets of checks ``services.auth_limits.CheckLimits``, the key
directory and the suspect key ids ``services.key_ids``.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc

from services import scheduler_replies as replies
from services.auth_header import bearer_key
from services.auth_known import _ADMIN_OWNER, KnownKeys
from services.auth_limits import CheckLimits
from services.key_ids import SUSPECT_TTL_S, KeyDirectory, SuspectKeyIds
from services.store_failures import abort_store_failure
from tenants.keys import fingerprint, parse_key_id
from tenants.model import Tenant
from tenants.ratelimit import ExpiringSet, WindowLimiter

log = logging.getLogger(__name__)


_CACHE_TTL_S = 10.0


class Authenticator(KnownKeys, CheckLimits):
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
        self._forgets = 0  # forgettings so far: a check that saw one begin after it caches nothing
        self.directory = KeyDirectory(scheduler, directory_refreshes_per_s, self._forget_key_ids)
        self.on_keys_gone = None  # the gateway's key watch, once it has one (``KnownKeys._keys_gone``)

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
        tenant, since = None, self._forgets
        try:
            async with self._check_slot(context, "tenant", key, wait_s) as unknown:
                tenant = await self._authenticate(context, key, allow_pbkdf2=wait_s == 0)
            if tenant is not None:
                self._remember_tenant(key, tenant, since)
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
                if await self._is_admin(context, key, allow_pbkdf2=wait_s == 0):
                    return
                is_tenant = await self._is_tenant_key(context, key, allow_pbkdf2=wait_s == 0)
        if is_tenant:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this call needs the admin key; a tenant's key may not make it")
        await self._refuse(context, "admin", key, wait_s, unknown)

    async def _authenticate(self, context: grpc.aio.ServicerContext, key: str, **kwargs: Any) -> Tenant | None:
        """The scheduler's ``authenticate(key, **kwargs)``: ``key``'s tenant, None for no
        tenant's key; a malformed reply aborts the call INTERNAL (``scheduler_replies``).
        Regression (s38): a reply that was not a tenant record was cached as one, and the call
        (and every call with the key for ``_CACHE_TTL_S``) failed UNKNOWN."""
        try:
            reply = await self.scheduler.authenticate.remote(api_key=key, **kwargs)
        except sqlite3.Error as exc:
            await abort_store_failure(context, "authenticate", exc)  # (s40 diff review r7 of 01ed7ce:
            # it was raised out of the key check, failing the call UNKNOWN with a remote traceback)
        return await replies.answer(context, "authenticate", reply, replies.tenant_or_none)

    async def _verify_admin_key(self, context: grpc.aio.ServicerContext, key: str, **kwargs: Any) -> bool:
        """The scheduler's ``verify_admin_key(key, **kwargs)``, a bool; any other reply aborts the
        call INTERNAL. Regression (s38): its truth was taken, so a reply of ``"False"`` or ``1``
        (a version skew, a bug) passed any key as the admin key."""
        try:
            reply = await self.scheduler.verify_admin_key.remote(key=key, **kwargs)
        except sqlite3.Error as exc:
            await abort_store_failure(context, "verify_admin_key", exc)
        return await replies.answer(context, "verify_admin_key", reply, replies.verdict)

    async def _is_tenant_key(self, context: grpc.aio.ServicerContext, key: str, allow_pbkdf2: bool) -> bool:
        since = self._forgets
        tenant = await self._authenticate(context, key, allow_pbkdf2=allow_pbkdf2)
        if tenant is not None:
            self._remember_tenant(key, tenant, since)
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
        since = self._forgets
        async with self._check_slot(context, "tenant", key, wait_s) as unknown:
            if try_admin and await self._is_admin(context, key, allow_pbkdf2=not over):
                return None
            if try_tenant:
                tenant = await self._authenticate(context, key, allow_pbkdf2=wait_s == 0)
        if tenant is None:
            if unknown:  # a failed check of an unknown key id, whichever refusal follows
                self._count_unknown_failure(context, key)
            if not try_tenant:
                await self._refuse_known_bad(context, "tenant", key)
            await self._refuse(context, "tenant", key, wait_s)
        self._remember_tenant(key, tenant, since)
        return tenant

    async def recheck(self, context: grpc.aio.ServicerContext, caller: Tenant | None) -> Tenant | None:
        """Confirm at the scheduler now, past this gateway's caches, that the call's key (which
        passed ``admin``, ``tenant`` or ``admin_or_tenant`` here, maybe from the cache) is still
        ``caller``'s: the admin key for None, else a key of the tenant whose id is
        ``caller.tenant_id`` (the id, not the name: a tenant deleted and registered again
        under its name is another tenant). Returns the tenant as stored now (None for the
        admin key). A key no longer valid (rotated away, its tenant deleted, through this
        gateway or another) is forgotten here (its cached success and known id) and the call
        aborted UNAUTHENTICATED.

        For the calls that change state or reach a tenant by name (``services.gateway_admin``):
        a key cached here stays valid for up to ``_CACHE_TTL_S`` after a change made at another
        gateway, which is only told at its next key-directory refresh. Regression (session 32
        review, cross-tenant takeover): within that window a deleted tenant's key read and
        rotated the key of a new tenant registered under its name, and a leaked key rotated
        away by its owner rotated the tenant's key again.
        """
        key = bearer_key(context)
        if caller is None:
            fresh, ok = None, await self._verify_admin_key(context, key)
        else:
            fresh = await self._authenticate(context, key)
            ok = fresh is not None and fresh.tenant_id == caller.tenant_id
        if not ok:
            self.forget_key(key)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "this key is no longer valid: it was rotated away or its tenant deleted "
                                "(at this or another gateway)")
        return fresh

    def is_verified(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call's key passed a check here lately (a cached tenant or admin key)."""
        fp = fingerprint(bearer_key(context))
        return self._cached_tenant(fp) is not None or self._cached_admin(fp)

    async def refuse_unknown_key(self, context: grpc.aio.ServicerContext, role: str) -> None:
        """Abort with UNAUTHENTICATED (``role``'s message: "tenant" or "admin") a call whose key
        is missing, malformed, or of an id that exists nowhere (``_refuse_malformed``,
        ``_refuse_absent``), asking the scheduler nothing; returns for any other key (its
        handler's ``tenant``/``admin`` check follows). Regression (secrev19 H5): the gateway's
        interceptor (``services.grpc_call_gate.CallGate``) runs this on a call's headers, before
        its request message, which a keyless call held unchecked by never sending."""
        if self.is_verified(context):
            return
        key = bearer_key(context)
        await self._refuse_malformed(context, role, key)
        await self._refuse_absent(context, role, key)

    def _cached_tenant(self, fp: bytes) -> Tenant | None:
        hit = self._tenants.get(fp)
        return hit[0] if hit is not None and hit[1] > self.clock() else None

    def _cached_admin(self, fp: bytes) -> bool:
        hit = self._admins.get(fp)
        return hit is not None and hit[0] > self.clock()

    def _remember_tenant(self, key: str, tenant: Tenant, since: int) -> None:
        """Cache ``key`` as ``tenant``'s for ``_CACHE_TTL_S`` and know its id, unless a key or
        tenant was forgotten since its check began (``since``: ``_forgets`` then).

        Regression (review 23d, rotation race): a check in flight at the scheduler when its
        key was rotated away (or its tenant deleted or changed) answered with the old state
        after ``forget_tenant`` ran, and cached the rotated-away key for ``_CACHE_TTL_S``. The
        call that asked still gets that answer (its check began first); nothing is cached.
        """
        if since != self._forgets:
            return
        self._tenants[fingerprint(key)] = (tenant, self.clock() + _CACHE_TTL_S, parse_key_id(key) or "")
        self._know(key, tenant.spec.name)

    async def _is_admin(self, context: grpc.aio.ServicerContext, key: str, allow_pbkdf2: bool) -> bool:
        """Ask the scheduler whether ``key`` is the admin key (cached when it is, unless a key
        was forgotten meanwhile: ``_remember_tenant``)."""
        since = self._forgets
        if not await self._verify_admin_key(context, key, allow_pbkdf2=allow_pbkdf2):
            return False
        if since != self._forgets:
            return True
        self._admins[fingerprint(key)] = (self.clock() + _CACHE_TTL_S, parse_key_id(key) or "")
        self._know(key, _ADMIN_OWNER)
        return True
