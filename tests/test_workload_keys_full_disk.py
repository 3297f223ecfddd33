"""``kvstrata run deepresearch``'s keys file cannot be written after the run registered its
tenants (its disk full, or its state dir unusable): the tenants just registered are removed
again, the error names the file and why, and the next run registers them anew.

Regression (s40 diskfull): ``save_keys`` raised ``OSError`` out of the command (a traceback),
the new keys only in memory; the next run, with the keys file's older keys, found each demo
tenant held by a key nobody had and refused it as another's (``TenantNameTaken``) until the
operator removed them by hand.

Over a real gRPC TenantService (``tests.gateway_harness``); the disk fills for real (a 256 KiB
tmpfs of its own, filled to its last byte) where this process may mount one (root), and the
save's lock file is a folder (EISDIR) anywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.gateway_harness import serve
from tests.test_workload_register import PROFILES
from tests.tiny_disk import fill_disk, tiny_disk  # noqa: F401 - the fixture
from workloads.deepresearch.register import (
    KeysNotSaved,
    load_keys,
    register_tenants,
    save_or_unregister,
)

DEPLOYMENT = "127.0.0.1:1"


def _run(address: str, admin_key: str, keys_file: Path) -> dict[str, str]:
    """One run's registration and keys saved, as ``kvstrata run deepresearch`` does them."""
    async def go() -> dict[str, str]:
        async with grpc.aio.insecure_channel(address) as ch:
            keys = await register_tenants(ch, admin_key, PROFILES, earlier_keys=load_keys(keys_file, DEPLOYMENT))
            await save_or_unregister(ch, admin_key, keys_file, DEPLOYMENT, keys)
            return keys
    return asyncio.run(go())


@pytest.fixture(params=["full_disk", "lock_unopenable"])
def broken(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, object]]:
    """(keys file, a call that breaks its disk and returns one that mends it)."""
    if request.param == "full_disk":
        root = request.getfixturevalue("tiny_disk")

        def fill() -> object:
            return fill_disk(root).unlink
        yield root / "cli" / "workload_keys.json", fill
    else:
        keys_file = tmp_path / "cli" / "workload_keys.json"
        lock = keys_file.with_name(f".{keys_file.name}.lock")

        def spoil() -> object:
            lock.unlink()
            lock.mkdir()  # the save's lock cannot be opened (EISDIR); the keys file still reads
            return lock.rmdir
        yield keys_file, spoil


def test_keys_that_cannot_be_saved_unregister_their_tenants_and_the_next_run_goes_on(
    tmp_path: Path, broken: tuple[Path, object]
) -> None:
    keys_file, breaker = broken
    with serve(tmp_path / "gw") as gw:
        first = _run(gw.address, gw.admin_key, keys_file)
        assert load_keys(keys_file, DEPLOYMENT) == first
        mend = breaker()  # type: ignore[operator]

        with pytest.raises(KeysNotSaved) as err:
            _run(gw.address, gw.admin_key, keys_file)

        message = str(err.value)
        assert str(keys_file) in message and "removed again" in message and "run again" in message
        assert [t.spec.name for t in gw.scheduler.store.list()] == []  # no tenant under keys nobody holds
        mend()
        third = _run(gw.address, gw.admin_key, keys_file)  # before: TenantNameTaken for 'chat'
        assert load_keys(keys_file, DEPLOYMENT) == third
        assert {gw.scheduler.store.authenticate(k).spec.name for k in third.values()} == set(third)


def test_a_registration_failing_midway_leaves_no_tenant_under_a_key_nobody_holds(tmp_path: Path) -> None:
    """A run's second registration fails (its spec refused: INVALID_ARGUMENT; a store that
    fills meanwhile fails it UNAVAILABLE alike): the error is raised, the tenant this run
    registered before it is removed again (its key was only in memory), and the next run
    registers every tenant.

    Regression (s40 diff review r7 of 5e8e559): the tenants registered before the failure
    stayed under keys nobody had, so the next run refused 'chat' as another's
    (``TenantNameTaken``) until removed by hand, as a failed save did before 5e8e559."""
    keys_file = tmp_path / "cli" / "workload_keys.json"
    refused = dataclasses.replace(PROFILES[1], cache_namespace="not a namespace!")  # the gateway refuses it
    with serve(tmp_path / "gw") as gw:
        async def register() -> None:
            async with grpc.aio.insecure_channel(gw.address) as ch:
                await register_tenants(ch, gw.admin_key, [PROFILES[0], refused],
                                       earlier_keys=load_keys(keys_file, DEPLOYMENT))

        with pytest.raises(grpc.aio.AioRpcError) as err:
            asyncio.run(register())

        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert [t.spec.name for t in gw.scheduler.store.list()] == []
        again = _run(gw.address, gw.admin_key, keys_file)  # before: TenantNameTaken for 'chat'
        assert {gw.scheduler.store.authenticate(k).spec.name for k in again.values()} == set(again)


def test_no_keys_to_save_is_no_failure(tmp_path: Path) -> None:
    """A run refused before it registered anything (``TenantNameTaken``, ``registered`` empty)
    has no keys to save: its keys file is not touched, so a full disk adds no 'could not be
    saved ... removed again ()' to the refusal (s40 diff review r7 of 5e8e559)."""
    keys_file = tmp_path / "cli" / "workload_keys.json"
    keys_file.parent.mkdir()
    keys_file.with_name(f".{keys_file.name}.lock").mkdir()  # any save fails (EISDIR)

    async def save_nothing() -> None:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as ch:  # (nothing to delete: never used)
            await save_or_unregister(ch, "admin", keys_file, DEPLOYMENT, {})
    asyncio.run(save_nothing())
    assert not keys_file.exists()
