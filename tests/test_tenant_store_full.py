"""The tenant store's disk full during an admin or tenant call: the call fails UNAVAILABLE
(``retry-after-ms`` 10 s; s41: it was RESOURCE_EXHAUSTED, which HTTP answers as the client's
rate limit, 429) saying the store's disk is full and that nothing changed (the store locked by another
connection: UNAVAILABLE, busy; its file corrupt: DATA_LOSS), the store keeps every tenant and key as they were,
and every call works again once the disk has room.

Regression (s40 diskfull): the store's ``sqlite3.OperationalError`` ("database or disk is
full") reached the gateway's servicer uncaught, so gRPC failed the call UNKNOWN with the
exception's class and a whole remote traceback in place of a status a client can act on.

Real ``GlobalSchedulerService`` and tenant store on disk, the gateway's real ``TenantServicer``
and ``AdminServicer``. The disk fills two ways: the store's own bound (``PRAGMA
max_page_count``: the file cannot grow, which SQLite reports as it reports ENOSPC, SQLITE_FULL;
runs anywhere), and, where this process may mount one (root), a real 256 KiB tmpfs filled to
its last byte, which fails every write (the rollback journal cannot be made).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvstrata.v1 import admin_pb2, tenant_pb2
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_tenants import OWN_ROTATIONS_PER_WINDOW
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tests.test_auth_flood import _Aborted, _Ctx
from tests.test_stale_key_other_gateway import _Gateway
from tests.tiny_disk import fill_disk, tiny_disk  # noqa: F401 - the fixture


class _Full(_Ctx):
    """A call's context keeping the abort's details too."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.details = details
        raise _Aborted(code, self.retry_after_ms)


async def _status(call: Any, ctx: _Full) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except _Aborted as err:
        return err.code, ctx.details
    return grpc.StatusCode.OK, ""


Call = Callable[[_Full], Any]


def _statuses(calls: list[tuple[str, str, Call]]) -> list[tuple[str, grpc.StatusCode, str]]:
    async def run() -> list[tuple[str, grpc.StatusCode, str]]:
        out = []
        for label, key, call in calls:
            ctx = _Full(key)
            out.append((label, *await _status(call(ctx), ctx)))
        return out

    return asyncio.run(run())


def _assert_full(failed: list[tuple[str, grpc.StatusCode, str]]) -> None:
    """Each call failed UNAVAILABLE (the server's trouble, retried once there is room: not the
    client's quota), saying the tenant store's disk is full and nothing changed."""
    for label, code, details in failed:
        assert code == grpc.StatusCode.UNAVAILABLE, (label, code, details)
        assert "tenant store's disk is full" in details and "nothing changed" in details, (label, details)
        assert "Traceback" not in details


def _setup(state_dir: Path) -> tuple[GlobalSchedulerService, str, str, _Gateway]:
    scheduler = GlobalSchedulerService(str(state_dir), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key()
    assert admin_key is not None
    _, ann_key = scheduler.store.register(TenantSpec("ann"))
    return scheduler, admin_key, ann_key, _Gateway(scheduler)


def _register(gw: _Gateway, name: str) -> Call:
    return lambda c: gw.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name=name)), c)


def test_a_full_tenant_store_fails_register_unavailable_and_registers_once_it_has_room(tmp_path: Path) -> None:
    scheduler, admin_key, _, gw = _setup(tmp_path)
    conn = scheduler.store._conn
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    registered = 0
    while _statuses([("register", admin_key, _register(gw, f"t{registered}"))])[0][1] == grpc.StatusCode.OK:
        registered += 1  # the store's pages fill up
        assert registered < 1000

    failed = _statuses([("register", admin_key, _register(gw, "dan"))] * 2)

    _assert_full(failed)
    names = {t.spec.name for t in scheduler.store.list()}
    assert "dan" not in names and f"t{registered}" not in names and len(names) == registered + 1
    conn.execute("PRAGMA max_page_count = 1073741823")
    assert _statuses([("register", admin_key, _register(gw, "dan"))])[0][1] == grpc.StatusCode.OK


def test_a_full_disk_fails_every_store_write_unavailable_and_changes_nothing(tiny_disk: Path) -> None:  # noqa: F811
    """On a real full disk: register, update, delete, the admin's and a tenant's own key
    rotation, and the admin key's rotation each fail UNAVAILABLE; every key and tenant stays as
    it was; with room again, each works."""
    scheduler, admin_key, ann_key, gw = _setup(tiny_disk)
    scheduler.store.register(TenantSpec("bob"))
    tenant = tenant_pb2.TenantSpec(name="ann", max_context_tokens=1024)
    calls: list[tuple[str, str, Call]] = [
        ("register", admin_key, _register(gw, "dan")),
        ("update", admin_key, lambda c: gw.tenants.UpdateTenant(
            tenant_pb2.UpdateTenantRequest(name="ann", spec=tenant), c)),
        ("delete", admin_key, lambda c: gw.tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="bob"), c)),
        ("rotate_own", ann_key, lambda c: gw.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), c)),
        ("rotate_admin", admin_key, lambda c: gw.admin.RotateAdminKey(admin_pb2.RotateAdminKeyRequest(), c)),
    ]
    filler = fill_disk(tiny_disk)

    _assert_full(_statuses(calls))

    assert scheduler.store.verify_admin_key(admin_key)
    ann = scheduler.store.authenticate(ann_key)
    assert ann is not None and ann.spec.max_context_tokens != 1024
    assert {t.spec.name for t in scheduler.store.list()} == {"ann", "bob"}
    filler.unlink()
    assert [code for _, code, _ in _statuses(calls)] == [grpc.StatusCode.OK] * len(calls)
    assert {t.spec.name for t in scheduler.store.list()} == {"ann", "dan"}
    assert scheduler.store.authenticate(ann_key) is None  # rotated away now
    scheduler.store.close()


