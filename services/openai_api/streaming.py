"""Writing a call's response to its HTTP client, and watching for the client leaving: the
server-sent events of a streamed response (``_stream``, in ``_ClosingStream``, which closes
the stream however it ends and is stopped for an idle reader), a whole response (``_whole``),
and ``unless_gone`` / ``until_gone`` (a wait that a client's disconnect cancels:
``ClientGone``, answered 499).

Part of ``services.openai_api.app`` (which re-exports these names).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.gateway import StreamWriter
from services.openai_api.context import CallAborted
from services.openai_api.errors import ClientGone, _gone
from services.openai_api.response_budget import Held
from services.openai_api.responses import Generation, says_nothing, sse
from services.openai_api.scope_hooks import end_unfinished
from services.openai_api.stream_shape import StreamShape

T = TypeVar("T")


async def until_gone(request: Request) -> None:
    """Return once the client has disconnected: its ``http.disconnect`` message on the ASGI
    ``receive`` channel (``Request.receive``; what Starlette's ``StreamingResponse`` listens
    for). Only for use once the body has been read: other messages are dropped."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless ``request``'s client disconnects first: then ``work`` is
    cancelled, its cancellation has landed (an async generator's ``finally`` ran) when this
    returns, and ``ClientGone`` is raised. Exceptions of ``work`` propagate; cancelling the
    caller cancels ``work``. A ``receive`` channel that fails (no disconnect: nothing to
    watch) leaves ``work`` awaited alone.

    Regression: a client gone while the result of the whole reply's task was read, just after
    cancelling it: ``result()`` of the still-pending task raised InvalidStateError, a 500."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(until_gone(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watch.exception() is not None:
            await asyncio.wait({task})
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # the client is gone (or the caller was cancelled): abort
    if not task.done():  # cancelled just now: let the cancellation land
        await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone
    return task.result()


class _ClosingStream(StreamingResponse):
    """A streaming response that closes its body generator however the stream ends (the
    client gone included), so the request behind it is aborted at once, not when the
    generator is garbage-collected.

    ``writer`` (the task running this response) is stopped when the client takes none of the
    stream's waiting events for the gateway's ``stream_idle_timeout_s``
    (``InferenceServicer.generate``): the response ends there, unfinished (the client, which
    reads nothing, could not take a last event either), and the server closes the connection
    (``end_unfinished``). Regression (secrev18 B residue): such a response was never ended.
    Its connection's minimum read rate (``protocol.Guarded._send_stalled``) applies as to any
    response: a client holding the stream's writes up is cut off, and the stream ends as for
    a client gone.
    Regression: uvicorn logged each such end at ERROR ("ASGI callable returned without
    completing response")."""

    def __init__(self, *args: Any, writer: StreamWriter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writer = writer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.writer.withdraw():
                raise
            end_unfinished(scope)
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


async def _stream(generation: Generation, shape: StreamShape,
                  about: Callable[[CallAborted], CallAborted] = lambda exc: exc) -> AsyncIterator[bytes]:
    """The SSE body: for a chat, a first chunk with the role (``content`` ""); text chunks; a
    chunk with the finish reason; the usage chunk when asked for; ``[DONE]``; each chunk with
    what ``shape`` adds (usage so far, padding: ``stream_shape``). A failure after
    the status line went out is an ``{"error": ...}`` event, worded by ``about`` as a whole
    response's refusal is (review of 6b09071, L4: a size refusal was
    ``context_length_exceeded`` in a whole response, ``invalid_argument`` in a stream).

    As vLLM's (``serving_completion.completion_stream_generator``), a text completion's stream
    starts with its first text: it has no role to announce (review 25b N5: it began with a
    chunk of empty text). The finish reason has a chunk of its own, with empty text: the node
    reports a request's end as its own event after its last text, and the edge never reads an
    event ahead of what its client has taken (a stream's idle-reader deadline counts events not
    taken). vLLM puts it on the last token's chunk, but sends it alone as well when the last
    token has no text (an EOS), so clients take both."""
    pieces = generation.pieces()
    try:
        if generation.chat:
            yield shape.event(generation.chunk("", first=True, include_usage=shape.usage), generation.usage)
        async for text in pieces:
            chunk = generation.chunk(text, include_usage=shape.usage)
            if not says_nothing(chunk):
                yield shape.event(chunk, generation.usage)
        yield shape.event(generation.chunk(None, generation.finish_reason, include_usage=shape.usage),
                          generation.usage)
        if shape.usage:
            yield shape.event(generation.usage_chunk())
    except CallAborted as exc:
        yield sse(about(exc).response().body.decode())
        return
    finally:
        await pieces.aclose()
    yield sse("[DONE]")


Render = Callable[[Request, Held, Callable[[], dict[str, Any]]], Awaitable[Response]]
"""Builds a whole response's body from what it will hold (``Held``: its log probabilities and
characters) and a builder (``OpenAIEdge.render``: on a worker thread when they are many)."""


async def _render_here(request: Request, held: Held, build: Callable[[], dict[str, Any]]) -> Response:
    return JSONResponse(build())


async def _whole(generation: Generation, request: Request,
                 about: Callable[[CallAborted], CallAborted] = lambda exc: exc,
                 render: Render = _render_here) -> Response:
    """The non-streamed body (built by ``render``); a client gone before it is ready aborts
    the request (499); a refusal after the request started goes out as ``about`` words it."""

    async def collect() -> str:
        return "".join([text async for text in generation.pieces()])

    try:
        text = await unless_gone(request, collect())
    except ClientGone:
        return _gone()
    except CallAborted as exc:
        return about(exc).response()
    return await render(request, generation.held(text), lambda: generation.response(text))

