"""Calls before they are authenticated, on the gateway's gRPC server. ``CallGate`` is a
``grpc.aio`` server interceptor that refuses a call with a missing, malformed or absent API key
right after its headers, bounds how long and how many calls may wait for their request message,
and decodes that message itself (``services.grpc_wire``: a malformed one ends INVALID_ARGUMENT,
one too many repeated elements is refused before protobuf builds it).
``BoundedHealthServicer`` answers Health/Watch only for the gateway's own service names, with a
bound on open watchers. (The server's connection bounds: ``services.grpc_bounds``.)

Regression (secrev19 H5): grpc.aio runs a unary-request handler (``Generate`` and every other
method) only once the request message has arrived, and the API key was checked inside the
handler, so a call that sent HEADERS alone, with no key, was held with no deadline (~21 KB and 2
loop tasks each, 256 per connection); Health/Watch streams were held for any service name.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1._async import HealthServicer

from services.actor_calls import ActorSilent
from services.auth import Authenticator
from services.grpc_bounds import GrpcLimits
from services.grpc_wire import RequestDecoder
from services.loop_lag import running_lag
from services.peers import peer_network
from services.ray_errors import PROCESS_UNREACHABLE, RayActorError, retry_after_ms

log = logging.getLogger(__name__)

HEALTH_WATCHERS_PER_ADDRESS = 16
"""Health/Watch streams one client network may hold open at once (``peer_network``)."""

UNVERIFIED_CALLS_PER_ADDRESS = 64
"""Calls with a key not verified here lately that one client network may have waiting for their
request message at once (``CallGate``)."""

HEALTH_SERVICE = "grpc.health.v1.Health"
"""Its methods need no key (probes carry none)."""

BUSY_RETRY_MS = 1000
"""The ``retry-after-ms`` trailer of a call refused for a cap on calls waiting or watching
(``_refuse_busy``): the places free as other calls send their message, end or are shed."""


async def _refuse_busy(context: Any, message: str) -> None:
    """End the call RESOURCE_EXHAUSTED with ``message`` and the ``BUSY_RETRY_MS`` hint."""
    context.set_trailing_metadata((("retry-after-ms", str(BUSY_RETRY_MS)),))
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


async def _refuse_unreachable(context: Any, exc: BaseException) -> None:
    """End a call failed by a Ray actor error UNAVAILABLE with ``PROCESS_UNREACHABLE``, and the
    ``retry-after-ms`` hint while the actor may come back (``ray_errors.retry_after_ms``).

    Regression (bench.chaos ``kill_scheduler``): a call whose key check reached the scheduler
    while Ray restarted it (a key not checked here in the last 10 s) ended UNAVAILABLE with no
    hint, unlike the admissions refused meanwhile, though a retry a second later succeeds."""
    hint = retry_after_ms(exc)
    if hint is not None:
        context.set_trailing_metadata((("retry-after-ms", str(hint)),))
    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) if isinstance(exc, ActorSilent) else PROCESS_UNREACHABLE)


async def _refuse_failed(context: Any, method: str, exc: Exception) -> None:
    """End a call its handler failed with an exception no check expected (a bug, or a library
    raising something its callers do not catch) INTERNAL with an incident id, the exception
    logged here with that id. Regression: grpc.aio ended such a call UNKNOWN with
    "Unexpected <class '...'>: <the exception's text>", the server's internals (class paths,
    library messages) in the client's hands, and no status a client could act on
    (jinja2's ``TemplateError`` from a chat template, before ``services.chat.TemplateRefusal``)."""
    incident = uuid.uuid4().hex[:12]
    log.error("gRPC %s failed (incident %s)", method, incident, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}): the server's log has "
                        "its details")


class _Counts:
    """Open things in all and per client network, with caps on both."""

    def __init__(self, total: int, per_network: int) -> None:
        self.total, self.per_network = total, per_network
        self.open: dict[str, int] = {}
        self.count = 0

    def take(self, network: str) -> bool:
        if self.count >= self.total or self.open.get(network, 0) >= self.per_network:
            return False
        self.open[network] = self.open.get(network, 0) + 1
        self.count += 1
        return True

    def give(self, network: str) -> None:
        self.count -= 1
        left = self.open[network] - 1
        if left:
            self.open[network] = left
        else:
            del self.open[network]


