"""A gateway's start is all or nothing, and a restarted gateway retries a failed start, then
exits for Ray to restart it again (review 23b F3).

The real ``Gateway`` / ``RayGateway`` (gRPC server, ``NodeStreams``, ``NodeMonitor``, the
OpenAI-compatible HTTP API, ``/metrics``) on 127.0.0.1, in-process and without Ray: the
scheduler is a real ``GlobalSchedulerService`` behind ``LocalActor``, the cache node a fake that
answers ``describe`` and ``health``, and ``RayGateway`` sees a fake Ray runtime context that
says it was restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.chaos_stack import tiny_checkpoint
from services import gateway_server
from services.global_scheduler_admission import GlobalSchedulerService
from services.metrics import MetricsEndpoint
from services.openai_api import HttpServer
from tests.gateway_harness import NODE_INFO, ClusterKeyValues, LocalActor, cluster_key_values

GATEWAY_ID = "gw-1"

pytestmark = pytest.mark.timeout(60)  # before the fix, a failed test could hang at its loop's end


@pytest.fixture(autouse=True)
def gcs(monkeypatch: pytest.MonkeyPatch) -> ClusterKeyValues:
    """Ray's GCS key-value store, where each gateway keeps where it served (``ServedRecord``)."""
    return cluster_key_values(monkeypatch)


class FakeNode:
    """A healthy cache node as the gateway sees it (``describe``, ``health``' long poll)."""

    async def describe(self) -> dict[str, Any]:
        return dict(NODE_INFO, pid=1, restarts=0)

    async def health(self, wait_s: float) -> dict[str, Any]:
        await asyncio.sleep(wait_s)
        return {"healthy": True, "failure": "", "pid": 1, "restarts": 0, "data_address": NODE_INFO["data_address"]}


class FakeContext:
    """Ray's runtime context inside the gateway actor, restarted by Ray."""

    def get_actor_id(self) -> str:
        return GATEWAY_ID

    was_current_actor_reconstructed = True
    current_actor = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_free(port: int) -> bool:
    """Whether a listening socket can take ``port`` (nothing holds it)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def hold(port: int) -> socket.socket:
    """Another process's listening socket on ``port``."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(1)
    return s


@contextlib.asynccontextmanager
async def scheduler(tmp_path: Path) -> AsyncIterator[GlobalSchedulerService]:
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    try:
        yield sched
    finally:
        sched.close_data_plane()
        sched.store.close()


def nodes() -> dict[str, Any]:
    return {"n0": LocalActor(FakeNode())}


