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
import time
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

import services.auth
import services.auth_limits
import tenants.keys
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.keys import new_api_key, parse_key_id
from tenants.model import Tenant, TenantSpec
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
    for SHA-256 rows); other tenants' keys and the admin key known at this gateway still work
    from the same peer. (secrev17 F2: a key never seen at this gateway waits there, as the
    peer spent its checks of unknown key ids.)"""
    with serve(tmp_path) as gw:
        _, ann_key = gw.scheduler.store.register(TenantSpec("ann"))
        _, bob_key = gw.scheduler.store.register(TenantSpec("bob"))
        if stored_as == "pbkdf2":
            _as_pbkdf2(tmp_path / "tenants.sqlite", ann_key)
        _, carol_key = gw.scheduler.store.register(TenantSpec("carol"))
        with grpc.insecure_channel(gw.address) as ch:
            stub = tenant_pb2_grpc.TenantServiceStub(ch)

            def rotate(name: str, key: str) -> grpc.StatusCode:
                try:
                    stub.RotateKey(tenant_pb2.RotateKeyRequest(name=name),
                                   metadata=(("authorization", f"Bearer {key}"),))
                except grpc.RpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            md = lambda key: (("authorization", f"Bearer {key}"),)
            stub.GetUsage(tenant_pb2.GetUsageRequest(name="bob"), metadata=md(bob_key))  # known here
            stub.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=md(gw.admin_key))
            codes = [rotate("ann", _wrong_secret(ann_key)) for _ in range(200)]
            flood_runs = len(pbkdf2_runs)
            with pytest.raises(grpc.RpcError) as not_admin:  # a tenant key on an admin call ...
                stub.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=md(bob_key))
            after = [rotate("bob", bob_key), rotate("ann", gw.admin_key)]  # ... still works as a tenant's
            never_seen = rotate("carol", carol_key)

    # authenticated, not allowed (a fresh-user trial got UNAUTHENTICATED for its valid key)
    assert not_admin.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not_admin.value.details() == "this call needs the admin key; a tenant's key may not make it"

    limit = gw.auth.failures_per_peer_key
    assert codes[:limit] == [grpc.StatusCode.UNAUTHENTICATED] * limit
    assert codes[limit:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (200 - limit)
    assert flood_runs <= (limit if stored_as == "pbkdf2" else 0)
    assert after == [grpc.StatusCode.OK, grpc.StatusCode.OK]
    assert never_seen == grpc.StatusCode.RESOURCE_EXHAUSTED


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


# secrev17 F2: unauthenticated traffic must not cost the scheduler work in proportion to its rate.
# These run the gateway's Authenticator over a scheduler that counts its calls (no Ray, no store).


class _Remote:
    """An actor method's ``.remote``: here a coroutine of the fake's method."""

    def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.fn = fn

    def remote(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.fn(*args, **kwargs)


class _CountingScheduler:
    """``authenticate`` / ``verify_admin_key`` over a fixed key table, recording every key asked
    about; while ``hold`` is set, checks of keys not in the table wait on it."""

    def __init__(self, tenants: dict[str, object], admin_key: str = "") -> None:
        self.tenants, self.admin_key = tenants, admin_key
        self.calls: list[str] = []
        self.hold: asyncio.Event | None = None
        self.authenticate = _Remote(self._authenticate)
        self.verify_admin_key = _Remote(self._verify_admin_key)

    async def _authenticate(self, api_key: str, allow_pbkdf2: bool = True) -> object | None:
        self.calls.append(api_key)
        if self.hold is not None and api_key not in self.tenants:
            await self.hold.wait()
        return self.tenants.get(api_key)

    async def _verify_admin_key(self, key: str, allow_pbkdf2: bool = True) -> bool:
        self.calls.append(key)
        return key == self.admin_key


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, retry_after_ms: int | None) -> None:
        super().__init__(code.name)
        self.code, self.retry_after_ms = code, retry_after_ms


class _Ctx:
    """A gRPC call's context as the authenticator reads it: its bearer key and its peer."""

    def __init__(self, key: str, host: str = "203.0.113.7") -> None:
        self.key, self.host, self.retry_after_ms = key, host, None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)

    def peer(self) -> str:
        return f"ipv4:{self.host}:4242"

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.retry_after_ms = int(dict(metadata)["retry-after-ms"])

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, self.retry_after_ms)


