"""A bound on one tenant's control calls in flight at one gateway (``TenantCallSlots``).

A tenant's control calls (TenantService's ``GetTenant``, ``GetUsage`` and ``RotateKey``; the
inference services' ``CloseSession``) each cost the global scheduler several actor calls (the
key's recheck, the lookup, the read or change), and ``GetUsage`` one call on every cache node.
Regression (security review s33, suspicion 1): nothing bounded how many of them one tenant kept
in flight, so a client sending them without waiting queued thousands of actor calls on the
scheduler's event loop, the loop that admits every tenant's requests. Past ``limit`` in flight a
tenant's call is refused RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailer, before it costs
the scheduler anything; the admin key's calls are not counted. ``Generate`` has its own bound
(``max_streams_per_tenant``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

TENANT_CALLS_IN_FLIGHT = 32
"""Control calls one tenant may have in flight at one gateway (``TenantCallSlots``)."""

SLOT_RETRY_S = 1.0
"""The ``retry-after-ms`` hint of a call refused for want of a slot."""


class TenantCallSlots:
    """Counts each tenant's control calls in flight here; ``refused`` counts the calls turned
    away.

    Args:
        limit: calls one tenant may have in flight at once (>= 1).

    Raises:
        ValueError: ``limit`` < 1.
    """

    def __init__(self, limit: int = TENANT_CALLS_IN_FLIGHT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.held: dict[str, int] = {}
        self.refused = 0

    @contextlib.asynccontextmanager
    async def hold(self, context: Any, tenant_id: str) -> AsyncIterator[None]:
        """Hold one of ``tenant_id``'s slots while the block runs; with none free, end the call
        (``context.abort``) RESOURCE_EXHAUSTED with the ``SLOT_RETRY_S`` hint."""
        held = self.held.get(tenant_id, 0)
        if held >= self.limit:
            self.refused += 1
            context.set_trailing_metadata((("retry-after-ms", str(int(SLOT_RETRY_S * 1000))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the tenant has {self.limit} control calls in flight at this gateway: "
                                "wait for one to end")
        self.held[tenant_id] = held + 1
        try:
            yield
        finally:
            left = self.held[tenant_id] - 1
            if left:
                self.held[tenant_id] = left
            else:
                del self.held[tenant_id]
