"""A key deleted or rotated away through one gateway, still in another gateway's key cache, never
reaches a tenant it is not a current key of (session 32 review: cross-tenant takeover).

The fault: each gateway's ``Authenticator`` caches a key that passed for ``_CACHE_TTL_S`` (10 s)
and only the gateway that made a change forgets it; the others learn at their next key-directory
refresh. ``TenantServicer`` matched a tenant's own calls by *name* and the scheduler rotated by
name without looking at the calling key. So, within those seconds, at a second gateway:

- A: the key of a deleted tenant "alice" read the usage of a new tenant registered as "alice"
  and rotated its key (taking the tenant: the new owner's key stopped working);
- B: a leaked key its owner had just rotated away at the first gateway rotated again, leaving
  the attacker's key valid and the owner's not.

Now every tenant-service call and every state-changing admin call is confirmed at the scheduler
past the cache (``Authenticator.recheck``), a tenant's own calls go by tenant id, and a rotation
is a compare-and-swap in the store on the presented key's id (tenant and admin keys alike).

Real ``GlobalSchedulerService`` and tenant store on disk; two ``TenantServicer`` /
``AdminServicer`` pairs, each with its own ``Authenticator``, are the two gateways.
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstrata.v1 import admin_pb2, tenant_pb2
from services.auth import Authenticator
from services.gateway_admin import AdminServicer, TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from tenants import errors
from tenants.keys import fingerprint, parse_key_id
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor
from tests.test_auth_flood import _Aborted, _Ctx


class _Gateway:
    """One gateway's tenant and admin servicers, with their own key cache."""

    def __init__(self, scheduler: GlobalSchedulerService) -> None:
        self.auth = Authenticator(LocalActor(scheduler))
        self.tenants = TenantServicer(LocalActor(scheduler), self.auth)
        self.admin = AdminServicer(LocalActor(scheduler), self.auth, {})

    def cached(self, key: str) -> bool:
        return self.auth._cached_tenant(fingerprint(key)) is not None or self.auth._cached_admin(fingerprint(key))


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except _Aborted as err:
        return err.code
    return grpc.StatusCode.OK


def _setup(tmp_path: Path) -> tuple[GlobalSchedulerService, str, _Gateway, _Gateway]:
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key()
    assert admin_key is not None
    return scheduler, admin_key, _Gateway(scheduler), _Gateway(scheduler)


def test_a_deleted_tenants_cached_key_never_reaches_a_new_tenant_of_its_name(tmp_path: Path) -> None:
    """Repro A: alice's key is cached at gateway 2; the admin deletes alice and registers a new
    alice at gateway 1. Old code: the old key, at gateway 2, read the new alice's usage and
    rotated her key (its result authenticated as the new tenant; her own key stopped working).
    Now each of GetTenant, GetUsage and RotateKey is UNAUTHENTICATED, the new tenant's key is
    untouched, and gateway 2 has forgotten the old key."""
    scheduler, admin_key, g1, g2 = _setup(tmp_path)
    spec = tenant_pb2.TenantSpec(name="alice")

    async def run() -> tuple[str, str, list[grpc.StatusCode]]:
        old = await g1.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), _Ctx(admin_key))
        await g2.tenants.GetTenant(tenant_pb2.GetTenantRequest(name="alice"), _Ctx(old.api_key))
        assert g2.cached(old.api_key)  # as on the old code: within the 10-s cache
        await g1.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="alice"), _Ctx(admin_key))
        new = await g1.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), _Ctx(admin_key))
        assert new.tenant.tenant_id != old.tenant.tenant_id
        codes = [await _code(g2.tenants.GetUsage(tenant_pb2.GetUsageRequest(name="alice"), _Ctx(old.api_key))),
                 await _code(g2.tenants.GetTenant(tenant_pb2.GetTenantRequest(name="alice"), _Ctx(old.api_key))),
                 await _code(g2.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="alice"), _Ctx(old.api_key)))]
        assert not g2.cached(old.api_key)
        return old.api_key, new.api_key, codes

    old_key, new_key, codes = asyncio.run(run())

    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    assert scheduler.store.authenticate(old_key) is None
    new_tenant = scheduler.store.authenticate(new_key)
    assert new_tenant is not None and new_tenant.spec.name == "alice"  # the new owner's key still works


