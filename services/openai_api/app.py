"""The OpenAI-compatible HTTP API (FastAPI): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` and
the extension ``DELETE /v1/sessions/{session_id}`` (the id URL-encoded; it may hold ``/``).
Every response carries its request's id in ``X-Request-Id`` (the client's, when it sent a
valid one: ``request_ids``).

A thin edge over the gateway's one call path (``InferenceServicer.generate`` and
``close_session``, shared with gRPC): it parses the body (``schemas``), hands it to that path
with an ``HttpCallContext`` and writes the events as OpenAI's JSON or server-sent events
(``responses``). Errors come in OpenAI's shape (``context``): a 400 has code
``invalid_argument`` (``context_length_exceeded`` for a prompt, or prompt + max_tokens, that
does not fit the context or a node's KV pool) and, when it is about one body field (the
schema's, the edge's or the gateway's checks), ``param`` naming it; an unknown model is a 404
``model_not_found``, a bad key a 401 ``invalid_api_key``. A tenant's API key is the bearer token. Order of
checks: the key (401), room for the body's bytes in its tenant's and the gateway's budget
(429 / 503 with ``Retry-After``, before it is read; ``BodyBudget``), the body (400, naming the
field), the model (404), then the gateway's own (policy, bounds, admission: 429 with
``Retry-After``; 503 without a healthy node). The framework's own refusals (404 for an unknown path, 405 for a wrong method)
come in the same shape. A client that disconnects aborts its request on the node, which frees its
blocks, as a cancelled gRPC call does: at any point once its body has been read (being admitted,
queued on its node, prefilling or generating; ``unless_gone``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.convert import MAX_PROMPT_TOKEN_IDS
from services.gateway import InferenceServicer, StreamWriter
from services.openai_api.connections import authenticated
from services.openai_api.context import (
    BodyBudget,
    BodyHold,
    BodyLimits,
    CallAborted,
    HttpCallContext,
    error_response,
)
from services.openai_api.request_ids import RequestIds, request_id
from services.openai_api.responses import Generation, sse
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected while its call was being served (answered 499)."""


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
    reads nothing, could not take a last event either), and the server closes the connection.
    Regression (secrev18 B residue): such a response was never ended."""

    def __init__(self, *args: Any, writer: StreamWriter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writer = writer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.writer.withdraw():
                raise
        finally:
            await self.body_iterator.aclose()  # type: ignore[union-attr]


_HTTP_ERRORS: dict[int, tuple[str, str]] = {
    404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}
"""The framework's own refusals (no route, wrong method) as OpenAI ``(type, code)``."""


MAX_BODY_BYTES = 8 << 20
"""Largest request body read (bytes): the largest valid request, ``MAX_PROMPT_CHARS`` of text
each JSON-escaped to ``\\uXXXX``, is ~6 MiB. Regression: bodies were read and parsed whole,
whatever their size: a 48 MB body held the gateway's event loop, which serves every tenant's
gRPC and HTTP calls, for 3.9 s, at ~10x its size in memory."""

OFF_LOOP_BYTES = 256 << 10
"""Bodies above this many bytes are parsed and validated on a worker thread, one at a time
per tenant (``InferenceServicer.off_loop``)."""

MAX_BODY_VALUES = MAX_PROMPT_TOKEN_IDS + (1 << 16)
"""Most JSON values (array elements, object members) outside strings a body may hold: the
longest token-id prompt and room for every other field."""

MAX_BODY_STRINGS = 1 << 16
"""Most JSON strings a body may hold (keys included): 1,024 messages of a few parts each."""


def check_body_shape(data: bytes) -> None:
    """Refuse (400) a body holding more JSON values or strings than ``MAX_BODY_VALUES`` /
    ``MAX_BODY_STRINGS``, before ``json.loads`` builds them: byte scans at memcpy speed
    (escaped backslashes and quotes dropped, quotes counted, separators counted outside the
    strings). Long text costs nothing here: only structure counts.

    Regression (security review): parsing "off the loop" on a thread still held the GIL
    (``json.loads`` and pydantic never release it), so one 8 MiB body of 4.2M token ids froze
    the gateway's event loop (every tenant's streams) ~0.3-0.9 s, four at once 1.6 s, before
    the prompt's 131,072-id bound refused it."""
    if data.count(b",") < MAX_BODY_VALUES and data.count(b'"') <= 2 * MAX_BODY_STRINGS:
        return  # upper bounds of both (commas and quotes in strings included) are within
    strings, separators = body_shape(data, 2 * MAX_BODY_STRINGS)
    if strings > MAX_BODY_STRINGS:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_STRINGS} JSON strings; no valid request does")
    if separators >= MAX_BODY_VALUES:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_VALUES} JSON values; no valid request does")


