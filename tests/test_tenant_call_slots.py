"""One tenant's control calls in flight at a gateway are bounded (``services.tenant_call_slots``).

Regression (security review s33, suspicion 1, confirmed here): nothing bounded how many
``GetTenant``/``GetUsage``/``RotateKey``/``CloseSession`` calls one tenant kept in flight, each
several actor calls on the scheduler's event loop (``GetUsage`` one on every node too), so a
client sending them without waiting queued the scheduler's loop that admits every tenant's
requests. Past ``TENANT_CALLS_IN_FLIGHT`` in flight a tenant's call is refused
RESOURCE_EXHAUSTED with a retry hint before it reaches the scheduler; other tenants and the
admin key are not affected, and the slots come back as the calls end.

Real ``GlobalSchedulerService`` and tenant store on disk, behind ``LocalActor``; its
``usage_of`` and ``close_session`` are held (an ``asyncio.Event``) to keep calls in flight.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from kvstrata.v1 import tenant_pb2
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.gateway_admin import TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from services.tenant_call_slots import TENANT_CALLS_IN_FLIGHT, TenantCallSlots
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor
from tests.test_auth_flood import _Aborted, _Ctx


class HeldScheduler:
    """The scheduler, with ``usage_of`` and ``close_session`` waiting for ``release`` and
    counting how many reached it."""

    def __init__(self, sched: GlobalSchedulerService) -> None:
        self.sched, self.release, self.reached = sched, asyncio.Event(), 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.sched, attr)

    async def usage_of(self, tenant_id: str) -> Any:
        self.reached += 1
        await self.release.wait()
        return self.sched.usage_of(tenant_id)

    async def close_session(self, session_id: str, tenant_id: str, key_id: str = "") -> Any:
        self.reached += 1
        await self.release.wait()
        return None


async def _code(call: Any) -> tuple[grpc.StatusCode, int | None]:
    try:
        await call
    except _Aborted as err:
        return err.code, err.retry_after_ms
    return grpc.StatusCode.OK, None


def test_a_tenants_control_calls_in_flight_are_bounded_and_others_pass(tmp_path: Path) -> None:
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    admin_key = sched.store.ensure_admin_key()
    assert admin_key is not None

    async def run() -> None:
        held = HeldScheduler(sched)
        auth = Authenticator(LocalActor(held))
        tenants = TenantServicer(LocalActor(held), auth)
        (_, ann), (_, bob) = [await sched.register_tenant(TenantSpec(name)) for name in ("ann", "bob")]

        def usage(name: str, key: str) -> Any:
            return tenants.GetUsage(tenant_pb2.GetUsageRequest(name=name), _Ctx(key))

        for name, key in (("ann", ann), ("bob", bob), ("ann", admin_key)):  # the keys known here
            await tenants.GetTenant(tenant_pb2.GetTenantRequest(name=name), _Ctx(key))
        waiting = [asyncio.ensure_future(usage("ann", ann)) for _ in range(TENANT_CALLS_IN_FLIGHT)]
        while held.reached < TENANT_CALLS_IN_FLIGHT:
            await asyncio.sleep(0.01)
        refused = [await _code(usage("ann", ann)) for _ in range(50)]
        assert refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED, 1000)] * 50
        rotate = tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), _Ctx(ann))
        assert (await _code(rotate))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert held.reached == TENANT_CALLS_IN_FLIGHT  # none of the refused reached the scheduler
        others = [asyncio.ensure_future(usage("bob", bob)), asyncio.ensure_future(usage("ann", admin_key))]
        while held.reached < TENANT_CALLS_IN_FLIGHT + 2:  # another tenant's and the admin's go on
            await asyncio.sleep(0.01)
        held.release.set()
        for call in [*waiting, *others]:
            assert (await call).usage is not None
        assert tenants.slots.held == {} and tenants.slots.refused == 51
        assert (await _code(usage("ann", ann)))[0] == grpc.StatusCode.OK  # the slots came back

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        sched.close_data_plane()
        sched.store.close()


def test_a_tenants_close_session_calls_in_flight_are_bounded(tmp_path: Path) -> None:
    """``CloseSession`` (gRPC, and the HTTP API's DELETE /v1/sessions/{id}) the same way."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})

    async def run() -> None:
        held = HeldScheduler(sched)
        (ann_t, ann), (_, bob) = [await sched.register_tenant(TenantSpec(name)) for name in ("ann", "bob")]
        servicer = InferenceServicer.__new__(InferenceServicer)  # only close_session's parts
        servicer.scheduler, servicer.auth, servicer.nodes = LocalActor(held), Authenticator(LocalActor(held)), {}
        servicer.close_slots = TenantCallSlots()
        for key in (ann, bob):  # the keys known here
            await servicer.auth.tenant(_Ctx(key))
        waiting = [asyncio.ensure_future(servicer.close_session(_Ctx(ann), f"s{i}"))
                   for i in range(TENANT_CALLS_IN_FLIGHT)]
        while held.reached < TENANT_CALLS_IN_FLIGHT:
            await asyncio.sleep(0.01)
        assert await _code(servicer.close_session(_Ctx(ann), "one-more")) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                                               1000)
        bobs = asyncio.ensure_future(servicer.close_session(_Ctx(bob), "s0"))
        while held.reached < TENANT_CALLS_IN_FLIGHT + 1:
            await asyncio.sleep(0.01)
        held.release.set()
        for call in [*waiting, bobs]:  # no such sessions: NOT_FOUND once they reach the scheduler
            assert (await _code(call))[0] == grpc.StatusCode.NOT_FOUND
        assert servicer.close_slots.held == {} and ann_t.tenant_id

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        sched.close_data_plane()
        sched.store.close()
