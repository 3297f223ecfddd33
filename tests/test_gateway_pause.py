"""A gateway whose own event loop stalls (SIGSTOP, a VM pause, swapping, a long GC) past its
health polls' deadline must not take its healthy nodes for hung (review 29a F6).

The node stand-in answers from another thread, as a Ray actor in another process does; an
answer it sends while the gateway is stalled is read shortly after the gateway resumes (as one
waiting in a socket), so the poll's deadline, on the gateway's clock, fires first. Before: on
resume every healthy node was declared down and every stream on it ended UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace
from typing import Any

from services.node_monitor import NodeMonitor

POLL_S, TIMEOUT_S = 0.5, 1.0
READ_DELAY_S = 0.05  # an answer that arrived during the stall is read this long after it

_SOUND = {"healthy": True, "failure": "", "pid": 41, "restarts": 0, "data_address": "tcp://127.0.0.1:9"}


class _Node:
    """``health(wait_s)`` answered from a thread after ``wait_s`` (``answers`` False: never)."""

    def __init__(self) -> None:
        self.answers = True
        self.asked: list[float] = []
        self.health = SimpleNamespace(remote=self._health)

    def _health(self, wait_s: float) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.asked.append(wait_s)
        if not self.answers:
            return fut

        def reply() -> None:
            time.sleep(wait_s)
            # read from the socket on the loop's next turn, a moment later
            with contextlib.suppress(RuntimeError):  # the test's loop closed meanwhile
                loop.call_soon_threadsafe(loop.call_later, READ_DELAY_S, _settle, fut, dict(_SOUND))

        threading.Thread(target=reply, daemon=True).start()
        return fut


def _stall_loop(seconds: float) -> None:
    """Block the running event loop (what a SIGSTOP, a VM pause or a long GC does to it)."""
    time.sleep(seconds)


def _settle(fut: asyncio.Future[Any], answer: dict[str, Any]) -> None:
    if not fut.done():
        fut.set_result(answer)


class _Scheduler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

        async def down_nodes() -> dict[str, str]:
            return {}

        async def node_down(node_id: str, reason: str) -> None:
            self.calls.append(("down", node_id))

        async def node_up(node_id: str, inbox: str, pid: int = 0, previous_pid: int = 0, restarts: int = -1,
                          previous_restarts: int = -1) -> None:
            self.calls.append(("up", node_id))

        async def health() -> dict[str, Any]:
            return {"pid": 7, "restarts": 0, "data_address": "", "down": {}}

        self.down_nodes, self.node_down, self.node_up, self.health = (
            SimpleNamespace(remote=f) for f in (down_nodes, node_down, node_up, health))


class _Streams:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []

    def fail_node(self, node_id: str, reason: str) -> None:
        self.failed.append((node_id, reason))

    def reconnect(self, node_id: str, address: str) -> None:
        pass


def _monitor(node: _Node, streams: _Streams, scheduler: _Scheduler) -> NodeMonitor:
    monitor = NodeMonitor({"n0": node}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                          poll_s=POLL_S, timeout_s=TIMEOUT_S, retry_s=0.05)
    monitor.start()
    return monitor


def test_a_gateway_stalled_past_the_poll_deadline_keeps_its_healthy_node() -> None:
    node, streams, scheduler = _Node(), _Streams(), _Scheduler()

    async def run() -> NodeMonitor:
        monitor = _monitor(node, streams, scheduler)
        try:
            await asyncio.sleep(1.2)  # a few polls answered
            assert monitor.state["n0"].healthy
            for _ in range(2):
                _stall_loop(POLL_S + TIMEOUT_S + 1.5)  # the loop stalls past a poll's whole deadline
                await asyncio.sleep(1.5)  # resumed: polls go on
            assert monitor.state["n0"].healthy
        finally:
            await monitor.aclose()
        return monitor

    monitor = asyncio.run(run())
    assert streams.failed == [] and scheduler.calls == []
    assert monitor.lag_retries >= 1 and monitor.num_healthy() == 1


def test_a_node_that_stops_answering_is_still_down_within_the_bound() -> None:
    """Without a stall: down after ``poll_s + timeout_s``, not asked again. With a stall during
    the poll: asked once more, down after at most ``poll_s + 2 * timeout_s`` plus the stall."""
    for stall_s in (0.0, POLL_S + TIMEOUT_S + 1.5):
        node, streams, scheduler = _Node(), _Streams(), _Scheduler()

        async def run(stall_s: float = stall_s, node: _Node = node, streams: _Streams = streams,
                      scheduler: _Scheduler = scheduler) -> tuple[float, int]:
            monitor = _monitor(node, streams, scheduler)
            try:
                await asyncio.sleep(0.8)
                node.answers = False
                t0 = time.monotonic()
                await asyncio.sleep(0.1)  # its poll in flight now never comes back
                if stall_s:
                    _stall_loop(stall_s)
                while not streams.failed:
                    assert time.monotonic() - t0 < POLL_S * 2 + 2 * TIMEOUT_S + stall_s + 3.0, "not declared down"
                    await asyncio.sleep(0.02)
                return time.monotonic() - t0, monitor.lag_retries
            finally:
                await monitor.aclose()

        took, retries = asyncio.run(run())
        assert streams.failed[0][0] == "n0" and "did not answer" in streams.failed[0][1]
        assert scheduler.calls[0] == ("down", "n0")
        assert retries == (1 if stall_s else 0), (stall_s, retries)
        bound = POLL_S + TIMEOUT_S + (TIMEOUT_S + stall_s if stall_s else 0.0)
        assert took <= bound + POLL_S + 1.5, (stall_s, took, bound)
