"""secrev18 A: one tenant's keys never push another tenant's key ids out of a gateway's known
ids, and a tenant's own key rotations are limited and run off the scheduler's loop.

The ``Authenticator`` runs over a real ``TenantStore`` (no key directory: the fallback in which
a key of an id not known here is checked within the per-address and per-gateway budgets, and
known ids are the only exemption); the rotation limit is the real ``GlobalScheduler``'s, and
over gRPC the real ``TenantServicer`` (``tests.gateway_harness``).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest

import services.auth_known
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_tenants import OWN_ROTATION_WINDOW_S, OWN_ROTATIONS_PER_WINDOW
from tenants.errors import TooManyRotationsError
from tenants.keys import new_api_key, parse_key_id
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tests.gateway_harness import serve
from tests.test_auth_flood import _code, _Ctx, _Remote


class _StoreScheduler:
    """The scheduler's two key checks over ``store``, without ``key_ids_since``."""

    def __init__(self, store: TenantStore) -> None:
        async def authenticate(api_key: str, allow_pbkdf2: bool = True):  # type: ignore[no-untyped-def]
            return store.authenticate(api_key, allow_pbkdf2)

        async def verify_admin_key(key: str, allow_pbkdf2: bool = True) -> bool:
            return store.verify_admin_key(key, allow_pbkdf2)

        self.authenticate, self.verify_admin_key = _Remote(authenticate), _Remote(verify_admin_key)


def _nat_mate_flood(auth: Authenticator, host: str, n: int = 60) -> list[grpc.StatusCode]:
    """``n`` well-formed keys of unknown ids from ``host`` (the address's failure limit is 50)."""
    async def run() -> list[grpc.StatusCode]:
        return [await _code(auth.tenant, _Ctx(new_api_key(), host)) for _ in range(n)]
    return asyncio.run(run())