def test_a_rotated_away_key_cannot_rotate_again_at_another_gateway(tmp_path: Path) -> None:
    """Repro B: a leaked key is cached at gateway 2; its owner rotates it away at gateway 1.
    Old code: the leaked key rotated again at gateway 2 (owner's new key invalid, attacker's
    valid). Now the leaked key's RotateKey, GetTenant and GetUsage there are UNAUTHENTICATED and
    the owner's key stays the only one."""
    scheduler, admin_key, g1, g2 = _setup(tmp_path)

    async def run() -> tuple[str, list[grpc.StatusCode]]:
        reg = await g1.tenants.RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="bob")), _Ctx(admin_key))
        leaked = reg.api_key
        await g2.tenants.GetTenant(tenant_pb2.GetTenantRequest(name="bob"), _Ctx(leaked))  # the attacker, at G2
        owners = (await g1.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="bob"), _Ctx(leaked))).api_key
        assert g2.cached(leaked)
        codes = [await _code(g2.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="bob"), _Ctx(leaked))),
                 await _code(g2.tenants.GetTenant(tenant_pb2.GetTenantRequest(name="bob"), _Ctx(leaked))),
                 await _code(g2.tenants.GetUsage(tenant_pb2.GetUsageRequest(name="bob"), _Ctx(leaked)))]
        assert not g2.cached(leaked)
        # the owner's new key works at either gateway, its own rotation too
        again = (await g2.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="bob"), _Ctx(owners))).api_key
        return again, codes

    owners, codes = asyncio.run(run())

    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3
    tenant = scheduler.store.authenticate(owners)
    assert tenant is not None and tenant.spec.name == "bob"
    assert set(scheduler.store.key_ids_since("", -1).added) == {parse_key_id(admin_key), parse_key_id(owners)}


def test_a_rotated_away_admin_key_is_refused_at_another_gateway(tmp_path: Path) -> None:
    """The same kind for the admin key: rotated at gateway 1, the old admin key cached at
    gateway 2 neither rotates the admin key back (which would take it), nor registers, deletes,
    lists tenants, rotates a tenant's key, flushes or drains there (UNAUTHENTICATED); the new
    admin key works at both."""
    scheduler, admin_key, g1, g2 = _setup(tmp_path)
    _, ann_key = scheduler.store.register(TenantSpec("ann"))

    async def run() -> tuple[str, list[grpc.StatusCode]]:
        await g2.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), _Ctx(admin_key))
        new_admin = (await g1.admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), _Ctx(admin_key))).api_key
        assert g2.cached(admin_key)
        old = _Ctx(admin_key)
        codes = [
            await _code(g2.admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), old)),
            await _code(g2.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), _Ctx(admin_key))),
            await _code(g2.tenants.RegisterTenant(
                tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="mallory")), _Ctx(admin_key))),
            await _code(g2.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="ann"), _Ctx(admin_key))),
            await _code(g2.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), _Ctx(admin_key))),
            await _code(g2.admin.Flush(admin_pb2.FlushRequest(), _Ctx(admin_key))),
            await _code(g2.admin.Drain(admin_pb2.DrainRequest(), _Ctx(admin_key))),
        ]
        assert await _code(g2.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), _Ctx(new_admin))) \
            == grpc.StatusCode.OK
        return new_admin, codes

    new_admin, codes = asyncio.run(run())

    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 7
    assert scheduler.store.verify_admin_key(new_admin) and not scheduler.store.verify_admin_key(admin_key)
    assert scheduler.store.authenticate(ann_key) is not None  # not rotated, not deleted
    assert [t.spec.name for t in scheduler.store.list()] == ["ann"]