async def grpc_serving(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


async def http_health(port: int) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return json.loads(reply.read())

    return await asyncio.to_thread(get)


class Made:
    """What ``create_server`` made for each start (its monitor and data plane)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monitors: list[Any] = []
        self.streams: list[Any] = []
        create = gateway_server.create_server

        async def recording(*args: Any, **kwargs: Any) -> Any:
            made = await create(*args, **kwargs)
            self.monitors.append(made[4])
            self.streams.append(made[3].streams)
            return made

        monkeypatch.setattr(gateway_server, "create_server", recording)

    async def all_stopped(self) -> bool:
        for _ in range(20):  # a cancelled task ends within a few turns of the loop
            await asyncio.sleep(0.01)
        return (all(t.done() for m in self.monitors for t in m._tasks)
                and all(s._context.closed for s in self.streams))


def http_start_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP server's next start ends RuntimeError, bound and not up in time (a loaded machine)."""
    start = HttpServer.start

    async def slow(self: HttpServer, host: str, port: int, start_timeout_s: float = 10.0) -> int:
        monkeypatch.setattr(HttpServer, "start", start)
        return await start(self, host, port, start_timeout_s=0.0)

    monkeypatch.setattr(HttpServer, "start", slow)


@pytest.mark.parametrize("failure", ["http_port_taken", "http_start_timeout", "metrics_port_taken"])
def test_a_failed_start_stops_what_it_made_and_a_retry_serves_on_the_same_ports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """Regression (review 23b F3): a start that failed after the gRPC bind (the HTTP port or
    /metrics' taken, or uvicorn not up in time) left the gRPC server (its port bound), the
    NodeStreams and the NodeMonitor behind, so a retry on the same port always failed with
    "could not bind the gateway". Now everything it made is stopped, every port is free, and
    the retry serves gRPC, HTTP and /metrics on the same ports."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    made = Made(monkeypatch)

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            gw = gateway_server.Gateway(LocalActor(sched), nodes(), str(tiny_checkpoint()), http_port=http_port,
                                        metrics=MetricsEndpoint("127.0.0.1", metrics_port))
            holder = None
            if failure == "http_start_timeout":
                http_start_times_out(monkeypatch)
            else:
                holder = hold(http_port if failure == "http_port_taken" else metrics_port)
            with pytest.raises(RuntimeError if failure == "http_start_timeout" else OSError):
                await gw.start("127.0.0.1", grpc_port)
            if holder is not None:
                holder.close()
            assert await made.all_stopped(), "a NodeMonitor or NodeStreams of the failed start still runs"
            assert (gw.server, gw.streams, gw.monitor, gw.http, gw.metrics_server) == (None,) * 5
            assert is_free(grpc_port) and is_free(http_port) and is_free(metrics_port)
            assert await gw.start("127.0.0.1", grpc_port) == grpc_port
            try:
                assert await grpc_serving(grpc_port)
                assert (await http_health(http_port))["status"] == "ok"
                assert gw.http_address() == f"127.0.0.1:{http_port}"
                assert gw.metrics_address() == f"127.0.0.1:{metrics_port}"
            finally:
                await gw.stop(0)

    asyncio.run(go())


def restarted_gateway(sched: GlobalSchedulerService, http_port: int,
                      monkeypatch: pytest.MonkeyPatch) -> gateway_server.RayGateway:
    """A ``RayGateway`` Ray restarted (its ``_serve_again`` task runs on the current loop)."""
    monkeypatch.setattr(gateway_server.ray, "get_runtime_context", FakeContext)
    gw = gateway_server.RayGateway(LocalActor(sched), nodes(), str(tiny_checkpoint()), http_port=http_port)
    assert gw.restarted is not None
    return gw


@pytest.mark.parametrize("failure", ["http_port_taken", "http_start_timeout"])
def test_a_restarted_gateway_retries_a_failed_start_and_serves_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """Regression (review 23b F3): a restarted gateway whose HTTP port was still held for a
    moment never served again (each retry failed on its own gRPC port), and an HTTP start
    timeout (RuntimeError) was not retried at all. Now it serves on its old gRPC port once
    the HTTP port is free, and it attached to the scheduler with its new inbox."""
    monkeypatch.setattr(gateway_server, "RESTART_RETRY_S", 0.05)
    grpc_port, http_port = free_port(), free_port()

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            await sched.attach_gateway(GATEWAY_ID, f"127.0.0.1:{grpc_port}", "tcp://127.0.0.1:1")
            holder = None
            if failure == "http_start_timeout":
                http_start_times_out(monkeypatch)
            else:
                holder = hold(http_port)
                asyncio.get_running_loop().call_later(0.5, holder.close)  # the old process's socket
            gw = restarted_gateway(sched, http_port, monkeypatch)
            assert await asyncio.wait_for(gw.restarted, 30) == grpc_port
            try:
                assert await grpc_serving(grpc_port)
                assert (await http_health(http_port))["status"] == "ok"
                assert gw.streams is not None
                assert sched.gateways[GATEWAY_ID].subscriber == gw.streams.subscriber
            finally:
                await gw.stop(0)

    asyncio.run(go())


class Exited(Exception):
    """``os._exit`` was called (it never returns)."""


def quick_tries_recording_exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Three restart tries 10 ms apart; ``os._exit`` records its status and raises ``Exited``.
    Returns the recorded statuses."""
    monkeypatch.setattr(gateway_server, "RESTART_BIND_TRIES", 3)
    monkeypatch.setattr(gateway_server, "RESTART_RETRY_S", 0.01)
    exits: list[int] = []

    def exit_(status: int) -> None:
        exits.append(status)
        raise Exited

    monkeypatch.setattr(os, "_exit", exit_)
    return exits


def test_a_restarted_gateway_that_cannot_start_exits_for_ray_to_restart_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 23b F3): after its last failed try the restart task ended, and Ray
    kept a live actor that served nothing, for good. Now the process exits (status 1), with
    nothing of its tries left bound."""
    exits = quick_tries_recording_exits(monkeypatch)
    grpc_port, http_port = free_port(), free_port()
    made = Made(monkeypatch)

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            await sched.attach_gateway(GATEWAY_ID, f"127.0.0.1:{grpc_port}", "tcp://127.0.0.1:1")
            with hold(http_port):
                gw = restarted_gateway(sched, http_port, monkeypatch)
                with pytest.raises(Exited):
                    await asyncio.wait_for(gw.restarted, 30)
            assert exits == [1]
            assert len(made.monitors) == 3
            assert await made.all_stopped()
            assert is_free(grpc_port)

    asyncio.run(go())


def test_a_gateway_restarted_before_its_first_start_waits_for_the_launchers_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review s37 r4 F3): a gateway Ray restarted before its first ``start`` (the
    launcher creates it while the nodes load their models) found no address of its own at the
    scheduler, failed every try and exited, and again after each restart (max_restarts -1).
    Now its restart task ends at once, serving nothing, and the launcher's start serves it."""
    exits = quick_tries_recording_exits(monkeypatch)
    grpc_port, http_port = free_port(), free_port()
    made = Made(monkeypatch)

    async def go() -> None:
        async with scheduler(tmp_path) as sched:  # no attach_gateway: it never served
            gw = restarted_gateway(sched, http_port, monkeypatch)
            assert await asyncio.wait_for(gw.restarted, 30) == 0  # Exited (os._exit(1)) before
            assert exits == [] and made.monitors == []
            try:
                assert await gw.start("127.0.0.1", grpc_port) == grpc_port
                assert await grpc_serving(grpc_port)
                assert sched.gateway_addresses(GATEWAY_ID)["grpc"] == f"127.0.0.1:{grpc_port}"
            finally:
                await gw.stop(0)

    asyncio.run(go())


