"""The DeepResearch workload's OpenAI client (``kvstrata run deepresearch --api openai``)
against a real running stack, call for call beside the gRPC client (issue 20 part 4)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.service_fixtures import Stack
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.openai_client import OpenAIInferenceClient

pytestmark = pytest.mark.slow


def test_openai_client_matches_the_grpc_client(stack: Stack) -> None:
    """Same greedy calls, same session turns: same text, same counts, same result fields; a
    refusal's status is the gRPC status name either way."""
    key = stack.register("oai-workload")

    async def turns(client: object, session: str) -> list:
        calls = [[{"role": "user", "content": "Name two moons of Jupiter."}],
                 [{"role": "user", "content": "And one of Saturn?"}]]
        out = [await client.generate(api_key=key, session_id=session, messages=m, max_tokens=6,  # type: ignore[attr-defined]
                                     temperature=0.0, request_id=f"{session}#{i}") for i, m in enumerate(calls)]
        out.append(await client.generate(api_key="kvs_nope_nope", session_id="", messages=calls[0],  # type: ignore[attr-defined]
                                         max_tokens=2, temperature=0.0, request_id="x"))
        out.append(await client.close_session(api_key=key, session_id=session))  # type: ignore[attr-defined]
        out.append(await client.close_session(api_key=key, session_id=session))  # type: ignore[attr-defined]
        return out

    async def both() -> tuple[list, list]:
        http = OpenAIInferenceClient(f"http://{stack.services.http_address}/v1", timeout_s=60)
        try:
            via_http = await turns(http, "wl/openai")
        finally:
            await http.close()
        async with grpc.aio.insecure_channel(stack.services.address) as channel:
            via_grpc = await turns(GrpcInferenceClient(channel=channel, timeout_s=60), "wl/grpc")
        return via_http, via_grpc

    via_http, via_grpc = asyncio.run(both())
    for h, g in zip(via_http[:2], via_grpc[:2]):
        assert h.ok and g.ok and h.text == g.text and h.text
        assert (h.prompt_tokens, h.completion_tokens, h.finish_reason) == (g.prompt_tokens, g.completion_tokens,
                                                                             g.finish_reason)
        assert h.node_id and h.server_ttft_ms is not None and h.ttft_ms is not None
    assert via_http[1].cached_device_tokens == via_grpc[1].cached_device_tokens > 0  # the session's history
    assert via_http[2].status == via_grpc[2].status == "UNAUTHENTICATED"
    assert via_http[3:] == via_grpc[3:] == ["ok", "NOT_FOUND"]
