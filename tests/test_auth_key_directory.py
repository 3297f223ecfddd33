"""The gateway's key directory (``services.key_ids.KeyDirectory``): a key whose id exists nowhere
is refused UNAUTHENTICATED at the gateway without a check and without spending the budget of
checks of key ids not known there, so a flood of random key ids never refuses a valid key.

The gateway's ``Authenticator`` runs over a real in-process ``GlobalSchedulerService`` (its
tenant store on disk, called as a Ray actor is: ``handle.method.remote(...)`` awaitables) that
records every call, or over a stand-in whose directory replies are malformed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import services.auth
import services.key_ids
from services.auth import Authenticator
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.errors import TenantExistsError
from tenants.keys import new_api_key, parse_key_id
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tenants.store_key_ids import KEY_LOG_LENGTH
from tests.gateway_harness import LocalActor
from tests.test_auth_flood import _code, _CountingScheduler, _Ctx, _Remote, _tenant, _wrong_secret


class _Recorded:
    """``LocalActor(scheduler)`` that records each call as ``(method name, first argument)``, the
    first keyword argument's value where none is positional (the gateway calls by keyword)."""

    def __init__(self, scheduler: GlobalSchedulerService) -> None:
        self._actor, self.calls = LocalActor(scheduler), []

    def __getattr__(self, name: str) -> _Remote:
        method = getattr(self._actor, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args[0] if args else next(iter(kwargs.values()), None)))
            return method.remote(*args, **kwargs)

        return _Remote(call)

    def asked(self, name: str) -> list[Any]:
        return [arg for method, arg in self.calls if method == name]


def _host(i: int) -> str:
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"


