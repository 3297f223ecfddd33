"""OpenAI's ``n`` > 1 (``POST /v1/chat/completions`` and ``POST /v1/completions``): one body
served as ``n`` requests on the gateway's one call path, started all or nothing, their events
merged into one response whose ``choices`` hold index 0..n-1.

Each choice is a request of its own through ``InferenceServicer.generate``: authenticated,
bounded, admitted, counted and streamed as any request is, with the body's prompt and sampling
and its own id, ``<i>_<request id>`` (as vLLM names a parallel-sampling child; the response's
``id`` is still ``chatcmpl-<request id>``). The body holds its request id in flight for its
tenant and ``cache_salt`` from before choice 0 starts until every choice has ended
(``InferenceServicer.hold_call``), as a call with ``n`` 1 holds its own: another call with that
id under the same salt (or none), of either API and any ``n``, is refused 409 naming it. The choices' ids are held by nobody
(``GenerateInput.call_id``), so a client's own id (a gRPC client may send ``0_<id>``) never
collides with one, and a duplicate never names one (past the gateway each attempt's id is
unique). With a ``seed``, choice ``i`` samples with ``(seed + i) mod 2**64`` (vLLM's ``seed +
index``; ``choice_seed``), so the response is reproducible and its choices differ; without one
each choice draws from its node's generator.
``temperature`` 0 with ``n`` > 1 is served, as OpenAI and vLLM serve it: n equal greedy texts.
The prompt is parsed (a completion's tokenized, a chat's rendered and tokenized by the
gateway's templater: ``OpenAIEdge.rendered``) once for all choices (``ChoiceInputs``), on the
first choice's turn on the tenant's worker thread.

Prompt KV is reused: choice 0 is started first, and the others are submitted once its
``started`` event came (its node has scheduled its first step), all with one routing key: the
body's ``prompt_cache_key``, else one made from the prompt (``shared_routing_key``). The
scheduler sends them to choice 0's node while it has running room, where they find the
prompt's full blocks in the prefix cache (a node caches a block once its KV is computed, after
the step that computed it): a prompt prefilled in one step is computed once, a longer one
(chunked prefill) shared as far as choice 0 had computed it. A choice routed to another node
(choice 0's full) computes the prompt there. The response's ``kvstrata.choices`` says, for
each choice, its node and its ``cached_tokens``.

All or nothing: the status is known once every choice has started. A refusal of any (the 429 /
503 with ``Retry-After``, a quota, a bound, a context limit: whatever the gateway answers one
request) aborts each choice already admitted (on its node, which frees its blocks, and at the
scheduler) and is the response; a client that disconnects, at any point, aborts all n; a
choice that fails mid-response aborts the others, and its error is the response (a stream's
error event).

Accounting: each choice is one request to admission, the metrics, ``max_streams_per_tenant``
(an ``n`` above it is a 400 naming ``n``: its choices could never all be open) and its tenant's
usage (its prompt tokens, the reused ones counted as cached, and its completion tokens). The
response's ``usage`` is OpenAI's: ``prompt_tokens`` once (with choice 0's cached counts: what
the prompt reused from before this request), ``completion_tokens`` summed over the choices.

Shapes (vLLM's): a whole response's ``choices`` each have their own text and
``finish_reason``; a stream sends a chat's role chunk for each choice first, then each chunk
as its choice's text arrives (``choices: [{"index": i, ...}]``, one choice a chunk,
interleaved), each choice's finish chunk when it ends, the usage chunk when
``stream_options.include_usage`` asks, and ``[DONE]``. Log probabilities, when asked, are each
choice's own (``services.openai_api.logprobs``: one collector a choice).

Part of ``services.openai_api.app`` (``OpenAIEdge.complete`` hands a body with ``n`` > 1 here).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from fastapi import Request
from starlette.responses import Response

from services.gateway import RETRY_S, GenerateInput, InferenceServicer, StreamWriter
from services.openai_api.context import CallAborted, HttpCallContext
from services.openai_api.errors import _gone, refusal_about
from services.openai_api.logprobs import Logprobs
from services.openai_api.prompt_logprobs import PromptExtras
from services.openai_api.response_budget import Held
from services.openai_api.responses import Generation, says_nothing, sse, usage_dict
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from services.openai_api.stream_shape import StreamShape
from services.openai_api.streaming import (
    ClientGone,
    Render,
    _ClosingStream,
    _render_here,
    unless_gone,
)

SEED_SPACE = 1 << 64
"""A seed is an unsigned 64-bit integer (``SamplingParams.seed``)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed: ``(seed + index) mod 2**64``; None (no seed) stays None."""
    return None if seed is None else (seed + index) % SEED_SPACE


def shared_routing_key(call: GenerateInput) -> str:
    """A routing key for the choices of a body without ``prompt_cache_key``: a digest of its
    prompt, cache salt and KV policy, so they (and a later body with the same prompt) go to one
    node while it has room. One key per distinct prompt joins the tenant's remembered keys
    (``RoutingKeys``: its newest 8,192)."""
    text = json.dumps([call.prompt, call.cache_salt, call.policy], separators=(",", ":"))
    return "n-choices:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class ChoiceInputs:
    """The ``GenerateInput`` of each choice from one ``parse`` (the edge's: the body's, with the
    request id), called once, on the first choice's worker-thread turn (the others reuse it).

    Choice ``i`` has id ``<i>_<request id>`` (its ``call_id`` the request id, which the body
    holds), seed ``choice_seed(seed, i)`` and the routing key of ``shared_routing_key`` when
    the body has none. A ``ValueError`` of ``parse`` is raised to
    the first choice that asks (the gateway answers it INVALID_ARGUMENT)."""

    def __init__(self, parse: Callable[[], GenerateInput]) -> None:
        self._parse, self._lock = parse, threading.Lock()
        self._call: GenerateInput | None = None

    def _shared(self) -> GenerateInput:
        with self._lock:  # (choices parse one at a time anyway: the tenant's worker-thread turn)
            if self._call is None:
                call = self._parse()
                self._call = dataclasses.replace(call, routing_key=call.routing_key or shared_routing_key(call))
            return self._call

    def parse_for(self, index: int) -> Callable[[], GenerateInput]:
        """Choice ``index``'s ``parse`` (for ``InferenceServicer.generate``)."""
        def parse() -> GenerateInput:
            call = self._shared()
            sampling = dataclasses.replace(call.sampling, seed=choice_seed(call.sampling.seed, index))
            return dataclasses.replace(call, request_id=f"{index}_{call.request_id}", call_id=call.request_id,
                                       sampling=sampling)

        return parse