def test_the_launchers_start_cancels_a_restart_still_trying(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review s37 r4 F3): the launcher's ``start`` and a restart task still trying
    (here: its old HTTP port held) both served, racing for the ports; ``start`` now cancels
    the task first, and serves alone."""
    monkeypatch.setattr(gateway_server, "RESTART_RETRY_S", 0.05)
    monkeypatch.setattr(os, "_exit", lambda status: (_ for _ in ()).throw(Exited()))
    old_grpc, http_port, grpc_port = free_port(), free_port(), free_port()
    made = Made(monkeypatch)

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            await sched.attach_gateway(GATEWAY_ID, f"127.0.0.1:{old_grpc}", "tcp://127.0.0.1:1")
            with hold(http_port):
                gw = restarted_gateway(sched, http_port, monkeypatch)
                while len(made.monitors) < 2:  # it has failed a try, and goes on
                    await asyncio.sleep(0.01)
                try:
                    assert await gw.start("127.0.0.1", grpc_port, 0) == grpc_port
                    assert gw.restarted.cancelled()  # still trying before
                    assert await grpc_serving(grpc_port)
                    assert is_free(old_grpc)
                    assert sched.gateway_addresses(GATEWAY_ID)["grpc"] == f"127.0.0.1:{grpc_port}"
                finally:
                    await gw.stop(0)

    asyncio.run(go())