_PEER_CHECKS, _GATEWAY_CHECKS_PER_S, _IN_FLIGHT = 50, 100, 16
"""``Authenticator``'s defaults: failed checks of unknown key ids per address per window; such
checks per second at the gateway, at once at the gateway."""


def _tenant(name: str) -> Tenant:
    """A tenant record as the scheduler's ``authenticate`` answers it (the gateway checks its type)."""
    return Tenant(f"id-{name}", TenantSpec(name), 0.0)


async def _code(call, context: _Ctx) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        await call(context)
    except _Aborted as err:
        return err.code
    return grpc.StatusCode.OK


def _bad_keys(n: int) -> list[str]:
    """``n`` distinct bad keys: half malformed, half well-formed with random key ids."""
    return [new_api_key() if i % 2 else "x" * (i + 1) for i in range(n)]


@pytest.fixture
def no_key_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cached success expires at once: a valid key reaches the scheduler each time."""
    monkeypatch.setattr(services.auth, "_CACHE_TTL_S", 0.0)


def test_distinct_bad_keys_from_one_address_cost_the_scheduler_a_bounded_number_of_calls(no_key_cache) -> None:
    """Regression (secrev17 F2): 2000 distinct bad keys from one address made 2000 scheduler
    calls (the limit keyed on the key id). Malformed keys cost none; well-formed ones at most the
    address's allowance of unknown key ids; a valid key known here, a valid key first used from
    another address, and the admin key pass all through the flood, and wrong secrets for a known
    key id cost no call."""
    ann_key, bob_key, admin_key = new_api_key(), new_api_key(), new_api_key()
    ann, bob = _tenant("ann"), _tenant("bob")
    scheduler = _CountingScheduler({ann_key: ann, bob_key: bob}, admin_key)
    auth = Authenticator(scheduler)

    async def run() -> tuple[Counter, list[grpc.StatusCode], list[grpc.StatusCode]]:
        assert await auth.tenant(_Ctx(ann_key)) is ann  # known here from now on
        assert await _code(auth.admin, _Ctx(admin_key)) == grpc.StatusCode.OK
        codes, during, wrong = Counter(), [], []
        for i, key in enumerate(_bad_keys(2000)):
            codes[await _code(auth.tenant, _Ctx(key))] += 1
            if i % 200 == 0:
                during += [await _code(auth.tenant, _Ctx(ann_key)), await _code(auth.admin, _Ctx(admin_key)),
                           await _code(auth.admin_or_tenant, _Ctx(bob_key, f"198.51.100.{i // 200}"))]
                wrong.append(await _code(auth.tenant, _Ctx(_wrong_secret(ann_key))))
        return codes, during, wrong

    codes, during, wrong = asyncio.run(run())
    flood_calls = [k for k in scheduler.calls if k not in (ann_key, bob_key, admin_key)]

    assert not [k for k in flood_calls if parse_key_id(k) is None]  # malformed: never asked about
    assert len(flood_calls) <= _PEER_CHECKS
    assert codes[grpc.StatusCode.UNAUTHENTICATED] >= 1000  # every malformed key, the first checks
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 1000 - _PEER_CHECKS
    assert during == [grpc.StatusCode.OK] * len(during)
    assert grpc.StatusCode.OK not in wrong
    # before: ann, admin; each round: ann, admin, bob as admin then as a tenant (no cache here)
    assert len(scheduler.calls) == 2 + len(flood_calls) + 4 * (len(during) // 3)
    assert (auth.failures_per_peer, auth.unknown_checks_per_s, auth.unknown_checks_in_flight) == (
        _PEER_CHECKS, _GATEWAY_CHECKS_PER_S, _IN_FLIGHT)


def test_distinct_bad_keys_from_many_addresses_are_bounded_by_the_gateways_budget(no_key_cache) -> None:
    """secrev17 F2: 2000 well-formed bad keys, each from its own address (no address over its
    limit), cost at most ``unknown_checks_per_s`` scheduler calls per second at the gateway;
    a key known here passes from any of those addresses all the while."""
    ann_key = new_api_key()
    ann = _tenant("ann")
    scheduler = _CountingScheduler({ann_key: ann})
    auth = Authenticator(scheduler)

    async def run() -> tuple[Counter, list[grpc.StatusCode], float]:
        assert await auth.tenant(_Ctx(ann_key, "192.0.2.1")) is ann
        codes, during, start = Counter(), [], time.monotonic()
        for i in range(2000):
            host = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
            codes[await _code(auth.tenant, _Ctx(new_api_key(), host))] += 1
            if i % 100 == 0:
                during.append(await _code(auth.tenant, _Ctx(ann_key, host)))
        return codes, during, time.monotonic() - start

    codes, during, elapsed_s = asyncio.run(run())
    flood_calls = [k for k in scheduler.calls if k != ann_key]

    assert len(flood_calls) <= _GATEWAY_CHECKS_PER_S * (elapsed_s + 1)  # 2000 before the budget
    assert codes[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 2000 - len(flood_calls)
    assert during == [grpc.StatusCode.OK] * len(during)


def test_checks_of_unknown_keys_in_flight_at_the_scheduler_are_bounded(no_key_cache) -> None:
    """secrev17 F2: while the scheduler is slow, at most ``unknown_checks_in_flight`` checks of
    unknown keys wait on it, at most ``_PEER_CHECKS_IN_FLIGHT`` of them from one address (the
    others are refused RESOURCE_EXHAUSTED with a retry hint at once); a key known here still
    passes meanwhile."""
    ann_key = new_api_key()
    ann = _tenant("ann")
    scheduler = _CountingScheduler({ann_key: ann})
    auth = Authenticator(scheduler)

    async def run() -> tuple[list[object], int, int, grpc.StatusCode]:
        assert await auth.tenant(_Ctx(ann_key)) is ann
        scheduler.hold = asyncio.Event()
        contexts = [_Ctx(new_api_key(), "10.9.9.9") for _ in range(20)]  # one address first
        contexts += [_Ctx(new_api_key(), f"10.0.{i // 256}.{i % 256}") for i in range(180)]
        tasks = [asyncio.ensure_future(_code(auth.tenant, ctx)) for ctx in contexts]
        for _ in range(5):
            await asyncio.sleep(0)
        waiting = len(scheduler.calls) - 1
        from_one_address = len({ctx.key for ctx in contexts[:20]} & set(scheduler.calls))
        known = await _code(auth.tenant, _Ctx(ann_key, "10.0.0.1"))
        scheduler.hold.set()
        codes = await asyncio.gather(*tasks)
        return [(c, ctx.retry_after_ms) for c, ctx in zip(codes, contexts)], waiting, from_one_address, known

    results, waiting, from_one_address, known = asyncio.run(run())

    assert waiting == _IN_FLIGHT  # 200 before
    assert from_one_address == services.auth_limits._PEER_CHECKS_IN_FLIGHT  # 20 before
    refused = [ms for code, ms in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(refused) == 200 - _IN_FLIGHT and all(ms and ms > 0 for ms in refused)
    assert known == grpc.StatusCode.OK


def test_the_http_api_refuses_through_the_same_limits() -> None:
    """secrev17 F2, over the HTTP API (``GET /v1/models`` through the app): a malformed key is a
    401 with no scheduler call; distinct well-formed bad keys from one client address are 401,
    then 429 with ``Retry-After`` once the address spent its checks of unknown key ids; the
    scheduler saw at most that many."""
    from services.openai_api.app import OpenAIEdge, create_app

    scheduler = _CountingScheduler({})
    auth = Authenticator(scheduler)
    edge = OpenAIEdge(servicer=types.SimpleNamespace(auth=auth), model_id="m@0:f16", encode=list,  # type: ignore[arg-type]
                      num_healthy=lambda: 1)
    app = create_app(edge)

    async def get(key: str) -> tuple[int, dict[str, str]]:
        sent: list[dict] = []
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "path": "/v1/models", "raw_path": b"/v1/models", "query_string": b"", "scheme": "http",
                 "headers": [(b"authorization", f"Bearer {key}".encode())],
                 "client": ("203.0.113.9", 5000), "server": ("127.0.0.1", 8000), "root_path": ""}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return sent[0]["status"], {k.decode(): v.decode() for k, v in sent[0]["headers"]}

    async def run() -> tuple[int, list[tuple[int, dict[str, str]]]]:
        malformed = (await get("not-a-key-" + secrets.token_hex(8)))[0]
        return malformed, [await get(new_api_key()) for _ in range(200)]

    malformed, answers = asyncio.run(run())

    assert malformed == 401
    statuses = [status for status, _ in answers]
    assert len(scheduler.calls) == statuses.count(401) == _PEER_CHECKS
    assert statuses[_PEER_CHECKS:] == [429] * (200 - _PEER_CHECKS)
    assert all("retry-after" in {k.lower() for k in headers} for status, headers in answers if status == 429)


class _Ctx6(_Ctx):
    """A call from an IPv6 address, its peer written as grpc writes it (percent-encoded)."""

    def peer(self) -> str:
        return f"ipv6:%5B{self.host}%5D:4242"


def test_rotating_ipv6_addresses_of_one_network_share_its_failure_limits(no_key_cache) -> None:
    """Regression: the failure limits keyed on the whole client address, so a client rotating
    through the addresses of its IPv6 /64 had every allowance anew: wrong secrets for a known key
    id were checked without end, and each new address spent another ``failures_per_peer``
    scheduler checks of unknown key ids (2000 calls for 2000 keys). Now one /64 is one client
    network: another /64, and ann's own key from the attacked /64, are unaffected."""
    ann_key = new_api_key()
    ann = _tenant("ann")
    scheduler = _CountingScheduler({ann_key: ann})
    auth = Authenticator(scheduler)
    attacker = [f"2001:db8:7:7::{i:x}" for i in range(1, 2001)]

    async def run() -> tuple[list[grpc.StatusCode], Counter, list[grpc.StatusCode]]:
        assert await auth.tenant(_Ctx6(ann_key, "2001:db8:1:1::1")) is ann
        wrong = [await _code(auth.tenant, _Ctx6(_wrong_secret(ann_key), host)) for host in attacker[:100]]
        unknown = Counter([await _code(auth.tenant, _Ctx6(new_api_key(), host)) for host in attacker])
        after = [await _code(auth.tenant, _Ctx6(ann_key, "2001:db8:7:7::ffff")),
                 await _code(auth.tenant, _Ctx6(_wrong_secret(ann_key), "2001:db8:1:2::1"))]
        return wrong, unknown, after

    wrong, unknown, after = asyncio.run(run())
    flood_calls = [k for k in scheduler.calls if k != ann_key]

    limit = auth.failures_per_peer_key
    assert wrong[:limit] == [grpc.StatusCode.UNAUTHENTICATED] * limit
    assert set(wrong[limit:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}  # 100 UNAUTHENTICATED before
    assert len(flood_calls) <= _PEER_CHECKS  # 2000 before
    assert unknown[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 2000 - _PEER_CHECKS
    assert after == [grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED]  # another /64: its own limit


def test_http_clients_are_counted_under_the_networks_grpc_peers_are() -> None:
    """The HTTP API's calls reach the authenticator with the client's address in gRPC's peer
    form, an IPv6 one bracketed, so both front ends count a client under one network."""
    from services.peers import grpc_peer, peer_network

    assert grpc_peer("203.0.113.9", 5000) == "ipv4:203.0.113.9:5000"
    assert grpc_peer("2001:db8:7:7::1", 5000) == "ipv6:[2001:db8:7:7::1]:5000"
    assert peer_network(grpc_peer("2001:db8:7:7::1", 5000)) == peer_network("ipv6:%5B2001:db8:7:7::9%5D:1") \
        == "ipv6:2001:db8:7:7::/64"
    assert peer_network(grpc_peer("::ffff:203.0.113.9", 1)) == peer_network("ipv4:203.0.113.9:2") == "ipv4:203.0.113.9"
    assert grpc_peer("/run/kvstrata.sock", 0) == "unix:/run/kvstrata.sock"
