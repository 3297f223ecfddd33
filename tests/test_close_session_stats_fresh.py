"""A closed session's blocks are gone from the node's answers the moment the close returns.

Regression (s41 new-user walkthrough): a client that called ``CloseSession`` and then at once
``GetUsage`` (``kvstrata close-session`` then ``tenant show``) was told the tenant still held the
closed session's blocks "by idle sessions" (2 of 3 tries over gRPC: 3 blocks right after the close,
0 1.5 s later), and ``Stats`` (``kvstrata status``) counted them "by sessions". The node answered
``tenant_blocks`` and ``stats`` from the snapshot its step thread refreshes after its idle wait
(``step_idle_wait_s``), and the close was answered before that refresh. Now the step thread
refreshes the snapshot after it runs admin calls and before it answers them. A real plain
``CacheNode`` (SmolLM2, no Ray); ``step_idle_wait_s`` 2 s makes the old wait longer than the test.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest


def test_close_session_answers_after_the_stats_snapshot_shows_it_freed() -> None:
    """Before the close the snapshot shows the idle session's 4 blocks (53 history tokens, 16 a
    block); the close frees 54 tokens (50 prompt + 4 generated); right after ``close_session`` returns, ``tenant_blocks`` and ``stats`` show none.
    Before the fix they still showed 4 (and 4 ``session_blocks``) until the idle wait ended."""
    node = CacheNode("n0", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0, step_idle_wait_s=2.0), num_threads=1)

    async def run() -> tuple[dict[str, int], dict[str, int], dict[str, Any], int]:
        request = NodeRequest(request_id="t/r1", tenant="t", cache_namespace="ns", token_ids=tuple(range(100, 150)),
                              session_id="t/s1", sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        async for _ in node.generate(request):
            pass
        await node.integrity_stats()  # a step boundary after the turn's end: the session is idle in the snapshot
        for _ in range(60):  # the step thread republishes once STATS_EVERY_S passed since the last one
            if node.tenant_blocks(tenant="t")["idle_sessions"]:
                break
            await asyncio.sleep(0.05)
        held = node.tenant_blocks(tenant="t")
        freed = await node.close_session(session_id="t/s1", tenant="t")
        return held, node.tenant_blocks(tenant="t"), node.stats(), freed

    try:
        held, after, stats, freed = asyncio.run(run())
    finally:
        node.shutdown()
    assert held == {"requests": 0, "idle_sessions": 4}
    assert freed == 54  # 50 prompt tokens + 4 generated
    assert after == {"requests": 0, "idle_sessions": 0}
    assert stats["session_blocks"] == 0 and stats["sessions"] == 0
