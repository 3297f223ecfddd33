"""A cache node's shutdown ends its in-process streams (a real CacheNode on the tiny Llama):
one running when it shuts down, and one opened after, each get UNAVAILABLE as their last
event, where they got no event at all and their ``generate`` callers waited for ever."""

from __future__ import annotations

import asyncio
from typing import Any

from services.cache_node import CacheNode
from services.config import NodeConfig
from tests.test_deleted_tenant_cache import prompt, request


async def _next(gen: Any) -> dict[str, Any]:
    return await asyncio.wait_for(gen.__anext__(), 10)


def test_streams_open_at_shutdown_or_opened_after_end_unavailable() -> None:
    """Regression (s40): ``shutdown`` stopped the step thread with in-process streams open,
    which then got no event (a ``generate`` caller, ``bench.service``'s, waited for ever), and a
    ``generate`` called after it opened a stream no step thread would ever start. Now both end
    UNAVAILABLE naming the shut-down node, the running one after the events it had."""
    node = CacheNode("n-down", NodeConfig(kv_pool_bytes=128 << 20), num_threads=1)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        running = node.generate(request("r1", "t", "ns", prompt(1), 2500))
        events = [await _next(running)]
        while events[-1]["type"] != "delta":
            events.append(await _next(running))
        await asyncio.get_running_loop().run_in_executor(None, node.shutdown)
        while events[-1]["type"] not in ("finished", "error"):
            events.append(await _next(running))
        after = [event async for event in node.generate(request("r2", "t", "ns", prompt(2), 4))]
        return events, after

    try:
        events, after = asyncio.run(run())
    finally:
        node.shutdown()
    assert events[0]["type"] == "started", events[0]
    assert [e["type"] for e in events[1:-1]] == ["delta"] * (len(events) - 2)
    message = "cache node n-down is shut down; retry the request"
    assert (events[-1]["type"], events[-1].get("code"), events[-1].get("message")) == ("error", "UNAVAILABLE", message)
    assert after == [{"type": "error", "code": "UNAVAILABLE", "message": message}]
    assert node._streams == {}
