"""A key rotated away through one gateway closes no session at another gateway that still has
it cached (review s35 C, C1).

The fault: ``InferenceServicer.close_session`` (gRPC ``CloseSession`` and HTTP
``DELETE /v1/sessions/{id}``) authenticated from the gateway's 10-s key cache alone and told
the scheduler nothing of the key, so a leaked key its owner had rotated away at gateway 1 still
closed the owner's sessions at gateway 2 (their KV freed on the node). Now the close carries the
key's id, the scheduler refuses a removed one as admission does (``StaleKeyError``:
UNAUTHENTICATED), and gateway 2 forgets the key.

Real ``GlobalSchedulerService`` and tenant store on disk; two gateways' ``Authenticator``s; the
session's cache node is a stand-in that records what it is asked to close.
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
from services.gateway_inputs import session_scope
from services.global_scheduler_admission import GlobalSchedulerService
from services.tenant_call_slots import TenantCallSlots
from tenants.keys import fingerprint
from tests.gateway_harness import LocalActor
from tests.test_auth_flood import _Ctx


class _Node:
    """The session's cache node: records each close it is asked for."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    def close_session(self, session_id: str, tenant: str, turns: list[str]) -> int:
        self.closed.append(session_id)
        return 1234


def _close_servicer(sched: GlobalSchedulerService, node: _Node) -> InferenceServicer:
    """A gateway's InferenceServicer with only ``close_session``'s parts (as
    tests/test_gateway_close_session.py builds it), with a key cache of its own."""
    servicer = InferenceServicer.__new__(InferenceServicer)
    servicer.scheduler, servicer.auth = LocalActor(sched), Authenticator(LocalActor(sched))
    servicer.nodes, servicer.close_slots = {"n0": LocalActor(node)}, TenantCallSlots()
    return servicer


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code.name)
        self.code, self.details = code, details


class _DetailCtx(_Ctx):
    """``_Ctx`` whose refusal keeps its details."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)


async def _close(servicer: InferenceServicer, key: str, session: str) -> tuple[grpc.StatusCode, Any]:
    try:
        return grpc.StatusCode.OK, await servicer.close_session(_DetailCtx(key, "198.51.100.9"), session)
    except _Refused as err:
        return err.code, err.details


def test_a_rotated_away_key_cached_at_another_gateway_closes_no_session(tmp_path: Path) -> None:
    """bob's key leaks and is used at gateway 2 (cached there); bob rotates it away at gateway 1.
    Old code: the leaked key closed bob's session "chat-1" at gateway 2 (the node freed it).
    Now that close is UNAUTHENTICATED, gateway 2 has forgotten the key, the session's route is
    still there, and bob's new key closes it at gateway 2."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    node = _Node()

    async def run() -> tuple[list[tuple[grpc.StatusCode, Any]], bool, bool]:
        admin = sched.store.ensure_admin_key()
        g1 = TenantServicer(LocalActor(sched), Authenticator(LocalActor(sched)))
        g2 = _close_servicer(sched, node)
        reg = await g1.RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="bob")), _Ctx(admin))
        leaked, tenant_id = reg.api_key, reg.tenant.tenant_id
        sched.route_unconfirmed(tenant_id, session_scope(tenant_id, "", "chat-1"), "n0")  # bob's session on n0
        results = [await _close(g2, leaked, "nope")]  # the attacker's first use at gateway 2: cached there
        cached = g2.auth._cached_tenant(fingerprint(leaked)) is not None
        owners = (await g1.RotateKey(tenant_pb2.RotateKeyRequest(name="bob"), _Ctx(leaked))).api_key
        results.append(await _close(g2, leaked, "chat-1"))
        forgotten = g2.auth._cached_tenant(fingerprint(leaked)) is None
        results.append(await _close(g2, owners, "chat-1"))
        return results, cached, forgotten

    try:
        results, cached, forgotten = asyncio.run(run())
    finally:
        sched.store.close()

    assert cached
    assert results[0][0] == grpc.StatusCode.NOT_FOUND
    assert results[1][0] == grpc.StatusCode.UNAUTHENTICATED and "no longer valid" in results[1][1], results[1]
    assert forgotten
    assert results[2] == (grpc.StatusCode.OK, 1234)  # the owner's close, after the refused one
    assert len(node.closed) == 1


def test_the_scheduler_refuses_a_removed_key_id_on_close(tmp_path: Path) -> None:
    """``close_session`` with a removed key's id raises ``StaleKeyError`` and changes nothing;
    with the current key's id, or none, it closes."""
    import pytest

    from tenants.errors import StaleKeyError
    from tenants.keys import parse_key_id
    from tenants.model import TenantSpec

    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    try:
        ann, key = asyncio.run(sched.register_tenant(TenantSpec("ann")))
        new = asyncio.run(sched.rotate_tenant_key("ann"))
        sched.route_unconfirmed(ann.tenant_id, "ann/s", "n0")
        with pytest.raises(StaleKeyError):
            sched.close_session("ann/s", ann.tenant_id, parse_key_id(key))
        assert "ann/s" in sched.session_nodes
        assert sched.close_session("ann/s", ann.tenant_id, parse_key_id(new)) == ("n0", [])
        sched.route_unconfirmed(ann.tenant_id, "ann/s2", "n0")
        assert sched.close_session("ann/s2", ann.tenant_id) == ("n0", [])
    finally:
        sched.store.close()
