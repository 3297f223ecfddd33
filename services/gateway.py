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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from cache_node.hashing import hash_prompt_blocks
from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services import convert
from services.auth import Authenticator
from services.chat import ChatTemplater, content_chars, estimate_message_tokens
from services.data_plane_auth import Security
from services.gateway_stream_bounds import StreamLimits
from services.gateway_streams import NodeStreams
from services.metrics.requests import GatewayMetrics, RequestTracker, status_of
from services.node_request import NodeRequest, check_priority, resolve_prefix_tokens

_CODES = {c.name: c for c in grpc.StatusCode}

RETRY_S = 1.0
"""The retry hint (``retry-after-ms``) of the gateway's own refusals that pass with time: a
call past ``max_streams_per_tenant`` (the cap frees as the tenant's streams end), an admission
the scheduler did not answer in time (busy, or being restarted), a stream its node ended
UNAVAILABLE (down or drained: the scheduler routes the retry elsewhere, or to the node once it
is back). Those that stand until the client acts carry none: a node's RESOURCE_EXHAUSTED
(``max_session_text_chars_per_tenant``: until a session is closed or expires), a stream ended
for not being read."""


def set_retry_after(context: Any, retry_after_s: float) -> None:
    """Give the refusal ``context`` is about to send the ``retry-after-ms`` trailer (the HTTP
    API's ``Retry-After``, ``services.openai_api.context``)."""
    context.set_trailing_metadata((("retry-after-ms", str(int(retry_after_s * 1000))),))

TOKENIZER_THREADS = 4
"""Worker threads parsing, rendering and tokenizing prompts (``InferenceServicer.off_loop``;
one per tenant at a time)."""

MAX_ID_CHARS = 256
"""Longest client-chosen request or session id."""


def scoped_id(tenant_id: str, client_id: str) -> str:
    """The id the scheduler and the nodes know a client's request or session by: scoped to its
    tenant (``tenant_id`` is hex, so the first ``/`` separates the two), so that tenants never
    reach each other's requests or sessions by reusing an id."""
    return f"{tenant_id}/{client_id}"


@dataclass(frozen=True)
class GenerateInput:
    """One generation request, whichever API it came through (values already parsed by that
    API's edge; the gateway bounds them against the tenant and the model).

    Attributes:
        prompt: chat messages ``[{"role", "content"}]`` or prompt token ids.
        policy: the KV policy override ("" = the tenant's policy).
        cache_salt: partitions the tenant's prefix cache further ("" = none): requests share
            cached blocks only with requests of the same tenant namespace and salt.
        routing_key: a routing hint (OpenAI's ``prompt_cache_key``): requests with the same key
            go to the same cache node while it has room ("" = none).
        fill_context: no max_tokens was given: generate up to what the context limit and the
            node's KV pool leave after the whole prompt (``sampling.max_tokens`` is ignored).
        priority: lower is served earlier among this tenant's own waiting requests on its
            node, never ahead of another tenant's; in [-1000, 1000] (else INVALID_ARGUMENT).
        prefix_tokens / prefix_messages: the prompt's reusable document prefix, as tokens of a
            token prompt or leading messages of a chat (``node_request.resolve_prefix_tokens``;
            out of bounds: INVALID_ARGUMENT).
    """

    prompt: list[dict[str, str]] | list[int]
    sampling: SamplingParams
    session_id: str = ""
    request_id: str = ""
    policy: str = ""
    cache_salt: str = ""
    routing_key: str = ""
    fill_context: bool = False
    priority: int = 0
    prefix_tokens: int = 0
    prefix_messages: int = 0


def input_from_pb(request: inference_pb2.GenerateRequest) -> GenerateInput:
    """A ``GenerateRequest`` as a ``GenerateInput``. Raises ValueError naming the bad field."""
    return GenerateInput(
        prompt=convert.prompt_from_pb(request), sampling=convert.sampling_params_from_pb(request.sampling),
        session_id=request.session_id, request_id=request.request_id, policy=convert.policy_from_pb(request.policy, ""),
        priority=request.priority, prefix_tokens=request.prefix_tokens,
        prefix_messages=request.prefix_messages,
    )