def test_rotation_is_a_compare_and_swap_on_the_callers_key(tmp_path: Path) -> None:
    """The store rotates a tenant's own key only while the presented key id is still one of that
    tenant's, and ``name`` still that tenant (same transaction), so a rotation racing another
    (both checked before either committed) or a re-registration changes nothing; the admin key
    likewise. ``StaleKeyError`` (UNAUTHENTICATED) names what happened, nothing is written."""
    scheduler, admin_key, _, _ = _setup(tmp_path)
    store = scheduler.store
    ann, key = store.register(TenantSpec("ann"))
    first = store.rotate_key("ann", tenant_id=ann.tenant_id, key_id=parse_key_id(key))  # checked: ok
    with pytest.raises(errors.StaleKeyError):  # a second rotation by the same (now rotated-away) key id
        store.rotate_key("ann", tenant_id=ann.tenant_id, key_id=parse_key_id(key))
    assert store.authenticate(first) == ann
    store.delete("ann")
    ann2, key2 = store.register(TenantSpec("ann"))
    with pytest.raises(errors.StaleKeyError):  # the deleted ann's id, and a key id the new ann has
        store.rotate_key("ann", tenant_id=ann.tenant_id, key_id=parse_key_id(key2))
    with pytest.raises(errors.StaleKeyError):  # no tenant of the name at all: the caller's is gone
        store.rotate_key("nobody", tenant_id=ann.tenant_id, key_id=parse_key_id(key2))
    with pytest.raises(errors.TenantNotFoundError):  # the admin's rotation keeps its NOT_FOUND
        store.rotate_key("nobody")
    assert store.authenticate(key2) == ann2

    new_admin = store.rotate_admin_key(key_id=parse_key_id(admin_key))
    with pytest.raises(errors.StaleKeyError):
        store.rotate_admin_key(key_id=parse_key_id(admin_key))
    assert store.verify_admin_key(new_admin)


def test_the_scheduler_checks_the_presented_key_itself(tmp_path: Path) -> None:
    """``rotate_tenant_key`` with a tenant's key checks that key at the scheduler (no gateway
    cache): a wrong or stale key is ``StaleKeyError``, another tenant's ``NotOwnTenantError``;
    ``get_tenant`` with the caller's tenant id refuses a tenant of that name with another id;
    ``rotate_admin_key`` with a key that is not the admin key rotates nothing. The errors survive
    Ray's pickling with their type and text."""
    scheduler, admin_key, _, _ = _setup(tmp_path)
    ann, ann_key = asyncio.run(scheduler.register_tenant(TenantSpec("ann")))
    _, bob_key = asyncio.run(scheduler.register_tenant(TenantSpec("bob")))

    with pytest.raises(errors.NotOwnTenantError):
        asyncio.run(scheduler.rotate_tenant_key("ann", api_key=bob_key))
    new = asyncio.run(scheduler.rotate_tenant_key("ann", api_key=ann_key))
    with pytest.raises(errors.StaleKeyError):
        asyncio.run(scheduler.rotate_tenant_key("ann", api_key=ann_key))
    assert scheduler.store.authenticate(new) == ann and scheduler.store.authenticate(bob_key) is not None
    assert scheduler.get_tenant("ann", tenant_id=ann.tenant_id) == ann
    with pytest.raises(errors.StaleKeyError):
        scheduler.get_tenant("bob", tenant_id=ann.tenant_id)
    with pytest.raises(errors.StaleKeyError):
        asyncio.run(scheduler.rotate_admin_key(api_key=bob_key))
    assert scheduler.store.verify_admin_key(admin_key)
    for err in (errors.StaleKeyError("ann"), errors.StaleKeyError(""), errors.NotOwnTenantError("bob")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.name == err.name


def test_a_deleted_tenants_cached_key_is_refused_at_admission(tmp_path: Path) -> None:
    """The inference path (gRPC and HTTP share ``Authenticator.tenant``): the deleted alice's
    key, cached at gateway 2, still resolves there to the deleted tenant's *id*, never to the new
    alice's, and the scheduler refuses that id at admission (UNAUTHENTICATED ``tenant_deleted``;
    the gateway then forgets the key: ``Authenticator.forget_tenant_id``). So it was before this
    fix too (secrev18 E): kept here as the inference path's guard of the same kind."""
    scheduler, admin_key, g1, g2 = _setup(tmp_path)
    spec = tenant_pb2.TenantSpec(name="alice")

    async def run() -> tuple[Any, Any, Any]:
        old = await g1.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), _Ctx(admin_key))
        await g2.auth.tenant(_Ctx(old.api_key))
        await g1.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="alice"), _Ctx(admin_key))
        new = await g1.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), _Ctx(admin_key))
        return old, new, await g2.auth.tenant(_Ctx(old.api_key))

    old, new, cached = asyncio.run(run())

    assert cached.tenant_id == old.tenant.tenant_id != new.tenant.tenant_id
    adm = scheduler.admit(cached.tenant_id, f"{cached.tenant_id}/r1", prompt_tokens=8)
    assert (adm.code, adm.reason) == ("UNAUTHENTICATED", "tenant_deleted")
    assert scheduler.admit(new.tenant.tenant_id, f"{new.tenant.tenant_id}/r1", prompt_tokens=8).code != "UNAUTHENTICATED"


