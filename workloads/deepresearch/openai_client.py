""":class:`InferenceClient` over kvstrata's OpenAI-compatible HTTP API, with the official
``openai`` package (``AsyncOpenAI``, streaming chat completions).

Each call streams with ``stream_options.include_usage``: text chunks, then a usage chunk
with the prompt, completion and cached token counts per tier
(``prompt_tokens_details.cached_tokens_per_tier``) and kvstrata's ``kvstrata`` extension
(node, queue time, the server's TTFT/TPOT, preemption). The session rides as the
``session_id`` body extension (the messages are appended to its history, as with gRPC);
``close_session`` is ``DELETE /v1/sessions/{id}``. A failed call's status is the gRPC status
name the server gave (the ``code`` of its OpenAI-shaped error), so reports read the same
whichever API ran them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

import openai

from services.tls import ClientTls
from workloads.deepresearch.client import OK, TIERS, CallResult, StreamAccumulator, retry_after_from

_HTTP_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


def status_of(exc: openai.APIError) -> str:
    """The gRPC status name of a failed call: the error's ``code`` (kvstrata writes the
    status name there, in a refusal and in an error event mid-stream), else one from the HTTP
    status, else UNAVAILABLE (no answer)."""
    body = exc.body if isinstance(exc.body, dict) else {}
    code = body.get("code")
    if isinstance(code, str) and code.upper() in _HTTP_STATUS.values():
        return code.upper()
    if isinstance(exc, openai.APIStatusError):
        return _HTTP_STATUS.get(exc.status_code, "UNKNOWN")
    return "UNAVAILABLE"


class _Stream(StreamAccumulator):
    """Accumulates one streamed chat completion into the fields of a :class:`CallResult`."""

    def add(self, chunk: Any, now_s: float) -> None:
        for choice in chunk.choices:
            if choice.delta.content:
                self.text.append(choice.delta.content)
                self.first_token_s = self.first_token_s or now_s
                self.last_token_s = now_s
            if choice.finish_reason:
                self.fields["finish_reason"] = choice.finish_reason
        if chunk.usage is not None:
            self.finished = True
            self._usage(chunk.usage, (chunk.model_extra or {}).get("kvstrata") or {})

    def _usage(self, usage: Any, server: dict[str, Any]) -> None:
        tiers = (usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_per_tier", {})
        self.fields.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                           **{f"cached_{t}_tokens": int(tiers.get(t, 0)) for t in TIERS})
        self.fields.update(node_id=server.get("node_id", ""), queue_ms=server.get("queue_ms"),
                           server_ttft_ms=server.get("ttft_ms"), server_tpot_ms=server.get("tpot_ms"),
                           preempted=bool(server.get("preempted", False)))

def openai_http_client(tls: ClientTls | None) -> openai.DefaultAsyncHttpxClient | None:
    """The ``http_client`` of an ``AsyncOpenAI`` verifying with ``tls`` (its CA and server name;
    None: the package's default)."""
    return openai.DefaultAsyncHttpxClient(**tls.http_client_options()) if tls is not None else None


class OpenAIInferenceClient:
    """Talks to a kvstrata gateway's OpenAI-compatible API.

    Args:
        base_url: the API root, ``http://host:port/v1`` (``https://`` for a TLS gateway).
        model: the model name to send (None: the first of ``GET /v1/models``, asked once).
        timeout_s: per-call timeout; None for none.
        tls: how to verify a TLS gateway and, for mutual TLS, the client certificate
            (``services.tls.ClientTls``); None: the ``openai`` package's defaults (the
            system's trust roots for https).
    """

    def __init__(self, base_url: str, *, model: str | None = None, timeout_s: float | None = None,
                 tls: ClientTls | None = None) -> None:
        self.base_url, self.model, self.timeout_s, self.tls = base_url, model, timeout_s, tls
        self._clients: dict[str, openai.AsyncOpenAI] = {}

    def _client(self, api_key: str) -> openai.AsyncOpenAI:
        """One ``AsyncOpenAI`` per tenant key, sharing the first one's connection pool."""
        if api_key not in self._clients:
            first = next(iter(self._clients.values()), None)
            self._clients[api_key] = (
                openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s,
                                   http_client=openai_http_client(self.tls))
                if first is None else first.with_options(api_key=api_key)
            )
        return self._clients[api_key]

    async def _model(self, client: openai.AsyncOpenAI) -> str:
        if self.model is None:
            self.model = (await client.models.list()).data[0].id
        return self.model

    async def generate(
        self, *, api_key: str, session_id: str, messages: list[dict[str, str]], max_tokens: int,
        temperature: float, request_id: str,
    ) -> CallResult:
        """Stream one chat completion; failures come back as a non-ok result, never raised.
        ``request_id`` is not sent (the gateway names HTTP requests itself)."""
        client = self._client(api_key)
        stream = _Stream(time.monotonic())
        try:
            response = await client.chat.completions.create(
                model=await self._model(client), messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                temperature=temperature, stream=True, stream_options={"include_usage": True},
                extra_body={"session_id": session_id} if session_id else None)
            async with response:
                async for chunk in response:
                    stream.add(chunk, time.monotonic())
        except (openai.APITimeoutError, asyncio.TimeoutError):
            return stream.result("DEADLINE_EXCEEDED", time.monotonic(), "client timeout")
        except openai.APIError as exc:  # refused, no connection, or an error event mid-stream
            response = getattr(exc, "response", None)
            retry = retry_after_from(response.headers) if response is not None else None
            return stream.result(status_of(exc), time.monotonic(), str(exc.message), retry)
        except Exception as exc:  # noqa: BLE001 - a failed call is data, not a crash
            return stream.result("UNKNOWN", time.monotonic(), f"{type(exc).__name__}: {exc}")
        if not stream.finished:
            return stream.result("UNKNOWN", time.monotonic(), "stream ended before its usage chunk")
        return stream.result(OK, time.monotonic())

    async def close_session(self, *, api_key: str, session_id: str) -> str:
        """``DELETE /v1/sessions/{session_id}``; ``"ok"`` or the gRPC status name."""
        try:
            await self._client(api_key).delete(f"/sessions/{quote(session_id, safe='')}", cast_to=object)
        except openai.APIStatusError as exc:
            return status_of(exc)
        except Exception:  # noqa: BLE001
            return "UNKNOWN"
        return OK

    async def close(self) -> None:
        """Close the connection pool."""
        first = next(iter(self._clients.values()), None)
        if first is not None:
            await first.close()