def body_shape(data: bytes, max_quotes: int) -> tuple[int, int]:
    """(JSON strings, value separators ``,`` outside strings) of a JSON text; past
    ``max_quotes`` quotes the separators are not counted (0). For JSON, the separators are
    the sum over arrays and objects of their length less one."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = plain.count(b'"')
    if quotes > max_quotes:
        return quotes // 2, 0
    outside = b"".join(plain.split(b'"')[::2]) if quotes else plain
    return quotes // 2, outside.count(b",")

_LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_body(request: Request, limit: int, hold: BodyHold | None = None) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed ``limit`` bytes
    (its ``Content-Length``, else the bytes received so far): nothing larger is buffered.

    ``hold`` (its tenant's ``BodyBudget``) is grown to the ``Content-Length`` before a byte is
    read, and to the bytes received when more arrive (a chunked body); past the budget
    ``BodyHold.grow_to`` raises ``CallAborted`` (429/503), and the caller releases the hold."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the request body has {int(declared)} bytes; at most {limit} are accepted")
    if hold is not None and declared.isdigit():
        hold.grow_to(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body exceeds {limit} bytes")
        if hold is not None:
            hold.grow_to(size)
        chunks.append(chunk)
    return b"".join(chunks)


def load_json(data: bytes) -> Any:
    """A body as JSON; a 400 (``CallAborted``) when it is not UTF-8 JSON (too deeply nested
    included), or when a string in it holds a lone UTF-16 surrogate (``"\\ud800"``: valid JSON,
    but no UTF-8 text; regression: it reached msgpack and the block hashes and raised there,
    a plain-text 500)."""
    try:
        text = data.decode("utf-8")
        raw = json.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, "body: not valid JSON (UTF-8)") from None
    if _LONE_SURROGATE.search(text):
        try:
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                              "body: a string holds a lone UTF-16 surrogate escape (not UTF-8 text)") from None
    return raw


_UNION_TAG = re.compile(r"(?:str|int|float|bool|list|dict|tuple|none|literal|function-\w+)(?:\[.*\])?|[A-Z]\w*")
"""How pydantic names a union's member in an error's location (``str``, ``list[TextPart]``)."""


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """An error location as the client's field path: without ``body`` and union member tags."""
    return tuple(p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.fullmatch(p)))


INVALID = grpc.StatusCode.INVALID_ARGUMENT.name.lower()
"""Every 400's ``code`` (the schema's, the edge's and the gateway's alike): ``invalid_argument``."""


def invalid(exc: ValidationError | RequestValidationError) -> JSONResponse:
    """A 400 naming the first bad field (pydantic's location, without ``body`` and without a
    union's member tags: ``messages.0.content``, not ``messages.0.content.str``).

    The message is ours, not pydantic's: a validator's ``ValueError`` gives its own text
    (pydantic's "Value error, " prefix dropped), an undeclared field "unsupported field". A
    value no member of a union accepts names what each would take ("Input should be a valid
    string or a valid list"); when one member got further into it, that member's error."""
    errors = exc.errors()
    path = _field_path(errors[0].get("loc", ()))
    same = [e for e in errors if _field_path(e.get("loc", ()))[: len(path)] == path]
    first = max(same, key=lambda e: len(_field_path(e.get("loc", ()))))  # the deepest: the closest match
    field = ".".join(str(p) for p in _field_path(first.get("loc", ()))) or "body"
    kind, raised = first.get("type"), first.get("ctx", {}).get("error")
    if kind == "extra_forbidden":
        message = "unsupported field"
    elif kind in ("value_error", "assertion_error") and raised is not None:
        message = str(raised)
    else:
        message = first.get("msg", "invalid")
        alike = [e["msg"] for e in same if _field_path(e.get("loc", ())) == _field_path(first.get("loc", ()))]
        if len(alike) > 1 and all(m.startswith("Input should be ") for m in alike):
            message = "Input should be " + " or ".join(m.removeprefix("Input should be ") for m in alike)
    return error_response(400, f"{field}: {message}", "invalid_request_error", INVALID, param=field)