def salted_namespace(namespace: str, cache_salt: str) -> str:
    """The cache namespace of a request with ``cache_salt`` (its tenant's namespace otherwise):
    a salt cannot name another tenant's namespace, whose names hold no ``#``."""
    return f"{namespace}#salt={cache_salt}" if cache_salt else namespace


@dataclass
class _Seen:
    """What a stream's events said its request used: the usage to account when the request
    ends without its ``finished`` event (cancelled, past its deadline, failed on its node).
    Tokens the node made after the gateway stopped reading are not in it."""

    prompt_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def observe(self, event: dict[str, Any]) -> None:
        if event["type"] == "started":
            self.prompt_tokens, self.cached_tokens = event["prompt_tokens"], dict(event.get("cached_tokens", {}))
        elif event["type"] == "delta":
            self.completion_tokens += len(event["token_ids"])

    def usage(self) -> dict[str, Any] | None:
        """``release``'s usage (None when nothing ran)."""
        if not (self.prompt_tokens or self.completion_tokens):
            return None
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens}


class StreamWriter:
    """The task that hands one call's events to its client (a gRPC call's, an HTTP response's),
    which the idle-reader deadline stops (``NodeStreams.expire_idle``): it is stuck in a write
    its client does not take, so it would never take the error that ends its stream.

    ``stop(message)`` cancels ``task``; the writer, catching that ``CancelledError``, calls
    ``withdraw()``: True when the cancellation was this stop (it is then withdrawn,
    ``Task.uncancel``, and ``stopped`` holds the client's RESOURCE_EXHAUSTED message), False
    for any other (re-raise it).
    """

    def __init__(self, task: asyncio.Task[Any] | None = None) -> None:
        self.task = task if task is not None else asyncio.current_task()
        self.stopped: str | None = None

    def stop(self, message: str) -> None:
        if self.stopped is None and self.task is not None:
            self.stopped = message
            self.task.cancel()

    def withdraw(self) -> bool:
        if self.stopped is None or self.task is None:
            return False
        self.task.uncancel()
        return True


