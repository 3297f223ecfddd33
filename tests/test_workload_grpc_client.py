"""GrpcInferenceClient against an in-process stand-in servicer (real gRPC, no model).

The stand-in implements only the wire contract of kvstrata.v1.InferenceService;
the end-to-end test against the real gateway lives elsewhere.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstrata.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from workloads.deepresearch.client import CallResult
from workloads.deepresearch.grpc_client import GrpcInferenceClient


class StandIn(inference_pb2_grpc.InferenceServiceServicer):
    """Streams "Fritz" + " Lang"; aborts for a bad key or session "full"."""

    def __init__(self) -> None:
        self.requests: list[inference_pb2.GenerateRequest] = []
        self.closed: list[str] = []

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        if ("authorization", "Bearer good") not in context.invocation_metadata():
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad api key")
        if request.session_id == "full":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "retry in 2 s")
        tiers = common_pb2.TierTokens(device=5, host=3, spill_ram=2, spill_disk=1)
        yield inference_pb2.GenerateResponse(started=inference_pb2.GenerateStarted(
            request_id=request.request_id, node_id="node-0", prompt_tokens=20,
            cached_tokens=tiers, queue_ms=1.5))  # fmt: skip
        for ids, text in (([11], "Fritz"), ([12], " Lang")):
            await asyncio.sleep(0.01)
            yield inference_pb2.GenerateResponse(
                delta=inference_pb2.GenerateDelta(token_ids=ids, text=text)
            )
        if request.session_id == "truncated":
            return
        reason = "abort" if request.session_id == "aborted" else "stop"
        yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(
            finish_reason=reason, prompt_tokens=20, completion_tokens=2, cached_tokens=tiers,
            ttft_ms=7.0, tpot_ms=3.0, preempted=True))  # fmt: skip

    async def CloseSession(self, request: Any, context: Any) -> Any:
        self.closed.append(request.session_id)
        return inference_pb2.CloseSessionResponse(freed_tokens=22)


def _with_server(test: Callable[[GrpcInferenceClient, StandIn], Awaitable[None]]) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        servicer = StandIn()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = GrpcInferenceClient(f"127.0.0.1:{port}", timeout_s=10.0)
        try:
            await test(client, servicer)
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(main())


async def _generate(client: GrpcInferenceClient, session_id: str, key: str = "good") -> CallResult:
    return await client.generate(
        api_key=key, session_id=session_id, messages=[{"role": "user", "content": "who?"}],
        max_tokens=8, temperature=0.0, request_id="r-1",
    )  # fmt: skip


def test_stream_is_accumulated_into_a_call_result() -> None:
    async def check(client: GrpcInferenceClient, servicer: StandIn) -> None:
        result = await _generate(client, "s-1")
        assert (result.status, result.text, result.error) == ("ok", "Fritz Lang", "")
        assert (result.prompt_tokens, result.completion_tokens) == (20, 2)
        assert [result.cached_tokens(t) for t in ("device", "host", "spill_ram", "spill_disk")] == [
            5, 3, 2, 1,
        ]  # fmt: skip
        assert (result.server_ttft_ms, result.server_tpot_ms, result.queue_ms) == (7.0, 3.0, 1.5)
        assert result.preempted and result.finish_reason == "stop" and result.node_id == "node-0"
        assert result.ttft_ms is not None and result.ttft_ms >= 10.0
        assert result.tpot_ms is not None and result.tpot_ms >= 10.0
        assert result.end_s - result.start_s >= 0.02
        request = servicer.requests[0]
        assert (request.session_id, request.request_id) == ("s-1", "r-1")
        assert request.sampling.max_tokens == 8
        assert [(m.role, m.content) for m in request.chat.messages] == [("user", "who?")]

    _with_server(check)


def test_grpc_errors_become_status_names() -> None:
    async def check(client: GrpcInferenceClient, servicer: StandIn) -> None:
        full = await _generate(client, "full")
        assert (full.status, full.error, full.text) == ("RESOURCE_EXHAUSTED", "retry in 2 s", "")
        bad = await _generate(client, "s-1", key="wrong")
        assert (bad.status, bad.error) == ("UNAUTHENTICATED", "bad api key")
        cut = await _generate(client, "truncated")
        assert (cut.status, cut.text) == ("UNKNOWN", "Fritz Lang")
        assert cut.error == "stream ended before finished"
        aborted = await _generate(client, "aborted")
        assert aborted.status == "ABORTED"

    _with_server(check)


def test_unreachable_server_is_a_result_not_an_exception() -> None:
    async def main() -> CallResult:
        client = GrpcInferenceClient("127.0.0.1:1", timeout_s=2.0)
        try:
            return await _generate(client, "s-1")
        finally:
            await client.close()

    result = asyncio.run(main())
    assert result.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert not result.ok


def test_close_session_sends_the_session_id() -> None:
    async def check(client: GrpcInferenceClient, servicer: StandIn) -> None:
        assert await client.close_session(api_key="good", session_id="s-9") == "ok"
        assert servicer.closed == ["s-9"]

    _with_server(check)
