"""The plain CacheNode's two delivery paths, with the real model and no Ray.

``submit`` + ``poll`` is what the gateway uses through Ray: one poll returns every stream's
events since the last one. These tests check that it carries the same events as ``generate``,
posts refusals like any other event, and that ``abort`` frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)


@pytest.fixture(scope="module")
def node():
    n = CacheNode("t", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def request(rid: str, max_tokens: int = 6, tokens: tuple[int, ...] = PROMPT, **kw) -> NodeRequest:
    return NodeRequest(
        request_id=rid, tenant="t", cache_namespace="ns", token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw,
    )


async def drain(node: CacheNode, sub: str, want: set[str], timeout_s: float = 60.0) -> dict[str, list]:
    """Poll until every request in ``want`` has its last event; events per request, in order."""
    got: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while want - {r for r, evs in got.items() if evs and evs[-1]["type"] in ("finished", "error")}:
        assert time.monotonic() < deadline, got
        for rid, event in await node.poll(sub, 0.5):
            got.setdefault(rid, []).append(event)
    return got


def test_submit_and_poll_carry_the_same_tokens_as_generate(node) -> None:
    async def run():
        direct = [ev async for ev in node.generate(request("g"))]
        await node.submit(request("a"), "gw")
        await node.submit(request("b", max_tokens=3), "gw")
        return direct, await drain(node, "gw", {"a", "b"})

    direct, polled = asyncio.run(run())
    tokens = [t for ev in direct if ev["type"] == "delta" for t in ev["token_ids"]]
    for rid, n in (("a", 6), ("b", 3)):
        kinds = [ev["type"] for ev in polled[rid]]
        assert kinds[0] == "started" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"delta"}
        got = [t for ev in polled[rid] if ev["type"] == "delta" for t in ev["token_ids"]]
        assert got == tokens[:n]  # greedy: the same continuation through either path
        assert polled[rid][-1]["completion_tokens"] == n


def test_a_refused_request_gets_its_error_through_poll(node) -> None:
    async def run():
        await node.submit(request("empty", tokens=()), "gw2")
        await node.submit(request("fine", max_tokens=2), "gw2")
        return await drain(node, "gw2", {"empty", "fine"})

    got = asyncio.run(run())
    assert [ev["type"] for ev in got["empty"]] == ["error"]
    assert got["empty"][0]["code"] == "INVALID_ARGUMENT"
    assert got["fine"][-1]["type"] == "finished"


def test_abort_stops_events_and_frees_blocks(node) -> None:
    async def run():
        await node.submit(request("long", max_tokens=400), "gw3")
        first = await node.poll("gw3", 30.0)  # the first step's events
        assert first and first[0][0] == "long"
        assert node.abort("long")
        for _ in range(50):  # the abort lands at the next step boundary
            if node.stats()["used_blocks"] == 0:
                break
            await asyncio.sleep(0.1)
        await node.poll("gw3", 0.1)  # whatever the last step posted before the abort
        return await node.poll("gw3", 0.3)

    assert asyncio.run(run()) == []  # nothing more for the aborted request
    assert "long" not in node._streams
    assert node.stats()["used_blocks"] == 0 and node.stats()["running"] == 0
    node.engine.check_integrity()


def test_an_abort_that_overtakes_its_request_cancels_it(node) -> None:
    """The gateway aborts while the scheduler is still forwarding the request."""
    assert not node.abort("early")

    async def run():
        await node.submit(request("early"), "gw4")
        return await drain(node, "gw4", {"early"})

    got = asyncio.run(run())
    assert [(ev["type"], ev.get("code")) for ev in got["early"]] == [("error", "CANCELLED")]
    assert "early" not in node._streams and node.stats()["running"] == 0
