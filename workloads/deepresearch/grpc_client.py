""":class:`InferenceClient` over the kvstrata.v1 gRPC API (``grpc.aio``).

``Generate`` is server-streaming: one ``started`` event (prompt size, cached
tokens per tier), ``delta`` events with text, and one ``finished`` event with
the final counts and the server's timings. The tenant's API key travels in the
``authorization: Bearer <key>`` metadata.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services.grpc_messages import client_channel_options
from services.tls import ClientTls, open_aio_channel
from workloads.deepresearch.client import OK, CallResult, StreamAccumulator, retry_after_from


def _metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def _tier_fields(tiers: Any) -> dict[str, int]:
    return {
        "cached_device_tokens": int(tiers.device),
        "cached_host_tokens": int(tiers.host),
        "cached_spill_ram_tokens": int(tiers.spill_ram),
        "cached_spill_disk_tokens": int(tiers.spill_disk),
    }


class _Stream(StreamAccumulator):
    """Accumulates one Generate stream into the fields of a :class:`CallResult`."""

    def add(self, event: inference_pb2.GenerateResponse, now_s: float) -> None:
        kind = event.WhichOneof("event")
        if kind == "started":
            s = event.started
            self.fields.update(prompt_tokens=s.prompt_tokens, node_id=s.node_id,
                               queue_ms=s.queue_ms, **_tier_fields(s.cached_tokens))  # fmt: skip
        elif kind == "delta":
            self.text.append(event.delta.text)
            if event.delta.token_ids or event.delta.text:
                if self.first_token_s is None:
                    self.first_token_s = now_s
                self.last_token_s = now_s
        elif kind == "finished":
            f = event.finished
            self.finished = True
            self.fields.update(
                prompt_tokens=f.prompt_tokens, completion_tokens=f.completion_tokens,
                server_ttft_ms=f.ttft_ms, server_tpot_ms=f.tpot_ms, preempted=f.preempted,
                finish_reason=f.finish_reason, **_tier_fields(f.cached_tokens),
            )  # fmt: skip

class GrpcInferenceClient:
    """Talks to a kvstrata gateway.

    Args:
        target: ``host:port`` of the gateway (a channel is opened: secure with ``tls``,
            plaintext without), or
        channel: an existing ``grpc.aio.Channel`` (not closed by :meth:`close`).
        timeout_s: per-call deadline; None for no deadline.
        tls: how to verify a TLS gateway at ``target`` (``services.tls.ClientTls``).

    Raises:
        ValueError: neither or both of ``target`` and ``channel`` given.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        channel: grpc.aio.Channel | None = None,
        timeout_s: float | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if (target is None) == (channel is None):
            raise ValueError("give exactly one of target and channel")
        self._owns_channel = channel is None
        self._channel = channel if channel is not None else open_aio_channel(target, tls, client_channel_options())
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._timeout_s = timeout_s

    async def generate(
        self, *, api_key: str, session_id: str, messages: list[dict[str, str]], max_tokens: int,
        temperature: float, request_id: str,
    ) -> CallResult:
        """Stream one generation; failures come back as a non-ok result, never raised."""
        request = inference_pb2.GenerateRequest(
            chat=inference_pb2.ChatMessages(
                messages=[inference_pb2.ChatMessage(**m) for m in messages]
            ),
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature),
            session_id=session_id,
            request_id=request_id,
        )
        stream = _Stream(time.monotonic())
        try:
            call = self._stub.Generate(
                request, metadata=_metadata(api_key), timeout=self._timeout_s
            )
            async for event in call:
                stream.add(event, time.monotonic())
        except grpc.aio.AioRpcError as exc:
            return stream.result(exc.code().name, time.monotonic(), exc.details() or "",
                                 retry_after_from(exc.trailing_metadata()))
        except asyncio.TimeoutError:
            return stream.result("DEADLINE_EXCEEDED", time.monotonic(), "client timeout")
        except Exception as exc:  # noqa: BLE001 - a failed call is data, not a crash
            return stream.result("UNKNOWN", time.monotonic(), f"{type(exc).__name__}: {exc}")
        if not stream.finished:
            return stream.result("UNKNOWN", time.monotonic(), "stream ended before finished")
        return stream.result(OK, time.monotonic())

    async def close_session(self, *, api_key: str, session_id: str) -> str:
        """Close ``session_id`` on the server; ``"ok"`` or the gRPC status name."""
        try:
            await self._stub.CloseSession(
                inference_pb2.CloseSessionRequest(session_id=session_id),
                metadata=_metadata(api_key),
                timeout=self._timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)
        except Exception:  # noqa: BLE001
            return "UNKNOWN"
        return OK

    async def close(self) -> None:
        """Close the channel if this client opened it."""
        if self._owns_channel:
            await self._channel.close()
