"""A cache node whose step thread stops progressing while its actor answers (review 29a F5).

The node is real (the tiny Llama on the real data plane, ``tests.loop_plane``), and so are the
gateway's ``NodeStreams``, its ``NodeMonitor`` and the GlobalScheduler; only the model's forward
pass is made to wait on an Event the test holds (the GIL released, as in a hung driver call or
lock). Before: ``health`` answered healthy for as long as the thread was stuck, and the stream
(and every request routed to the node) waited without bound.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from services.gateway_streams import NodeStreams
from services.node_monitor import NodeMonitor
from tests.known_tenants import know_tenants
from tests.loop_plane import Actor, LoopPlane, call, wait_for
from tests.test_gateway_gone import request

STALL_S = 1.0


class Plane(LoopPlane):
    """Node "n0" whose forward passes wait while ``gate`` is clear, one gateway and its monitor."""

    def __init__(self) -> None:
        super().__init__(4, "kvstrata-stall-")
        know_tenants(self.scheduler, "t")
        self.node.config = self.node.config.model_copy(update={"step_stall_timeout_s": STALL_S})
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()  # a forward pass waits on the gate
        execute = self.node.engine.runner.execute

        def gated(*args: Any, **kwargs: Any) -> Any:
            if not self.gate.is_set():
                self.blocked.set()
                self.gate.wait()
            return execute(*args, **kwargs)

        self.node.engine.runner.execute = gated
        self.gateway = NodeStreams({"n0": None}, {"n0": self.node_address}, self.sched_address,
                                   security=self.keys.security("gateway"))
        self.run(self.gateway.start())
        self.healthy: list[int] = []

        async def monitor() -> NodeMonitor:
            mon = NodeMonitor({"n0": Actor(self.node)}, {"n0": self.node.describe()}, self.gateway,
                              Actor(self.scheduler), on_change=self.healthy.append, poll_s=2.0, timeout_s=5.0,
                              retry_s=0.1)
            mon.start()
            return mon

        self.monitor = self.run(monitor())

    def down(self) -> dict[str, str]:
        return self.run(call(self.scheduler.down_nodes))

    async def close_gateways(self) -> None:
        await self.monitor.aclose()
        self.gateway.shutdown()

    def close(self) -> None:
        self.gate.set()
        super().close()


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def test_a_stuck_step_thread_is_declared_down_and_rejoins_when_it_moves_again(plane: Plane) -> None:
    async def first_token(rid: str) -> asyncio.Queue[dict[str, Any]]:
        queue = plane.gateway.open(rid)
        adm = await plane.gateway.admit(request(rid, 400), [])
        assert adm.code == "OK", adm
        plane.gateway.bind(rid, adm.node_id)  # as ``InferenceServicer`` does
        while (await asyncio.wait_for(queue.get(), 60))["type"] != "delta":
            pass
        return queue

    queue = plane.run(first_token("a"))
    plane.gate.clear()
    assert plane.blocked.wait(30)
    last_step = plane.node.step_progress_s  # the turn that runs the stuck step began then

    async def end_of(q: asyncio.Queue[dict[str, Any]]) -> dict[str, Any]:
        while (event := await asyncio.wait_for(q.get(), 30))["type"] == "delta":
            pass
        return event

    end = plane.run(end_of(queue))
    took = time.monotonic() - last_step
    assert (end["type"], end["code"]) == ("error", "UNAVAILABLE"), end
    assert "cache node n0 is down" in end["message"]  # the reason is the operators' (review s35 C S1)
    assert "its step loop has completed no step" in plane.down()["n0"]
    assert STALL_S <= took < STALL_S + 6.0, took  # not before the bound, and soon after it
    assert "step loop" in plane.down()["n0"]  # the scheduler routes elsewhere
    assert plane.monitor.state["n0"].healthy is False and plane.healthy[-1] == 0
    health = plane.run(call(plane.node.health))
    assert health["healthy"] is False and "step_stall_timeout_s 1 s" in health["failure"]
    assert plane.node.ping() is False

    plane.gate.set()  # the steps resume: the monitor rejoins it (``node_up``)
    wait_for(lambda: plane.monitor.state["n0"].healthy and not plane.down(), 20)
    assert plane.healthy[-1] == 1 and plane.node.ping() is True
    done = plane.run(first_token("b"))  # served again, to the end
    event = plane.run(end_of(done), 90)
    assert event["type"] == "finished", event
    wait_for(lambda: not plane.node._streams, 20)


def test_an_idle_node_is_not_stalled_and_a_slow_step_under_the_bound_is_not_either(plane: Plane) -> None:
    """No work: the heartbeat's age alone says nothing (a stuck idle thread is found once work
    arrives). A step slower than the poll but under ``step_stall_timeout_s`` is healthy."""
    plane.node.step_progress_s = time.monotonic() - 100  # as if the idle loop were stuck
    assert plane.run(call(plane.node.health))["healthy"] is True
    plane.node.step_progress_s = time.monotonic()
    execute = plane.node.engine.runner.execute

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.6 * STALL_S)
        return execute(*args, **kwargs)

    plane.node.engine.runner.execute = slow

    async def whole() -> list[dict[str, Any]]:
        queue = plane.gateway.open("s")
        adm = await plane.gateway.admit(request("s", 6), [])
        assert adm.code == "OK", adm
        plane.gateway.bind("s", adm.node_id)
        events = []
        while (event := await asyncio.wait_for(queue.get(), 60))["type"] not in ("finished", "error"):
            events.append(event)
        return [*events, event]

    events = plane.run(whole(), 90)
    assert events[-1]["type"] == "finished", events[-1]
    assert plane.monitor.state["n0"].healthy is True and not plane.down()
