"""A call whose tenant store fails gets one answer over gRPC and over OpenAI's HTTP API: the
server's trouble, never a client's 4xx. A retry may help (busy, locked, the disk full,
read-only or failing): gRPC UNAVAILABLE with ``retry-after-ms``, HTTP 503 with
``Retry-After``; it cannot (the file corrupt or not a database): DATA_LOSS, HTTP 500 with
``x-should-retry: false`` and a message naming tenants.sqlite; never a path or a traceback.

Regression (s41): a full store was RESOURCE_EXHAUSTED, which the HTTP API answers as the
client's rate limit (429 ``rate_limit_error``), and no store failure carried ``retry-after-ms``
(no ``Retry-After``); a corrupt store's 500 was retried by the ``openai`` client.

Real SQLite errors of each kind (no error built by hand), the real ``HttpCallContext`` and
``CallAborted``; end to end, a real ``GlobalSchedulerService`` whose store file another
connection locks, then overwrites, behind the real gRPC gateway (``gateway_harness.serve``)
and the real ``HttpServer`` / ``OpenAIEdge`` on the same scheduler.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import types
import urllib.error
import urllib.request
from collections.abc import Callable
from email.message import Message
from pathlib import Path

import grpc
import pytest

from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.context import CallAborted, HttpCallContext
from services.openai_api.server import HttpServer
from services.store_failures import abort_store_failure
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor, serve


def _raised(fn: Callable[[], object]) -> sqlite3.Error:
    try:
        fn()
    except sqlite3.Error as exc:
        return exc
    raise AssertionError("no sqlite3.Error")


def _full(d: Path) -> sqlite3.Error:
    conn = sqlite3.connect(d / "full.db")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")

    def insert() -> None:
        with conn:
            conn.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    return _raised(insert)


def _busy(d: Path) -> sqlite3.Error:
    sqlite3.connect(d / "busy.db").execute("CREATE TABLE t (x)").connection.commit()
    other = sqlite3.connect(d / "busy.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        return _raised(lambda: sqlite3.connect(d / "busy.db", timeout=0).execute("SELECT * FROM t").fetchall())
    finally:
        other.execute("ROLLBACK")


def _locked(d: Path) -> sqlite3.Error:
    conn = sqlite3.connect(d / "locked.db", isolation_level=None)
    conn.execute("CREATE TABLE t (x)")
    conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(3)])
    reading = conn.execute("SELECT * FROM t")
    reading.fetchone()
    return _raised(lambda: conn.execute("DROP TABLE t"))


def _readonly(d: Path) -> sqlite3.Error:
    sqlite3.connect(d / "ro.db").execute("CREATE TABLE t (x)").connection.commit()
    return _raised(lambda: sqlite3.connect(f"file:{d / 'ro.db'}?mode=ro", uri=True).execute("INSERT INTO t VALUES (1)"))


def _cantopen(d: Path) -> sqlite3.Error:
    return _raised(lambda: sqlite3.connect(d / "no such folder" / "tenants.sqlite").execute("SELECT 1"))


def _notadb(d: Path) -> sqlite3.Error:
    conn = sqlite3.connect(d / "notadb.db")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    with (d / "notadb.db").open("r+b") as f:
        f.write(b"not a database, overwritten!")  # SQLite's header and its change counter
    return _raised(lambda: conn.execute("SELECT * FROM t").fetchall())


def _corrupt(d: Path) -> sqlite3.Error:
    conn = sqlite3.connect(d / "corrupt.db")
    conn.execute("CREATE TABLE t (x)")
    conn.executemany("INSERT INTO t VALUES (?)", [(b"y" * 200,) for _ in range(100)])
    conn.commit()
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    conn.close()
    with (d / "corrupt.db").open("r+b") as f:
        f.seek(page_size)  # the table's root page
        f.write(b"\xff" * 64)
    return _raised(lambda: sqlite3.connect(d / "corrupt.db").execute("SELECT sum(length(x)) FROM t").fetchall())


# (SQLite's cause, the error's maker, gRPC status, retry-after-ms, HTTP status)
KINDS = [
    ("SQLITE_FULL", _full, grpc.StatusCode.UNAVAILABLE, 10_000, 503),
    ("SQLITE_BUSY", _busy, grpc.StatusCode.UNAVAILABLE, 1000, 503),
    ("SQLITE_LOCKED", _locked, grpc.StatusCode.UNAVAILABLE, 1000, 503),
    ("SQLITE_READONLY", _readonly, grpc.StatusCode.UNAVAILABLE, 10_000, 503),
    ("SQLITE_CANTOPEN", _cantopen, grpc.StatusCode.UNAVAILABLE, 10_000, 503),
    ("SQLITE_NOTADB", _notadb, grpc.StatusCode.DATA_LOSS, None, 500),
    ("SQLITE_CORRUPT", _corrupt, grpc.StatusCode.DATA_LOSS, None, 500),
]


class _GrpcCall:
    """What a gRPC servicer's context is told: the trailers, then the abort."""

    def __init__(self) -> None:
        self.trailers: dict[str, str] = {}

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailers.update(metadata)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAborted(code, details)


