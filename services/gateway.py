"""The gateway's inference servicer: ``Generate`` and ``CloseSession``, and the request ids
it scopes to their tenant.

``Generate`` authenticates, converts (services.convert), and goes through the data plane
(``services.gateway_streams.NodeStreams``, ``services.data_plane``); ``CloseSession`` is a Ray
actor call. Failures map to precise status codes for that call alone. The operator servicers
are in ``services.gateway_admin``.

Both APIs run one path: ``InferenceServicer.generate`` (authenticate -> policy check ->
bound/convert -> admit -> stream events -> usage/cancel) and ``close_session``. gRPC calls them
with its ``ServicerContext``; the OpenAI-compatible HTTP API (``services.openai_api``) with a
context of the same shape whose ``abort`` raises, so every refusal keeps its gRPC status.

Where its parts live: ``services.gateway_inputs`` (``GenerateInput``, ``input_from_pb``,
``MAX_ID_CHARS``, ``scoped_id``, ``salted_namespace``), ``services.gateway_tracking``
(``StreamWriter`` and what a call keeps while it streams), ``services.gateway_prepare``
(``RequestPreparation``: ``off_loop`` and the checks and conversion before admission). This
module keeps ``InferenceServicer`` (Generate, the admitted attempt, CloseSession) and re-exports
those names, so ``from services.gateway import ...`` keeps working.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services import client_ids, convert
from services import scheduler_replies as replies
from services.auth import Authenticator, bearer_key
from services.chat import ChatTemplater
from services.chat_tools import check_tool_output
from services.data_plane_auth import Security
from services.gateway_admin import error_message
from services.gateway_inputs import (
    MAX_ID_CHARS,
    GenerateInput,
    grpc_refusal,
    input_from_pb,
    request_scope,
    salted_namespace,  # noqa: F401 - re-exported
    scoped_id,  # noqa: F401 - re-exported
    session_scope,
)
from services.gateway_key_watch import KeyWatch
from services.gateway_prepare import RequestPreparation
from services.gateway_stream_bounds import StreamLimits
from services.gateway_streams import NodeStreams
from services.gateway_tracking import StreamWriter, _RecordedAbort, _Seen
from services.loop_lag import running_lag, wait_past_stall
from services.metrics.requests import GatewayMetrics, RequestTracker, status_of
from services.node_request import NodeRequest
from services.ray_errors import SchedulerRestarting
from services.render_process import RenderFailed
from services.tenant_call_slots import TenantCallSlots
from services.tool_calls import ToolOutput
from services.tool_requests import TOOL_PARSERS
from tenants.errors import StaleKeyError
from tenants.keys import parse_key_id
from tenants.model import spec_digest

log = logging.getLogger(__name__)

_CODES = {c.name: c for c in grpc.StatusCode}

RETRY_S = 1.0
"""The retry hint (``retry-after-ms``) of the gateway's own refusals that pass with time: a
call past ``max_streams_per_tenant`` (the cap frees as the tenant's streams end), an admission
the scheduler did not answer in time (busy, or being restarted), a stream its node ended
UNAVAILABLE (down or drained: the scheduler routes the retry elsewhere, or to the node once it
is back). Those that stand until the client acts carry none: a node's RESOURCE_EXHAUSTED
for ``max_session_text_chars_per_tenant`` (until a session is closed or expires), a stream ended
for not being read. A node's refusal that passes with time carries its own hint (the error
event's ``retry_after_s``: a tenant's full grammar compile queue or its
``grammar_max_active_per_tenant``), passed on as is."""


def set_retry_after(context: Any, retry_after_s: float) -> None:
    """Give the refusal ``context`` is about to send the ``retry-after-ms`` trailer (the HTTP
    API's ``Retry-After``, ``services.openai_api.context``)."""
    context.set_trailing_metadata((("retry-after-ms", str(int(retry_after_s * 1000))),))

MAX_FREED_TOKENS = (1 << 32) - 1
"""The most tokens a node's ``close_session`` answer may say it freed (``CloseSessionResponse``'s
``uint32``)."""

NODE_CLOSE_TIMEOUT_S = 30.0
"""How long ``CloseSession`` waits for the session's node (``InferenceServicer._close_on_node``)."""

TOKENIZER_THREADS = 4
"""Worker threads parsing, rendering and tokenizing prompts (``InferenceServicer.off_loop``;
one per tenant at a time)."""


class _GrpcPaths:
    """A gRPC call's ``context`` whose INVALID_ARGUMENT refusals name the gRPC API's fields
    (``gateway_inputs.grpc_refusal``: the shared checks' and the nodes' words name the HTTP
    API's ``messages.N.field`` and a constraint's ``structured_output``); ``parsed``: the
    call's ``GenerateInput`` once parsed."""

    def __init__(self, context: Any, parsed: list[GenerateInput]) -> None:
        self._context, self._parsed = context, parsed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any, **kwargs: Any) -> Any:
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            details = grpc_refusal(details, self._parsed[0] if self._parsed else None)
        return await self._context.abort(code, details, *args, **kwargs)


