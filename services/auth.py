"""API-key authentication at the gateway, with short-lived caches in front of the scheduler.

- A key that worked is remembered for ``_CACHE_TTL_S`` (``forget`` drops every cached key
  after a tenant or key changes).
- A key that failed is remembered for ``_CACHE_TTL_S`` and refused with UNAUTHENTICATED
  without asking the scheduler.
- At most ``failures_per_peer_key`` failed checks per (client address, key id, role) in any
  ``failure_window_s``; past that, keys of that id from that address are refused with
  RESOURCE_EXHAUSTED (and a ``retry-after-ms`` trailer) without asking the scheduler, so a
  flood of wrong secrets costs the scheduler a few PBKDF2 runs (``tenants.store`` bounds
  them per key id too), not one per attempt. Other key ids from the same address still work,
  and so does a key that passed a check within ``_KNOWN_GOOD_TTL_S`` (a flood of wrong secrets
  for a key id from a shared address cannot lock out the key's real holder there).
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from tenants.keys import fingerprint, parse_key_id
from tenants.model import Tenant
from tenants.ratelimit import ExpiringSet, WindowLimiter

_CACHE_TTL_S = 10.0
_KNOWN_GOOD_TTL_S = 900.0


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
        failures_per_peer_key: failed checks allowed per (client address, key id) per window.
        failure_window_s: that window, seconds.
    """

    def __init__(self, scheduler: Any, failures_per_peer_key: int = 10, failure_window_s: float = 10.0) -> None:
        self.scheduler = scheduler
        self.failures_per_peer_key = failures_per_peer_key
        self._tenants: dict[bytes, tuple[Tenant, float]] = {}
        self._admins: dict[bytes, float] = {}
        self._failed = ExpiringSet(_CACHE_TTL_S)
        self._known_good = ExpiringSet(_KNOWN_GOOD_TTL_S)  # (role, fingerprint) that passed lately
        self._failures = WindowLimiter(failures_per_peer_key, failure_window_s)

    async def tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant; aborts the call with UNAUTHENTICATED (RESOURCE_EXHAUSTED while
        its address is over the failure limit for that key id) otherwise."""
        key = bearer_key(context)
        fp, now = fingerprint(key), time.monotonic()
        hit = self._tenants.get(fp)
        if hit and hit[1] > now:
            return hit[0]
        await self._refuse_known_bad(context, "tenant", key)
        tenant = await self.scheduler.authenticate.remote(key) if key else None
        if tenant is None:
            await self._refuse(context, "tenant", key, _REFUSALS["tenant"])
        self._tenants[fp] = (tenant, now + _CACHE_TTL_S)
        self._known_good.add(("tenant", fp))
        return tenant

    async def admin(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts unless the call carries the admin key: PERMISSION_DENIED for a tenant's own
        key (authenticated, not allowed; a fresh-user trial got UNAUTHENTICATED for its valid
        key), else UNAUTHENTICATED (or RESOURCE_EXHAUSTED, as ``tenant``)."""
        key = bearer_key(context)
        if self._admins.get(fingerprint(key), 0.0) > time.monotonic():
            return
        await self._refuse_known_bad(context, "admin", key)
        if await self._is_admin(key):
            return
        if await self._is_tenant_key(key):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this call needs the admin key; a tenant's key may not make it")
        await self._refuse(context, "admin", key, _REFUSALS["admin"])

    async def _is_tenant_key(self, key: str) -> bool:
        hit = self._tenants.get(fingerprint(key))
        if hit is not None and hit[1] > time.monotonic():
            return True
        return bool(key) and await self.scheduler.authenticate.remote(key) is not None

    async def admin_or_tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """``None`` for the admin key, the calling tenant for a tenant key; aborts with
        UNAUTHENTICATED (or RESOURCE_EXHAUSTED) otherwise."""
        key = bearer_key(context)
        if (self._admins.get(fingerprint(key), 0.0) > time.monotonic()
                or (("admin", fingerprint(key)) not in self._failed and await self._is_admin(key))):
            return None
        return await self.tenant(context)

    def forget(self) -> None:
        """Drop every cached key (after a tenant's spec or keys, or the admin key, changed)."""
        self._tenants.clear()
        self._admins.clear()
        self._failed.clear()
        self._known_good.clear()

    async def _is_admin(self, key: str) -> bool:
        """Ask the scheduler whether ``key`` is the admin key (cached when it is)."""
        if not key or not await self.scheduler.verify_admin_key.remote(key):
            return False
        self._admins[fingerprint(key)] = time.monotonic() + _CACHE_TTL_S
        self._known_good.add(("admin", fingerprint(key)))
        return True

    async def _refuse_known_bad(self, context: grpc.aio.ServicerContext, role: str, key: str) -> None:
        """Abort, without asking the scheduler, for a key that failed lately as ``role``
        ("tenant" or "admin") or whose id this address has failed too often as ``role`` (unless
        the key itself passed lately: it is then checked again, as any key is)."""
        known_good = (role, fingerprint(key)) in self._known_good
        wait_s = 0.0 if known_good else self._failures.retry_after_s((role, _peer_host(context), parse_key_id(key)))
        if wait_s > 0:
            context.set_trailing_metadata((("retry-after-ms", str(int(wait_s * 1000) + 1)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many failed API-key checks from this address; retry in {wait_s:.0f} s",
            )
        if (role, fingerprint(key)) in self._failed:  # the message a first refusal gives
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSALS[role])

    async def _refuse(self, context: grpc.aio.ServicerContext, role: str, key: str, message: str) -> None:
        """Record a failed check of ``key`` as ``role``, then abort with UNAUTHENTICATED."""
        self._failed.add((role, fingerprint(key)))
        self._failures.try_acquire((role, _peer_host(context), parse_key_id(key)))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