class _NodeInbox:
    """The cache node's command inbox as the scheduler sends to it: records each submit."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def send(self, address: str, message: dict[str, Any]) -> bool:
        if message.get("op") == "submit":
            self.submitted.append(message["req"]["tenant"])
        return True

    def forget(self, address: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_rotated_away_key_cached_at_a_gateway_is_refused_at_admission(tmp_path: Path) -> None:
    """Regression (session 32's open list): a key its owner rotated away through another
    gateway (here: the scheduler's own ``rotate_tenant_key``, as any other gateway or the CLI
    reaches it) stayed in this gateway's key cache for up to 10 s, and the inference requests
    it authenticated were admitted and ran, billed to the tenant that had revoked it. The
    gateway sends the key's id with each admission now, and the scheduler refuses a removed one
    (UNAUTHENTICATED ``key_revoked``), the gateway then forgetting the key. Through the real
    gateway's gRPC server and data plane to the real scheduler; the node's inbox records what
    was handed on to it (an admitted call then waits for events that never come: its deadline)."""
    from kvstrata.v1 import inference_pb2_grpc
    from services import gateway_server
    from tests.service_fixtures import chat
    from tests.test_metrics_forget_tenant import FakeNode, tiny_checkpoint

    async def generate(channel: grpc.aio.Channel, key: str) -> tuple[grpc.StatusCode, str]:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            chat("hello", max_tokens=2), metadata=(("authorization", f"Bearer {key}"),), timeout=3)
        try:
            [event async for event in call]
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
        return grpc.StatusCode.OK, ""

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        inbox = _NodeInbox()
        sched.attach_nodes({"n0": "tcp://127.0.0.1:9"}, sender=inbox)
        gw = gateway_server.Gateway(LocalActor(sched), {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()))
        port = await gw.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                tenant, leaked = await sched.register_tenant(TenantSpec(name="bob"))
                assert (await generate(channel, leaked))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
                assert inbox.submitted == [tenant.tenant_id]  # admitted: the key is cached here now
                owners = await sched.rotate_tenant_key("bob")  # through another gateway
                code, details = await generate(channel, leaked)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "rotated away" in details, (code, details)
                assert inbox.submitted == [tenant.tenant_id]  # never handed on
                code, details = await generate(channel, leaked)  # forgotten: refused at the key check
                assert code == grpc.StatusCode.UNAUTHENTICATED and "rotated away" not in details
                assert (await generate(channel, owners))[0] == grpc.StatusCode.DEADLINE_EXCEEDED
                assert inbox.submitted == [tenant.tenant_id] * 2
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(asyncio.wait_for(go(), 120))
