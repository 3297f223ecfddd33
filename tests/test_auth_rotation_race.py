"""Review 23d (rotation race): a key check in flight at the scheduler when its key is rotated
away, its tenant deleted, or the admin key changed must not leave the old key cached at the
gateway. The ``Authenticator`` runs over a real ``TenantStore`` whose checks wait on a gate, so
the rotation lands between the check's question and its answer, as it can in a real gateway."""

from __future__ import annotations

import asyncio

import grpc

from services.auth import Authenticator
from tenants.keys import fingerprint
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tests.test_auth_flood import _code, _Ctx, _Remote


class _GatedStoreScheduler:
    """The scheduler's key checks over ``store``, each answered (from the store as it was when
    asked) only once ``gate`` is set; with ``admin_gated`` off the admin check answers at once
    (``admin_or_tenant`` asks it first)."""

    def __init__(self, store: TenantStore, admin_gated: bool = True) -> None:
        self.gate = asyncio.Event()

        async def authenticate(api_key: str, allow_pbkdf2: bool = True):  # type: ignore[no-untyped-def]
            answer = store.authenticate(api_key, allow_pbkdf2)
            await self.gate.wait()
            return answer

        async def verify_admin_key(key: str, allow_pbkdf2: bool = True) -> bool:
            answer = store.verify_admin_key(key, allow_pbkdf2)
            if admin_gated:
                await self.gate.wait()
            return answer

        self.authenticate, self.verify_admin_key = _Remote(authenticate), _Remote(verify_admin_key)


def _race(check, forget) -> tuple[grpc.StatusCode, Authenticator, str]:  # type: ignore[no-untyped-def]
    """A check of alice's key (``check(auth)``, returning the call) with ``forget(store, auth)``
    run while it waits at the scheduler; its code, the authenticator and the old key."""
    store = TenantStore(":memory:")
    _, key = store.register(TenantSpec("alice"))

    async def run() -> tuple[grpc.StatusCode, Authenticator]:
        scheduler = _GatedStoreScheduler(store, admin_gated=False)
        auth = Authenticator(scheduler)
        call = asyncio.create_task(_code(check(auth), _Ctx(key)))
        await asyncio.sleep(0.05)  # the check is at the scheduler
        forget(store, auth)
        scheduler.gate.set()
        return await call, auth

    code, auth = asyncio.run(run())
    return code, auth, key


def test_a_key_rotated_during_its_check_is_not_cached() -> None:
    """Before: the check answered with the old key's tenant after ``forget_tenant`` and cached
    it, so the rotated-away key passed for 10 s more. The call that asked first still passes;
    the key is not cached, and its id is not known here."""
    def rotate(store: TenantStore, auth: Authenticator) -> None:
        store.rotate_key("alice")
        auth.forget_tenant("alice", keys_gone=True)

    for check in (lambda a: a.tenant, lambda a: a.admin_or_tenant):
        code, auth, old = _race(check, rotate)
        assert code == grpc.StatusCode.OK
        assert auth._cached_tenant(fingerprint(old)) is None
        assert not auth._known


def test_a_tenant_deleted_during_its_check_is_not_cached() -> None:
    def delete(store: TenantStore, auth: Authenticator) -> None:
        auth.forget_tenant_id(store.delete("alice"))

    code, auth, old = _race(lambda a: a.tenant, delete)
    assert code == grpc.StatusCode.OK
    assert auth._cached_tenant(fingerprint(old)) is None
    assert asyncio.run(_code(auth.tenant, _Ctx(old))) == grpc.StatusCode.UNAUTHENTICATED


def test_the_admin_key_changed_during_its_check_is_not_cached() -> None:
    store = TenantStore(":memory:")
    admin = store.ensure_admin_key()

    async def run() -> Authenticator:
        scheduler = _GatedStoreScheduler(store)
        auth = Authenticator(scheduler)
        call = asyncio.create_task(_code(auth.admin, _Ctx(admin)))
        await asyncio.sleep(0.05)
        store.rotate_admin_key()
        auth.forget_admin()
        scheduler.gate.set()
        assert await call == grpc.StatusCode.OK
        return auth

    auth = asyncio.run(run())
    assert not auth._cached_admin(fingerprint(admin))


def test_a_check_with_nothing_forgotten_meanwhile_is_cached() -> None:
    code, auth, key = _race(lambda a: a.tenant, lambda store, auth: None)
    assert code == grpc.StatusCode.OK
    assert auth._cached_tenant(fingerprint(key)) is not None
