"""A restarted gateway serves its OpenAI-compatible API and ``/metrics`` on the ports it served
them on before, as it does gRPC, also when they were configured as 0 (review 23b F4).

The real ``RayGateway`` in-process without Ray, as in ``test_gateway_restart_start``: its first
life starts as the launcher starts it, is stopped (its process "died"), and a second one that
Ray "restarted" serves again from the scheduler's record (``GlobalScheduler.gateway_addresses``).
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest

from bench.chaos_stack import tiny_checkpoint
from services import gateway_server
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import GlobalSchedulerService
from services.metrics import MetricsEndpoint
from tests.gateway_harness import LocalActor
from tests.test_gateway_restart_start import (
    GATEWAY_ID,
    FakeContext,
    gcs,  # noqa: F401 - autouse: each test's GCS key-value store
    grpc_serving,
    hold,
    http_health,
    nodes,
    scheduler,
)

pytestmark = pytest.mark.timeout(60)


class FirstContext(FakeContext):
    """Ray's runtime context in the gateway actor's first process."""

    was_current_actor_reconstructed = False


def gateway(sched: GlobalSchedulerService, context: type[FakeContext],
            monkeypatch: pytest.MonkeyPatch) -> gateway_server.RayGateway:
    """A gateway configured with ``http_port`` 0 and ``/metrics`` on port 0 (any free ones)."""
    monkeypatch.setattr(gateway_server.ray, "get_runtime_context", context)
    return gateway_server.RayGateway(LocalActor(sched), nodes(), str(tiny_checkpoint()), http_port=0,
                                     metrics=MetricsEndpoint("127.0.0.1", 0))


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


async def metrics_served(address: str) -> bool:
    def get() -> bool:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            return reply.status == 200 and b"# HELP" in reply.read()

    return await asyncio.to_thread(get)


async def first_life(sched: GlobalSchedulerService, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Start the gateway as the launcher does, then stop it (its process died); where it served."""
    first = gateway(sched, FirstContext, monkeypatch)
    grpc_port = await first.start("127.0.0.1", 0)
    served = {"grpc": f"127.0.0.1:{grpc_port}", "http": first.http_address(), "metrics": first.metrics_address()}
    await first.stop(0)
    return served


def test_a_restarted_gateway_serves_http_and_metrics_on_its_old_ports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 23b F4): with ``http_port`` 0 and the metrics port 0, a restarted
    gateway came back on its old gRPC port but on new HTTP and /metrics ports, so the
    ``http_address`` ``kvstrata up`` saved and the Prometheus targets pointed at dead ports.
    The scheduler now records all three and a restarted gateway rebinds them."""
    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            served = await first_life(sched, monkeypatch)
            again = gateway(sched, FakeContext, monkeypatch)
            assert again.restarted is not None
            assert await asyncio.wait_for(again.restarted, 30) == port_of(served["grpc"])
            try:
                assert (again.http_address(), again.metrics_address()) == (served["http"], served["metrics"])
                assert await grpc_serving(port_of(served["grpc"]))
                assert (await http_health(port_of(served["http"])))["status"] == "ok"
                assert await metrics_served(served["metrics"])
                assert sched.gateway_addresses(GATEWAY_ID) == served
            finally:
                await again.stop(0)

    asyncio.run(go())


def test_old_api_ports_held_for_good_fall_back_to_the_configured_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restarted gateway's old HTTP port is held by another process for good: its last
    try serves the API and /metrics on the configured ports (0: free ones) rather than not at
    all, on its old gRPC port, and the scheduler records the new addresses."""
    monkeypatch.setattr(gateway_server, "RESTART_BIND_TRIES", 3)
    monkeypatch.setattr(gateway_server, "RESTART_RETRY_S", 0.01)

    async def go() -> None:
        async with scheduler(tmp_path) as sched:
            served = await first_life(sched, monkeypatch)
            with hold(port_of(served["http"])):
                again = gateway(sched, FakeContext, monkeypatch)
                assert await asyncio.wait_for(again.restarted, 30) == port_of(served["grpc"])
            try:
                moved = again.http_address()
                assert moved not in ("", served["http"])
                assert (await http_health(port_of(moved)))["status"] == "ok"
                assert await grpc_serving(port_of(served["grpc"]))
                assert sched.gateway_addresses(GATEWAY_ID) == {"grpc": served["grpc"], "http": moved,
                                                               "metrics": again.metrics_address()}
            finally:
                await again.stop(0)

    asyncio.run(go())


def test_a_restarted_gateway_the_scheduler_lost_serves_again_on_its_own_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s38 fault 1): the scheduler lost its record of a gateway that had served (it
    was restarted and rebuilt its state without it: no gateway's ``_scheduler_back`` attach
    came before the gateway died too), and the gateway Ray restarted took itself for one
    restarted before its first start: its restart task ended (0) and it stayed up serving
    nothing, for good. Now it serves gRPC, HTTP and /metrics again on the addresses it kept
    itself (``ServedRecord``, in Ray's GCS) and attaches, giving the scheduler its record back."""
    async def go() -> None:
        async with scheduler(tmp_path / "first") as sched:
            served = await first_life(sched, monkeypatch)
        async with scheduler(tmp_path / "again") as restarted_sched:  # nothing of the first one's
            assert restarted_sched.gateway_addresses(GATEWAY_ID)["grpc"] == ""
            again = gateway(restarted_sched, FakeContext, monkeypatch)
            assert await asyncio.wait_for(again.restarted, 30) == port_of(served["grpc"])  # 0 before
            try:
                assert await grpc_serving(port_of(served["grpc"]))
                assert (await http_health(port_of(served["http"])))["status"] == "ok"
                assert await metrics_served(served["metrics"])
                assert restarted_sched.gateway_addresses(GATEWAY_ID) == served
                assert again.streams is not None
                assert restarted_sched.gateways[GATEWAY_ID].subscriber == again.streams.subscriber
            finally:
                await again.stop(0)

    asyncio.run(go())


def test_the_scheduler_keeps_a_gateways_api_addresses_across_its_attaches(tmp_path: Path) -> None:
    """``attach_gateway`` of a restarted gateway (a new inbox) keeps the API addresses until
    ``attach_gateway_apis`` replaces them (a gateway dying in between serves them again); a
    gateway never attached has none, and its API addresses are not recorded."""
    sched = GlobalScheduler(str(tmp_path), {"n0": 1})
    assert sched.gateway_addresses("gw") == {"grpc": "", "http": "", "metrics": ""}
    assert sched.attach_gateway_apis("gw", "127.0.0.1:2", "127.0.0.1:3") is False
    sched.attach_gateway("gw", "127.0.0.1:1", "tcp://127.0.0.1:10")
    assert sched.attach_gateway_apis("gw", "127.0.0.1:2", "127.0.0.1:3") is True
    sched.attach_gateway("gw", "127.0.0.1:1", "tcp://127.0.0.1:11")
    assert sched.gateway_addresses("gw") == {"grpc": "127.0.0.1:1", "http": "127.0.0.1:2", "metrics": "127.0.0.1:3"}
    assert sched.gateway_address("gw") == "127.0.0.1:1"
    sched.attach_gateway_apis("gw", "127.0.0.1:4", "")
    assert sched.gateway_addresses("gw") == {"grpc": "127.0.0.1:1", "http": "127.0.0.1:4", "metrics": ""}

