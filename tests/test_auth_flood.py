"""A flood of wrong API-key secrets costs few PBKDF2 runs and never blocks the scheduler's
event loop (issue 18 fault 9: PBKDF2 for failed key checks ran on the scheduler actor without
caching or rate limiting), and never locks out the key's holder (secrev16 fault A).

Keys are stored as SHA-256 now; PBKDF2 runs only for an earlier version's rows (``_as_pbkdf2``
makes one). Runs are counted by wrapping ``tenants.keys._pbkdf2`` (the one place that runs
it); the store, the gateway's servicers and gRPC are real.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

import tenants.keys
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.keys import parse_key_id
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tests.gateway_harness import serve


@pytest.fixture
def pbkdf2_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Thread ids of every PBKDF2 run of the store."""
    runs: list[int] = []
    real = tenants.keys._pbkdf2

    def counted(api_key, salt, iterations):  # type: ignore[no-untyped-def]
        runs.append(threading.get_ident())
        return real(api_key, salt, iterations)

    monkeypatch.setattr(tenants.keys, "_pbkdf2", counted)
    return runs


def _as_pbkdf2(db_path: Path, api_key: str) -> None:
    """Store ``api_key`` as an earlier version did: a PBKDF2 row (1,000 iterations, for speed)."""
    salt = secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", api_key.encode(), salt, 1000)  # not counted
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE api_keys SET salt = ?, iterations = ?, digest = ? WHERE key_id = ?",
                     (salt, 1000, digest, parse_key_id(api_key)))
    conn.close()


def _wrong_secret(api_key: str) -> str:
    """``api_key``'s key id with another random secret."""
    return api_key[: len("kvs_0123456789ab_")] + secrets.token_urlsafe(32)


def test_store_flood_of_wrong_secrets_runs_no_pbkdf2(tmp_path: Path, pbkdf2_runs) -> None:
    """issue 18 fault 9, secrev16 fault A: 200 wrong secrets for one key id against SHA-256
    rows cost no PBKDF2 at all, and the valid keys work during and after the flood."""
    store = TenantStore(tmp_path / "t.sqlite")
    ann, ann_key = store.register(TenantSpec("ann"))
    bob, bob_key = store.register(TenantSpec("bob"))
    wrong = [_wrong_secret(ann_key) for _ in range(200)]
    assert [store.authenticate(k) for k in wrong] == [None] * 200
    assert store.authenticate(ann_key) == ann
    assert store.authenticate(bob_key) == bob
    assert pbkdf2_runs == []


def test_store_flood_against_a_pbkdf2_row_is_bounded_and_never_refuses_its_key(tmp_path: Path, pbkdf2_runs) -> None:
    """secrev16 fault A: against an earlier version's PBKDF2 row, each distinct wrong secret
    costs one run (a repeated one none, and none at all with ``allow_pbkdf2=False``); the
    correct key passes after any number of them, and its row then is SHA-256 (no more runs)."""
    store = TenantStore(tmp_path / "t.sqlite")
    ann, ann_key = store.register(TenantSpec("ann"))
    store.close()
    _as_pbkdf2(tmp_path / "t.sqlite", ann_key)
    store = TenantStore(tmp_path / "t.sqlite")

    wrong = [_wrong_secret(ann_key) for _ in range(50)]
    assert [store.authenticate(k) for k in wrong + wrong[:10]] == [None] * 60
    assert len(pbkdf2_runs) == 50
    assert store.authenticate(ann_key, allow_pbkdf2=False) is None  # not verified yet: not checked
    assert len(pbkdf2_runs) == 50
    assert store.authenticate(ann_key) == ann
    assert len(pbkdf2_runs) == 51
    assert [store.authenticate(k) for k in [_wrong_secret(ann_key) for _ in range(50)]] == [None] * 50
    assert store.authenticate(ann_key, allow_pbkdf2=False) == ann
    assert len(pbkdf2_runs) == 51  # rewritten as SHA-256