def _read_tool_calls(tool_output: str, texts: list[str], event: dict[str, Any]) -> dict[str, Any]:
    """``event`` of a request whose reply is read as tool calls (``tool_output``'s spec): a delta's
    text is kept in ``texts``; the ``finished`` event gets the calls read from their whole text
    (``ToolOutput.message``, the HTTP API's whole response's reading), the ``content`` and the
    finish reason (``tool_calls`` when calls came and the model ended)."""
    if event["type"] == "delta":
        texts.append(event.get("text") or "")
    elif event["type"] == "finished":
        spec = check_tool_output(tool_output)  # (the gateway's own spec: input_from_pb)
        fields, reason = ToolOutput(*spec).message("".join(texts), event.get("finish_reason"))  # type: ignore[misc]
        if fields.get("tool_calls"):
            return {**event, "finish_reason": reason, "tool_calls": fields["tool_calls"],
                    "content": fields.get("content") or ""}
    return event


class _TenantChanged(Exception):
    """An attempt's admission was refused ``tenant_changed`` (``_attempt``, before any event):
    the tenant spec it was prepared with, cached here with the call's key, is no longer the
    tenant's (changed through another gateway). ``_generate`` prepares it anew, once."""


class InferenceServicer(RequestPreparation, inference_pb2_grpc.InferenceServiceServicer):
    """Generate (server streaming) and CloseSession.

    Args:
        nodes: node id -> CacheNode actor handle.
        node_info: node id -> ``CacheNode.describe()`` (model identity, block size, limits,
            data-plane address); every node serves the same model.
        scheduler_address: the GlobalScheduler's admission socket (``open_data_plane``).
        security: the gateway's data-plane identity (``NodeStreams``).
        metrics: where ``generate`` observes each request (``services.metrics.requests``).
        limits: what clients that read slowly or not at all may hold here (``StreamLimits``):
            Generate calls per tenant (past it RESOURCE_EXHAUSTED, ``streams_refused``), a
            stream's undelivered bytes, and how long its events may wait unread.
        tool_call_parser: how ``Generate`` reads tool_choice "auto"'s calls
            (``tool_requests.TOOL_PARSERS``: "hermes"); "" (off): "auto" is INVALID_ARGUMENT
            naming ``tool_choice``, as the HTTP API's 400 (``OpenAIEdge`` has its own).
    """

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 node_info: dict[str, dict[str, Any]], templater: ChatTemplater | None,
                 scheduler_address: str, security: Security | None = None,
                 metrics: GatewayMetrics | None = None, limits: StreamLimits | None = None,
                 tool_call_parser: str = "") -> None:
        if tool_call_parser not in ("", *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_PARSERS} or \"\" (off), got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self._in_flight: set[str] = set()  # client ids of this gateway's calls in flight (``request_scope``)
        # a held call's (``hold_call``) requests in flight: its scope -> {client id: attempt's request id}
        self._call_attempts: dict[str, dict[str, str]] = {}
        self.limits = limits = limits or StreamLimits()
        self.max_streams_per_tenant = limits.max_streams_per_tenant
        self.open_streams: dict[str, int] = {}  # tenant id -> its Generate calls open here
        self.close_slots = TenantCallSlots()  # a tenant's CloseSession calls in flight here
        self.streams_refused = 0  # calls refused for ``max_streams_per_tenant``
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "kvstrata-tokenize")
        self.info, self.templater = next(iter(node_info.values())), templater
        self.metrics = metrics or GatewayMetrics()  # the Gateway serves its registry (gateway_server)
        self.streams = NodeStreams(
            nodes, {nid: info["data_address"] for nid, info in node_info.items()}, scheduler_address,
            security=security, max_undelivered_bytes=limits.max_undelivered_bytes,
            stream_idle_timeout_s=limits.idle_timeout_s, silent_stream_s=limits.silent_stream_s,
        )
        self.metrics.watch_streams(lambda: self.streams)  # streams ended unread
        self.key_watch = KeyWatch(self.streams, auth,  # streams end when their key is removed
                                  staleness_max_s=limits.key_staleness_max_s)

    def close(self) -> None:
        """Stop the tokenizer threads (``kvstrata-tokenize``): work queued is dropped, work
        running ends on its thread, which then exits; ``off_loop`` raises RuntimeError from now
        on. Call once its calls have ended (``Gateway.stop``, after the gRPC and HTTP servers).

        Regression (s39): nothing stopped them, so every stopped gateway (and every start a
        restarted one retried) left its threads, holding the servicer and the tokenizer."""
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def Generate(self, request, context) -> None:
        """Stream one request's events (``generate``), written here (``context.write``) so that
        a stream its client stopped reading ends RESOURCE_EXHAUSTED (``StreamWriter``).

        Regression (secrev18 B residue): written by gRPC from an async generator, a call stuck
        in a write its client never took could only be cancelled, which sent the client no
        status at all.

        A request with tools and a tool choice other than none has its reply read as tool calls
        as the HTTP API reads a choice's (``services.tool_calls.ToolOutput``): the deltas go as
        generated, and the ``finished`` event carries the calls read from their whole text, the
        content and finish reason ``tool_calls`` (``_read_tool_calls``). The calls' ids come from
        a seed, which a session turn's node keeps them by (``GenerateInput.tool_output``)."""
        writer = StreamWriter()
        seed = uuid.uuid4().hex
        parsed: list[GenerateInput] = []

        def parse() -> GenerateInput:
            call = input_from_pb(request, self.tool_call_parser, seed)
            parsed.append(call)
            return call

        texts: list[str] = []
        try:  # refusals worded in this API's field paths (``grpc_refusal``)
            async with contextlib.aclosing(self.generate(_GrpcPaths(context, parsed), parse, writer)) as events:
                async for event in events:
                    if parsed and parsed[0].tool_output:
                        event = _read_tool_calls(parsed[0].tool_output, texts, event)
                    await context.write(convert.generate_event_to_pb(event))
        except asyncio.CancelledError:
            if not writer.withdraw():
                raise
            context.set_code(writer.code)  # RESOURCE_EXHAUSTED; UNAUTHENTICATED / ABORTED: key removed
            context.set_details(writer.stopped)

    async def generate(self, context: Any, parse: Callable[[], GenerateInput],
                       writer: StreamWriter | None = None) -> AsyncIterator[dict[str, Any]]:
        """One request's node events (``services.node_request``), for either API: authenticate,
        ``parse`` (ValueError -> INVALID_ARGUMENT), check and bound, admit, stream; a consumer
        that stops early aborts it on its node. Refusals are ``context.abort`` with the gRPC
        status (RESOURCE_EXHAUSTED sets a ``retry-after-ms`` trailer first). Request and session
        ids are the tenant's own, and a ``cache_salt``'s (``request_scope``, ``session_scope``):
        one in flight already under the same salt (or none) is ALREADY_EXISTS.

        ``writer``: the task handing these events to the client (None: the one calling this),
        stopped when its client takes none of the stream's waiting events for
        ``limits.idle_timeout_s`` (``NodeStreams.expire_idle``): the stream is then ended
        RESOURCE_EXHAUSTED, its request aborted on its node, and the call counted so.

        A stream whose API key is removed meanwhile (rotated away, its tenant deleted, through
        this gateway or another) ends UNAUTHENTICATED (ABORTED when its tenant was deleted)
        within ``gateway_key_watch.KEY_CHECK_S``
        (``KeyWatch``, started here): its request aborted on its node and released with its
        usage, as a cancelled one. Regression (security hardening, session 36): such a stream
        ran on to its end (``max_tokens``), a stolen key rotated away still generating."""
        self.key_watch.start()
        tenant = await self.auth.tenant(context)
        track, status = self.metrics.track(tenant), "OK"  # services.metrics.requests
        refusal = _RecordedAbort(context, track)
        writer = writer or StreamWriter()
        try:
            async with contextlib.aclosing(self._generate(refusal, parse, tenant, track, writer)) as events:
                async for event in events:
                    yield event
        except BaseException as exc:
            status = status_of(exc, context)
            raise
        finally:
            if not refusal.recorded:
                track.finish(status)

    async def hold_call(self, context: Any, client_id: str, cache_salt: str = "") -> Callable[[], None]:
        """Hold ``client_id``, the id of a call of ``context``'s tenant served as several
        requests (an HTTP body with ``n`` > 1: ``services.openai_api.choices``), in flight as a
        call's own id is held, under the call's ``cache_salt`` (``request_scope``); its requests
        name it in ``GenerateInput.call_id`` and hold nothing. The function returned releases
        it. One in flight already under that salt (any call's, of either API, whatever its
        ``n``) is ALREADY_EXISTS naming ``client_id``, counted as a refused request. Each of
        its requests' admissions names the others in flight as its siblings (the scheduler
        counts their backlog as no work ahead of it: ``GlobalScheduler._own_body``).

        Regression (review 26d P1, P2): each choice held only its own ``<i>_<id>``, so a call
        with the same id and another ``n`` ran beside it, and a duplicate's 409 named ``0_<id>``."""
        tenant = await self.auth.tenant(context)
        scoped = request_scope(tenant.tenant_id, cache_salt, client_id)
        if scoped in self._in_flight:
            await _RecordedAbort(context, self.metrics.track(tenant)).abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request {client_id!r} is in flight already")
        self._in_flight.add(scoped)
        self._call_attempts[scoped] = {}

        def release() -> None:
            self._in_flight.discard(scoped)
            self._call_attempts.pop(scoped, None)
        return release

    async def _generate(self, context: Any, parse: Callable[[], GenerateInput], tenant: Any,
                        track: RequestTracker, writer: StreamWriter) -> AsyncIterator[dict[str, Any]]:
        """``generate`` past authentication; ``track`` sees every event and the refusal.

        A tenant's calls are counted from here until this generator ends, i.e. until its
        client has taken the last event (or hung up); past ``max_streams_per_tenant`` a call
        is refused RESOURCE_EXHAUSTED. Regression (security review B): the scheduler releases
        a request when its end arrives here, not when its client reads it, so a tenant whose
        client never read could open wave after wave of streams, each holding its events at
        the gateway."""
        tenant_id = tenant.tenant_id
        if self.open_streams.get(tenant_id, 0) >= self.max_streams_per_tenant:
            self.streams_refused += 1
            track.rejected("too_many_streams")
            set_retry_after(context, RETRY_S)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the tenant has {self.max_streams_per_tenant} calls open at this gateway "
                                "(max_streams_per_tenant): read or cancel them first")
        self.open_streams[tenant_id] = self.open_streams.get(tenant_id, 0) + 1
        scoped = client_id = ""
        attempts: dict[str, str] = {}  # (a held call's: ``_call_attempts``)
        try:
            try:
                call = await self.off_loop(tenant_id, parse)  # a completion's prompt is tokenized here
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RenderFailed as exc:  # (an HTTP body's n choices render their chat here: ``rendered``)
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            req, hashes = await self._prepare(call, tenant, context)
            own = req.request_id  # (a retry's ``_prepare`` may draw another id: this one stays)
            client_id = own.split("/", 1)[1]
            held = request_scope(tenant_id, call.cache_salt, call.call_id or client_id)
            if call.call_id:  # one of a call's requests (an n>1 body's choice): the call holds its id
                if held not in self._in_flight:
                    raise RuntimeError(f"request {client_id!r} is a part of call {call.call_id!r}, whose id "
                                       "is not held in flight (hold_call)")
            elif held in self._in_flight:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {client_id!r} is in flight already")
            else:
                scoped = held
                self._in_flight.add(scoped)
        # each attempt has its own id past this gateway (scheduler, node, events, aborts).
        # Regression: a client id reused right after a cancel got the cancelled attempt's
        # "abort" ending while its own attempt ran on, unseen and unabortable, on the node;
        # and a late abort of a finished attempt refused the id's next use (CANCELLED)
            # the call's other requests in flight (an n>1 body's other choices): its own body
            attempts = self._call_attempts.get(held, attempts) if call.call_id else attempts
            for retried in (False, True):
                req = dataclasses.replace(req, request_id=f"{own}#{uuid.uuid4().hex[:16]}")
                siblings = tuple(rid for cid, rid in attempts.items() if cid != client_id)
                attempts[client_id] = req.request_id
                try:  # closed here, at once: its ``finally`` releases and aborts the attempt
                    async with contextlib.aclosing(self._attempt(context, req, hashes, client_id, track, writer,
                                                                 spec_digest(tenant.spec), retried,
                                                                 siblings)) as events:
                        async for event in events:
                            yield event
                    break
                except _TenantChanged:  # (raised before any event): the spec cached here is stale
                    tenant = await self._fresh_tenant(context, tenant_id)
                    req, hashes = await self._prepare(call, tenant, context)
        finally:
            self._in_flight.discard(scoped)
            attempts.pop(client_id, None)
            left = self.open_streams[tenant_id] - 1
            if left:
                self.open_streams[tenant_id] = left
            else:
                del self.open_streams[tenant_id]

    async def _fresh_tenant(self, context: Any, tenant_id: str) -> Any:
        """The call's tenant as the scheduler has it now, after an admission refused
        ``tenant_changed``: its cached keys here are forgotten (not its known key ids: the key
        still works) and the call's key authenticated again (``Authenticator.tenant``, which
        aborts the call UNAUTHENTICATED if the key stopped working meanwhile). A key that now
        names another tenant id (never, key ids being unique) is UNAUTHENTICATED too."""
        self.auth.forget_tenant_id(tenant_id, keys_gone=False)
        tenant = await self.auth.tenant(context)
        if tenant.tenant_id != tenant_id:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this key is no longer this call's tenant's")
        return tenant

    async def _attempt(self, context: Any, req: NodeRequest, hashes: list[bytes], client_id: str,
                       track: RequestTracker, writer: StreamWriter | None = None, spec: str = "",
                       retried: bool = False, siblings: tuple[str, ...] = ()) -> AsyncIterator[dict[str, Any]]:
        """One admitted attempt of a request: admit, stream its node's events, and on any end
        release it at the scheduler (aborting it on its node when it did not finish).
        ``siblings``: the request ids of the other choices of its ``n`` > 1 body in flight.

        ``spec`` is the digest of the tenant spec ``req`` was prepared with
        (``tenants.model.spec_digest``), sent with the admission: a stale one is refused
        ``tenant_changed``, raised here as ``_TenantChanged`` (before any event, nothing to
        undo) unless ``retried`` (the call's second attempt, whose initial metadata the first
        sent: then the refusal goes to the client, UNAVAILABLE with a retry hint).
        Regression (review s35 C C2): a spec changed through another gateway was used here
        from the key cache for up to 10 s (the namespace a tenant had left included).

        The release of a request that ended on its node (its ``finished`` or error event) is
        sent as that event arrives, not when the client has read up to it. Regression
        (hardening review): a client that stopped reading a stream (gRPC or HTTP flow control
        holding this generator at a ``yield``) kept its finished request in flight at the
        scheduler for as long as it held the connection; enough of them filled the queue
        limit, and every tenant's requests were refused ``queue_full``.

        A stream whose client takes none of its waiting events for ``limits.idle_timeout_s``
        is ended by ``NodeStreams.expire_idle`` (released, aborted on its node) and ``writer``
        stopped, which closes this generator and its tenant's stream: ``on_idle``.
        Regression (secrev18 B residue): such a stream was never ended."""
        writer = writer or StreamWriter()  # None: the task consuming this
        adm = None
        usage: dict[str, Any] | None = None
        seen = _Seen()  # the usage of a request that ends without its finished event
        released = False

        def release(ended: dict[str, Any] | None) -> None:
            nonlocal released
            if not released:
                released = True
                self.scheduler.release.remote(request_id=req.request_id, usage=ended)

        def on_event(event: dict[str, Any]) -> None:  # as it arrives (``NodeStreams.open``)
            seen.observe(event)
            if event["type"] == "finished":
                release(event)
            elif event["type"] == "error":
                release(seen.usage())

        def on_idle(message: str, code: str = "RESOURCE_EXHAUSTED") -> None:  # ``NodeStreams.expire_idle``:
            context.record(_CODES[code])  # counted, then stopped (UNAUTHENTICATED: its key was removed)
            writer.stop(message, _CODES[code])

        key_id = parse_key_id(bearer_key(context)) or ""  # its stream ends when the key is removed (``KeyWatch``)
        queue = self.streams.open(req.request_id, on_event, on_idle, req.sampling.logprobs, req.sampling.prompt_logprobs,
                                  () if req.session_id else req.token_ids,  # (a session's turn: its history's too)
                                  key_id=key_id)
        # the scheduler hands an admitted request straight to its node; every answer from the
        # node, a refusal included, comes back on this gateway's event inbox
        # the key's id goes with it: one rotated away since this gateway cached it is refused
        admission = asyncio.ensure_future(self.streams.admit(req, hashes, key_id, spec=spec, siblings=siblings))
        try:
            if not retried:  # headers now, while admission and prefill run, not with the first token
                await context.send_initial_metadata(())
            try:  # shielded: a cancelled call still learns where its request went, to abort it
                adm = await asyncio.shield(admission)
            except (RuntimeError, asyncio.TimeoutError) as exc:  # a scheduler fault (a malformed
                usage = {}  # reply included: ``data_plane.admission_reply``): UNAVAILABLE
                for node_id in self.streams.node_inboxes:  # admitted late, it must not run unseen:
                    self.streams.abort(node_id, req.request_id)  # its id is this attempt's alone
                if isinstance(exc, (asyncio.TimeoutError, SchedulerRestarting)):  # a scheduler fault
                    set_retry_after(context, RETRY_S)  # (RuntimeError) has none: no wait is known to undo it
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) or "the global scheduler did not answer")
            if adm.code != "OK":
                usage = {}
                track.rejected(adm.reason)
                if adm.reason == "tenant_changed" and not retried:
                    raise _TenantChanged
                if adm.reason in ("tenant_deleted", "unknown_tenant", "key_revoked"):  # a stale cached key
                    self.auth.forget_tenant_id(req.tenant)
                elif adm.reason == "tenant_changed":  # changed again meanwhile: the client retries
                    self.auth.forget_tenant_id(req.tenant, keys_gone=False)
                if adm.retry_after_s:
                    set_retry_after(context, adm.retry_after_s)
                await context.abort(_CODES[adm.code], adm.message)
            self.streams.bind(req.request_id, adm.node_id)
            while usage is None:
                event = await queue.get()
                track.observe(event)
                if event["type"] == "error":
                    usage = {}
                    if event["code"] == "UNAVAILABLE":  # maybe this gateway's verdict on the node
                        # (``NodeStreams.fail_node``): a node that only missed a health poll
                        # still runs the request. Regression (diff review): it finished there,
                        # unseen, and a session's history took a turn its client never got
                        self.streams.abort(adm.node_id, req.request_id)
                        set_retry_after(context, RETRY_S)
                    elif event.get("retry_after_s"):  # the node's hint (``check_event`` bounded it)
                        set_retry_after(context, event["retry_after_s"])
                    await context.abort(_CODES[event["code"]], event["message"])
                if event["type"] == "finished":
                    usage = event
                if event["type"] == "started":
                    event = {**event, "request_id": client_id}
                yield event
        finally:
            self.streams.close(req.request_id)  # ``seen`` holds every event that arrived
            if usage is None and not released and adm is None:  # cancelled while being admitted:
                released = True  # abort and release once the admission's answer is here
                asyncio.get_running_loop().create_task(self._abort_admitted(admission, req.request_id, seen))
            elif usage is None and not released:  # cancelled or past its deadline
                self.streams.abort(adm.node_id, req.request_id)  # type: ignore[union-attr]
            if adm is None or adm.code == "OK":
                release(usage or seen.usage())

    async def _abort_admitted(self, admission: Any, request_id: str, seen: _Seen) -> None:
        """Abort on its node, and release at the scheduler, a request whose call ended while
        it was being admitted, once its admission is answered: admitted, it runs there.

        Regression: the release was sent when the call ended, and reached the scheduler (a Ray
        call) before the admission (the data plane) often enough: a no-op there, after which the
        admission held its place in its node's ``in_flight`` and its tenant's share for as long
        as the scheduler ran (``max_num_seqs`` such calls filled a node for good). The
        admission's answer comes after the scheduler admitted, so a release sent then lands
        after it.

        An admission that fails (its reply late past ``admit_timeout_s``, malformed, or the
        scheduler restarting) may still have been admitted, as the connected path in
        ``_attempt`` has it: the request is aborted on every node (its id is this attempt's
        alone) and released (a no-op at a scheduler that never admitted it). Regression
        (review 26c F3): such a request was taken as never admitted, and held its place in
        its node's ``in_flight`` while the node ran it, unseen, to its end."""
        try:
            adm = await admission
        except Exception:  # noqa: BLE001 - admitted late, maybe: it must not run unseen
            for node_id in self.streams.node_inboxes:
                self.streams.abort(node_id, request_id)
            self.scheduler.release.remote(request_id=request_id, usage=seen.usage())
            return
        if adm.code == "OK":
            self.streams.abort(adm.node_id, request_id)
            self.scheduler.release.remote(request_id=request_id, usage=seen.usage())

    async def CloseSession(self, request, context):
        """Close the caller's session ``session_id`` under ``cache_salt`` (``close_session``)."""
        freed = await self.close_session(context, request.session_id, request.cache_salt)
        return inference_pb2.CloseSessionResponse(freed_tokens=freed)

    async def _close_on_node(self, node_id: str, scoped: str, tenant_id: str, turns: list[str]) -> int:
        """The node's answer to closing ``scoped`` (tokens freed, -1 for none by that id), or
        0, as for a node known down, when its call fails (its step loop failed, the actor died:
        the session's KV went with them) or takes over ``NODE_CLOSE_TIMEOUT_S`` (the close it
        was sent frees the session when it lands; its TTL otherwise). The scheduler has dropped
        the route by then, so the close is done either way.

        Regression (review 22d): a close reaching a node whose step loop had failed before the
        monitor marked it down raised here: HTTP 500 in plain text (gRPC UNKNOWN), and the
        client's retry got NOT_FOUND.

        The answer is untrusted: one that is not an int in [-1, ``MAX_FREED_TOKENS``] counts as
        0, as a failed call. Regression (s38): it was ``int()``-ed, so a count past
        ``CloseSessionResponse.freed_tokens``' uint32 failed the gRPC call UNKNOWN after the
        scheduler had dropped the session (the client's retry: NOT_FOUND), one below -1 was
        NOT_FOUND for a session that was closed, and ``"5"`` or ``5.9`` counted as 5."""
        try:
            closing = asyncio.ensure_future(self.nodes[node_id].close_session.remote(session_id=scoped, tenant=tenant_id, turns=turns))
            # (once more when this gateway's own loop stalled meanwhile: ``services.loop_lag``)
            answer = (await wait_past_stall(closing, NODE_CLOSE_TIMEOUT_S, running_lag(), NODE_CLOSE_TIMEOUT_S))[0]
        except Exception as exc:  # noqa: BLE001 - a failed, dead or slow node frees nothing now
            log.warning("closing session %s on node %s: %s: %s; answered as freed 0", scoped, node_id,
                        type(exc).__name__, exc)
            return 0
        if type(answer) is not int or not -1 <= answer <= MAX_FREED_TOKENS:  # (untrusted)
            log.warning("closing session %s on node %s: a malformed answer %.80r; answered as freed 0", scoped,
                        node_id, answer)
            return 0
        return answer

    async def close_session(self, context: Any, session_id: str, cache_salt: str = "") -> int:
        """Close the caller's session ``session_id`` opened under ``cache_salt`` ("" = none;
        ``session_scope``: another tenant's equal id, or the same id under another salt, is
        another session); returns the tokens freed. NOT_FOUND (``context.abort``) when the
        caller has none by that id and salt, INVALID_ARGUMENT for an empty id or one over
        ``MAX_ID_CHARS``, or a salt over ``MAX_ID_CHARS``, or either holding a character
        ``services.client_ids`` refuses (``<name>: holds U+...``).

        Regression (review s36 E1): the salt was not part of a session's id, so a close under
        any salt, or none, closed the session opened under another (and answered its size)."""
        tenant = await self.auth.tenant(context)
        if not session_id or len(session_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"session_id must have 1 to {MAX_ID_CHARS} characters, got {len(session_id)}")
        if len(cache_salt) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"cache_salt is longer than {MAX_ID_CHARS} characters")
        for name, value in (("session_id", session_id), ("cache_salt", cache_salt)):
            why = client_ids.refusal(value)  # (no control characters: ``services.client_ids``)
            if why is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {why}")
        async with self.close_slots.hold(context, tenant.tenant_id):  # (``services.tenant_call_slots``)
            return await self._close_session(context, tenant, session_id, cache_salt)

    async def _close_session(self, context: Any, tenant: Any, session_id: str, cache_salt: str) -> int:
        """``close_session`` past its checks. The scheduler's reply is untrusted
        (``scheduler_replies.closing``): a malformed one is INTERNAL. Regression (s38): it was
        unpacked as it came, so a reply of another shape failed the call UNKNOWN (``TypeError``,
        ``ValueError``) and a non-list of turns went on to the node."""
        scoped = session_scope(tenant.tenant_id, cache_salt, session_id)
        try:  # the key's id goes with it: one rotated away since it was cached here closes nothing
            closing = await self.scheduler.close_session.remote(session_id=scoped, tenant_id=tenant.tenant_id,
                                                                key_id=parse_key_id(bearer_key(context)) or "")
        except StaleKeyError as exc:  # (review s35 C, C1: it closed the tenant's sessions for 10 s)
            self.auth.forget_tenant_id(tenant.tenant_id)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, error_message(exc))
        closing = await replies.answer(context, "close_session", closing, replies.closing)  # (untrusted)
        if closing is None:
            freed = -1
        elif not closing[0]:  # its node is down or restarted: nothing to free there now
            freed = 0
        else:  # its turns still in flight are refused there (never open it again)
            node_id, turns = closing
            freed = await self._close_on_node(node_id, scoped, tenant.tenant_id, turns)
        if freed < 0:
            under = " under this cache_salt" if cache_salt else " without a cache_salt"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {session_id!r} for this tenant{under}")
        return freed
