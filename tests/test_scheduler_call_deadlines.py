"""The gateway's calls to a global scheduler that is alive but silent (stopped, deadlocked)
end within ``scheduler_timeout_s`` (``services.actor_calls.BoundedActor``), UNAVAILABLE with
a retry hint naming the scheduler, and nothing is cached from them: once it answers again, the
same calls pass. Regression (review 29a F2): with the scheduler SIGSTOPped for 90 s, a call
whose key was not in the gateway's 10-s cache, CloseSession, every Tenant/Admin call and the
HTTP API for such keys waited until SIGCONT (89 s; no bound at all).

The real ``gateway_server.create_server`` and ``GlobalSchedulerService``; the scheduler's
silence is a gate its handle's calls wait on (what a stopped actor's callers see: no answer,
no error)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstrata.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tenant_pb2,
    tenant_pb2_grpc,
)
from services import gateway_server
from services.actor_calls import ActorSilent, BoundedActor
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.test_grpc_connection_bounds import QUICK

TIMEOUT_S = 0.5


class Silenceable:
    """A scheduler's handle whose calls get no answer while ``silent`` is set (sent, never
    answered until it is cleared)."""

    def __init__(self, obj: Any) -> None:
        self.obj, self.awake = obj, asyncio.Event()
        self.awake.set()
        self.only: set[str] | None = None  # the methods that get no answer (None: every one)
        self.sent: list[str] = []  # the calls sent, in order

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.obj, name)

        async def run(*args: Any, **kwargs: Any) -> Any:
            self.sent.append(name)
            if self.only is None or name in self.only:
                await self.awake.wait()
            result = fn(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return type("M", (), {"remote": staticmethod(lambda *a, **kw: asyncio.ensure_future(run(*a, **kw)))})()


@dataclass
class SilenceableGateway:
    """A real gateway (``create_server``) over a real ``GlobalSchedulerService`` behind a
    ``Silenceable`` handle, a tenant's and the admin's key."""

    scheduler: GlobalSchedulerService
    handle: Silenceable
    port: int
    monitor: Any
    key: str
    admin_key: str


@contextlib.asynccontextmanager
async def silenceable_gateway(tmp_path: Path, timeout_s: float,
                              data_address: str | None = "tcp://127.0.0.1:9") -> AsyncIterator[SilenceableGateway]:
    """The gateway served and SERVING, its scheduler calls bounded by ``timeout_s``, admitting
    at ``data_address`` (None: the scheduler's own admission socket); everything stopped (and
    the scheduler awake) after."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    admin_key = scheduler.store.ensure_admin_key() or ""
    _tenant, key = await scheduler.register_tenant(TenantSpec("t"))
    handle = Silenceable(scheduler)
    server, port, health, inference, monitor = await gateway_server.create_server(
        handle, {}, {"n0": NODE_INFO}, None, data_address or await scheduler.open_data_plane(), grpc_limits=QUICK,
        scheduler_timeout_s=timeout_s)
    await server.start()
    await gateway_server.set_health(health, True)
    try:
        yield SilenceableGateway(scheduler, handle, port, monitor, key, admin_key)
    finally:
        handle.awake.set()
        monitor.stop()
        await server.stop(0)
        inference.streams.shutdown()
        scheduler.store.close()


def test_bounded_actor_sends_at_once_and_bounds_only_the_wait() -> None:
    async def run() -> None:
        sent: list[str] = []

        class Handle:
            class slow:
                @staticmethod
                def remote(x: str) -> asyncio.Future[Any]:
                    sent.append(x)
                    return asyncio.get_running_loop().create_future()  # never answered
            version = "v1"

        bounded = BoundedActor(Handle(), 0.2, "the global scheduler")
        ref = bounded.slow.remote("fire-and-forget")  # not awaited: still sent
        assert sent == ["fire-and-forget"] and bounded.version == "v1"
        start = time.monotonic()
        with pytest.raises(ActorSilent, match="the global scheduler did not answer in 0.2 s"):
            await bounded.slow.remote("awaited")
        assert 0.15 < time.monotonic() - start < 2.0
        del ref
        with pytest.raises(ValueError):
            BoundedActor(Handle(), 0)

    asyncio.run(run())


def test_calls_to_a_silent_scheduler_end_unavailable_within_the_deadline(tmp_path: Path) -> None:
    async def run() -> None:
        async with silenceable_gateway(tmp_path, TIMEOUT_S) as gw:
            handle, port, key, admin_key = gw.handle, gw.port, gw.key, gw.admin_key
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                inference_stub = inference_pb2_grpc.InferenceServiceStub(channel)
                admin = admin_pb2_grpc.AdminServiceStub(channel)
                tenant_md = (("authorization", f"Bearer {key}"),)
                admin_md = (("authorization", f"Bearer {admin_key}"),)
                handle.awake.clear()  # the scheduler stops answering
                calls = {
                    "generate (key never checked here)": lambda: _drain(inference_stub.Generate(
                        inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                                      sampling=inference_pb2.SamplingParams(max_tokens=2)),
                        metadata=tenant_md, timeout=30)),
                    "admin stats": lambda: admin.Stats(admin_pb2.StatsRequest(), metadata=admin_md, timeout=30),
                }
                for name, make in calls.items():
                    start = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await make()
                    took = time.monotonic() - start
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, err.value)
                    assert "the global scheduler did not answer" in err.value.details(), (name, err.value)
                    assert dict(err.value.trailing_metadata() or ())["retry-after-ms"] == "1000", name
                    assert took < 10 * TIMEOUT_S + 3, (name, took)
                # a call that changes state may still be made when the scheduler runs again: no
                # retry hint, and the message says to check first (review 29i F4)
                tenants = tenant_pb2_grpc.TenantServiceStub(channel)
                handle.only = {"rotate_tenant_key"}  # silent once the rotation itself is sent
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="t"), metadata=admin_md, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert "may still be made" in err.value.details(), err.value
                assert "retry-after-ms" not in dict(err.value.trailing_metadata() or ()), err.value
                handle.only = None
                handle.awake.set()  # it answers again: nothing was cached as a refusal
                stats = await admin.Stats(admin_pb2.StatsRequest(), metadata=admin_md, timeout=30)
                assert stats is not None
                handle.awake.clear()  # a key checked moments ago is cached: CloseSession asks the scheduler
                await _close_session(inference_stub, tenant_md, refused=True)
                handle.awake.set()
                await _close_session(inference_stub, tenant_md, refused=False)

    asyncio.run(run())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def _close_session(stub: Any, md: Any, refused: bool) -> None:
    request = inference_pb2.CloseSessionRequest(session_id="s-1")
    if not refused:
        try:
            await stub.CloseSession(request, metadata=md, timeout=30)
        except grpc.aio.AioRpcError as err:  # no such session is an answer, not a silence
            assert err.code() != grpc.StatusCode.UNAVAILABLE, err
        return
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CloseSession(request, metadata=md, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "did not answer" in err.value.details(), err.value
    assert time.monotonic() - start < 10 * TIMEOUT_S + 3