def test_verified_cache_forgets_rotated_and_deleted_keys(tmp_path: Path) -> None:
    """issue 18 fault 9: the verified-key cache never outlives a rotation or a deletion."""
    store = TenantStore(tmp_path / "t.sqlite")
    ann, ann_key = store.register(TenantSpec("ann"))
    assert store.authenticate(ann_key) == ann
    new_key = store.rotate_key("ann")
    assert store.authenticate(ann_key) is None
    assert store.authenticate(new_key) == ann
    store.delete("ann")
    assert store.authenticate(new_key) is None


def test_scheduler_runs_pbkdf2_off_its_event_loop(tmp_path: Path, pbkdf2_runs) -> None:
    """issue 18 fault 9: the actor's authenticate awaits PBKDF2 in a thread; the loop keeps turning."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    ann, ann_key = scheduler.store.register(TenantSpec("ann"))
    _as_pbkdf2(tmp_path / "tenants.sqlite", ann_key)

    async def run() -> tuple[object, int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        tenant = await scheduler.authenticate(ann_key)
        admin = await scheduler.verify_admin_key(_wrong_secret(ann_key))
        task.cancel()
        assert admin is False
        return tenant, ticks, threading.get_ident()

    tenant, ticks, loop_thread = asyncio.run(run())

    assert tenant == ann
    assert len(pbkdf2_runs) == 1 and pbkdf2_runs[0] != loop_thread
    assert ticks >= 2  # the loop ran while PBKDF2 did


@pytest.mark.parametrize("stored_as", ["sha256", "pbkdf2"])
def test_gateway_flood_is_refused_cheaply_and_valid_keys_still_work(tmp_path: Path, pbkdf2_runs, stored_as) -> None:
    """issue 18 fault 9: 200 wrong secrets for one key id over gRPC: UNAUTHENTICATED, then
    RESOURCE_EXHAUSTED for that key id from that peer, far fewer PBKDF2 runs than calls (none
    for SHA-256 rows); other tenants' keys (first use) and the admin key still work from the
    same peer."""
    with serve(tmp_path) as gw:
        _, ann_key = gw.scheduler.store.register(TenantSpec("ann"))
        _, bob_key = gw.scheduler.store.register(TenantSpec("bob"))
        if stored_as == "pbkdf2":
            _as_pbkdf2(tmp_path / "tenants.sqlite", ann_key)
        with grpc.insecure_channel(gw.address) as ch:
            stub = tenant_pb2_grpc.TenantServiceStub(ch)

            def rotate(name: str, key: str) -> grpc.StatusCode:
                try:
                    stub.RotateKey(tenant_pb2.RotateKeyRequest(name=name),
                                   metadata=(("authorization", f"Bearer {key}"),))
                except grpc.RpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            codes = [rotate("ann", _wrong_secret(ann_key)) for _ in range(200)]
            flood_runs = len(pbkdf2_runs)
            with pytest.raises(grpc.RpcError) as not_admin:  # a tenant key on an admin call ...
                stub.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=(("authorization", f"Bearer {bob_key}"),))
            after = [rotate("bob", bob_key), rotate("ann", gw.admin_key)]  # ... still works as a tenant's

    # authenticated, not allowed (a fresh-user trial got UNAUTHENTICATED for its valid key)
    assert not_admin.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not_admin.value.details() == "this call needs the admin key; a tenant's key may not make it"

    limit = gw.auth.failures_per_peer_key
    assert codes[:limit] == [grpc.StatusCode.UNAUTHENTICATED] * limit
    assert codes[limit:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (200 - limit)
    assert flood_runs <= (limit if stored_as == "pbkdf2" else 0)
    assert after == [grpc.StatusCode.OK, grpc.StatusCode.OK]


def test_burst_of_a_new_valid_key_costs_one_pbkdf2_run(tmp_path: Path, pbkdf2_runs) -> None:
    """issue 18 fault 9: 30 concurrent first uses of a key with a PBKDF2 row all pass and
    cost one PBKDF2 run."""
    store = TenantStore(tmp_path / "t.sqlite")
    ann, ann_key = store.register(TenantSpec("ann"))
    _as_pbkdf2(tmp_path / "t.sqlite", ann_key)
    with ThreadPoolExecutor(max_workers=30) as pool:
        results = list(pool.map(lambda _: store.authenticate(ann_key), range(30)))

    assert results == [ann] * 30
    assert len(pbkdf2_runs) == 1


def test_flood_for_a_key_id_does_not_lock_out_its_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 18 fault 9 (found by bench.chaos fuzz): wrong secrets for the admin key's id from
    one address made the real admin key, once its 10 s cache entry expired, RESOURCE_EXHAUSTED
    from that address too. A key that passed a check lately is never refused by the limit."""
    import services.auth

    monkeypatch.setattr(services.auth, "_CACHE_TTL_S", 0.0)  # every cached success expires at once
    with serve(tmp_path) as gw, grpc.insecure_channel(gw.address) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)

        def list_as(key: str) -> grpc.StatusCode:
            try:
                stub.ListTenants(tenant_pb2.ListTenantsRequest(),
                                 metadata=(("authorization", f"Bearer {key}"),))
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        first = list_as(gw.admin_key)
        flood = [list_as(_wrong_secret(gw.admin_key)) for _ in range(30)]
        after = [list_as(gw.admin_key) for _ in range(3)]
        still_limited = list_as(_wrong_secret(gw.admin_key))

    limit = gw.auth.failures_per_peer_key
    assert first == grpc.StatusCode.OK
    assert flood == [grpc.StatusCode.UNAUTHENTICATED] * limit + [grpc.StatusCode.RESOURCE_EXHAUSTED] * (30 - limit)
    assert after == [grpc.StatusCode.OK] * 3
    assert still_limited == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_key_refused_twice_gets_the_same_message(tmp_path: Path) -> None:
    """A fresh-user trial: an old admin key got "this call needs the admin key", then, tried
    again, "missing or unknown API key" (the cached refusal reused the tenant message)."""
    with serve(tmp_path) as gw, grpc.insecure_channel(gw.address) as channel:
        stub = tenant_pb2_grpc.TenantServiceStub(channel)
        old = ((("authorization", f"Bearer {_wrong_secret(gw.admin_key)}"),))
        details = []
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                stub.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=old)
            details.append((err.value.code(), err.value.details()))
    assert details == [(grpc.StatusCode.UNAUTHENTICATED, "this call needs the admin key")] * 2