def test_a_tenants_rotations_do_not_evict_another_tenants_known_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 A): the known ids were one LRU for all tenants (65,536; 64 here), so
    the attacker's 64 rotations of its own key evicted the victim's id, and after a NAT-mate's
    60 wrong keys the victim's valid key got RESOURCE_EXHAUSTED. Now the attacker holds at most
    ``_KNOWN_IDS_PER_OWNER`` ids and the victim's stays known: its key passes."""
    monkeypatch.setattr(services.auth_known, "_MAX_KNOWN_IDS", 64)
    store = TenantStore(":memory:")
    _, victim_key = store.register(TenantSpec("victim"))
    _, attacker_key = store.register(TenantSpec("attacker"))
    auth = Authenticator(_StoreScheduler(store), unknown_checks_per_s=10**6, unknown_checks_in_flight=10**3)
    nat = "203.0.113.7"

    assert asyncio.run(_code(auth.tenant, _Ctx(victim_key, nat))) == grpc.StatusCode.OK
    key = attacker_key
    for _ in range(64):
        assert asyncio.run(_code(auth.tenant, _Ctx(key, "198.51.100.9"))) == grpc.StatusCode.OK
        key = store.rotate_key("attacker")
        auth.forget_tenant("attacker")  # as an admin's rotation (no keys_gone: the worst case)

    assert parse_key_id(victim_key) in auth._known
    assert len(auth._known_by_owner["attacker"]) == services.auth_known._KNOWN_IDS_PER_OWNER
    assert len(auth._known) == services.auth_known._KNOWN_IDS_PER_OWNER + 1
    assert _nat_mate_flood(auth, nat)[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED  # the address is over
    auth._tenants.clear()  # the victim's 10 s cache of its key expired
    assert asyncio.run(_code(auth.tenant, _Ctx(victim_key, nat))) == grpc.StatusCode.OK


def test_past_the_global_bound_the_largest_owner_loses_its_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory guard (``_MAX_KNOWN_IDS``, 6 here) sheds the owner holding the most ids, never
    an owner holding one while another holds more."""
    monkeypatch.setattr(services.auth_known, "_MAX_KNOWN_IDS", 6)
    auth = Authenticator(_StoreScheduler(TenantStore(":memory:")))
    keys = {owner: [new_api_key() for _ in range(n)] for owner, n in (("a", 4), ("b", 1), ("c", 1), ("d", 1))}
    for owner, owned in keys.items():
        for key in owned:
            auth._know(key, owner)

    assert {owner: len(ids) for owner, ids in auth._known_by_owner.items()} == {"a": 3, "b": 1, "c": 1, "d": 1}
    assert list(auth._known_by_owner["a"]) == [parse_key_id(k) for k in keys["a"][1:]]
    assert len(auth._known) == 6


def test_forget_tenant_drops_known_ids_only_when_its_keys_are_gone() -> None:
    """A spec change keeps the tenant's known id (its key still works: the exemption stays); a
    rotation or deletion (``keys_gone``) drops it, and never another tenant's."""
    store = TenantStore(":memory:")
    _, ann_key = store.register(TenantSpec("ann"))
    _, bob_key = store.register(TenantSpec("bob"))
    auth = Authenticator(_StoreScheduler(store))
    for key in (ann_key, bob_key):
        assert asyncio.run(_code(auth.tenant, _Ctx(key))) == grpc.StatusCode.OK

    auth.forget_tenant("ann")
    assert set(auth._known) == {parse_key_id(ann_key), parse_key_id(bob_key)}
    auth.forget_tenant("ann", keys_gone=True)
    assert set(auth._known) == {parse_key_id(bob_key)} and "ann" not in auth._known_by_owner


def test_a_key_admission_finds_of_no_tenant_is_forgotten_by_its_tenant_id() -> None:
    """Regression (secrev18 E residue): the gateway kept a key of a tenant deleted elsewhere (or
    before the scheduler restarted) cached for its TTL, every call refused at admission. Now
    admission's ``tenant_deleted``/``unknown_tenant`` makes it forget that tenant's keys
    (``forget_tenant_id``): the next call is checked at the store and refused there, and other
    tenants' cached keys and known ids stay."""
    store = TenantStore(":memory:")
    ann, ann_key = store.register(TenantSpec("ann"))
    _, bob_key = store.register(TenantSpec("bob"))
    auth = Authenticator(_StoreScheduler(store))
    for key in (ann_key, bob_key):
        assert asyncio.run(_code(auth.tenant, _Ctx(key))) == grpc.StatusCode.OK
    store.delete("ann")
    assert asyncio.run(_code(auth.tenant, _Ctx(ann_key))) == grpc.StatusCode.OK  # cached
    auth.forget_tenant_id(ann.tenant_id)
    assert asyncio.run(_code(auth.tenant, _Ctx(ann_key))) == grpc.StatusCode.UNAUTHENTICATED
    assert set(auth._known) == {parse_key_id(bob_key)}
    assert asyncio.run(_code(auth.tenant, _Ctx(bob_key))) == grpc.StatusCode.OK


def test_own_rotations_are_limited_per_tenant(tmp_path: Path) -> None:
    """Regression (secrev18 A): a tenant could rotate its own key without limit. Now
    ``OWN_ROTATIONS_PER_WINDOW`` a window pass and the next is refused with the wait; another
    tenant's and the admin's rotations are not limited by it, and the window passing lifts it.
    (An own rotation presents the tenant's key: ``rotate_tenant_key``'s ``api_key``.)"""
    now = [0.0]
    gs = GlobalScheduler(str(tmp_path), {"n0": 1}, clock=lambda: now[0])
    _, ann = gs.register_tenant(TenantSpec("ann"))
    _, bob = gs.register_tenant(TenantSpec("bob"))
    for _ in range(OWN_ROTATIONS_PER_WINDOW):
        ann = gs.rotate_tenant_key("ann", api_key=ann)
    now[0] = 10.0
    with pytest.raises(TooManyRotationsError) as err:
        gs.rotate_tenant_key("ann", api_key=ann)

    assert err.value.retry_after_s == pytest.approx(OWN_ROTATION_WINDOW_S - 10.0)
    assert gs.store.authenticate(ann) is not None  # the refused rotation changed nothing
    ann = gs.rotate_tenant_key("ann")  # the admin's
    assert gs.store.authenticate(ann).spec.name == "ann"
    assert gs.store.authenticate(gs.rotate_tenant_key("bob", api_key=bob)).spec.name == "bob"
    now[0] = OWN_ROTATION_WINDOW_S + 0.1
    assert gs.store.authenticate(gs.rotate_tenant_key("ann", api_key=ann)).spec.name == "ann"


def test_rotation_commits_in_a_worker_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (secrev18 A): each rotation's SQLite commit (1-12 ms) ran on the scheduler's
    event loop, which answers every admission; it runs in a worker thread now."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    _, key = scheduler.store.register(TenantSpec("ann"))
    threads: list[int] = []
    real = scheduler.store.rotate_key

    def rotate_key(name: str, **expected: str) -> str:
        threads.append(threading.get_ident())
        return real(name, **expected)

    monkeypatch.setattr(scheduler.store, "rotate_key", rotate_key)
    key = asyncio.run(scheduler.rotate_tenant_key("ann", api_key=key))

    assert threads and threads[0] != threading.get_ident()
    assert scheduler.store.authenticate(key).spec.name == "ann"


def test_rotate_key_rpc_refuses_a_tenants_rotations_past_the_limit(tmp_path: Path) -> None:
    """Over gRPC: a tenant's own rotations past the limit are RESOURCE_EXHAUSTED with
    ``retry-after-ms`` (its key unchanged); the admin key still rotates it."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann"))
        with grpc.insecure_channel(gw.address) as ch:
            stub = tenant_pb2_grpc.TenantServiceStub(ch)
            for _ in range(OWN_ROTATIONS_PER_WINDOW):
                key = stub.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"),
                                     metadata=(("authorization", f"Bearer {key}"),)).api_key
            with pytest.raises(grpc.RpcError) as err:
                stub.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=(("authorization", f"Bearer {key}"),))
            by_admin = stub.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"),
                                      metadata=(("authorization", f"Bearer {gw.admin_key}"),)).api_key

        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        retry_ms = int(dict(err.value.trailing_metadata())["retry-after-ms"])
        assert 0 < retry_ms <= OWN_ROTATION_WINDOW_S * 1000 + 1
        assert gw.scheduler.store.authenticate(key) is None  # the refused call rotated nothing before the admin's
        assert gw.scheduler.store.authenticate(by_admin).spec.name == "ann"
