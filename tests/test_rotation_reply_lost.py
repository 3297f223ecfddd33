"""A key rotation whose reply comes malformed says whether the key was rotated and how to get
a key back (``services.rotation_replies``).

Regression (s39): the scheduler commits a rotation before it replies and keeps only the new
key's hash, so a malformed ``rotate_tenant_key`` / ``rotate_admin_key`` reply (a version skew,
a bug) left the caller with INTERNAL "malformed ... reply" alone while its old key was already
gone: the tenant (or the admin) locked out, told nothing of it. Now the message says "the key
was rotated" with the exact recovery command (checked below to work for a tenant), "nothing
was rotated" when the presented key still exists, or that it is unknown.

The real ``GlobalSchedulerService`` behind ``LocalActor``, one of its methods lying (run or
not run first), and the real ``TenantServicer`` / ``AdminServicer``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from kvstrata.v1 import admin_pb2, tenant_pb2
from services.auth import Authenticator
from services.gateway_admin import AdminServicer, TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor
from tests.grpc_context import GrpcContext, Refused


class Lying:
    """The scheduler with ``lies``: method name -> (whether the real method runs first, the
    reply sent in place of its own)."""

    def __init__(self, scheduler: GlobalSchedulerService, lies: dict[str, tuple[bool, Any]]) -> None:
        self.scheduler, self.lies = scheduler, lies

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.scheduler, name)
        if name not in self.lies:
            return real
        runs, reply = self.lies[name]

        async def lie(*args: Any, **kwargs: Any) -> Any:
            if runs:
                answer = real(*args, **kwargs)
                if asyncio.iscoroutine(answer):
                    await answer
            return reply

        return lie


async def _refusal(call: Any) -> tuple[str, str]:
    try:
        await call
    except Refused as refused:
        return refused.code.name, refused.message
    return "OK", ""


def _tenants(scheduler: GlobalSchedulerService, lies: dict[str, tuple[bool, Any]]) -> TenantServicer:
    handle = LocalActor(Lying(scheduler, lies))
    return TenantServicer(handle, Authenticator(handle), {}, node_timeout_s=5.0)


def _run(tmp_path: Path, body: Any) -> Any:
    async def run() -> Any:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 4})
        try:
            return await body(scheduler)
        finally:
            scheduler.store.close()

    return asyncio.run(run())


ROTATE = tenant_pb2.RotateKeyRequest(name="ann")


def test_a_tenant_whose_rotation_reply_is_lost_is_told_so_and_the_admin_command_recovers_it(tmp_path: Path) -> None:
    """Own rotation, the scheduler rotating then answering None: INTERNAL naming the malformed
    reply, that the key was rotated, and `kvstrata tenant rotate-key ann`; the old key is indeed
    gone, and the admin's RotateKey (what that command sends) gives ann a key that works."""

    async def body(scheduler: GlobalSchedulerService) -> tuple[tuple[str, str], Any, Any]:
        admin_key = scheduler.store.ensure_admin_key()
        _ann, key = await scheduler.register_tenant(TenantSpec("ann"))
        lost = await _refusal(_tenants(scheduler, {"rotate_tenant_key": (True, None)}).RotateKey(ROTATE, GrpcContext(key)))
        old_works = await scheduler.authenticate(key)
        recovered = await _tenants(scheduler, {}).RotateKey(ROTATE, GrpcContext(admin_key))
        return lost, old_works, await scheduler.authenticate(recovered.api_key)

    (code, message), old_works, recovered = _run(tmp_path, body)
    assert code == "INTERNAL" and "malformed rotate_tenant_key reply (NoneType None" in message, message
    assert ("the key was rotated: the key presented no longer works and the new one was not received; "
            "the admin gives ann a new key with `kvstrata tenant rotate-key ann`") in message, message
    assert old_works is None
    assert recovered is not None and recovered.spec.name == "ann"


def test_a_lie_with_nothing_rotated_says_the_key_still_works(tmp_path: Path) -> None:
    """The scheduler answering 5 without rotating: "nothing was rotated", and the key works."""

    async def body(scheduler: GlobalSchedulerService) -> tuple[tuple[str, str], Any]:
        _ann, key = await scheduler.register_tenant(TenantSpec("ann"))
        said = await _refusal(_tenants(scheduler, {"rotate_tenant_key": (False, 5)}).RotateKey(ROTATE, GrpcContext(key)))
        return said, await scheduler.authenticate(key)

    (code, message), works = _run(tmp_path, body)
    assert code == "INTERNAL" and message.endswith("nothing was rotated: the key presented still works; retry"), message
    assert works is not None and works.spec.name == "ann"


def test_a_lost_rotation_whose_check_fails_too_says_it_is_unknown(tmp_path: Path) -> None:
    """``key_ids_exist`` malformed as well: "unknown", with the recovery to use if the key is refused."""

    async def body(scheduler: GlobalSchedulerService) -> tuple[str, str]:
        _ann, key = await scheduler.register_tenant(TenantSpec("ann"))
        lies = {"rotate_tenant_key": (True, ""), "key_ids_exist": (False, "yes")}
        return await _refusal(_tenants(scheduler, lies).RotateKey(ROTATE, GrpcContext(key)))

    code, message = _run(tmp_path, body)
    assert code == "INTERNAL" and message.endswith(
        "whether the key was rotated is unknown: try the key presented; if it is refused, the admin gives ann "
        "a new key with `kvstrata tenant rotate-key ann`"), message


def test_the_admin_rotating_a_tenants_key_is_told_to_rotate_again(tmp_path: Path) -> None:
    async def body(scheduler: GlobalSchedulerService) -> tuple[str, str]:
        admin_key = scheduler.store.ensure_admin_key()
        await scheduler.register_tenant(TenantSpec("ann"))
        servicer = _tenants(scheduler, {"rotate_tenant_key": (True, None)})
        return await _refusal(servicer.RotateKey(ROTATE, GrpcContext(admin_key)))

    code, message = _run(tmp_path, body)
    assert code == "INTERNAL" and message.endswith(
        "the tenant's earlier keys may be gone; rotate it again for a key you receive (the admin gives ann a new "
        "key with `kvstrata tenant rotate-key ann`)"), message


def test_an_admin_key_rotation_reply_lost_names_the_local_recovery(tmp_path: Path) -> None:
    """RotateAdminKey, the scheduler rotating then answering a list: the admin key presented is
    gone, and the message names `kvstrata admin rotate-key --local`."""

    async def body(scheduler: GlobalSchedulerService) -> tuple[tuple[str, str], bool]:
        admin_key = scheduler.store.ensure_admin_key()
        handle = LocalActor(Lying(scheduler, {"rotate_admin_key": (True, ["k"])}))
        servicer = AdminServicer(handle, Authenticator(handle), {})
        said = await _refusal(servicer.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), GrpcContext(admin_key)))
        return said, scheduler.store.verify_admin_key(admin_key)

    (code, message), old_works = _run(tmp_path, body)
    assert code == "INTERNAL" and "malformed rotate_admin_key reply" in message, message
    assert message.endswith(
        "the key was rotated: the key presented no longer works and the new one was not received; recover it "
        "with `kvstrata admin rotate-key --local` where `kvstrata up` ran (no key needed: it writes a new admin "
        "key to the state dir's admin_key file)"), message
    assert old_works is False
