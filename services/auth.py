"""API-key authentication at the gateway, with short-lived caches in front of the scheduler.

- A key that worked is remembered for ``_CACHE_TTL_S``. A change of one tenant (its spec, its
  keys, its deletion) forgets that tenant's cached keys alone (``forget_tenant``); a new admin
  key forgets the cached admin key alone (``forget_admin``).
- A key that failed is remembered for ``_CACHE_TTL_S`` and refused with UNAUTHENTICATED
  without asking the scheduler.
- At most ``failures_per_peer_key`` failed checks per (client address, key id, role) in any
  ``failure_window_s``. Past that the address is over its limit for that key id: a key of that
  id is still checked, but with ``allow_pbkdf2=False`` (``tenants.store``: a SHA-256 row costs
  microseconds; an earlier version's PBKDF2 row is checked only if that key was verified since
  the scheduler started), and one that does not pass is refused with RESOURCE_EXHAUSTED (and a
  ``retry-after-ms`` trailer). So a flood of wrong secrets costs the scheduler at most a few
  PBKDF2 runs per address and key id, not one per attempt, and another client's failures from
  the same address (a NAT, a proxy) never lock out a valid key. Other key ids from the same
  address are not limited.

The client address is the connection's (gRPC's peer; for the HTTP API, uvicorn's client, which
honours X-Forwarded-For only from the proxies named in ``http_forwarded_allow_ips``).
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from tenants.keys import fingerprint, parse_key_id
from tenants.model import Tenant
from tenants.ratelimit import ExpiringSet, WindowLimiter

_CACHE_TTL_S = 10.0


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
        scheduler: the GlobalScheduler actor handle (``authenticate``, ``verify_admin_key``).
        failures_per_peer_key: failed checks allowed per (client address, key id) per window
            (>= 1).
        failure_window_s: that window, seconds (> 0).

    Raises:
        ValueError: ``failures_per_peer_key`` < 1 or ``failure_window_s`` <= 0.
    """

    def __init__(self, scheduler: Any, failures_per_peer_key: int = 10, failure_window_s: float = 10.0) -> None:
        self.scheduler = scheduler
        self.failures_per_peer_key = failures_per_peer_key
        self._tenants: dict[bytes, tuple[Tenant, float]] = {}
        self._admins: dict[bytes, float] = {}
        self._failed = ExpiringSet(_CACHE_TTL_S)
        self._failures = WindowLimiter(failures_per_peer_key, failure_window_s)

    async def tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant; aborts the call with UNAUTHENTICATED (RESOURCE_EXHAUSTED for a
        key that does not pass while its address is over the failure limit for its key id)
        otherwise."""
        key = bearer_key(context)
        fp, now = fingerprint(key), time.monotonic()
        hit = self._tenants.get(fp)
        if hit and hit[1] > now:
            return hit[0]
        wait_s = await self._refuse_known_bad(context, "tenant", key)
        tenant = await self.scheduler.authenticate.remote(key, allow_pbkdf2=wait_s == 0) if key else None
        if tenant is None:
            await self._refuse(context, "tenant", key, wait_s)
        self._tenants[fp] = (tenant, now + _CACHE_TTL_S)
        return tenant

    async def admin(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts unless the call carries the admin key: PERMISSION_DENIED for a tenant's own
        key (authenticated, not allowed; a fresh-user trial got UNAUTHENTICATED for its valid
        key), else UNAUTHENTICATED (or RESOURCE_EXHAUSTED, as ``tenant``)."""
        key = bearer_key(context)
        if self._admins.get(fingerprint(key), 0.0) > time.monotonic():
            return
        wait_s = await self._refuse_known_bad(context, "admin", key)
        if await self._is_admin(key, allow_pbkdf2=wait_s == 0):
            return
        if await self._is_tenant_key(key, allow_pbkdf2=wait_s == 0):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this call needs the admin key; a tenant's key may not make it")
        await self._refuse(context, "admin", key, wait_s)

    async def _is_tenant_key(self, key: str, allow_pbkdf2: bool) -> bool:
        hit = self._tenants.get(fingerprint(key))
        if hit is not None and hit[1] > time.monotonic():
            return True
        return bool(key) and await self.scheduler.authenticate.remote(key, allow_pbkdf2=allow_pbkdf2) is not None

    async def admin_or_tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """``None`` for the admin key, the calling tenant for a tenant key; aborts with
        UNAUTHENTICATED (or RESOURCE_EXHAUSTED) otherwise. The admin check spends no PBKDF2
        while the address is over its limit for the key id as either role (failures here
        count as the tenant role's)."""
        key = bearer_key(context)
        fp = fingerprint(key)
        if self._admins.get(fp, 0.0) > time.monotonic():
            return None
        if ("admin", fp) not in self._failed:
            over = self._wait_s(context, "admin", key) > 0 or self._wait_s(context, "tenant", key) > 0
            if await self._is_admin(key, allow_pbkdf2=not over):
                return None
        return await self.tenant(context)

    def forget_tenant(self, name: str) -> None:
        """Drop the cached keys of tenant ``name`` (after its spec or keys changed, or it was
        deleted); every other tenant's cached keys stay.

        Regression (secrev16 fault B): ``forget`` dropped every tenant's cached key and the
        exemption of keys that passed lately, so a tenant that sent wrong secrets for another
        tenant's key id from their shared address and then rotated its own key had the other
        tenant refused RESOURCE_EXHAUSTED there. (A valid key now passes over the failure
        limit anyway: see the module docstring.)
        """
        for fp in [fp for fp, (tenant, _) in self._tenants.items() if tenant.spec.name == name]:
            del self._tenants[fp]

    def forget_admin(self) -> None:
        """Drop the cached admin key (after the admin key changed); tenants' keys stay."""
        self._admins.clear()

    async def _is_admin(self, key: str, allow_pbkdf2: bool) -> bool:
        """Ask the scheduler whether ``key`` is the admin key (cached when it is)."""
        if not key or not await self.scheduler.verify_admin_key.remote(key, allow_pbkdf2=allow_pbkdf2):
            return False
        self._admins[fingerprint(key)] = time.monotonic() + _CACHE_TTL_S
        return True

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

    async def _refuse(self, context: grpc.aio.ServicerContext, role: str, key: str, wait_s: float) -> None:
        """Abort for a key that did not pass as ``role``: with RESOURCE_EXHAUSTED when it was
        checked over the failure limit (``wait_s`` > 0; without PBKDF2, so it may be valid: not
        remembered as failed), else record the failure and abort with UNAUTHENTICATED."""
        if wait_s > 0:
            await self._abort_over_limit(context, wait_s)
        self._failed.add((role, fingerprint(key)))
        self._failures.try_acquire((role, _peer_host(context), parse_key_id(key)))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])

    @staticmethod
    async def _abort_over_limit(context: grpc.aio.ServicerContext, wait_s: float) -> None:
        context.set_trailing_metadata((("retry-after-ms", str(int(wait_s * 1000) + 1)),))
        await context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"too many failed API-key checks from this address; retry in {wait_s:.0f} s",
        )