class _RecordedAbort:
    """``context`` whose ``abort`` records the refusal's status in the request's metrics first:
    the client has the status as soon as ``abort`` sends it, so counting it afterwards (in
    ``generate``'s ``finally``) raced a scrape that followed the refusal."""

    def __init__(self, context: Any, track: RequestTracker) -> None:
        self._context, self._track, self.recorded = context, track, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def record(self, code: grpc.StatusCode) -> None:
        """Count the call as ended with ``code`` (once)."""
        if not self.recorded:
            self.recorded = True
            self._track.finish(code.name)

    async def abort(self, code: grpc.StatusCode, *args: Any, **kwargs: Any) -> Any:
        self.record(code)
        return await self._context.abort(code, *args, **kwargs)


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
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
    """

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 node_info: dict[str, dict[str, Any]], templater: ChatTemplater | None,
                 scheduler_address: str, security: Security | None = None,
                 metrics: GatewayMetrics | None = None, limits: StreamLimits | None = None) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self._in_flight: set[str] = set()  # scoped client ids of this gateway's calls in flight
        self.limits = limits = limits or StreamLimits()
        self.max_streams_per_tenant = limits.max_streams_per_tenant
        self.open_streams: dict[str, int] = {}  # tenant id -> its Generate calls open here
        self.streams_refused = 0  # calls refused for ``max_streams_per_tenant``
        self._tokenizing: dict[str, asyncio.Lock] = {}  # tenant id -> its turn on a worker thread
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, "kvstrata-tokenize")
        self.info, self.templater = next(iter(node_info.values())), templater
        self.metrics = metrics or GatewayMetrics()  # the Gateway serves its registry (gateway_server)
        self.streams = NodeStreams(
            nodes, {nid: info["data_address"] for nid, info in node_info.items()}, scheduler_address,
            security=security, max_undelivered_bytes=limits.max_undelivered_bytes,
            stream_idle_timeout_s=limits.idle_timeout_s,
        )

    async def off_loop(self, tenant_id: str, work: Callable[[], Any]) -> Any:
        """Run ``work`` (parsing, rendering, tokenizing a prompt) on a worker thread, one at a
        time per tenant; returns its result, raises what it raised.

        Regression (security review): a prompt's text was rendered and tokenized on the event
        loop that serves every tenant's calls and streams (1 Mi characters: ~3.6 s); three
        such calls froze every other tenant's streams for ~14 s. One at a time per tenant: a
        tenant's burst of them holds one worker thread, not every one."""
        lock = self._tokenizing.setdefault(tenant_id, asyncio.Lock())
        await lock.acquire()
        loop = asyncio.get_running_loop()
        try:
            done = self._tokenizer_pool.submit(work)
        except BaseException:
            lock.release()
            raise
        # released when the work is done, not when a cancelled caller stops waiting for it
        # (regression, diff review: a tenant that sent big prompts and hung up ran one thread
        # per call at once and filled the pool every tenant's parses share)
        done.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(lock.release))
        return await asyncio.wrap_future(done)

    async def _prepare(self, call: GenerateInput, tenant: Any, context: Any) -> tuple[NodeRequest, list[bytes]]:
        spec = tenant.spec
        policy = call.policy or spec.policy
        try:
            convert.check_policy_spec(policy)
        except (ValueError, KeyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not spec.allows_policy(policy):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"KV policy {policy!r} is not allowed for "
                                f"this tenant; allowed: {', '.join(spec.allowed_policies)}")
        for name in ("request_id", "session_id", "cache_salt", "routing_key"):
            if len(getattr(call, name)) > MAX_ID_CHARS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is longer than {MAX_ID_CHARS} characters")
        try:
            check_priority(call.priority)
        except (TypeError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        messages: tuple[dict[str, str], ...] = ()
        tokens: tuple[int, ...] = ()
        prompt, sampling = call.prompt, call.sampling
        limit = min(spec.max_context_tokens or 1 << 30, self.info["max_model_len"])
        room = min(limit, self.info["pool_tokens"])  # the most prompt tokens that can ever run
        templater = self.templater
        if prompt and isinstance(prompt[0], dict):
            messages = tuple(prompt)
            if templater is not None:
                try:  # before any rendering: text that can never fit is refused for free
                    templater.check_messages_fit(messages, room)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if not call.session_id and templater is not None:
                tokens = tuple(await self.off_loop(tenant.tenant_id, lambda: templater.first_turn(prompt)))
                messages = ()
        else:
            tokens = tuple(prompt)
            vocab = self.info.get("vocab_size")
            if vocab and not all(type(t) is int and 0 <= t < vocab for t in tokens):  # regression:
                # ids past the data plane's int32 got UNAVAILABLE (a scheduler "failure") or a 500
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token ids must lie in [0, {vocab})")
        fill = {}
        if call.fill_context:  # what the context and the pool leave (the node sizes it again
            # from the whole prompt, session history included: regression, every chat call
            # without max_tokens was refused, asking for more than the pool holds)
            room = min(limit, self.info["pool_tokens"]) - len(tokens)
            sampling = dataclasses.replace(sampling, max_tokens=max(1, room))
            fill = {"fill_context": "1"}
        # a refusal for size reads as OpenAI's and vLLM's ("This model's maximum context length is
        # N tokens. However, you requested M tokens (P in the messages, K in the completion)"), which
        # clients such as LiteLLM key on. Regression (oairev20 O4): it read "prompt (P tokens) +
        # max_tokens (K) exceeds the context limit (N tokens)" and went unrecognised
        what = "messages" if prompt and isinstance(prompt[0], dict) else "prompt"
        if len(tokens) >= self.info["pool_tokens"]:
            pool_tokens = self.info["pool_tokens"]
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {pool_tokens} tokens on a cache node (its KV "
                f"pool holds {pool_tokens} tokens: the prompt and at least one generated token). However, "
                f"you requested {len(tokens)} tokens in the {what}. Please reduce the length of the {what}.",
            )
        if len(tokens) + sampling.max_tokens > limit:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"This model's maximum context length is {limit} tokens{self._whose(limit)}. However, you "
                f"requested {len(tokens) + sampling.max_tokens} tokens ({len(tokens)} in the {what}, "
                f"{sampling.max_tokens} in the completion). Please reduce the length of the {what} or completion.",
            )
        try:
            def prefix() -> int:
                return resolve_prefix_tokens(call.prefix_tokens, call.prefix_messages, prompt, tokens, templater)

            # only a chat prefix renders (the hot path of a token prompt takes no thread hop)
            prefix_tokens = await self.off_loop(tenant.tenant_id, prefix) if call.prefix_messages else prefix()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        namespace = salted_namespace(tenant.kv_namespace, call.cache_salt)
        hashes = hash_prompt_blocks(
            tokens, self.info["block_size"], (namespace, self.info["model_id"], self.info["kv_format"])
        ) if tokens else []
        extra = {"slo_class": spec.slo_class.value, "ttft_slo_ms": str(spec.ttft_slo_ms),
                 "min_tokens_per_s": str(spec.min_tokens_per_s), "weight": str(spec.weight),
                 "kv_quota_bytes": str(spec.kv_quota_bytes)} | fill
        if call.routing_key:
            extra["routing_key"] = scoped_id(tenant.tenant_id, call.routing_key)
        if messages:  # the node renders them: admission still needs their size
            estimate, overhead = await self.off_loop(tenant.tenant_id, lambda: (
                estimate_message_tokens(templater, messages), templater.conversation_overhead if templater else 0))
            if templater is not None and estimate - overhead >= room:
                await context.abort(  # whatever the history, the turn can never fit: the node is spared it
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"This model's maximum context length is {room} prompt tokens on a cache node. However, "
                    f"the messages alone take {estimate} tokens: they can never fit, whatever the session's "
                    "history. Please reduce the length of the messages.",
                )
            if templater is not None and not fill:
                await self._check_turn_fits(max(estimate - overhead, 0), sampling.max_tokens, limit, policy, context)
            if templater is not None:
                try:  # as the node's check of the turn's own tokens (``CacheNode._prompt``), which are at
                    # least these: regression (security review F3), text the tokenizer drops was kept there
                    templater.check_tokens_cover(content_chars(messages), max(estimate - overhead, 0))
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            extra["prompt_tokens_estimate"] = str(estimate)
        req = NodeRequest(
            request_id=scoped_id(tenant.tenant_id, call.request_id or uuid.uuid4().hex), tenant=tenant.tenant_id,
            cache_namespace=namespace, sampling=sampling, messages=messages, token_ids=tokens,
            session_id=scoped_id(tenant.tenant_id, call.session_id) if call.session_id else "",
            policy=policy, max_context_tokens=limit, arrival_time_s=time.monotonic(), extra=extra,
            priority=call.priority, prefix_tokens=prefix_tokens,
        )
        return req, hashes

    async def _check_turn_fits(self, own: int, max_tokens: int, limit: int, policy: str, context: Any) -> None:
        """Refuse (INVALID_ARGUMENT) a session turn whose own tokens (``own``, a lower bound:
        its messages' estimate without the conversation overhead) + ``max_tokens`` the cache node
        would refuse whatever the history: past the context ``limit``, or, under a policy that
        keeps every token (``policy`` "" or not compressing), past the node's pool.

        Regression (security review 20 S4): such a turn was rendered and tokenized on the node's
        one render thread (~0.15-0.4 s for 348-648K characters of long vocabulary pieces), then
        refused there for size, while every other tenant's chat turns waited behind it.
        """
        need = own + max_tokens
        requested = (f"However, you requested at least {need} tokens ({own} at least in the messages, with the "
                     f"session's history on top, {max_tokens} in the completion)")
        if need > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"This model's maximum context length is {limit} tokens{self._whose(limit)}. "
                                f"{requested}. Please reduce the length of the messages or completion.")
        pool_tokens = self.info["pool_tokens"]
        if need > pool_tokens and not (policy and convert.policy_compresses(policy)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"This model's maximum context length is {pool_tokens} tokens on a cache node "
                                f"under a KV policy that keeps every token (its KV pool holds {pool_tokens} "
                                f"tokens). {requested}: that can never fit. Please reduce the length of the "
                                "messages or completion.")

    def _whose(self, limit: int) -> str:
        """How a context-overflow message names a ``limit`` below the model's own."""
        return " for this tenant (its max_context_tokens)" if limit < self.info["max_model_len"] else ""

    async def Generate(self, request, context) -> None:
        """Stream one request's events (``generate``), written here (``context.write``) so that
        a stream its client stopped reading ends RESOURCE_EXHAUSTED (``StreamWriter``).

        Regression (secrev18 B residue): written by gRPC from an async generator, a call stuck
        in a write its client never took could only be cancelled, which sent the client no
        status at all."""
        writer = StreamWriter()
        try:
            async with contextlib.aclosing(self.generate(context, lambda: input_from_pb(request), writer)) as events:
                async for event in events:
                    await context.write(convert.generate_event_to_pb(event))
        except asyncio.CancelledError:
            if not writer.withdraw():
                raise
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(writer.stopped)

    async def generate(self, context: Any, parse: Callable[[], GenerateInput],
                       writer: StreamWriter | None = None) -> AsyncIterator[dict[str, Any]]:
        """One request's node events (``services.node_request``), for either API: authenticate,
        ``parse`` (ValueError -> INVALID_ARGUMENT), check and bound, admit, stream; a consumer
        that stops early aborts it on its node. Refusals are ``context.abort`` with the gRPC
        status (RESOURCE_EXHAUSTED sets a ``retry-after-ms`` trailer first). Request and session
        ids are the tenant's own (``scoped_id``); one in flight already is ALREADY_EXISTS.

        ``writer``: the task handing these events to the client (None: the one calling this),
        stopped when its client takes none of the stream's waiting events for
        ``limits.idle_timeout_s`` (``NodeStreams.expire_idle``): the stream is then ended
        RESOURCE_EXHAUSTED, its request aborted on its node, and the call counted so."""
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
        scoped = ""
        try:
            try:
                call = await self.off_loop(tenant_id, parse)  # a completion's prompt is tokenized here
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            req, hashes = await self._prepare(call, tenant, context)
            client_id = req.request_id.split("/", 1)[1]
            if req.request_id in self._in_flight:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {client_id!r} is in flight already")
            scoped = req.request_id
            self._in_flight.add(scoped)
        # each attempt has its own id past this gateway (scheduler, node, events, aborts).
        # Regression: a client id reused right after a cancel got the cancelled attempt's
        # "abort" ending while its own attempt ran on, unseen and unabortable, on the node;
        # and a late abort of a finished attempt refused the id's next use (CANCELLED)
            req = dataclasses.replace(req, request_id=f"{scoped}#{uuid.uuid4().hex[:16]}")
            # closed here, at once: its ``finally`` releases and aborts the attempt
            async with contextlib.aclosing(self._attempt(context, req, hashes, client_id, track, writer)) as events:
                async for event in events:
                    yield event
        finally:
            self._in_flight.discard(scoped)
            left = self.open_streams[tenant_id] - 1
            if left:
                self.open_streams[tenant_id] = left
            else:
                del self.open_streams[tenant_id]

    async def _attempt(self, context: Any, req: NodeRequest, hashes: list[bytes], client_id: str,
                       track: RequestTracker, writer: StreamWriter | None = None) -> AsyncIterator[dict[str, Any]]:
        """One admitted attempt of a request: admit, stream its node's events, and on any end
        release it at the scheduler (aborting it on its node when it did not finish).

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
                self.scheduler.release.remote(req.request_id, ended)

        def on_event(event: dict[str, Any]) -> None:  # as it arrives (``NodeStreams.open``)
            seen.observe(event)
            if event["type"] == "finished":
                release(event)
            elif event["type"] == "error":
                release(seen.usage())

        def on_idle(message: str) -> None:  # ``NodeStreams.expire_idle``: counted, then stopped
            context.record(grpc.StatusCode.RESOURCE_EXHAUSTED)
            writer.stop(message)

        queue = self.streams.open(req.request_id, on_event, on_idle)
        # the scheduler hands an admitted request straight to its node; every answer from the
        # node, a refusal included, comes back on this gateway's event inbox
        admission = asyncio.ensure_future(self.streams.admit(req, hashes))
        try:
            # headers now, while admission and prefill run, not with the first token
            await context.send_initial_metadata(())
            try:  # shielded: a cancelled call still learns where its request went, to abort it
                adm = await asyncio.shield(admission)
            except (RuntimeError, asyncio.TimeoutError) as exc:  # a scheduler fault (a malformed
                usage = {}  # reply included: ``data_plane.admission_reply``): UNAVAILABLE
                for node_id in self.streams.node_inboxes:  # admitted late, it must not run unseen:
                    self.streams.abort(node_id, req.request_id)  # its id is this attempt's alone
                if isinstance(exc, asyncio.TimeoutError):  # a scheduler fault (RuntimeError) has
                    set_retry_after(context, RETRY_S)  # no hint: no wait is known to undo it
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) or "the global scheduler did not answer")
            if adm.code != "OK":
                usage = {}
                track.rejected(adm.reason)
                if adm.reason in ("tenant_deleted", "unknown_tenant"):  # a stale cached key
                    self.auth.forget_tenant_id(req.tenant)
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
                    await context.abort(_CODES[event["code"]], event["message"])
                if event["type"] == "finished":
                    usage = event
                if event["type"] == "started":
                    event = {**event, "request_id": client_id}
                yield event
        finally:
            self.streams.close(req.request_id)  # ``seen`` holds every event that arrived
            if usage is None and not released:  # cancelled or past its deadline
                if adm is None:  # while being admitted: abort once the node is known
                    asyncio.get_running_loop().create_task(self._abort_admitted(admission, req.request_id))
                else:
                    self.streams.abort(adm.node_id, req.request_id)
            if adm is None or adm.code == "OK":
                release(usage or seen.usage())

    async def _abort_admitted(self, admission: Any, request_id: str) -> None:
        try:
            adm = await admission
        except Exception:  # noqa: BLE001 - nothing was admitted, nothing runs
            return
        if adm.code == "OK":
            self.streams.abort(adm.node_id, request_id)

    async def CloseSession(self, request, context):
        """Close the caller's session ``session_id`` (``close_session``)."""
        freed = await self.close_session(context, request.session_id)
        return inference_pb2.CloseSessionResponse(freed_tokens=freed)

    async def close_session(self, context: Any, session_id: str) -> int:
        """Close the caller's session ``session_id`` (another tenant's equal id is another
        session); returns the tokens freed. NOT_FOUND (``context.abort``) when the caller has
        none by that id, INVALID_ARGUMENT for an empty id or one over ``MAX_ID_CHARS``."""
        tenant = await self.auth.tenant(context)
        if not session_id or len(session_id) > MAX_ID_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"session_id must have 1 to {MAX_ID_CHARS} characters, got {len(session_id)}")
        scoped = scoped_id(tenant.tenant_id, session_id)
        closing = await self.scheduler.close_session.remote(scoped, tenant.tenant_id)
        if closing is None:
            freed = -1
        elif not closing[0]:  # its node is down or restarted: nothing to free there now
            freed = 0
        else:  # its turns still in flight are refused there (never open it again)
            node_id, turns = closing
            freed = await self.nodes[node_id].close_session.remote(scoped, tenant.tenant_id, turns)
        if freed < 0:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {session_id!r} for this tenant")
        return freed