def _http_request() -> HttpCallContext:
    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [], "client": ("127.0.0.1", 5)}
    return HttpCallContext(types.SimpleNamespace(headers={}, client=types.SimpleNamespace(host="127.0.0.1", port=5),
                                                 scope=scope))  # type: ignore[arg-type]


@pytest.mark.parametrize("cause, make, code, retry_after_ms, http", KINDS, ids=[k[0] for k in KINDS])
def test_each_store_failure_kind_is_the_servers_trouble_alike_over_grpc_and_http(
        tmp_path: Path, cause: str, make: Callable[[Path], sqlite3.Error], code: grpc.StatusCode,
        retry_after_ms: int | None, http: int) -> None:
    """The real SQLite error of ``cause`` through ``abort_store_failure``: gRPC's status and
    ``retry-after-ms`` trailer; the HTTP API's status, ``Retry-After`` (seconds, rounded up),
    ``x-should-retry`` and OpenAI error body from the same abort; no 4xx, no path, no traceback."""
    exc = make(tmp_path)
    assert exc.sqlite_errorname.startswith(cause), exc.sqlite_errorname

    grpc_call = _GrpcCall()
    with pytest.raises(CallAborted) as over_grpc:
        asyncio.run(abort_store_failure(grpc_call, "authenticate", exc))  # type: ignore[arg-type]
    assert over_grpc.value.code == code, over_grpc.value.message
    assert grpc_call.trailers.get("retry-after-ms") == (None if retry_after_ms is None else str(retry_after_ms))

    with pytest.raises(CallAborted) as over_http:
        asyncio.run(abort_store_failure(_http_request(), "authenticate", exc))  # type: ignore[arg-type]
    assert over_http.value.code == code and over_http.value.message == over_grpc.value.message
    response = over_http.value.response()
    body = response.body.decode()
    assert response.status_code == http, body
    if retry_after_ms is None:
        assert "retry-after" not in response.headers and response.headers["x-should-retry"] == "false"
        assert "tenants.sqlite" in body and "restore" in body and '"internal_error"' in body, body
        assert '"code":"data_loss"' in body, body
    else:
        assert response.headers["Retry-After"] == str(math.ceil(retry_after_ms / 1000))
        assert "x-should-retry" not in response.headers
        assert '"service_unavailable"' in body and "nothing changed; retry" in body, body
    assert str(tmp_path) not in body and "Traceback" not in body and "sqlite3" not in body


