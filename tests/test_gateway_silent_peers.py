"""A (re)starting gateway does not wait for ever on a silent cache node or a silent scheduler.

Regression (review s34 B F4): ``Gateway.start`` awaited every node's ``describe`` and the
scheduler's ``open_data_plane`` with no deadline, and ``RayGateway`` awaited the scheduler's
``gateway_addresses``, ``attach_gateway`` (``_attach_again`` too) with none either, so one node
alive but silent (its loop stuck, or being restarted by Ray, which queues calls to it) or a
silent scheduler kept a restarted gateway from ever serving, and from exiting for Ray to restart
it (``_serve_again`` retried and exited only on an exception).

The real ``Gateway`` / ``RayGateway`` (gRPC server, ``NodeStreams``, ``NodeMonitor``) in-process
and without Ray, as in ``test_gateway_restart_start``: the scheduler is a real
``GlobalSchedulerService`` behind ``LocalActor``; a silent actor's call is one whose answer never
comes (as the ObjectRef of a call to a stopped actor), until the test lets it answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_stack import tiny_checkpoint
from services import gateway_server
from services.actor_calls import BoundedActor
from services.global_scheduler_admission import GlobalSchedulerService
from tests.gateway_harness import NODE_INFO, LocalActor
from tests.test_gateway_restart_start import (
    GATEWAY_ID,
    FakeContext,
    FakeNode,
    free_port,
    grpc_serving,
)

pytestmark = pytest.mark.timeout(60)


class SilentNode:
    """A cache node whose calls get no answer until ``answering`` is set (then a healthy one,
    as ``FakeNode``, from process 2)."""

    def __init__(self) -> None:
        self.answering = asyncio.Event()

    async def describe(self) -> dict[str, Any]:
        await self.answering.wait()
        return dict(NODE_INFO, pid=2, restarts=0)

    async def health(self, wait_s: float) -> dict[str, Any]:
        await self.answering.wait()
        return {"healthy": True, "failure": "", "pid": 2, "restarts": 0, "data_address": "tcp://127.0.0.1:8"}

    async def open_data_plane(self) -> str:
        await self.answering.wait()
        return "tcp://127.0.0.1:8"


class SilentScheduler:
    """The scheduler's calls the gateway makes at a (re)start and a re-attach, never answered."""

    async def gateway_addresses(self, gateway_id: str) -> dict[str, str]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def attach_gateway(self, gateway_id: str, address: str, subscriber: str, handle: Any = None) -> str:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def until(done: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


def test_a_gateway_starts_without_a_silent_node_holds_it_down_and_rejoins_it_when_it_answers(tmp_path: Path) -> None:
    """One node of two silent: the gateway serves within ``describe_timeout_s`` (the old code
    waited for ever), with that node down from the start (the scheduler told, its streams
    UNAVAILABLE), and when the node answers its health poll it rejoins: connected, routed to."""

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1})
        silent = SilentNode()
        gw = gateway_server.Gateway(LocalActor(sched), {"n0": LocalActor(FakeNode()), "n1": LocalActor(silent)},
                                    str(tiny_checkpoint()))
        gw.describe_timeout_s = 0.5
        try:
            t0 = time.monotonic()
            port = await asyncio.wait_for(gw.start("127.0.0.1", free_port()), 15)
            assert time.monotonic() - t0 < 10
            assert await grpc_serving(port)
            assert gw.monitor is not None and gw.streams is not None
            state = gw.monitor.state["n1"]
            assert not state.healthy and "did not answer describe within 0.5 s" in state.failure
            assert gw.monitor.state["n0"].healthy and gw.monitor.num_healthy() == 1
            assert "n1" in gw.streams.down and "n1" not in gw.streams._commands
            await until(lambda: "n1" in sched.down_nodes())
            silent.answering.set()
            await until(lambda: gw.monitor.state["n1"].healthy)
            assert "n1" not in gw.streams.down and gw.streams.node_inboxes["n1"] == "tcp://127.0.0.1:8"
            assert "n1" in gw.streams._commands and gw.monitor.num_healthy() == 2
            await until(lambda: "n1" not in sched.down_nodes())
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())