@pytest.fixture
def gateway(tmp_path: Path) -> tuple[GlobalSchedulerService, _Recorded, Authenticator, str]:
    """(scheduler, its recording handle, a gateway's Authenticator over it, the admin key)."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key()
    assert admin_key is not None
    handle = _Recorded(scheduler)
    yield scheduler, handle, Authenticator(handle), admin_key
    scheduler.store.close()


def test_a_valid_new_key_passes_under_a_flood_of_random_key_ids(gateway) -> None:
    """Regression: 2000 well-formed bad keys with random ids from 2000 addresses spent the
    gateway's budget of checks of unknown key ids (16 at once, 100 a second), and ann's valid
    key, never used at this gateway, and the admin key got RESOURCE_EXHAUSTED. Now the flood is
    refused UNAUTHENTICATED with no key check at all (one shared directory refresh), and both
    valid keys pass."""
    scheduler, handle, auth, admin_key = gateway
    _, ann_key = scheduler.store.register(TenantSpec("ann"))

    async def run() -> tuple[Counter, grpc.StatusCode, grpc.StatusCode]:
        flood = [asyncio.ensure_future(_code(auth.tenant, _Ctx(new_api_key(), _host(i)))) for i in range(2000)]
        valid = asyncio.ensure_future(_code(auth.tenant, _Ctx(ann_key, "192.0.2.1")))
        admin = asyncio.ensure_future(_code(auth.admin, _Ctx(admin_key, "192.0.2.2")))
        return Counter(await asyncio.gather(*flood)), await valid, await admin

    codes, valid, admin = asyncio.run(run())

    assert valid == admin == grpc.StatusCode.OK  # before: RESOURCE_EXHAUSTED both
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 2000}  # before: 16 checked, 1984 RESOURCE_EXHAUSTED
    assert handle.asked("authenticate") == [ann_key]  # before: 16 flood keys too
    assert handle.asked("verify_admin_key") == [admin_key]
    assert len(handle.asked("key_ids_since")) == 1
    assert auth.directory.ids == {parse_key_id(ann_key), parse_key_id(admin_key)}


def test_refreshes_under_a_long_flood_are_bounded_by_their_rate(gateway) -> None:
    """20 waves of 100 random-id keys, each wave with a tenant registered since the last (as at
    another gateway): each wave costs one directory refresh and no key check, refreshes start
    at most ``directory_refreshes_per_s`` (10) a second, and every new tenant's key passes on
    its first use here."""
    scheduler, handle, auth, _ = gateway

    async def run() -> tuple[list[grpc.StatusCode], Counter, float]:
        valid, codes, start = [], Counter(), time.monotonic()
        for wave in range(20):
            _, key = scheduler.store.register(TenantSpec(f"t{wave}"))
            calls = [_code(auth.tenant, _Ctx(new_api_key(), _host(100 * wave + i))) for i in range(100)]
            *flood, ok = await asyncio.gather(*calls, _code(auth.tenant, _Ctx(key, "192.0.2.1")))
            codes.update(flood)
            valid.append(ok)
        return valid, codes, time.monotonic() - start

    valid, codes, elapsed_s = asyncio.run(run())

    assert valid == [grpc.StatusCode.OK] * 20
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: 2000}
    assert len(handle.asked("authenticate")) == 20
    assert len(handle.asked("key_ids_since")) == auth.directory.refreshes == 20
    assert elapsed_s >= 19 * auth.directory.interval_s  # the rate held: at most 10 a second


def test_a_key_made_after_the_last_refresh_passes_on_first_use(gateway) -> None:
    """A key of an id that exists nowhere is refused without a key check; a tenant registered and
    an admin key rotated after that refresh (through another gateway: this one is not told)
    pass on their first use here, each after one more refresh."""
    scheduler, handle, auth, _ = gateway

    async def run() -> list[grpc.StatusCode]:
        codes = [await _code(auth.tenant, _Ctx(new_api_key()))]
        _, bob_key = scheduler.store.register(TenantSpec("bob"))
        codes.append(await _code(auth.tenant, _Ctx(bob_key)))
        new_admin = scheduler.store.rotate_admin_key()
        codes.append(await _code(auth.admin, _Ctx(new_admin)))
        codes.append(await _code(auth.admin_or_tenant, _Ctx(new_admin, "192.0.2.9")))
        return codes

    codes = asyncio.run(run())

    assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert len(handle.asked("authenticate")) == 1  # bob's key alone (before: the random key too)
    assert len(handle.asked("verify_admin_key")) == 1  # the new admin key, then cached
    assert len(handle.asked("key_ids_since")) == 3


def test_deleted_and_rotated_key_ids_are_refused_after_a_refresh(gateway) -> None:
    """Regression: a key deleted or rotated away through another gateway kept passing here from
    the cache of keys that passed (10 s), and its id stayed known for an hour. After the next
    directory refresh such a key is refused UNAUTHENTICATED with no key check, its id and cached
    success are forgotten, and the directory holds exactly the store's key ids."""
    scheduler, handle, auth, admin_key = gateway
    _, ann_key = scheduler.store.register(TenantSpec("ann"))
    _, bob_key = scheduler.store.register(TenantSpec("bob"))

    async def run() -> tuple[list[grpc.StatusCode], list[grpc.StatusCode], Any]:
        before = [await _code(auth.tenant, _Ctx(ann_key)), await _code(auth.tenant, _Ctx(bob_key)),
                  await _code(auth.admin, _Ctx(admin_key))]
        new_ann_key = scheduler.store.rotate_key("ann")
        scheduler.store.delete("bob")
        new_admin_key = scheduler.store.rotate_admin_key()
        await _code(auth.tenant, _Ctx(new_api_key()))  # any unknown id refreshes the directory
        checks = len(handle.calls) - len(handle.asked("key_ids_since"))
        after = [await _code(auth.tenant, _Ctx(ann_key)), await _code(auth.tenant, _Ctx(bob_key)),
                 await _code(auth.admin, _Ctx(admin_key)), await _code(auth.admin_or_tenant, _Ctx(ann_key))]
        assert len(handle.calls) - len(handle.asked("key_ids_since")) == checks  # refused here
        after.append(await _code(auth.tenant, _Ctx(new_ann_key)))
        return before, after, {parse_key_id(new_ann_key), parse_key_id(new_admin_key)}

    before, after, current_ids = asyncio.run(run())

    assert before == [grpc.StatusCode.OK] * 3
    assert after == [grpc.StatusCode.UNAUTHENTICATED] * 4 + [grpc.StatusCode.OK]  # before: OK, OK, OK, OK, OK
    assert auth.directory.ids == current_ids
    assert parse_key_id(ann_key) not in auth._known and parse_key_id(bob_key) not in auth._known


def test_a_burst_of_first_calls_of_a_new_key_shares_one_check(gateway) -> None:
    """30 concurrent first calls of a key not yet in the directory wait on one refresh and then
    share one check (1f6ab5f): all pass, and the address's limit of checks at once is not hit."""
    scheduler, handle, auth, _ = gateway
    ann, ann_key = scheduler.store.register(TenantSpec("ann"))

    async def run() -> list[Any]:
        return await asyncio.gather(*(auth.tenant(_Ctx(ann_key)) for _ in range(30)))

    assert asyncio.run(run()) == [ann] * 30
    assert handle.asked("authenticate") == [ann_key]
    assert len(handle.asked("key_ids_since")) == 1


