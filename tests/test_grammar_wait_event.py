"""A cache node's ``finished`` event carries a structured request's grammar wait
(``grammar_wait_ms``: from its arrival to its grammar compiled), which the scheduler's
admission pace takes out of its TTFT (``NodePace.finished``; review 31, see
tests/test_admission_pace_structured.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from services import data_plane
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest


@pytest.mark.slow
def test_the_node_reports_a_structured_requests_grammar_wait() -> None:
    """On a real cache node (SmolLM2-135M): a structured request's ``finished`` event carries
    its grammar wait (its arrival to its grammar compiled; its first compile here waits for a
    compiler process to start: above 0, at most its TTFT), an unstructured one's none; the
    gateway's check takes both as they are."""
    pytest.importorskip("xgrammar")
    node = CacheNode("waits", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    try:
        def run(rid: str, structured: bool) -> dict:
            req = NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=tuple(range(20, 60)),
                              sampling=SamplingParams(max_tokens=4, structured_output=(
                                  StructuredOutputSpec("choice", json.dumps(["blue", "green"])) if structured
                                  else None)))

            async def events() -> list[dict]:
                return [event async for event in node.generate(req)]

            *_, finished = asyncio.run(events())
            assert finished["type"] == "finished", finished
            assert data_plane.check_event(finished) == finished
            return finished

        structured, free = run("s", True), run("u", False)
        assert 0.0 < structured["grammar_wait_ms"] <= structured["ttft_ms"], structured
        assert "grammar_wait_ms" not in free and free["ttft_ms"] > 0.0, free
    finally:
        node.shutdown()