def test_a_node_left_out_at_start_is_down_before_serving_and_keeps_its_sessions_when_it_rejoins(
        tmp_path: Path) -> None:
    """Diff review s34: (F5) the scheduler was told of a node left out at start only by the
    monitor's one 1-s try after the gateway served, so it could admit this gateway's requests
    to a node the gateway holds no command socket for (unwatched, never aborted); now it is down
    at the scheduler before the gRPC server starts. (F1) rejoining, the node was reported with
    its process unknown (pid 0, restarts -1) and the scheduler, with no record of it either,
    took it for a new process and marked every session routed there lost; the same process
    back keeps them now."""
    from tests.known_tenants import know_tenants

    fin = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}

    async def go() -> None:
        sched = know_tenants(GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1}), "a")
        sched.node_down("n0", "test: route the session to n1")
        assert sched.admit("a", "a/r0", session_id="a/s1").code == "OK"
        assert sched.requests["a/r0"][1] == "n1"
        sched.release("a/r0", fin)
        sched.down.pop("n0")  # (no node_up record of either node: a fresh deployment)
        silent = SilentNode()  # n1: the same process (pid 2, restarts 0) all along, only slow
        gw = gateway_server.Gateway(LocalActor(sched), {"n0": LocalActor(FakeNode()), "n1": LocalActor(silent)},
                                    str(tiny_checkpoint()))
        gw.describe_timeout_s = 0.5
        serving_with: list[dict[str, str]] = []
        create_server = gateway_server.create_server

        async def recording(*args: Any, **kwargs: Any) -> Any:
            serving_with.append(sched.down_nodes())  # what the scheduler holds down as serving begins
            return await create_server(*args, **kwargs)

        gateway_server.create_server = recording  # type: ignore[assignment]
        try:
            await asyncio.wait_for(gw.start("127.0.0.1", free_port()), 15)
            assert serving_with and "n1" in serving_with[0], serving_with
            silent.answering.set()
            await until(lambda: gw.monitor.state["n1"].healthy and "n1" not in sched.down_nodes())
            adm = sched.admit("a", "a/r1", session_id="a/s1")
            assert (adm.code, adm.node_id) == ("OK", "n1"), adm
        finally:
            gateway_server.create_server = create_server  # type: ignore[assignment]
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())


class Exited(Exception):
    """``os._exit`` was called (it never returns)."""


def test_a_restarted_gateway_whose_scheduler_is_silent_fails_each_try_and_exits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each try of ``_serve_again`` ends within ``RESTART_TRY_TIMEOUT_S`` though the scheduler
    never answers; after the last the process exits for Ray to restart it (the old code stayed
    in its first try for ever)."""
    monkeypatch.setattr(gateway_server, "RESTART_BIND_TRIES", 2)
    monkeypatch.setattr(gateway_server, "RESTART_RETRY_S", 0.01)
    monkeypatch.setattr(gateway_server, "RESTART_TRY_TIMEOUT_S", 0.5, raising=False)  # (none in the old code)
    exits: list[int] = []

    def exit_(status: int) -> None:
        exits.append(status)
        raise Exited

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(gateway_server.ray, "get_runtime_context", FakeContext)

    async def go() -> None:
        gw = gateway_server.RayGateway(LocalActor(SilentScheduler()), {"n0": LocalActor(FakeNode())},
                                       str(tiny_checkpoint()))
        assert gw.restarted is not None
        with pytest.raises(Exited):
            await asyncio.wait_for(gw.restarted, 10)
        assert exits == [1]

    asyncio.run(go())


class LiveContext(FakeContext):
    """Ray's runtime context inside a gateway actor that was not restarted."""

    was_current_actor_reconstructed = False


def test_reattaching_to_a_silent_scheduler_ends_within_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reattach`` (which every admission refused ``gateway_gone`` awaits) ends False once the
    scheduler's call passes its deadline, instead of waiting as long as the scheduler is silent."""
    monkeypatch.setattr(gateway_server.ray, "get_runtime_context", LiveContext)

    async def go() -> None:
        gw = gateway_server.RayGateway(LocalActor(SilentScheduler()), {"n0": LocalActor(FakeNode())})
        assert gw.gateway_id == GATEWAY_ID and gw.restarted is None
        gw.scheduler_calls = BoundedActor(gw.scheduler, 0.3)
        assert await asyncio.wait_for(gw.reattach(), 10) is False

    asyncio.run(go())
