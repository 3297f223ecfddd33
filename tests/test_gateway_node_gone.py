"""A cache node whose process dies mid-stream: every gateway stream on it ends UNAVAILABLE at
once, from its data-plane connection closing (``NodeStreams.on_disconnect``, the gateway's
``NodeMonitor``), not at a health poll's deadline. Real parts: the tiny Llama node on the real
data plane, the gateway's ``NodeStreams`` and ``NodeMonitor``, the GlobalScheduler
(``tests.test_node_step_stall.Plane``); the process's death is its command inbox closing (its
TCP connections close, as the kernel closes a dead process's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_gateway_gone import request
from tests.test_node_step_stall import Plane


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def test_every_stream_on_a_node_whose_process_died_ends_unavailable_at_once(plane: Plane) -> None:
    gateway = plane.gateway

    async def started(rid: str) -> asyncio.Queue[dict[str, Any]]:
        queue = gateway.open(rid)
        adm = await gateway.admit(request(rid, 600), [])
        assert adm.code == "OK", adm
        gateway.bind(rid, adm.node_id)
        while (await asyncio.wait_for(queue.get(), 60))["type"] != "delta":
            pass
        return queue

    queues = [plane.run(started(f"t/s{i}")) for i in range(3)]

    async def ends(queue: asyncio.Queue[dict[str, Any]]) -> dict[str, Any]:
        while (event := await asyncio.wait_for(queue.get(), 20))["type"] == "delta":
            pass
        return event

    t0 = time.monotonic()
    plane.run(_close(plane))  # on the node's loop, as its process's end
    events = [plane.run(ends(q)) for q in queues]
    took = time.monotonic() - t0
    assert all((e["type"], e.get("code")) == ("error", "UNAVAILABLE") and "cache node n0 is down" in e["message"]
               for e in events), events
    # the health poll (poll_s 2 + timeout_s 5) would see the in-process node healthy: the
    # connection's close alone ended them, within the scheduler's node_down wait (notify_s 1)
    assert took < 3.0, took


async def _close(plane: Plane) -> None:
    plane.node.close_data_plane()