class BoundedHealthServicer(HealthServicer):
    """grpc_health's servicer, answering Watch only for ``names`` and for at most
    ``max_watchers`` streams at once (``HEALTH_WATCHERS_PER_ADDRESS`` per client network).

    A Watch for another name ends NOT_FOUND at once, as Check does (the health protocol would
    hold it open with SERVICE_UNKNOWN); one past a cap ends RESOURCE_EXHAUSTED. Regression
    (secrev19 H5): Watch streams for any client-chosen name were held open, unbounded
    (16 connections x 256 streams: +63 MB, 5576 loop tasks).
    """

    def __init__(self, names: tuple[str, ...], max_watchers: int) -> None:
        super().__init__()
        self.names = frozenset(names)
        self.watchers = _Counts(max_watchers, HEALTH_WATCHERS_PER_ADDRESS)

    async def Watch(self, request: Any, context: Any) -> None:
        if request.service not in self.names:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service name")
        network = peer_network(context.peer() or "")
        if not self.watchers.take(network):
            await _refuse_busy(context, "too many health watchers")
        try:
            await super().Watch(request, context)
        finally:
            self.watchers.give(network)


Behavior = Callable[..., Any]


class CallGate(grpc.aio.ServerInterceptor):
    """Runs before any call's request message is awaited (its handler is turned into a
    request-streaming one, which grpc.aio starts right after the headers):

    1. Except for Health, refuses UNAUTHENTICATED a call whose API key is missing, malformed or
       of an id that exists nowhere (``Authenticator.refuse_unknown_key``: no scheduler call;
       ``admin_methods`` get the admin key's refusal message).
    2. A call whose key is not verified here lately (``Authenticator.is_verified``), Health's
       included, counts as unverified until its message arrives: past
       ``UNVERIFIED_CALLS_PER_ADDRESS`` from its client network, or ``max_unverified_calls``
       in all, the oldest call waiting from that network (from the network waiting with the
       most) is ended RESOURCE_EXHAUSTED to make room (``_wait_slot``: a valid client's message
       follows its headers at once, so what waits long is what never sends one).
    3. Waits at most ``message_timeout_s`` for the request message (DEADLINE_EXCEEDED; once
       more when the gateway's own event loop stalled meanwhile: ``services.loop_lag``), then
       runs the method's own handler with it; the handler authenticates fully as before.
       The message arrives as raw bytes (the replacement handler has no deserializer) and is
       decoded here (``services.grpc_wire.RequestDecoder``): a repeated field past its limit
       or bytes that are not a valid message end INVALID_ARGUMENT with a plain message, after
       the key's full check (``_authenticate``: a bad key is UNAUTHENTICATED first, as for a
       well-formed message). Regression (review 24h G1, G2): grpc's deserializer raised
       ``DecodeError`` here (UNKNOWN with its text, before the key check), and a message of
       4.19M empty chat messages was parsed whole on the event loop before any count.
    4. A call failed by a Ray actor error (the scheduler or a node it asked died or is being
       restarted) ends UNAVAILABLE with ``ray_errors.PROCESS_UNREACHABLE``, with a retry hint
       while Ray may bring the actor back (``_refuse_unreachable``). Regression (review 23b,
       F2): it ended UNKNOWN with Ray's exception text. A scheduler that does not answer in
       time (``services.actor_calls.ActorSilent``) is answered the same way, naming that.
    5. A call failed by any other exception its handler did not turn into a status ends
       INTERNAL with an incident id, the exception logged with it (``_refuse_failed``), not
       UNKNOWN with the exception's class and text.

    A valid client's calls are unchanged: their message follows their headers at once, and
    nothing here bounds how long a call runs once it has its message.

    ``admin_methods``' handlers check ``Authenticator.admin``, ``tenant_methods``'
    ``Authenticator.tenant``, any other method's ``Authenticator.admin_or_tenant``.
    """

    def __init__(self, auth: Authenticator, limits: GrpcLimits, admin_methods: frozenset[str],
                 tenant_methods: frozenset[str] = frozenset()) -> None:
        self.auth, self.limits, self.admin_methods = auth, limits, admin_methods
        self.tenant_methods = tenant_methods
        self.unverified = _Counts(limits.max_unverified_calls, UNVERIFIED_CALLS_PER_ADDRESS)
        # the unverified calls waiting for their message, oldest first: each one's "shed" future
        # and its network
        self.waiting: dict[asyncio.Future[None], str] = {}
        self.timeouts = self.shed = self.bad_messages = 0

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        keyless = method.startswith(f"/{HEALTH_SERVICE}/")
        role = "admin" if method in self.admin_methods else "tenant" if method in self.tenant_methods else "any"
        decode = RequestDecoder(handler.request_deserializer)

        async def first(requests: Any, context: Any) -> Any:
            return await self._first(requests, context, keyless, role, decode)
        if handler.response_streaming:
            inner = handler.unary_stream
            if inspect.isasyncgenfunction(inner):
                async def stream_gen(requests: Any, context: Any) -> Any:
                    try:
                        request = await first(requests, context)
                        async for reply in inner(request, context):
                            yield reply
                    except (RayActorError, ActorSilent) as exc:
                        await _refuse_unreachable(context, exc)
                    except grpc.aio.BaseError:  # (an abort: the status is set)
                        raise
                    except Exception as exc:  # noqa: BLE001 - logged with an incident id, INTERNAL
                        await _refuse_failed(context, method, exc)
                behavior: Behavior = stream_gen
            else:
                async def stream_coro(requests: Any, context: Any) -> Any:
                    try:
                        return await inner(await first(requests, context), context)
                    except (RayActorError, ActorSilent) as exc:
                        await _refuse_unreachable(context, exc)
                    except grpc.aio.BaseError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - logged with an incident id, INTERNAL
                        await _refuse_failed(context, method, exc)
                behavior = stream_coro
            return grpc.stream_stream_rpc_method_handler(behavior, None, handler.response_serializer)
        unary = handler.unary_unary

        async def single(requests: Any, context: Any) -> Any:
            try:
                return await unary(await first(requests, context), context)
            except (RayActorError, ActorSilent) as exc:  # the scheduler (or a node) a servicer asked is down
                await _refuse_unreachable(context, exc)
            except grpc.aio.BaseError:
                raise
            except Exception as exc:  # noqa: BLE001 - logged with an incident id, INTERNAL
                await _refuse_failed(context, method, exc)
        return grpc.stream_unary_rpc_method_handler(single, None, handler.response_serializer)

    async def _first(self, requests: Any, context: Any, keyless: bool, role: str, decode: RequestDecoder) -> Any:
        """The call's request message, after the checks above (aborts the call otherwise)."""
        data = await self._receive(requests, context, keyless, role)
        try:
            return decode(data)
        except ValueError as exc:
            self.bad_messages += 1
            if not keyless:
                await self._authenticate(context, role)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _authenticate(self, context: Any, role: str) -> None:
        """The key check the method's handler makes first (aborts the call for a bad key)."""
        if role == "admin":
            await self.auth.admin(context)
        elif role == "tenant":
            await self.auth.tenant(context)
        else:
            await self.auth.admin_or_tenant(context)

    async def _receive(self, requests: Any, context: Any, keyless: bool, role: str) -> Any:
        """The call's request message's bytes, after checks 1 and 2 within check 3's wait."""
        if not keyless:
            await self.auth.refuse_unknown_key(context, "admin" if role == "admin" else "tenant")
        network, shed = peer_network(context.peer() or ""), None
        if keyless or not self.auth.is_verified(context):
            shed = self._wait_slot(network)
            if shed is None:
                await _refuse_busy(context, "too many calls waiting for their request message")
        message = asyncio.ensure_future(anext(requests))
        lag, t0 = running_lag(), time.monotonic()
        try:
            waits = {message} if shed is None else {message, shed}
            done, _ = await asyncio.wait(waits, timeout=self.limits.message_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done and lag.since(t0) > lag.stall_s:  # this gateway stalled: not the client's
                # time (its message may be waiting unread); once more. Regression (helper 29h):
                # a gateway paused past the timeout ended such calls DEADLINE_EXCEEDED on resume
                done, _ = await asyncio.wait(waits, timeout=self.limits.message_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            if message in done:
                return message.result()
            message.cancel()
            if shed is not None and shed in done:
                await _refuse_busy(context, "ended for a newer call: too many calls waiting for their request message")
            self.timeouts += 1
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no request message within {self.limits.message_timeout_s:g} s")
        except StopAsyncIteration:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request message")
        finally:
            message.cancel()
            if shed is not None and self.waiting.pop(shed, None) is not None:
                self.unverified.give(network)

    def _wait_slot(self, network: str) -> asyncio.Future[None] | None:
        """A waiting place for an unverified call from ``network``: its "shed" future (set when
        a newer call takes its place), or None (refused: no call waits to be shed). When its
        network is at ``UNVERIFIED_CALLS_PER_ADDRESS``, that network's oldest waiting call is
        shed; when all places are taken, the oldest call of the network waiting with the most.
        A valid client's message follows its headers at once, so it leaves before it could be
        shed; what waits is what never sends one.

        Regression (review of ddf59ab, R1): the places were first come, first served; calls
        that never sent their message (Health needs no key) held them for 30 s at a time, and
        every unverified call of their network, or of all networks once 16 had filled the
        1,024 places (a tenant's first call, any after the 10 s key cache, the admin's, Health
        checks), was refused RESOURCE_EXHAUSTED."""
        counts = self.unverified
        crowded = network if counts.open.get(network, 0) >= counts.per_network else None
        if crowded is None and counts.count >= counts.total:
            crowded = max(counts.open, key=lambda net: counts.open[net])
        if crowded is not None:
            oldest = next((f for f, net in self.waiting.items() if net == crowded), None)
            if oldest is None:
                return None
            counts.give(self.waiting.pop(oldest))
            oldest.set_result(None)
            self.shed += 1
        if not counts.take(network):
            return None
        shed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[shed] = network
        return shed