def test_a_key_check_the_store_fails_is_answered_alike_over_grpc_and_http(tmp_path: Path) -> None:
    """A tenant's key checked while another connection holds the store's file exclusively:
    gRPC ``GetTenant`` UNAVAILABLE with ``retry-after-ms`` 1000, HTTP ``GET /v1/models`` 503
    with ``Retry-After: 1``; the file's header overwritten: DATA_LOSS, and HTTP 500
    ``data_loss`` with ``x-should-retry: false``, naming tenants.sqlite; the store freed again
    (before the overwrite), the same key passes both; another tenant's key is checked after
    the overwrite (the first one's pass is cached)."""
    with serve(tmp_path) as gw:
        gw.scheduler.store._conn.execute("PRAGMA busy_timeout = 0")  # (5 s by default)
        keys = {name: gw.scheduler.store.register(TenantSpec(name))[1] for name in ("ann", "bob")}
        auth = Authenticator(LocalActor(gw.scheduler))
        server = HttpServer(create_app(OpenAIEdge(types.SimpleNamespace(auth=auth), "m@0:f16", list,  # type: ignore[arg-type]
                                                  lambda: 1)))
        port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), gw.loop).result(10)
        channel = grpc.insecure_channel(gw.address)
        stub = tenant_pb2_grpc.TenantServiceStub(channel)

        def over_grpc(name: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
            try:
                stub.GetTenant(tenant_pb2.GetTenantRequest(name=name),
                               metadata=(("authorization", f"Bearer {keys[name]}"),), timeout=10)
            except grpc.RpcError as err:
                return err.code(), err.details(), dict(err.trailing_metadata() or ())
            return grpc.StatusCode.OK, "", {}

        def over_http(name: str) -> tuple[int, str, Message]:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models")
            request.add_header("Authorization", f"Bearer {keys[name]}")
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status, reply.read().decode(), reply.headers
            except urllib.error.HTTPError as err:
                return err.code, err.read().decode(), err.headers  # (its names case-insensitive)

        try:
            path = tmp_path / "tenants.sqlite"
            other = sqlite3.connect(path, isolation_level=None, timeout=0)
            other.execute("BEGIN EXCLUSIVE")
            other.execute("DELETE FROM tenants WHERE 0")  # the exclusive lock taken now
            try:
                code, details, trailers = over_grpc("ann")
                status, body, headers = over_http("ann")
            finally:
                other.execute("ROLLBACK")
                other.close()
            assert code == grpc.StatusCode.UNAVAILABLE and "busy" in details, (code, details)
            assert trailers.get("retry-after-ms") == "1000", trailers
            assert status == 503 and headers.get("Retry-After") == "1", (status, headers, body)
            assert "busy" in body and "x-should-retry" not in headers, body

            assert over_grpc("ann")[0] == grpc.StatusCode.OK
            assert over_http("ann")[0] == 200

            with path.open("r+b") as f:
                f.write(b"not a database, overwritten!")  # SQLite's header and its change counter
            code, details, trailers = over_grpc("bob")  # (ann's key passed lately: cached)
            status, body, headers = over_http("bob")
            assert code == grpc.StatusCode.DATA_LOSS and "tenants.sqlite" in details, (code, details)
            assert "retry-after-ms" not in trailers
            assert status == 500 and '"code":"data_loss"' in body and "tenants.sqlite" in body, (status, body)
            assert headers.get("x-should-retry") == "false" and "Retry-After" not in headers, headers
            for said in (details, body):
                assert str(tmp_path) not in said and "Traceback" not in said
        finally:
            channel.close()
            asyncio.run_coroutine_threadsafe(server.stop(), gw.loop).result(10)


def test_list_tenants_the_store_fails_is_data_loss_not_unknown(tmp_path: Path) -> None:
    """The tenants table's root page overwritten (the admin key's row, in another table, still
    read): ``ListTenants`` with the admin key fails DATA_LOSS naming tenants.sqlite, as every
    other admin call, never UNKNOWN "Unexpected <class 'sqlite3.DatabaseError'>".

    Regression (s41 diff review r1 of fd7d785): ``ListTenants`` awaited the scheduler outside
    ``gateway_admin._call``, so its store failure reached gRPC uncaught."""
    with serve(tmp_path) as gw:
        for name in ("ann", "bob"):
            gw.scheduler.store.register(TenantSpec(name))
        path = tmp_path / "tenants.sqlite"
        look = sqlite3.connect(path)
        root = look.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tenants'").fetchone()[0]
        page_size = look.execute("PRAGMA page_size").fetchone()[0]
        look.close()
        with path.open("r+b") as f:
            f.seek((root - 1) * page_size)
            f.write(b"\xff" * 64)
            f.seek(24)  # the file change counter: the scheduler's connection drops its page cache
            counter = int.from_bytes(f.read(4), "big")
            f.seek(24)
            f.write((counter + 1).to_bytes(4, "big"))
        with grpc.insecure_channel(gw.address) as channel, pytest.raises(grpc.RpcError) as failed:
            tenant_pb2_grpc.TenantServiceStub(channel).ListTenants(
                tenant_pb2.ListTenantsRequest(), metadata=(("authorization", f"Bearer {gw.admin_key}"),), timeout=10)
    err = failed.value
    assert err.code() == grpc.StatusCode.DATA_LOSS, (err.code(), err.details())
    assert "tenants.sqlite" in err.details() and "restore" in err.details(), err.details()
    assert "Unexpected" not in err.details() and str(tmp_path) not in err.details()
    assert "retry-after-ms" not in dict(err.trailing_metadata() or ())
