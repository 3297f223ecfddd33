"""One request's node events as OpenAI response objects: ``chat.completion`` /
``text_completion`` bodies, their streamed chunks, and ``usage``.

``usage`` always holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
``prompt_tokens_details.cached_tokens`` (every prompt token whose KV was reused, from any
tier), plus the extension ``prompt_tokens_details.cached_tokens_per_tier``
(``{"device", "host", "spill_ram", "spill_disk"}``). The non-streamed body and the usage chunk
also carry the extension ``kvstrata``: ``node_id``, ``queue_ms``, ``priority`` (as the node
queued the request) and the server's ``ttft_ms``, ``tpot_ms`` and ``preempted`` (what gRPC's
started and finished events say). A choice's ``logprobs`` is null unless the request asked for
them (``services.openai_api.logprobs``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from services.openai_api.logprobs import LOGPROB_TOKENS_PER_CHUNK, Logprobs
from services.openai_api.prompt_logprobs import PromptExtras
from services.openai_api.response_budget import Held
from services.openai_api.tool_calls import ToolOutput
from tenants.usage import TierTokens

ECHO_CHARS_PER_PIECE = 1 << 14
"""The most characters of an echoed prompt one piece of a choice's text holds (a streamed
chunk: at most ~96 KiB of JSON for 6-byte characters, ~192 KiB for 12-byte ones)."""


PROMPT_ENTRIES_PER_TURN = 256
"""The most prompt logprobs entries fed in one turn of the event loop (``Generation._feed``:
with 20 alternatives, ~1-3 ms)."""


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: dict[str, int]) -> dict[str, Any]:
    """OpenAI's ``usage`` with kvstrata's per-tier cached counts (``cached``: tier -> tokens)."""
    tiers = TierTokens.from_dict(cached).as_dict()
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(tiers.values()), "cached_tokens_per_tier": tiers},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    body = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {body}\n\n".encode()


class Generation:
    """Reads one request's events (``InferenceServicer.generate``, its ``started`` event
    already read) into text pieces, a finish reason and usage.

    Args:
        events: the rest of the request's events; closed when reading ends (an early end,
            a gone client, aborts the request on its node).
        started: its ``started`` event.
        chat: a chat completion (else a text completion).
        model: the model name the response reports.
        request_id: the request's id (``request_ids``); the response's ``id`` is
            ``chatcmpl-<request_id>`` (``cmpl-`` for a text completion), as vLLM builds it
            (None: a new uuid).
        logprobs: the request's log probabilities in the endpoint's shape, when it asked for
            them (``services.openai_api.logprobs``): each delta's entries are added to it as it
            is read, a streamed chunk carries those since the previous chunk, the whole
            response all of them.
        tools: a chat's text read as tool calls (``services.openai_api.tool_calls``; None:
            its text is the message's content).
        prompt: a completion's ``echo`` and either endpoint's ``prompt_logprobs``
            (``services.openai_api.prompt_logprobs``; None: neither asked).

    Stop strings are the node's (``SamplingParams.stop``): its text arrives cut before one,
    with finish_reason "stop", and is relayed as it comes.
    """

    def __init__(self, events: AsyncIterator[dict[str, Any]], started: dict[str, Any], chat: bool,
                 model: str, request_id: str | None = None, logprobs: Logprobs | None = None,
                 tools: ToolOutput | None = None, prompt: PromptExtras | None = None) -> None:
        self.events, self.chat, self.model, self.logprobs, self.tools = events, chat, model, logprobs, tools
        self.prompt = prompt
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = int(started["prompt_tokens"])
        self.cached: dict[str, int] = dict(started.get("cached_tokens", {}))
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.server: dict[str, Any] = {"node_id": started.get("node_id", ""), "queue_ms": started.get("queue_ms"),
                                       "priority": started.get("priority", 0), "ttft_ms": None, "tpot_ms": None,
                                       "preempted": False}

    async def pieces(self) -> AsyncIterator[str]:
        """The generated text in the increments it may be sent in; ``finish_reason`` and the
        counts are final once this ends. Raises ``CallAborted`` when the request fails."""
        try:
            if self.prompt is not None:  # refused before its prompt's entries are read (and its node
                self.prompt.check_prompt(self.prompt_tokens)  # computes them all): review 28c F3
            async for event in self.events:
                if event["type"] == "delta" and self.prompt is not None:  # its prompt's part
                    if event.get("prompt_logprobs"):
                        await self._feed(event["prompt_logprobs"])
                    if event["token_ids"] and self.prompt.echo_now(self.logprobs):
                        async for piece in self._echo():
                            yield piece
                    if self.prompt.echo_only:
                        continue
                if event["type"] == "delta":
                    self.completion_tokens += len(event["token_ids"])
                    if self.logprobs is not None and event.get("logprobs"):
                        self.logprobs.add(event["token_ids"], event["logprobs"])
                        # a stream's chunk carries at most LOGPROB_TOKENS_PER_CHUNK tokens'
                        # entries: more go first in chunks of empty text (review 26c F2: held
                        # back, or coalesced, tokens' entries all went in the next text's chunk)
                        while self.logprobs.streamed and self.logprobs.pending() > LOGPROB_TOKENS_PER_CHUNK:
                            yield ""
                    if event["text"]:
                        yield event["text"]
                elif event["type"] == "finished":
                    if self.prompt is not None and self.prompt.echo_now(self.logprobs):
                        async for piece in self._echo():
                            yield piece
                    self.prompt_tokens, self.completion_tokens = event["prompt_tokens"], event["completion_tokens"]
                    self.cached, self.finish_reason = dict(event.get("cached_tokens", {})), event["finish_reason"]
                    if self.prompt is not None and self.prompt.echo_only:  # max_tokens 0: the prompt alone
                        self.completion_tokens, self.finish_reason = 0, "length"
                    self.server.update(ttft_ms=event.get("ttft_ms"), tpot_ms=event.get("tpot_ms"),
                                       preempted=bool(event.get("preempted", False)))
        finally:
            await self.events.aclose()  # type: ignore[attr-defined]

    async def _feed(self, entries: list[list[Any]]) -> None:
        """A delta's prompt entries into ``prompt``, ``PROMPT_ENTRIES_PER_TURN`` at a time, the
        event loop's other work let in between (a delta coalesced while its client read
        slowly holds up to its whole prompt's: 12,483 entries of 20 alternatives at the bound)."""
        for start in range(0, len(entries), PROMPT_ENTRIES_PER_TURN):
            if start:
                await asyncio.sleep(0)
            self.prompt.feed(entries[start: start + PROMPT_ENTRIES_PER_TURN], self.logprobs)  # type: ignore[union-attr]

    async def _echo(self) -> AsyncIterator[str]:
        """The echoed prompt's text, after chunks of empty text carrying its tokens' entries
        past ``LOGPROB_TOKENS_PER_CHUNK`` (as ``pieces``), in pieces of at most
        ``ECHO_CHARS_PER_PIECE`` characters (a stream's chunk each: the event loop encodes
        one at a time, between its other work). Regression (review s33 F1): the whole echo
        was one chunk, up to ``MAX_PROMPT_CHARS`` characters (6 MB of JSON) encoded at once
        on the event loop every tenant's calls share, once per choice."""
        while self.logprobs is not None and self.logprobs.streamed and self.logprobs.pending() > LOGPROB_TOKENS_PER_CHUNK:
            yield ""
        echo = self.prompt.echo or ""  # type: ignore[union-attr]
        for start in range(0, max(len(echo), 1), ECHO_CHARS_PER_PIECE):
            yield echo[start: start + ECHO_CHARS_PER_PIECE]

    def held(self, text: str) -> Held:
        """What a whole response's choice of ``text`` (its echo included) holds
        (``OpenAIEdge.render``): the log probabilities (its own and its ``prompt_logprobs``)
        and ``text``'s characters."""
        values = (len(self.logprobs) if self.logprobs is not None else 0) + (len(self.prompt) if self.prompt else 0)
        return Held(values, len(text))

    def body_fields(self) -> dict[str, Any]:
        """A chat body's ``prompt_logprobs`` when asked (vLLM's, on the body: the choices share
        the prompt)."""
        if self.chat and self.prompt is not None and self.prompt.prompt_k is not None:
            return {"prompt_logprobs": self.prompt.field()}
        return {}

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached)

    def _choice(self, text: str | None, finish_reason: str | None, first: bool = False,
                whole: bool = False) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:  # (a streamed chunk: those since the previous chunk)
            logprobs = self.logprobs.whole() if whole else self.logprobs.take()
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if not self.chat:
            choice["text"] = text or ""
            if whole and self.prompt is not None and self.prompt.prompt_k is not None:  # vLLM's, on the choice
                choice["prompt_logprobs"] = self.prompt.field()
        elif whole:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:  # content and tool_calls; finish_reason tool_calls when called
                fields, choice["finish_reason"] = self.tools.message(text or "", finish_reason)
                message.update(fields)
            choice["message"] = message
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if self.tools is not None and not first:  # text held back or read as tool calls
                if text is not None:
                    delta.update(self.tools.delta(text))
                else:  # the finish chunk: what was held, and the calls
                    fields, choice["finish_reason"] = self.tools.end(finish_reason)
                    delta.update(fields)
            elif text is not None:
                delta["content"] = text
            choice["delta"] = delta
        return choice

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              include_usage: bool = False) -> dict[str, Any]:
        """A streamed chunk (``usage`` null on it when the stream ends with a usage chunk)."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion",
                              [self._choice(text, finish_reason, first)])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"], body["kvstrata"] = self.usage(), self.server
        return body

    def response(self, text: str) -> dict[str, Any]:
        """The non-streamed response body."""
        body = self._envelope("chat.completion" if self.chat else "text_completion",
                              [self._choice(text, self.finish_reason, whole=True)])
        body["usage"], body["kvstrata"] = self.usage(), self.server
        return body | self.body_fields()


def says_nothing(chunk: dict[str, Any]) -> bool:
    """A streamed chat chunk whose one choice has an empty delta, no logprobs and no finish
    reason (text a tool-call parser holds back): not sent, as vLLM sends none. Regression (trial
    28k F1): a streamed ``tool_choice: "auto"`` answer sent a ``delta: {}`` chunk for every
    token held back, 58 before one call's finish chunk."""
    choices = chunk.get("choices") or ()
    return (len(choices) == 1 and choices[0].get("delta") == {} and choices[0].get("logprobs") is None
            and choices[0].get("finish_reason") is None)