def test_an_update_that_fails_changed_nothing_even_when_its_read_back_fails(tmp_path: Path) -> None:
    """``TenantStore.update`` reads the updated row back inside its transaction: a store error
    raised out of it (which the gateway answers UNAVAILABLE, 'nothing changed') means the spec
    was not changed. Another connection (``kvstrata admin rotate-key --local``) takes the file's
    exclusive lock at the first statement after the UPDATE at which it can.

    Regression (s40 diff review r7 of 01ed7ce): the spec was committed and then read back
    outside the transaction; that read failing ('database is locked') raised out of the update
    with the new spec stored, so the caller was told nothing changed while the scheduler kept
    the old spec in memory and the gateway its cached keys' old spec."""
    path = tmp_path / "tenants.sqlite"
    store = TenantStore(path)
    store.register(TenantSpec("ann"))
    store._conn.execute("PRAGMA busy_timeout = 0")  # (5 s by default: the lock is held to the end)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    steps: list[str] = []

    def lock_when_free(sql: str) -> None:
        if not steps:  # (the UPDATE's own trace comes before it locks anything)
            if sql.lstrip().upper().startswith("UPDATE TENANTS"):
                steps.append("updating")
            return
        if steps[-1] != "locked":
            try:
                other.execute("BEGIN EXCLUSIVE")
            except sqlite3.OperationalError:  # the update's transaction holds the file
                steps.append(f"busy at {sql.split()[0]}")
            else:
                steps.append("locked")

    store._conn.set_trace_callback(lock_when_free)
    try:
        tenant = store.update("ann", TenantSpec("ann", max_context_tokens=1024))
    except sqlite3.Error:
        store._conn.set_trace_callback(None)
        other.execute("ROLLBACK")
        assert store.get("ann").spec.max_context_tokens != 1024, steps  # nothing changed, as told
    else:
        assert tenant.spec.max_context_tokens == 1024, steps
    finally:
        store._conn.set_trace_callback(None)
        if other.in_transaction:
            other.execute("ROLLBACK")
        other.close()
    assert steps, "the other connection never tried the lock"
    store.close()


def test_a_store_error_gets_the_status_of_its_cause(tmp_path: Path) -> None:
    """A register failing in the store: locked by another connection (``kvstrata admin
    rotate-key --local``): UNAVAILABLE, busy, retry; its file's header overwritten: DATA_LOSS
    naming tenants.sqlite, not to be retried. Nothing registered either way.

    Regression (s40 diff review r7 of 01ed7ce): every store error was UNAVAILABLE 'retry once
    its disk has room', a locked or corrupt store's included."""
    scheduler, admin_key, _, gw = _setup(tmp_path)
    path = tmp_path / "tenants.sqlite"
    assert path.is_file()
    scheduler.store._conn.execute("PRAGMA busy_timeout = 0")  # (5 s by default)
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")  # (reads go on: the caller's key is checked; writes are busy)
    try:
        [(_, code, details)] = _statuses([("register", admin_key, _register(gw, "dan"))])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "busy" in details and "nothing changed" in details and "disk" not in details, details
    assert "dan" not in {t.spec.name for t in scheduler.store.list()}

    with path.open("r+b") as f:
        f.write(b"not a database, overwritten!")  # SQLite's 16-byte header and past it
    [(_, code, details)] = _statuses([("register", admin_key, _register(gw, "dan"))])
    assert code == grpc.StatusCode.DATA_LOSS, details
    assert "tenants.sqlite" in details and "restore" in details and "disk" not in details, details
    assert "Traceback" not in details
    scheduler.store.close()


def test_an_own_rotation_failing_in_the_store_uses_none_of_the_tenants_rotations(tmp_path: Path) -> None:
    """A tenant's own key rotation that the store fails (busy: another connection writing)
    changed nothing, so it leaves the tenant's ``OWN_ROTATIONS_PER_WINDOW`` untouched: more
    failed tries than that, then the rotation works once the store is free.

    Regression (s40 diff review r7 of 01ed7ce): the slot was taken before the write and kept,
    so a tenant retrying through a store failure was refused RESOURCE_EXHAUSTED ('too many
    rotations') for a minute once the store worked again."""
    scheduler, _, ann_key, gw = _setup(tmp_path)
    scheduler.store._conn.execute("PRAGMA busy_timeout = 0")  # (5 s by default)
    rotate: Call = lambda c: gw.tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), c)
    other = sqlite3.connect(tmp_path / "tenants.sqlite", isolation_level=None, timeout=0)
    other.execute("BEGIN IMMEDIATE")  # (reads go on: ann's key is checked; writes are busy)
    try:
        failed = _statuses([("rotate_own", ann_key, rotate)] * (OWN_ROTATIONS_PER_WINDOW + 1))
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [code for _, code, _ in failed] == [grpc.StatusCode.UNAVAILABLE] * len(failed), failed
    assert scheduler.store.authenticate(ann_key) is not None  # nothing rotated

    [(_, code, details)] = _statuses([("rotate_own", ann_key, rotate)])
    assert code == grpc.StatusCode.OK, details
    assert scheduler.store.authenticate(ann_key) is None
    scheduler.store.close()