def test_a_valid_key_passes_from_an_address_over_its_failure_limit(tmp_path: Path, pbkdf2_runs) -> None:
    """Regression (secrev16 fault B): another client's wrong secrets for a key id from a shared
    address put the address over its failure limit, and the key's holder, not seen there
    lately, got RESOURCE_EXHAUSTED. A key that verifies (a SHA-256 row: no PBKDF2 to bound)
    passes over the limit, as a tenant's key and as the admin key; wrong ones stay refused."""
    with serve(tmp_path) as gw, grpc.insecure_channel(gw.address) as ch:
        _, ann_key = gw.scheduler.store.register(TenantSpec("ann"))
        stub = tenant_pb2_grpc.TenantServiceStub(ch)

        def call(rpc, request, key: str) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
            try:
                rpc(request, metadata=(("authorization", f"Bearer {key}"),))
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        usage = lambda key: call(stub.GetUsage, tenant_pb2.GetUsageRequest(name="ann"), key)
        listing = lambda key: call(stub.ListTenants, tenant_pb2.ListTenantsRequest(), key)
        limit = gw.auth.failures_per_peer_key
        flood = [usage(_wrong_secret(ann_key)) for _ in range(limit + 1)]
        admin_flood = [listing(_wrong_secret(gw.admin_key)) for _ in range(limit + 1)]
        after = [usage(ann_key), listing(gw.admin_key), usage(gw.admin_key)]
        wrong_after = [usage(_wrong_secret(ann_key)), listing(_wrong_secret(gw.admin_key))]

    assert flood[-1] == admin_flood[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after == [grpc.StatusCode.OK] * 3
    assert wrong_after == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert pbkdf2_runs == []
