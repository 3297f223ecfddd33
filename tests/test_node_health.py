"""A plain CacheNode (real model, no Ray) whose step loop fails: issue 18 fault 4 at the node."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)


def request(rid: str, max_tokens: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_fault_injection_is_off_by_default() -> None:
    node = CacheNode("off", NodeConfig(kv_pool_bytes=8 << 20, host_bytes=0), num_threads=1)
    try:
        with pytest.raises(PermissionError, match="fault_injection"):
            node.inject_step_fault()
        assert node.ping() is True
    finally:
        node.shutdown()


def test_a_failed_step_loop_ends_streams_and_reports_unhealthy() -> None:
    """Issue 18 fault 4: an exception in the step thread ended it silently: ``ping`` stayed
    True and the open stream waited forever. Now the stream ends with UNAVAILABLE (saying
    why), a waiting ``health`` long poll answers at once, ``ping`` and ``stats`` say unhealthy,
    and a request arriving later is refused with UNAVAILABLE instead of hanging."""
    node = CacheNode("f", NodeConfig(kv_pool_bytes=64 << 20, host_bytes=0, fault_injection=True), num_threads=1)

    async def run() -> None:
        gen = node.generate(request("a", 1000))
        assert (await asyncio.wait_for(gen.__anext__(), 60))["type"] == "started"
        assert (await asyncio.wait_for(gen.__anext__(), 60))["type"] == "delta"
        poll = asyncio.ensure_future(node.health(wait_s=30))
        await asyncio.sleep(0.05)
        assert not poll.done()
        node.inject_step_fault()
        t0 = time.monotonic()
        event = {"type": "delta"}
        while event["type"] == "delta":
            event = await asyncio.wait_for(gen.__anext__(), 5)
        assert event["type"] == "error" and event["code"] == "UNAVAILABLE"
        # the tenant's message names the node and an error id; the exception's text is the
        # operators' (health, stats, the log: review s35 C S1)
        assert "injected step fault" not in event["message"] and "error id" in event["message"]
        assert time.monotonic() - t0 < 2.0
        health = await asyncio.wait_for(poll, 2)
        error_id = event["message"].split("error id ", 1)[1][:12]
        assert health["healthy"] is False and "RuntimeError: injected step fault" in health["failure"]
        assert error_id in health["failure"]
        later = [e async for e in node.generate(request("b", 4))]
        assert [(e["type"], e["code"]) for e in later] == [("error", "UNAVAILABLE")]

    try:
        asyncio.run(run())
        assert node.ping() is False
        stats = node.stats()
        assert stats["healthy"] is False and "injected step fault" in stats["failure"]
    finally:
        node.shutdown()