class ChoiceGeneration(Generation):
    """One choice's ``Generation``: its chunks and its part of the whole response carry its
    ``index``."""

    def __init__(self, *args: Any, index: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.index = index

    def _choice(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        choice = super()._choice(*args, **kwargs)
        choice["index"] = self.index
        return choice


class Choices:
    """The ``n`` requests of one body: started all or none, then one response (``respond``).

    Args:
        servicer: the gateway's servicer (its ``generate``).
        request: the HTTP request (its client's disconnect aborts every choice).
        body: the parsed body (``n`` > 1).
        parse: the body's ``GenerateInput`` (the edge's parse, with the request id).
        writer: the task that writes the response (``StreamWriter``), shared by the choices:
            any choice's idle-reader deadline stops it.
        model: the model name the response reports; request_id: the request's id.
        logprobs: a new collector of one choice's log probabilities (``OpenAIEdge.logprobs``;
            None: not asked), called once per choice (the parse itself, a chat's rendering
            included, runs once: ``ChoiceInputs``).
        render: builds the whole response's body (``OpenAIEdge.render``: on a worker thread
            when it holds many log probabilities).
        prompt: a new collector of one choice's echo and prompt logprobs
            (``OpenAIEdge.prompt_extras``; None: neither asked), called once per choice.

    Every read of a choice's events runs as a task of ``reads`` (the choices are read
    together), and one ``close`` ends them all: cancels the reads, waits for them to land,
    then closes each choice (a request that did not finish is aborted on its node and
    released at the scheduler, as a single request's gone client has it).
    """

    def __init__(self, servicer: InferenceServicer, request: Request, body: ChatCompletionRequest | CompletionRequest,
                 parse: Callable[[], GenerateInput], writer: StreamWriter, model: str, request_id: str,
                 logprobs: Callable[[], Logprobs | None] = lambda: None, render: Render = _render_here,
                 prompt: Callable[[], PromptExtras | None] = lambda: None) -> None:
        self.servicer, self.request, self.body, self.writer = servicer, request, body, writer
        self.logprobs, self.render, self.prompt = logprobs, render, prompt
        self.inputs = ChoiceInputs(parse)
        self.chat = isinstance(body, ChatCompletionRequest)
        self.model, self.request_id = model, request_id
        self.events: list[AsyncIterator[dict[str, Any]]] = []
        self.pieces: list[AsyncIterator[str]] = []
        self.reads: dict[asyncio.Future[Any], int] = {}  # a read in flight -> its choice
        self._closing: asyncio.Future[None] | None = None
        self._release: Callable[[], None] | None = None  # the request id's hold (``hold_call``)

    def _open(self, index: int) -> AsyncIterator[dict[str, Any]]:
        events = self.servicer.generate(HttpCallContext(self.request), self.inputs.parse_for(index), self.writer)
        self.events.append(events)
        return events

    def _read(self, index: int, iterator: AsyncIterator[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(anext(iterator))
        self.reads[task] = index
        return task

    async def _start(self) -> list[dict[str, Any]]:
        """Every choice's ``started`` event: choice 0's first, then the others' together. The
        first refusal (the lowest index among those failed by then) is raised as soon as one
        fails, after ``close``; so is a cancellation."""
        try:
            self._release = await self.servicer.hold_call(HttpCallContext(self.request), self.request_id,
                                                          self.body.cache_salt)
            started = [await self._read(0, self._open(0))]
            tasks = [self._read(i, self._open(i)) for i in range(1, self.body.n)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            self.reads.clear()
            return started + [t.result() for t in tasks]
        except BaseException:
            await self.close()
            raise

    def close(self) -> Awaitable[None]:
        """End every choice (once, whoever asks first, and to its end even when the caller is
        cancelled): its reads cancelled and landed, its text and events closed."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return asyncio.shield(self._closing)

    async def _close(self) -> None:
        reads = list(self.reads)
        for task in reads:
            task.cancel()
        if reads:
            await asyncio.wait(reads)
        for task in reads:  # retrieved: none is logged as "never retrieved"
            _ = task.cancelled() or task.exception()
        try:
            for iterator in [*self.pieces, *self.events]:  # a text never read did not close its events
                await iterator.aclose()  # type: ignore[attr-defined]
        finally:  # the id is free once no choice runs
            if self._release is not None:
                self._release()

    async def _merged(self, gens: list[ChoiceGeneration]) -> AsyncIterator[tuple[int, str | None]]:
        """The choices' text as it arrives: ``(i, text)`` for a piece of choice ``i``'s text,
        ``(i, None)`` once it has ended (its ``finish_reason`` and counts final). Each choice
        has at most one read ahead of what the consumer took (the gateway's idle-reader
        deadline and undelivered-bytes bound see a slow client as they do for one request). A
        choice's failure (``CallAborted``) is raised; however this ends, ``close``."""
        self.pieces = [g.pieces() for g in gens]
        for i, pieces in enumerate(self.pieces):
            self._read(i, pieces)
        try:
            while self.reads:
                done, _ = await asyncio.wait(self.reads, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: self.reads[t]):
                    i = self.reads.pop(task)
                    try:
                        text = task.result()
                    except StopAsyncIteration:
                        yield i, None
                        continue
                    yield i, text
                    self._read(i, self.pieces[i])
        finally:
            await self.close()

    def _about(self, exc: CallAborted) -> CallAborted:
        return refusal_about(exc, self.body)

    async def respond(self) -> Response:
        """Start every choice, then the response (streamed or whole); a refusal's error
        response, or 499 when the client went first. An ``n`` above ``max_streams_per_tenant``
        (its choices could never all be open) is a 400 naming ``n``, before anything starts.
        Regression (review 26d P4): it was the cap's retryable 429, saying the tenant had calls
        open when it had none."""
        cap = self.servicer.max_streams_per_tenant
        if self.body.n > cap:
            return CallAborted(grpc.StatusCode.INVALID_ARGUMENT, f"n: must be at most {cap} at this gateway (its "
                               "max_streams_per_tenant: each choice is one of the tenant's calls open at once), "
                               f"got {self.body.n}", param="n").response()
        try:
            started = await unless_gone(self.request, self._start())
        except CallAborted as exc:
            return self._about(exc).response()
        except ClientGone:
            return _gone()
        except asyncio.CancelledError:
            # a started choice's events waited unread while the others waited to start (their
            # nodes' queues): past ``stream_idle_timeout_s`` its stream was ended and the writer
            # stopped RESOURCE_EXHAUSTED; past ``REVOKED_READ_S`` after its key was removed (or
            # its tenant deleted), with that code (``NodeStreams.expire_idle``). ``_start``,
            # cancelled, closes every choice. Regression (review R1 F4, session 36): the stop's
            # code was not read, so a key rotated away got a retryable 429, not 401.
            if not self.writer.withdraw():
                raise
            if self.writer.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return CallAborted(self.writer.code, self.writer.stopped or "").response()
            return CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"n: the {self.body.n} choices did not all start in time: {self.writer.stopped}",
                               int(RETRY_S * 1000)).response()
        gens = [ChoiceGeneration(e, s, self.chat, self.model, self.request_id, self.logprobs(), index=i,
                                 tools=self.body.tool_output() if self.chat else None,  # type: ignore[union-attr]
                                 prompt=self.prompt())
                for i, (e, s) in enumerate(zip(self.events, started))]
        for g in gens[1:]:
            g.created = gens[0].created
        if self.body.stream:
            body = _Body(self._stream(gens, self.body.stream_shape()), self.close)
            return _ClosingStream(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                  writer=self.writer)
        return await self._whole(gens)

    async def _stream(self, gens: list[ChoiceGeneration], shape: StreamShape) -> AsyncIterator[bytes]:
        """The SSE body (``streaming._stream``'s, for n choices: see the module docstring); a
        chunk's continuous usage is its own choice's counts so far, as vLLM's."""
        merged = self._merged(gens)
        try:
            if self.chat:
                for g in gens:
                    yield shape.event(g.chunk("", first=True, include_usage=shape.usage), g.usage)
            async for i, text in merged:
                g = gens[i]
                chunk = g.chunk(None, g.finish_reason, include_usage=shape.usage) if text is None else (
                    g.chunk(text, include_usage=shape.usage))
                if not says_nothing(chunk):
                    yield shape.event(chunk, g.usage)
            if shape.usage:
                body = gens[0]._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
                yield shape.event({**body, **_usage(gens)})
        except CallAborted as exc:
            yield sse(self._about(exc).response().body.decode())
            return
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")

    async def _whole(self, gens: list[ChoiceGeneration]) -> Response:
        """The non-streamed body; a client gone first aborts every choice (499)."""

        async def collect() -> list[str]:
            texts: list[list[str]] = [[] for _ in gens]
            async with contextlib.aclosing(self._merged(gens)) as merged:
                async for i, text in merged:
                    if text:
                        texts[i].append(text)
            return ["".join(t) for t in texts]

        try:
            texts = await unless_gone(self.request, collect())
        except ClientGone:
            await self.close()  # (a read never started did not)
            return _gone()
        except CallAborted as exc:
            return self._about(exc).response()

        def build() -> dict[str, Any]:
            body = gens[0]._envelope("chat.completion" if self.chat else "text_completion",
                                     [g._choice(t, g.finish_reason, whole=True) for g, t in zip(gens, texts)])
            return {**body, **_usage(gens), **gens[0].body_fields()}

        return await self.render(self.request, Held.total([g.held(t) for g, t in zip(gens, texts)]), build)


def _usage(gens: list[ChoiceGeneration]) -> dict[str, Any]:
    """``usage`` (OpenAI's: the prompt once, with choice 0's cached counts; the completions
    summed) and ``kvstrata`` (choice 0's server figures, and ``choices``: each choice's, with
    its ``cached_tokens``)."""
    first = gens[0]
    usage = usage_dict(first.prompt_tokens, sum(g.completion_tokens for g in gens), first.cached)
    server = {**first.server, "choices": [{**g.server, "cached_tokens": sum(g.cached.values())} for g in gens]}
    return {"usage": usage, "kvstrata": server}


class _Body:
    """A stream's body that, when closed (``_ClosingStream`` closes it however the response
    ends), also closes every choice, even when its generator never started (the client gone
    before the first chunk)."""

    def __init__(self, chunks: AsyncIterator[bytes], close: Callable[[], Any]) -> None:
        self.chunks, self._close = chunks, close

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self.chunks)

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()  # type: ignore[attr-defined]
        finally:
            await self._close()
