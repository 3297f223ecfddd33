"""The OpenAI-compatible HTTP API (FastAPI): ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health``,
vLLM's ``POST /tokenize`` and ``POST /detokenize`` (``tokenize``) and the extension
``DELETE /v1/sessions/{session_id}`` (the id URL-encoded; it may hold ``/``; ``?cache_salt=``
the salt the session's turns were sent with).
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

Where its parts live: ``bodies`` (reading and parsing a body within bounds), ``errors`` (the
error responses in OpenAI's shape that the handlers return), ``streaming`` (writing a response,
streamed or whole, and watching for the client leaving), ``choices`` (a body with ``n`` > 1:
n requests, started all or none, in one response), ``tokenize`` (``/tokenize`` and
``/detokenize``: the gateway's tokenizer, no node asked). This module keeps the edge
(``OpenAIEdge``) and the routes (``create_app``), and re-exports those modules' names, so
``from services.openai_api.app import ...`` keeps working.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from services import client_ids
from services.actor_calls import ActorSilent
from services.gateway import InferenceServicer, StreamWriter
from services.openai_api.bodies import (
    MAX_BODY_BYTES,
    MAX_BODY_DEPTH,  # noqa: F401 - re-exported
    MAX_BODY_STRINGS,  # noqa: F401 - re-exported
    MAX_BODY_VALUES,  # noqa: F401 - re-exported
    OFF_LOOP_BYTES,
    OFF_LOOP_VALUES,
    BodyShape,  # noqa: F401 - re-exported
    body_shape,  # noqa: F401 - re-exported
    check_body_shape,
    load_json,
    read_body,
)
from services.openai_api.choices import Choices
from services.openai_api.context import (
    BodyBudget,
    BodyLimits,
    CallAborted,
    HttpCallContext,
    error_response,
)
from services.openai_api.errors import (
    INVALID,  # noqa: F401 - re-exported
    _gone,
    edge_status,
    field_refusal,
    framework_error,
    invalid,
    refusal_about,
)
from services.openai_api.logprobs import (
    Logprobs,
    TokenTexts,
    check_whole_logprobs,
)
from services.openai_api.messages import check_tool_answers
from services.openai_api.prompt_logprobs import PromptExtras
from services.openai_api.protocol import authenticated
from services.openai_api.request_ids import RequestIds, request_id
from services.openai_api.response_budget import Held, HeldResponse, ResponseBudget
from services.openai_api.responses import Generation
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest, close_session_salt
from services.openai_api.streaming import (
    ClientGone,
    _ClosingStream,
    _stream,
    _whole,
    unless_gone,
    until_gone,  # noqa: F401 - re-exported
)
from services.openai_api.tokenize import DetokenizeRequest, TokenizeRequest, tokenize_answer
from services.openai_api.tools import TOOL_PARSERS
from services.ray_errors import PROCESS_UNREACHABLE, RayActorError, retry_after_ms
from services.render_process import RenderFailed
from services.tenant_turns import TenantTurns
from services.tool_requests import auto_refusal

log = logging.getLogger(__name__)


class OpenAIEdge:
    """The routes' shared state.

    Args:
        servicer: the gateway's inference servicer (its ``generate`` / ``close_session``).
        model_id: the nodes' model identity (``<dir name>@<digest>:<dtype>``); requests may
            name it or its served name, the directory name (what ``/v1/models`` lists).
        encode: text -> token ids with the model's tokenizer (``/v1/completions`` prompts).
        num_healthy: healthy cache nodes now (``NodeMonitor.num_healthy``).
        spill_down: spill node name -> why it does not serve (``NodeMonitor.spill_down``, from
            the scheduler's ``services.spill_watch``); None: none known. ``/health`` says
            "degraded" and lists their names, never why: it is unauthenticated, and the reasons
            name hosts, pids, paths and errors (``kvstrata status`` shows them, admin key).
        body_limits: the request-body bytes being read and parsed that one tenant, and all of
            them, may hold (``BodyBudget``), and the whole-response bytes not yet written out
            that one tenant may hold (``ResponseBudget``); None: ``BodyLimits``' defaults.
        tokens: a token id's text and bytes for log probabilities (``TokenTexts`` over the
            model's tokenizer; None: ``token_id:<id>``).
        tool_call_parser: how ``tool_choice`` "auto" reads tool calls from the text
            (``tools.TOOL_PARSERS``: "hermes"); "" (off): "auto" is refused, a 400 naming
            ``tool_choice`` (``check_tools``).

    ``created`` (the model card's) is when this edge was made: the gateway's start. ``turns``:
    each tenant's turn at parsing a body and building a whole response (``turn``): the
    servicer's (``InferenceServicer.turns``), so the gRPC API's work and this edge's take one
    turn per tenant; a servicer without them (a test's stand-in) gets the edge's own.
    """

    def __init__(self, servicer: InferenceServicer, model_id: str, encode: Callable[[str], list[int]],
                 num_healthy: Callable[[], int], body_limits: BodyLimits | None = None,
                 tokens: TokenTexts | None = None, tool_call_parser: str = "",
                 spill_down: Callable[[], dict[str, str]] | None = None) -> None:
        if tool_call_parser not in ("", *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_PARSERS} or \"\" (off), got {tool_call_parser!r}")
        self.servicer, self.model_id, self.encode, self.num_healthy = servicer, model_id, encode, num_healthy
        self.tool_call_parser = tool_call_parser
        self.spill_down = spill_down or dict
        self.tokens = tokens or TokenTexts()
        self.model_name = model_id.split("@", 1)[0]
        self.bodies = BodyBudget(body_limits)
        self.responses = ResponseBudget(self.bodies.limits.response_bytes_per_tenant,
                                        self.bodies.limits.retry_after_ms)
        self.created = int(time.time())
        turns = getattr(servicer, "turns", None)
        self.turns = turns if isinstance(turns, TenantTurns) else TenantTurns()

    @contextlib.asynccontextmanager
    async def turn(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold ``tenant_id``'s one turn here (``turns``: the gRPC API's too) while the block
        runs on the event loop: its bodies are parsed (and its whole responses built) one at a
        time, in the order they came; work too costly for the loop goes to a worker thread
        through ``InferenceServicer.off_loop`` instead, which takes the same turn (never both:
        the turn is not re-entrant). A tenant's burst of requests queues behind itself, not in
        front of other tenants' requests: each waits for at most one parse or build of every
        other tenant's. ``tenant_id``: the authenticated tenant's.

        Regressions: bodies of at most ``OFF_LOOP_BYTES`` were parsed on the event loop with
        no per-tenant bound; one tenant's 64 connections of 255 KiB bodies of ``[[]]`` (~100 ms
        each) took another tenant's ``GET /v1/models`` from 1 ms to 9.8 s (review s35 E F2).
        This turn and the servicer's were two locks, so a tenant using both APIs held two at
        once, and their tables kept a lock for every tenant id ever seen (s36:
        ``services.tenant_turns``)."""
        async with self.turns.hold(tenant_id):
            yield

    async def parsed(self, tenant_id: str, data: bytes, kind: type[BaseModel]) -> Any:
        """``data`` (a body read whole) checked (``check_body_shape``: 400 past its bounds)
        and parsed as ``kind`` (400 for bad JSON; ``ValidationError``), on ``tenant_id``'s turn:
        on the event loop (``turn``) when it holds at most ``OFF_LOOP_BYTES`` bytes and
        ``OFF_LOOP_VALUES`` JSON values and containers (a few ms at most), else on a worker
        thread (``InferenceServicer.off_loop``; a body past ``OFF_LOOP_BYTES`` is checked there
        too, a smaller one's check on the loop first)."""
        def parse() -> Any:
            return kind.model_validate(load_json(data))

        def check_and_parse() -> Any:
            check_body_shape(data)
            return parse()

        if len(data) > OFF_LOOP_BYTES:
            return await self.servicer.off_loop(tenant_id, check_and_parse)
        async with self.turn(tenant_id):
            if check_body_shape(data) <= OFF_LOOP_VALUES:
                return parse()
        return await self.servicer.off_loop(tenant_id, parse)

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
        as ``kind`` (400), then its model (404), then the log probabilities a whole response
        would hold (400: ``check_whole``) and, for a whole response, room in its tenant's
        ``ResponseBudget`` (429). Raises ``CallAborted``, ``HTTPException`` (413),
        ``ValidationError`` for a bad body, or ``ClientGone`` (a parse is not waited for, nor
        its tenant's turn, once the client has gone). Every body is parsed on its tenant's turn,
        on the event loop only when it is small in bytes and in JSON values (``parsed``).

        Regression (secrev19 H1): the body was read and waited for its parse with nothing
        counting its bytes (``BodyBudget``); they are held from the key's check until the parse
        has ended, however it ends."""
        context = HttpCallContext(request)
        tenant = await self.servicer.auth.tenant(context)
        authenticated(request.scope)
        request.state.tenant = tenant  # (``count_refusal``; ``tokenize``'s max_model_len)
        hold = self.bodies.hold(tenant.tenant_id)
        try:
            data = await read_body(request, MAX_BODY_BYTES, hold)
            body = await unless_gone(request, self.parsed(tenant.tenant_id, data, kind))
        finally:
            hold.release()
        model = body.model  # type: ignore[attr-defined]
        if model is not None and not self.serves(model):  # (None: /tokenize's default, this model)
            raise self.no_such_model(model)
        if isinstance(body, (ChatCompletionRequest, CompletionRequest)):
            self.check_whole(body, tenant)
        if isinstance(body, ChatCompletionRequest):
            self.check_tools(body)
        if not getattr(body, "stream", False):
            self.responses.check_room(tenant.tenant_id)
        request.state.tenant_id = tenant.tenant_id  # (``render``'s turn on a worker thread)
        return body

    def count_refusal(self, request: Request, exc: BaseException) -> None:
        """Count a generation request ``parse`` refused with ``exc`` in the gateway's
        ``requests_total``, once (it never reaches the gateway's request path, which counts
        the others): under its tenant, or tenant "" when its key check failed, by the gRPC
        status name of its refusal (``errors.edge_status``; the scheduler unreachable:
        UNAVAILABLE). Regression: the edge's refusals (401, 400, 404, 413, 429, 503) were
        counted nowhere, so ``requests_total`` undercounted a tenant's refused requests."""
        metrics = getattr(self.servicer, "metrics", None)
        if metrics is None:
            return
        status = "UNAVAILABLE" if isinstance(exc, (RayActorError, ActorSilent)) else edge_status(exc)
        metrics.refused_at_edge(getattr(request.state, "tenant", None), status)

    def check_whole(self, body: Any, tenant: Any) -> None:
        """A non-streamed body asking for log probabilities may hold at most
        ``MAX_WHOLE_LOGPROBS`` of them (``check_whole_logprobs``): else a 400 naming its
        ``top_logprobs`` (a completion's ``logprobs``) and telling the client to stream. A chat
        without ``max_tokens`` counts what the context leaves: ``max_model_len`` of its
        tenant's model card, less one prompt token (unknown: not bounded here).
        Regression (review 26c F2): nothing bounded it; n 16 x 8192 tokens x 21 built ~1 GiB."""
        top = body.asked_logprobs()
        if top is None or body.stream:
            return
        chat = isinstance(body, ChatCompletionRequest)
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        given = max_tokens is not None
        if max_tokens is None:
            context = self.model_card(tenant).get("max_model_len")
            if context is None:
                return
            max_tokens = max(1, context - 1)
        try:
            check_whole_logprobs(body.n, max_tokens, top, "top_logprobs" if chat else "logprobs", given)
        except ValueError as exc:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, str(exc),
                              param="top_logprobs" if chat else "logprobs") from exc

    def check_tools(self, body: ChatCompletionRequest) -> None:
        """A 400 naming ``tool_choice`` for "auto" (the default with tools) while the server reads
        no tool calls (``tool_call_parser`` off), as vLLM refuses it without
        ``--enable-auto-tool-choice --tool-call-parser``; or for a choice ``tools`` do not allow.
        A 400 naming ``messages.N.tool_call_id`` for a tool message answering no earlier
        assistant message's tool call (``messages.check_tool_answers``; a session turn's on its
        node, which keeps the session's earlier calls)."""
        try:
            check_tool_answers(body.messages, in_session=bool(body.session_id))
        except ValueError as exc:
            raise field_refusal(exc) from None
        try:
            mode = body.tool_mode()
        except ValueError as exc:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, str(exc), param="tool_choice") from None
        refusal = auto_refusal(mode, self.tool_call_parser)  # (the gRPC API's too: ``tool_requests``)
        if refusal is not None:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, refusal, param="tool_choice")

    async def render(self, request: Request, held: Held, build: Callable[[], dict[str, Any]]) -> Response:
        """A whole response's JSON body of ``build()``, which will hold ``held`` (its log
        probabilities and characters), on its tenant's turn (``turn``, one at a time per
        tenant): on a worker thread (``InferenceServicer.off_loop``) when they are many
        (``Held.off_loop``: past ``OFF_LOOP_LOGPROBS`` or ``OFF_LOOP_CHARS``), else here. Its bytes are held in its
        tenant's ``ResponseBudget`` until its connection has written them out (``HeldResponse``).
        Regressions: a body of 192 MiB was built on the event loop every tenant's calls share,
        for 7.9 s (review 26c F2); an echo's text was not counted, so n 16 copies of an echoed
        prompt (25 MB) were built there too (review s33 F1); one tenant's many responses under
        those thresholds were built on the loop with no per-tenant bound (review s35 E F2).

        When the tenant's unwritten responses leave no room for it, the response is that
        refusal instead, a 429 with ``Retry-After``: before it is built when they leave none for
        its least size (``Held.least_bytes``, ``ResponseBudget.check_fits``), else once built
        (``ResponseBudget.hold``). A client gone while it waits for its tenant's turn (or the
        build) gets nothing built: the wait is given up (499, ``unless_gone``).
        """
        tenant_id = getattr(request.state, "tenant_id", "")
        try:
            self.responses.check_fits(tenant_id, held.least_bytes())
        except CallAborted as exc:
            return exc.response()
        async def built() -> Response:
            if held.off_loop():
                return await self.servicer.off_loop(tenant_id, lambda: JSONResponse(build()))
            async with self.turn(tenant_id):
                return JSONResponse(build())

        try:  # (a client gone while this waits for its tenant's turn leaves no waiter behind)
            response = await unless_gone(request, built())
        except ClientGone:
            return _gone()
        try:
            hold = self.responses.hold(tenant_id, len(response.body))
        except CallAborted as exc:
            return exc.response()
        return HeldResponse(bytes(response.body), hold)

    def logprobs(self, body: ChatCompletionRequest | CompletionRequest) -> Logprobs | None:
        """Where one choice of ``body`` collects its log probabilities (None: not asked)."""
        top = body.asked_logprobs()
        return None if top is None else Logprobs(isinstance(body, ChatCompletionRequest), top, self.tokens,
                                                 streamed=body.stream)

    def echo_text(self, body: ChatCompletionRequest | CompletionRequest, call: Any) -> str | None:
        """The text ``body`` echoes (None: no echo): its prompt string as sent, or its token
        prompt (``call``'s, the parsed ``GenerateInput``) decoded with the model's tokenizer,
        special tokens kept ("" without a tokenizer). Called by the body's parse, on its
        tenant's worker-thread turn, once for all its choices (``ChoiceInputs``). Regression
        (review s33 F1): each choice decoded the whole prompt on the event loop every tenant's
        calls share (n 16 x 32,768 tokens: 0.4-0.7 s)."""
        if not (isinstance(body, CompletionRequest) and body.echo):
            return None
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.tokens.tokenizer
        return tokenizer.decode(list(call.prompt)) if tokenizer is not None else ""

    def prompt_extras(self, body: ChatCompletionRequest | CompletionRequest, call: Any,
                      echo: str | None) -> PromptExtras | None:
        """Where one choice of ``body`` collects its echo and prompt logprobs (None: neither
        asked); ``call``: the body's parsed ``GenerateInput`` (a completion's token prompt);
        ``echo``: the text it echoes (``echo_text``, None: no echo). Nothing here grows with
        the prompt but a reference to its tokens."""
        if call is None or (body.prompt_logprobs is None and echo is None):
            return None
        echoed = echo is not None
        return PromptExtras(call.prompt[0] if echoed else 0, body.prompt_logprobs, echo,
                            body.logprobs if echoed else None,  # type: ignore[union-attr]
                            echoed and body.max_tokens == 0, self.tokens)  # type: ignore[union-attr]

    async def tokenize(self, request: Request, body: TokenizeRequest) -> Response:
        """``/tokenize``'s answer (``services.openai_api.tokenize``): the ids of ``body``'s
        prompt or chat, tokenized on the tenant's worker-thread turn; its bad input a 400
        naming the field."""
        tokenizer, templater = self.tokens.tokenizer, getattr(self.servicer, "templater", None)
        if tokenizer is None:
            raise CallAborted(grpc.StatusCode.UNAVAILABLE, "this server has no tokenizer to tokenize with")
        max_model_len = self.model_card(request.state.tenant).get("max_model_len")
        try:
            body.check()
            answer = await unless_gone(request, self.servicer.off_loop(request.state.tenant_id, lambda: tokenize_answer(
                body.token_ids(tokenizer, templater), max_model_len, tokenizer, body.return_token_strs)))
        except ValueError as exc:
            raise field_refusal(exc) from None
        except RenderFailed as exc:  # the gateway's render child (as the chat sites: 026b1a8); before, a 500
            # "internal error (incident ...)" that hid what failed (diff review s36 R2 F5)
            raise CallAborted(grpc.StatusCode.INTERNAL, str(exc)) from None
        return await self.render(request, Held(answer["count"] * (2 if body.return_token_strs else 1)), lambda: answer)

    async def detokenize(self, request: Request, body: DetokenizeRequest) -> Response:
        """``/detokenize``'s answer: ``body``'s ids decoded together (special tokens kept, as
        vLLM), on the tenant's worker-thread turn; an id outside the vocabulary (the model's,
        as generation's ids are checked against it) a 400 naming ``tokens.N``."""
        tokenizer = self.tokens.tokenizer
        if tokenizer is None:
            raise CallAborted(grpc.StatusCode.UNAVAILABLE, "this server has no tokenizer to detokenize with")
        info = getattr(self.servicer, "info", None)
        vocab = (info.get("vocab_size") if isinstance(info, dict) else None) or len(tokenizer)
        try:
            body.check_vocabulary(vocab)
        except ValueError as exc:
            raise field_refusal(exc) from None
        text = await unless_gone(request, self.servicer.off_loop(
            request.state.tenant_id, lambda: tokenizer.decode(body.tokens)))
        return await self.render(request, Held(len(body.tokens), len(text)), lambda: {"prompt": text})

    def rendered(self, call: Any, tenant: Any) -> Any:
        """``call`` (a chat's ``GenerateInput``) with its messages rendered and tokenized by the
        gateway's templater, as the gateway's ``_prepare`` would render them for each request:
        the token prompt ``first_turn(messages, tools)``, after the same free bound on their
        characters (``check_messages_fit`` against the tenant's prompt room, ``model_card``'s
        ``max_model_len``: ``_prepare``'s ``room``). For the ``n`` choices of one body
        (``choices.ChoiceInputs`` parses once), so the chat is rendered once, not once per
        choice; each node gets the same ``token_ids`` as before (a chat the gateway renders
        reaches its node as tokens). A chat the gateway does not render (a session turn, a
        ``prefix_messages`` prefix, no templater) is left as it is. Runs on the tenant's
        worker-thread turn (``InferenceServicer.generate``'s parse); raises ValueError naming
        ``messages`` (the gateway answers INVALID_ARGUMENT). A size refusal of the token prompt
        says "prompt" where the chat's said "messages": ``errors.refusal_about`` words it back.

        Regression: a body with ``n`` 16 rendered and tokenized its chat 16 times, one after
        another on its tenant's one worker-thread turn."""
        templater = getattr(self.servicer, "templater", None)
        if templater is None or call.session_id or call.prefix_messages or not call.prompt \
                or not isinstance(call.prompt[0], dict):
            return call
        room = self.model_card(tenant).get("max_model_len")
        if room:
            templater.check_messages_fit(call.prompt, room)
        return dataclasses.replace(call, prompt=templater.first_turn(call.prompt, call.tools), tools=None)

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

        parsed: list[tuple[Any, str | None]] = []  # the body's input and echo, once parsed (``prompt_extras``)

        # a session turn's tool call ids come from a seed its node derives them from too: the
        # session keeps its replies' calls with the ids the client got (``ToolOutput.spec``)
        seed = uuid.uuid4().hex if chat and body.session_id else ""  # type: ignore[union-attr]

        def parse() -> Any:
            call = body.to_input() if chat else body.to_input(self.encode)  # type: ignore[union-attr, call-arg]
            parsed.append((call, self.echo_text(body, call)))
            tools = body.tool_output(seed) if seed else None  # type: ignore[union-attr]
            return dataclasses.replace(call, request_id=rid, tool_output=tools.spec() if tools else "")

        def prompt() -> PromptExtras | None:
            return self.prompt_extras(body, *parsed[0]) if parsed else None

        writer = StreamWriter()  # this task also runs the streamed response (``_ClosingStream``)
        if body.n > 1:  # n requests, started all or none, in one response (``choices``)
            shared = (lambda: self.rendered(parse(), request.state.tenant)) if chat else parse
            return await Choices(self.servicer, request, body, shared, writer, self.model_name, rid,
                                 lambda: self.logprobs(body), self.render, prompt).respond()
        events = self.servicer.generate(context, parse, writer)
        try:  # admitted and started: the status is known
            started = await unless_gone(request, anext(events))
        except CallAborted as exc:  # a 400 names its field: param
            return refusal_about(exc, body).response()
        except ClientGone:  # cancelled at its await: the gateway's path aborted and released it
            await events.aclose()  # type: ignore[attr-defined]
            return _gone()
        generation = Generation(events, started, chat, self.model_name, rid, self.logprobs(body),
                                body.tool_output(seed) if chat else None, prompt())  # type: ignore[union-attr]
        if body.stream:
            return _ClosingStream(_stream(generation, body.stream_shape(), lambda exc: refusal_about(exc, body)),
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"}, writer=writer)
        return await _whole(generation, request, lambda exc: refusal_about(exc, body), self.render)


def create_app(edge: OpenAIEdge) -> FastAPI:
    """The FastAPI application over ``edge`` (routes listed in the module docstring)."""
    # redirect_slashes off: a path with a trailing slash (``/v1/completions/``) is a 404 in
    # OpenAI's shape; it was a 307 with an empty body and a ``Location`` built from the client's
    # Host header (s41 HTTP fuzz)
    app = FastAPI(title="kvstrata OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.add_middleware(RequestIds)

    @app.exception_handler(CallAborted)
    async def _aborted(request: Request, exc: CallAborted) -> Response:
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return _gone()

    @app.exception_handler(RayActorError)
    async def _unreachable(request: Request, exc: RayActorError) -> Response:
        """The scheduler (or a node) the call asked died or is being restarted: UNAVAILABLE's
        503, not a 500 in plain text (review 23b, F2), with ``Retry-After`` while Ray may bring
        it back (``ray_errors.retry_after_ms``), as the gRPC API."""
        return CallAborted(grpc.StatusCode.UNAVAILABLE, PROCESS_UNREACHABLE, retry_after_ms(exc)).response()

    @app.exception_handler(ActorSilent)
    async def _silent(request: Request, exc: ActorSilent) -> Response:
        """The scheduler did not answer in time (``services.actor_calls``): 503 with
        ``Retry-After``, as the gRPC API's UNAVAILABLE (review 29a F2: the call waited with no
        bound)."""
        return CallAborted(grpc.StatusCode.UNAVAILABLE, str(exc), retry_after_ms(exc)).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return framework_error(request, exc)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> Response:
        """Any other exception (a bug): OpenAI's error shape, 500 ``internal_error`` with an
        incident id, the exception logged with it, as the gRPC API's ``CallGate`` answers
        INTERNAL. Regression: Starlette's plain-text "Internal Server Error", no JSON a client
        library reads, no id to find it in the log by."""
        incident = uuid.uuid4().hex[:12]
        log.error("HTTP %s %s failed (incident %s)", request.method, request.url.path[:256], incident, exc_info=exc)
        return error_response(500, f"internal error (incident {incident}): the server's log has its details",
                              "internal_error")

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: ValidationError | RequestValidationError) -> Response:
        return invalid(exc)

    async def generation(request: Request, kind: type[ChatCompletionRequest | CompletionRequest]) -> Response:
        """A completion: its refusal before the gateway's path is counted here, any later one
        there (``OpenAIEdge.count_refusal``)."""
        try:
            body = await edge.parse(request, kind)
        except BaseException as exc:
            edge.count_refusal(request, exc)
            raise
        return await edge.complete(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, CompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await edge.tokenize(request, await edge.parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await edge.detokenize(request, await edge.parse(request, DetokenizeRequest))

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
        """Close the caller's session opened under ``?cache_salt=`` (none without it:
        ``close_session_salt``); the key is checked first (401), then the query (400). Every
        400 names the field at fault in ``param`` (``session_id``, ``cache_salt``). Regression
        (s40 new-user trial): an id over ``MAX_ID_CHARS`` characters, refused by the gateway's
        own check, was a 400 whose ``param`` was null."""
        context = HttpCallContext(request)
        await edge.servicer.auth.tenant(context)
        try:
            client_ids.check("session_id", session_id)
            salt = close_session_salt(request.query_params.multi_items())
        except ValueError as exc:
            raise field_refusal(exc) from None
        try:
            freed = await edge.servicer.close_session(context, session_id, salt)
        except CallAborted as exc:  # the gateway's own checks of the id and salt name their field
            raise exc.naming(("session_id", "cache_salt")) from None
        authenticated(request.scope)
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True,
                             "freed_tokens": freed})

    @app.get("/health")
    async def health() -> Response:
        healthy = edge.num_healthy()
        if healthy == 0:
            return error_response(503, "no cache node can be routed to (none is healthy, or the global scheduler "
                                  "is down or not answering)", "service_unavailable", "unavailable")
        spill_down = edge.spill_down()
        if spill_down:  # served, without those nodes' part of the spill tier (200: routable)
            return JSONResponse({"status": "degraded", "healthy_nodes": healthy,  # names only (s37)
                                 "spill_nodes_not_serving": sorted(spill_down)})
        return JSONResponse({"status": "ok", "healthy_nodes": healthy})

    return app