class _DirectoryScheduler(_CountingScheduler):
    """``_CountingScheduler`` whose ``key_ids_since`` answers ``reply()``."""

    def __init__(self, tenants: dict[str, object], reply: Any) -> None:
        super().__init__(tenants)
        self.reply = reply
        self.key_ids_since = _Remote(self._key_ids_since)

    async def _key_ids_since(self, epoch: str, version: int) -> Any:
        return await self.reply() if asyncio.iscoroutinefunction(self.reply) else self.reply()


class _Str(str):
    pass


_EPOCH = "0123456789abcdef"
_ID = "0123456789ab"


async def _raises() -> Any:
    raise RuntimeError("scheduler trouble")


async def _hangs() -> Any:
    await asyncio.sleep(3600)


@pytest.mark.parametrize("reply", [
    lambda: None, lambda: "full", lambda: {"epoch": _EPOCH}, lambda: (_EPOCH, 1, True, []),
    lambda: (_EPOCH.upper(), 1, True, [], []), lambda: (7, 1, True, [], []),
    lambda: (_EPOCH, True, True, [], []), lambda: (_EPOCH, -1, True, [], []), lambda: (_EPOCH, 2**63, True, [], []),
    lambda: (_EPOCH, 1, 1, [], []), lambda: (_EPOCH, 1, True, _ID, []), lambda: (_EPOCH, 1, True, [_ID[:-1]], []),
    lambda: (_EPOCH, 1, True, [_ID.upper()], []), lambda: (_EPOCH, 1, True, [_Str(_ID)], []),
    lambda: (_EPOCH, 1, True, [123456789012], []), lambda: (_EPOCH, 1, True, [None], []),
    lambda: (_EPOCH, 1, True, [_ID], [_ID]), lambda: (_EPOCH, 1, True, [], ["ba9876543210"]),
    lambda: (_EPOCH, 1, False, [_ID], []),  # a delta, though this gateway has heard nothing yet
    lambda: (_EPOCH, 1, True, [f"{i:012x}" for i in range(5)], []),  # over the size limit (4 here)
    lambda: (_EPOCH, 1, True, iter([_ID]), []),
    _raises, _hangs,
], ids=lambda _: "")
def test_a_malformed_directory_reply_falls_back_to_the_budgeted_checks(reply, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the scheduler's directory answers (wrong types, sizes or id patterns, an error,
    no answer at all), the gateway neither crashes nor refuses on its account: the directory
    stays as it was (empty), a valid key passes and a bad one is checked as before."""
    monkeypatch.setattr(services.key_ids, "_MAX_DIRECTORY_IDS", 4)
    monkeypatch.setattr(services.key_ids, "_DIRECTORY_TIMEOUT_S", 0.05)
    ann_key, bad_key = new_api_key(), new_api_key()
    ann = _tenant("ann")
    scheduler = _DirectoryScheduler({ann_key: ann}, reply)
    auth = Authenticator(scheduler)

    async def run() -> list[Any]:
        return [await auth.tenant(_Ctx(ann_key)), await _code(auth.tenant, _Ctx(bad_key)),
                await _code(auth.admin_or_tenant, _Ctx(_wrong_secret(ann_key)))]

    assert asyncio.run(run()) == [ann, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED]
    assert scheduler.calls.count(bad_key) == 1  # checked, as without a directory
    assert not auth.directory.loaded and auth.directory.ids == set()


def test_a_good_reply_after_a_malformed_one_loads_the_directory() -> None:
    """A malformed reply is skipped; the next well-formed one loads the directory and unknown ids
    are refused locally from then on."""
    ann_key = new_api_key()
    replies = iter([("bad",), (_EPOCH, 3, True, [parse_key_id(ann_key)], [])])
    scheduler = _DirectoryScheduler({ann_key: _tenant("ann")}, lambda: next(replies))
    auth = Authenticator(scheduler, directory_refreshes_per_s=1000)
    first_bad, second_bad = new_api_key(), new_api_key()

    async def run() -> list[grpc.StatusCode]:
        return [await _code(auth.tenant, _Ctx(first_bad)), await _code(auth.tenant, _Ctx(second_bad)),
                await _code(auth.tenant, _Ctx(ann_key))]

    assert asyncio.run(run()) == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.OK]
    assert scheduler.calls == [first_bad, ann_key]  # the second bad key was refused here
    assert auth.directory.loaded and auth.directory.ids == {parse_key_id(ann_key)}


def test_a_scheduler_without_a_directory_keeps_the_budgeted_checks() -> None:
    """A scheduler with no ``key_ids_since`` (an older one) is asked once at most; keys are
    checked as before."""
    ann_key, bad_key = new_api_key(), new_api_key()
    scheduler = _CountingScheduler({ann_key: _tenant("ann")})
    auth = Authenticator(scheduler)

    async def run() -> list[grpc.StatusCode]:
        return [await _code(auth.tenant, _Ctx(bad_key)), await _code(auth.tenant, _Ctx(ann_key)),
                await _code(auth.tenant, _Ctx(new_api_key()))]

    assert asyncio.run(run()) == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK,
                                  grpc.StatusCode.UNAUTHENTICATED]
    assert scheduler.calls[:2] == [bad_key, ann_key] and len(scheduler.calls) == 3
    assert auth.directory.refreshes == 1


def test_directory_refreshes_per_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="refreshes_per_s"):
        Authenticator(_CountingScheduler({}), directory_refreshes_per_s=0)


# The store's side: ``TenantStore.key_ids_since``.


@pytest.fixture
def memory_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory in memory (``/dev/shm``, where it is a writable tmpfs; else ``tmp_path``):
    the store's commits there skip the disk's fsync (~11 ms each here, ~20 s of the 2,000-odd
    rotations below on the shared host's disk; ~0.5 ms in memory). The store's code is the same."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="kvstrata-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_store_key_ids_since_answers_deltas_then_everything_when_too_far_behind(memory_dir: Path) -> None:
    """A caller that heard ``(epoch, version)`` gets what changed since (a rotation: the new id
    added, the old removed; an id added then removed: removed); another epoch, a version
    ahead, or one over ``KEY_LOG_LENGTH`` changes behind gets every key id."""
    store = TenantStore(memory_dir / "t.sqlite")
    admin_id = parse_key_id(store.ensure_admin_key() or "")
    first = store.key_ids_since("", -1)
    assert (first.full, first.added, first.removed) == (True, (admin_id,), ())

    _, ann_key = store.register(TenantSpec("ann"))
    _, bob_key = store.register(TenantSpec("bob"))
    new_ann_key = store.rotate_key("ann")
    store.delete("bob")
    delta = store.key_ids_since(first.epoch, first.version)
    assert (delta.epoch, delta.version, delta.full) == (first.epoch, first.version + 5, False)
    assert delta.added == (parse_key_id(new_ann_key),)
    assert delta.removed == tuple(sorted([parse_key_id(ann_key), parse_key_id(bob_key)]))
    assert store.key_ids_since(delta.epoch, delta.version)[2:] == (False, (), ())

    everything = (True, tuple(sorted([admin_id, parse_key_id(new_ann_key)])), ())
    assert store.key_ids_since("fedcba9876543210", delta.version)[2:] == everything
    assert store.key_ids_since(delta.epoch, delta.version + 1)[2:] == everything
    for _ in range(KEY_LOG_LENGTH // 2 + 1):
        store.rotate_key("ann")
    far = store.key_ids_since(delta.epoch, delta.version)
    assert far.full and len(far.added) == 2
    store.close()


def test_store_key_ids_since_sees_another_connections_write(tmp_path: Path) -> None:
    """``kvstrata admin rotate-key --local`` writes the store's file from another process: the
    next answer is a new epoch with every key id (the new admin key's included)."""
    store = TenantStore(tmp_path / "t.sqlite")
    store.ensure_admin_key()
    first = store.key_ids_since("", -1)
    other = TenantStore(tmp_path / "t.sqlite")
    new_admin = new_api_key()
    other.set_admin_key(new_admin)
    other.close()
    after = store.key_ids_since(first.epoch, first.version)
    assert after.epoch != first.epoch
    assert (after.full, after.added) == (True, (parse_key_id(new_admin),))
    assert store.key_ids_since(after.epoch, after.version)[2:] == (False, (), ())
    store.close()


def test_a_rolled_back_change_is_not_announced(tmp_path: Path) -> None:
    """A registration refused (the name exists) adds no key id to the directory."""
    store = TenantStore(tmp_path / "t.sqlite")
    store.register(TenantSpec("ann"))
    first = store.key_ids_since("", -1)
    with pytest.raises(TenantExistsError):
        store.register(TenantSpec("ann"))
    assert store.key_ids_since(first.epoch, first.version)[1:] == (first.version, False, (), ())
    with sqlite3.connect(tmp_path / "t.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM api_keys").fetchone() == (1,)
    conn.close()
    store.close()
