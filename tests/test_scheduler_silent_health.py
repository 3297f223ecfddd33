"""A global scheduler that is alive but silent (stopped, deadlocked) is unreachable for the
gateway after ``NodeMonitor.silent_polls`` health polls in a row go unanswered: gRPC health
NOT_SERVING and ``num_healthy`` 0 (the HTTP API's /health 503), and every call that needs the
scheduler fails UNAVAILABLE at once, with a retry hint and a message saying how long it has not
answered (``SCHEDULER_SILENT``, ``BoundedActor.silent``), not after its 30-s deadline. When it
answers again the gateway serves again. Polls that timed out across a stall of the gateway's
own event loop are not counted (``LoopLag``).

Regression (trial 29k P5, review 29a F2): with the scheduler SIGSTOPped, /health said 200 and
gRPC health SERVING, and every call needing the scheduler ended 503/UNAVAILABLE only at its
30-s deadline (92 s for the openai client with its two retries); load balancers kept routing.

The real ``gateway_server.create_server``, ``NodeMonitor`` and ``GlobalSchedulerService``; the
silence is ``Silenceable``'s gate (sent, no answer, no error: what a stopped actor's callers see).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstrata.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tenant_pb2,
    tenant_pb2_grpc,
)
from tests.test_scheduler_call_deadlines import silenceable_gateway

CALL_TIMEOUT_S = 20.0  # the gateway's deadline on one scheduler call: a fast failure is far below it
POLL_S, POLL_TIMEOUT_S = 0.2, 0.3  # one poll of the scheduler's health: at most 0.5 s


def test_a_silent_scheduler_is_not_serving_and_fails_calls_at_once(tmp_path: Path) -> None:
    async def run() -> None:
        async with silenceable_gateway(tmp_path, CALL_TIMEOUT_S, None) as gw:
            scheduler, handle, port, monitor = gw.scheduler, gw.handle, gw.port, gw.monitor
            key, admin_key = gw.key, gw.admin_key
            monitor.poll_s, monitor.timeout_s, monitor.retry_s = POLL_S, POLL_TIMEOUT_S, 0.05
            monitor._poll_scheduler.set()  # the next poll with these settings
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                checks = health_pb2_grpc.HealthStub(channel)
                admin = admin_pb2_grpc.AdminServiceStub(channel)
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                tenants = tenant_pb2_grpc.TenantServiceStub(channel)
                admin_md = (("authorization", f"Bearer {admin_key}"),)
                tenant_md = (("authorization", f"Bearer {key}"),)

                async def serving() -> bool:
                    reply = await checks.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    return reply.status == health_pb2.HealthCheckResponse.SERVING

                await asyncio.sleep(0.3)
                assert await serving() and monitor.num_healthy() == 1

                # the gateway's own loop stalls across every poll of a silent scheduler: no poll
                # counts against it (each may have an answer waiting unread)
                handle.awake.clear()
                for _ in range(5):
                    time.sleep(1.3)  # noqa: ASYNC251 - the stall under test: blocks the loop past LAG_STALL_S
                    await asyncio.sleep(0.02)
                assert monitor.scheduler_failure == "", monitor.scheduler_failure
                assert monitor.lag_retries > 0
                assert await serving() and monitor.num_healthy() == 1
                handle.awake.set()
                await asyncio.sleep(0.3)

                # silent: unreachable within silent_polls polls (plus the pauses between them)
                handle.awake.clear()
                start = time.monotonic()
                while await serving():
                    assert time.monotonic() - start < 2 * (POLL_S + POLL_TIMEOUT_S) + 2.0, "still SERVING"
                    await asyncio.sleep(0.05)
                assert monitor.num_healthy() == 0  # the HTTP API's /health: 503
                assert "has not answered for" in monitor.scheduler_failure
                sent = len(handle.sent)
                for name, call in {
                    "admin stats": lambda: admin.Stats(admin_pb2.StatsRequest(), metadata=admin_md, timeout=30),
                    "rotate key": lambda: tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="t"), metadata=admin_md,
                                                            timeout=30),
                    "close session": lambda: stub.CloseSession(inference_pb2.CloseSessionRequest(session_id="s-1"),
                                                               metadata=tenant_md, timeout=30),
                }.items():
                    began = time.monotonic()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call()
                    took = time.monotonic() - began
                    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (name, err.value)
                    assert "the global scheduler has not answered for" in err.value.details(), (name, err.value)
                    assert took < 2.0, (name, took)  # not CALL_TIMEOUT_S
                    if name != "rotate key":
                        assert dict(err.value.trailing_metadata() or ())["retry-after-ms"] == "1000", name
                # review 29o F1/F6: nothing but the monitor's health polls was sent to the silent
                # scheduler (no backlog of refused calls for it to work off, no rotation that would
                # run when it answers again, its new key never shown)
                assert set(handle.sent[sent:]) <= {"health"}, handle.sent[sent:]

                # it answers again: SERVING, and the same calls pass
                handle.awake.set()
                start = time.monotonic()
                while not await serving():
                    assert time.monotonic() - start < 3.0, "still NOT_SERVING"
                    await asyncio.sleep(0.05)
                assert monitor.num_healthy() == 1 and monitor.scheduler_failure == ""
                assert await admin.Stats(admin_pb2.StatsRequest(), metadata=admin_md, timeout=30) is not None
                assert await scheduler.authenticate(key) is not None  # the rotation never ran: the key holds

    asyncio.run(run())


class _Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the global scheduler did not answer in 30 s"


def test_cli_deadlines_outlast_the_gateways_scheduler_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvstrata status`` (and the CLI's other unary calls that go through the scheduler) wait
    longer than the gateway waits for the scheduler, so its UNAVAILABLE and message reach the
    user. Regression (trial 29k P6): both were 30 s, and the user saw a bare
    ``DEADLINE_EXCEEDED: Deadline Exceeded``."""
    import contextlib

    import typer

    from cli import lifecycle
    from cli.state import RPC_TIMEOUT_S
    from services.actor_calls import SCHEDULER_CALL_TIMEOUT_S

    assert RPC_TIMEOUT_S >= SCHEDULER_CALL_TIMEOUT_S + 10
    deadlines: list[float] = []

    class Stub:
        def __init__(self, _channel: object) -> None:
            pass

        def Stats(self, _request: object, metadata: object, timeout: float) -> None:
            deadlines.append(timeout)
            raise _Refused()

    monkeypatch.setattr(lifecycle.admin_pb2_grpc, "AdminServiceStub", Stub)
    monkeypatch.setattr(lifecycle, "gateway_channel", lambda _gateway: contextlib.nullcontext(None))
    monkeypatch.setattr(lifecycle, "admin_metadata", lambda _gateway: ())
    with pytest.raises(typer.Exit):
        lifecycle.status(gateway="127.0.0.1:1", integrity=False)
    assert deadlines and deadlines[0] >= SCHEDULER_CALL_TIMEOUT_S + 10, deadlines
