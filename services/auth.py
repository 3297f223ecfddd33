"""API-key authentication at the gateway, with a short-lived cache in front of the scheduler."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import grpc

from tenants.model import Tenant

_CACHE_TTL_S = 10.0


def bearer_key(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and value.startswith("Bearer "):
            return value[len("Bearer "):].strip()
    return ""


class Authenticator:
    """Resolves API keys to tenants and checks the admin key, via the GlobalScheduler."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._tenants: dict[bytes, tuple[Tenant, float]] = {}
        self._admins: dict[bytes, float] = {}

    @staticmethod
    def _fp(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    async def tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant; aborts the call with UNAUTHENTICATED otherwise."""
        key = bearer_key(context)
        fp, now = self._fp(key), time.monotonic()
        hit = self._tenants.get(fp)
        if hit and hit[1] > now:
            return hit[0]
        tenant = await self.scheduler.authenticate.remote(key) if key else None
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        self._tenants[fp] = (tenant, now + _CACHE_TTL_S)
        return tenant

    async def admin(self, context: grpc.aio.ServicerContext) -> None:
        """Aborts with UNAUTHENTICATED unless the call carries the admin key."""
        key = bearer_key(context)
        fp, now = self._fp(key), time.monotonic()
        if self._admins.get(fp, 0.0) > now:
            return
        if not key or not await self.scheduler.verify_admin_key.remote(key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the admin key")
        self._admins[fp] = now + _CACHE_TTL_S

    async def admin_or_tenant(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        """``None`` for the admin key, the calling tenant for a tenant key; aborts with
        UNAUTHENTICATED otherwise."""
        key = bearer_key(context)
        if key and self._admins.get(self._fp(key), 0.0) > time.monotonic():
            return None
        if key and await self.scheduler.verify_admin_key.remote(key):
            self._admins[self._fp(key)] = time.monotonic() + _CACHE_TTL_S
            return None
        return await self.tenant(context)

    def forget(self) -> None:
        """Drop every cached key (after a tenant's spec or keys, or the admin key, changed)."""
        self._tenants.clear()
        self._admins.clear()