def framework_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own HTTP errors (404 no such path, 405 wrong method, ...) in OpenAI's shape,
    keeping their headers (405's ``Allow``)."""
    kind, code = _HTTP_ERRORS.get(exc.status_code, ("invalid_request_error", None))
    if exc.status_code == 404:
        message = f"no such endpoint: {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, kind, code, dict(exc.headers or {}))


class OpenAIEdge:
    """The routes' shared state.

    Args:
        servicer: the gateway's inference servicer (its ``generate`` / ``close_session``).
        model_id: the nodes' model identity (``<dir name>@<digest>:<dtype>``); requests may
            name it or its served name, the directory name (what ``/v1/models`` lists).
        encode: text -> token ids with the model's tokenizer (``/v1/completions`` prompts).
        num_healthy: healthy cache nodes now (``NodeMonitor.num_healthy``).
        body_limits: the request-body bytes being read and parsed that one tenant, and all of
            them, may hold (``BodyBudget``; None: ``BodyLimits``' defaults).

    ``created`` (the model card's) is when this edge was made: the gateway's start.
    """

    def __init__(self, servicer: InferenceServicer, model_id: str, encode: Callable[[str], list[int]],
                 num_healthy: Callable[[], int], body_limits: BodyLimits | None = None) -> None:
        self.servicer, self.model_id, self.encode, self.num_healthy = servicer, model_id, encode, num_healthy
        self.model_name = model_id.split("@", 1)[0]
        self.bodies = BodyBudget(body_limits)
        self.created = int(time.time())

    def serves(self, model: str) -> bool:
        """``model`` names this server's model (its served name or its full identity)."""
        return model in (self.model_name, self.model_id)

    def model_card(self, tenant: Any) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it, with vLLM's ``max_model_len``: the most tokens
        (prompt and output) one of ``tenant``'s requests may hold here, the least of the model's
        context, a node's KV pool and the tenant's ``max_context_tokens`` (absent when the
        servicer does not say)."""
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvstrata",
                "root": self.model_id}
        info = getattr(self.servicer, "info", None)
        if isinstance(info, dict) and "max_model_len" in info:
            limits = [info["max_model_len"], info.get("pool_tokens"),
                      getattr(getattr(tenant, "spec", None), "max_context_tokens", None)]
            card["max_model_len"] = min(n for n in limits if n)
        return card

    async def parse(self, request: Request, kind: type[BaseModel]) -> Any:
        """Authenticate (401), then the body (413 over ``MAX_BODY_BYTES``; 429 / 503 with
        ``Retry-After`` past its tenant's or the gateway's ``BodyBudget``, before it is read),
        as ``kind`` (400), then its model (404). Raises ``CallAborted``, ``HTTPException`` (413),
        ``ValidationError`` for a bad body, or ``ClientGone`` (a big body's parse on a thread
        is not waited for once the client has gone).

        Regression (secrev19 H1): the body was read and waited for its parse with nothing
        counting its bytes (``BodyBudget``); they are held from the key's check until the parse
        has ended, however it ends."""
        context = HttpCallContext(request)
        tenant = await self.servicer.auth.tenant(context)
        authenticated(request.scope)
        hold = self.bodies.hold(tenant.tenant_id)
        try:
            data = await read_body(request, MAX_BODY_BYTES, hold)
            check_body_shape(data)
            if len(data) > OFF_LOOP_BYTES:  # on a thread, one at a time per tenant
                body = await unless_gone(request, self.servicer.off_loop(
                    tenant.tenant_id, lambda: kind.model_validate(load_json(data))))
            else:
                body = kind.model_validate(load_json(data))
        finally:
            hold.release()
        if not self.serves(body.model):  # type: ignore[attr-defined]
            raise self.no_such_model(body.model)  # type: ignore[attr-defined]
        return body

    def no_such_model(self, model: str) -> CallAborted:
        """OpenAI's 404 for an unknown model: ``model_not_found``, ``param`` "model"."""
        return CallAborted(grpc.StatusCode.NOT_FOUND, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", error_code="model_not_found",
                           kind="invalid_request_error")

    async def complete(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        """Run ``body`` through the gateway's path; the response (streamed or whole), 499 when
        the client goes away first.

        Every wait runs against the client's disconnect (``unless_gone``; a stream's, once it
        has started, against Starlette's own watch): a client gone aborts its request at once.
        Regression: the wait for the ``started`` event (admission, the node's queue, the first
        step) watched nothing, as uvicorn does not cancel a handler whose client hangs up: an
        abandoned request kept its place in the node's queue and its tenant's share until it
        was scheduled, and ran its first prefill for nobody (a cancelled gRPC call leaves the
        queue at once)."""
        context = HttpCallContext(request)
        chat = isinstance(body, ChatCompletionRequest)
        rid = request_id(request.scope)

        def parse() -> Any:
            call = body.to_input() if chat else body.to_input(self.encode)  # type: ignore[union-attr, call-arg]
            return dataclasses.replace(call, request_id=rid)

        writer = StreamWriter()  # this task also runs the streamed response (``_ClosingStream``)
        events = self.servicer.generate(context, parse, writer)
        try:  # admitted and started: the status is known
            started = await unless_gone(request, anext(events))
        except CallAborted as exc:  # a 400 names its field: param
            return refusal_about(exc, body).response()
        except ClientGone:  # cancelled at its await: the gateway's path aborted and released it
            await events.aclose()  # type: ignore[attr-defined]
            return _gone()
        generation = Generation(events, started, chat, self.model_name, rid)
        if body.stream:
            return _ClosingStream(_stream(generation, body.include_usage(), lambda exc: refusal_about(exc, body)),
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"}, writer=writer)
        return await _whole(generation, request, lambda exc: refusal_about(exc, body))


def refusal_about(exc: CallAborted, body: ChatCompletionRequest | CompletionRequest) -> CallAborted:
    """``exc`` with what it is about in ``body``'s terms: a refusal for size as OpenAI's
    ``context_length_exceeded`` naming the field at fault (``CallAborted.about_context``: the
    ``max_tokens`` or ``max_completion_tokens`` the client sent, else "messages" / "prompt"),
    another 400 naming the field its message starts with (``CallAborted.naming``)."""
    sent = [f for f in ("max_completion_tokens", "max_tokens") if f in body.model_fields_set]
    prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if not exc.about_context(prompt_field, sent[0] if sent else None):
        exc.naming(type(body).model_fields)
    return exc


async def _stream(generation: Generation, include_usage: bool,
                  about: Callable[[CallAborted], CallAborted] = lambda exc: exc) -> AsyncIterator[bytes]:
    """The SSE body: a first chunk with the role, text chunks, a chunk with the finish
    reason, the usage chunk when asked for, ``[DONE]``. A failure after the first chunk is an
    ``{"error": ...}`` event (the status line went out already), worded by ``about`` as a
    whole response's refusal is (review of 6b09071, L4: a size refusal was
    ``context_length_exceeded`` in a whole response, ``invalid_argument`` in a stream)."""
    pieces = generation.pieces()
    try:
        yield sse(generation.chunk("" if generation.chat else None, first=True, include_usage=include_usage))
        async for text in pieces:
            yield sse(generation.chunk(text, include_usage=include_usage))
        yield sse(generation.chunk(None, generation.finish_reason, include_usage=include_usage))
        if include_usage:
            yield sse(generation.usage_chunk())
    except CallAborted as exc:
        yield sse(about(exc).response().body.decode())
        return
    finally:
        await pieces.aclose()
    yield sse("[DONE]")


async def _whole(generation: Generation, request: Request,
                 about: Callable[[CallAborted], CallAborted] = lambda exc: exc) -> Response:
    """The non-streamed body; a client gone before it is ready aborts the request (499); a
    refusal after the request started goes out as ``about`` words it."""

    async def collect() -> str:
        return "".join([text async for text in generation.pieces()])

    try:
        text = await unless_gone(request, collect())
    except ClientGone:
        return _gone()
    except CallAborted as exc:
        return about(exc).response()
    return JSONResponse(generation.response(text))


def _gone() -> JSONResponse:
    """The answer to a client that went away (nobody reads it): 499, code ``cancelled``."""
    return error_response(499, "the client closed the request", "invalid_request_error", "cancelled")


def create_app(edge: OpenAIEdge) -> FastAPI:
    """The FastAPI application over ``edge`` (routes listed in the module docstring)."""
    app = FastAPI(title="kvstrata OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestIds)

    @app.exception_handler(CallAborted)
    async def _aborted(request: Request, exc: CallAborted) -> Response:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return _gone()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return framework_error(request, exc)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: ValidationError | RequestValidationError) -> Response:
        return invalid(exc)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await edge.complete(request, await edge.parse(request, ChatCompletionRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await edge.complete(request, await edge.parse(request, CompletionRequest))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        tenant = await edge.servicer.auth.tenant(HttpCallContext(request))
        authenticated(request.scope)
        return JSONResponse({"object": "list", "data": [edge.model_card(tenant)]})

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> Response:
        """OpenAI's "Retrieve model" (``client.models.retrieve``); regression (oairev20 O6):
        it was a 404 "no such endpoint"."""
        tenant = await edge.servicer.auth.tenant(HttpCallContext(request))
        authenticated(request.scope)
        if not edge.serves(model):
            raise edge.no_such_model(model)
        return JSONResponse(edge.model_card(tenant))

    @app.delete("/v1/sessions/{session_id:path}")
    async def close_session(session_id: str, request: Request) -> Response:
        freed = await edge.servicer.close_session(HttpCallContext(request), session_id)
        authenticated(request.scope)
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True,
                             "freed_tokens": freed})

    @app.get("/health")
    async def health() -> Response:
        healthy = edge.num_healthy()
        if healthy == 0:
            return error_response(503, "no cache node is healthy", "service_unavailable", "unavailable")
        return JSONResponse({"status": "ok", "healthy_nodes": healthy})

    return app
