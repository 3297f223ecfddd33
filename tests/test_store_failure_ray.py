"""A tenant store failure raised inside the real scheduler actor's method (a Ray task error
carrying the ``sqlite3.Error``) reaches a gRPC client as the status of its SQLite cause, with
its ``retry-after-ms``, and never as UNKNOWN with Ray's remote traceback.

The mapping was checked only with Ray's task error built in-process (``as_instanceof_cause``);
here the error crosses a real Ray worker: a real ``GlobalSchedulerActor`` on the session's
cluster, its store file on disk locked by another connection (busy) and then overwritten
(not a database), behind the gateway's real ``TenantServicer`` and ``Authenticator`` on a real
gRPC server.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import grpc
import pytest
import ray

from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.gateway_admin import TenantServicer
from services.global_scheduler_admission import GlobalSchedulerActor
from tenants.model import TenantSpec


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):  # type: ignore[no-untyped-def]
    yield


async def _get_tenant(scheduler: object, name: str, key: str) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """``GetTenant(name)`` with ``key`` through a fresh gateway (no key cached) on a real
    gRPC server over the actor ``scheduler``: (status, details, trailers)."""
    server = grpc.aio.server()
    tenant_pb2_grpc.add_TenantServiceServicer_to_server(TenantServicer(scheduler, Authenticator(scheduler)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await tenant_pb2_grpc.TenantServiceStub(channel).GetTenant(
                    tenant_pb2.GetTenantRequest(name=name), metadata=(("authorization", f"Bearer {key}"),), timeout=60)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details() or "", dict(err.trailing_metadata() or ())
            return grpc.StatusCode.OK, "", {}
    finally:
        await server.stop(0)


def test_a_store_failure_in_the_scheduler_actor_reaches_the_grpc_client_as_its_status(tmp_path: Path) -> None:
    """Ann's key checked while another connection holds the store exclusively (the actor's
    connection waits its 5 s busy timeout): UNAVAILABLE, ``retry-after-ms`` 1000, "busy";
    the lock gone, it passes; bob's key after the file's header is overwritten: DATA_LOSS
    naming tenants.sqlite, no ``retry-after-ms``; neither with a traceback or the path."""
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(str(tmp_path), {"n0": 1})
    try:
        keys = {name: ray.get(scheduler.register_tenant.remote(spec=TenantSpec(name)), timeout=60)[1]
                for name in ("ann", "bob")}
        path = tmp_path / "tenants.sqlite"
        other = sqlite3.connect(path, isolation_level=None, timeout=0)
        other.execute("BEGIN EXCLUSIVE")
        other.execute("DELETE FROM tenants WHERE 0")  # the exclusive lock taken now
        try:
            busy = asyncio.run(_get_tenant(scheduler, "ann", keys["ann"]))
        finally:
            other.execute("ROLLBACK")
            other.close()
        passed = asyncio.run(_get_tenant(scheduler, "ann", keys["ann"]))
        with path.open("r+b") as f:
            f.write(b"not a database, overwritten!")  # SQLite's header and its change counter
        lost = asyncio.run(_get_tenant(scheduler, "bob", keys["bob"]))
    finally:
        ray.kill(scheduler)

    code, details, trailers = busy
    assert code == grpc.StatusCode.UNAVAILABLE and "busy" in details, busy
    assert trailers.get("retry-after-ms") == "1000", busy
    assert passed[0] == grpc.StatusCode.OK, passed
    code, details, trailers = lost
    assert code == grpc.StatusCode.DATA_LOSS and "tenants.sqlite" in details and "restore" in details, lost
    assert "retry-after-ms" not in trailers, lost
    for said in (busy[1], lost[1]):
        assert "Traceback" not in said and str(tmp_path) not in said and "ray::" not in said, said
