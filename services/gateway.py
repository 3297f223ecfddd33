"""gRPC servicers: thin translation between protobuf and the Ray services.

Each servicer authenticates, converts (services.convert), delegates to the GlobalScheduler or
a CacheNode actor, and maps failures to precise status codes for that call alone. ``Generate``
goes through the data plane (``NodeStreams``, ``services.data_plane``); every other call is a
Ray actor call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import zmq
from zmq.utils.monitor import parse_monitor_message

from cache_node.hashing import hash_prompt_blocks
from kvstrata.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services import convert, data_plane
from services.auth import Authenticator
from services.chat import ChatTemplater
from services.data_plane_auth import Security
from services.global_scheduler import Admission
from services.node_request import NodeRequest
from tenants.errors import TenantExistsError, TenantNotFoundError

log = logging.getLogger(__name__)

_CODES = {c.name: c for c in grpc.StatusCode}


def _message(exc: BaseException) -> str:
    """The error's own message: an exception raised inside an actor reaches the gateway as
    Ray's task error (``cause`` holds the original), whose ``str`` is a whole remote traceback."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


async def _call(context: grpc.aio.ServicerContext, ref: Any) -> Any:
    """Await an actor call, mapping tenant errors and bad input to statuses."""
    try:
        return await ref
    except TenantExistsError as exc:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, _message(exc))
    except TenantNotFoundError as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, _message(exc))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(exc))


MAX_ID_CHARS = 256
"""Longest client-chosen request or session id."""


def scoped_id(tenant_id: str, client_id: str) -> str:
    """The id the scheduler and the nodes know a client's request or session by: scoped to its
    tenant (``tenant_id`` is hex, so the first ``/`` separates the two), so that tenants never
    reach each other's requests or sessions by reusing an id."""
    return f"{tenant_id}/{client_id}"


def _check_policy(name: str) -> None:
    """Raise ValueError (listing the known names) for an unknown KV policy name."""
    if not name:
        return
    try:
        from cache_node.policies import get_policy_class
    except ImportError as exc:
        raise ValueError(f"unknown KV policy {name!r}: this node has no policies") from exc
    get_policy_class(name)


class TenantServicer(tenant_pb2_grpc.TenantServiceServicer):
    def __init__(self, scheduler: Any, auth: Authenticator) -> None:
        self.scheduler, self.auth = scheduler, auth

    async def _spec(self, msg: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return convert.tenant_spec_from_pb(msg)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def RegisterTenant(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        spec = await self._spec(request.spec, context)
        tenant, key = await _call(context, self.scheduler.register_tenant.remote(spec))
        return tenant_pb2.RegisterTenantResponse(tenant=convert.tenant_to_pb(tenant), api_key=key)

    async def UpdateTenant(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        spec = await self._spec(request.spec, context)
        tenant = await _call(context, self.scheduler.update_tenant.remote(request.name, spec))
        self.auth.forget()
        return tenant_pb2.UpdateTenantResponse(tenant=convert.tenant_to_pb(tenant))

    async def DeleteTenant(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        await _call(context, self.scheduler.delete_tenant.remote(request.name))
        self.auth.forget()
        return tenant_pb2.DeleteTenantResponse()

    async def GetTenant(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        tenant = await _call(context, self.scheduler.get_tenant.remote(request.name))
        return tenant_pb2.GetTenantResponse(tenant=convert.tenant_to_pb(tenant))

    async def ListTenants(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        tenants = await self.scheduler.list_tenants.remote()
        return tenant_pb2.ListTenantsResponse(tenants=[convert.tenant_to_pb(t) for t in tenants])

    async def GetUsage(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        tenant = await _call(context, self.scheduler.get_tenant.remote(request.name))
        usage = await self.scheduler.usage_of.remote(tenant.tenant_id)
        return tenant_pb2.GetUsageResponse(usage=convert.usage_to_pb(usage))

    async def RotateKey(self, request, context):  # noqa: N802
        """The admin key rotates any tenant's key; a tenant's own key rotates only its own."""
        caller = await self.auth.admin_or_tenant(context)
        if caller is not None and caller.name != request.name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "a tenant key rotates only its own tenant's key")
        key = await _call(context, self.scheduler.rotate_tenant_key.remote(request.name))
        self.auth.forget()
        return tenant_pb2.RotateKeyResponse(api_key=key)


class NodeStreams:
    """The gateway's end of the data plane (``services.data_plane``).

    - ``admit``: a request's admission by the GlobalScheduler, which hands an admitted request
      straight to its node;
    - the event inbox: each node pushes one message per engine step with every event for this
      gateway's streams, routed here to per-request queues (``open``);
    - ``abort``: straight to the node's command inbox.

    A node found down (``services.node_monitor.NodeMonitor`` calls ``fail_node``) ends each
    stream open on it, and any stream bound to it later, with an UNAVAILABLE error event, until
    it rejoins (``reconnect``, with its new command inbox).

    Args:
        nodes: node id -> CacheNode actor handle.
        node_inboxes: node id -> the node's command inbox address.
        scheduler_address: the GlobalScheduler's admission socket address.
        admit_timeout_s: an admission not answered by then fails with UNAVAILABLE.
        security: the gateway's data-plane identity (``services.data_plane_auth``): its event
            inbox admits only nodes. None: plaintext on loopback (unit tests only).

    Every message read is checked (``data_plane.event_items``, ``admission_reply``); a bad
    one is dropped and counted in ``bad_messages``.
    """

    def __init__(self, nodes: dict[str, Any], node_inboxes: dict[str, str], scheduler_address: str,
                 admit_timeout_s: float = 30.0, security: Security | None = None) -> None:
        self.security = security
        self.bad_messages = 0
        self.nodes, self.node_inboxes = nodes, dict(node_inboxes)
        self.scheduler_address = scheduler_address
        self.admit_timeout_s = admit_timeout_s
        self.subscriber = ""  # this gateway's event inbox address (``start``)
        self.down: dict[str, str] = {}  # node id -> why it is down (``fail_node``)
        self.on_disconnect: Callable[[str], Any] | None = None  # node id (``_connect_node``)
        self._queues: dict[str, tuple[str, asyncio.Queue[dict[str, Any]]]] = {}
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: dict[str, asyncio.Task[None]] = {}  # node id -> its connection watch

    async def start(self) -> None:
        """Bind the event inbox and connect to the scheduler and the nodes (on the running loop)."""
        self._context = ctx = data_plane.context(asyncio_=True)
        self._authenticator = self.security.start_authenticator(ctx) if self.security is not None else None
        inbox, self.subscriber = data_plane.serving_socket(ctx, zmq.PULL, self.security)
        self._admission = ctx.socket(zmq.DEALER)
        self._admission.setsockopt(zmq.MAXMSGSIZE, data_plane.MAX_MESSAGE_BYTES)
        if self.security is not None:
            self.security.connect_to(self._admission, "scheduler")
        self._admission.connect(self.scheduler_address)
        self._commands = {}
        for node_id, address in self.node_inboxes.items():
            self._connect_node(node_id, address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_events(inbox)), loop.create_task(self._read_admissions())]

    def _connect_node(self, node_id: str, address: str) -> None:
        """Connect the command socket to ``node_id``'s inbox, and watch the connection: when
        the node's process dies its TCP connection closes, and ``on_disconnect(node_id)``
        hears of it at once (Ray takes 1-2 s to fail calls to a killed actor)."""
        sock = self._context.socket(zmq.PUSH)
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self.security is not None:
            self.security.connect_to(sock, "node")
        sock.connect(address)
        self._commands[node_id] = sock
        self._connections[node_id] = asyncio.get_running_loop().create_task(
            self._watch_connection(node_id, sock, events))

    async def _watch_connection(self, node_id: str, sock: Any, events: Any) -> None:
        try:
            while True:
                event = parse_monitor_message(await events.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.on_disconnect is not None:
                    self.on_disconnect(node_id)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            events.close(linger=0)

    def shutdown(self) -> None:
        """Stop reading and close every socket."""
        for task in [*self._tasks, *self._connections.values()]:
            task.cancel()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)

    async def admit(self, req: NodeRequest, hashes: list[bytes]) -> Admission:
        """The scheduler's ``Admission`` for ``req`` (which it has handed on to the node when
        admitted); ``hashes`` are the prompt's block hashes for routing.

        Raises:
            RuntimeError: the scheduler failed on it; TimeoutError: no answer in time.
        """
        self._next_id += 1
        corr = self._next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        try:
            await self._admission.send(data_plane.pack({
                "id": corr, "req": data_plane.request_to_wire(req), "sub": self.subscriber,
                "hashes": hashes}))
            reply = await asyncio.wait_for(fut, self.admit_timeout_s)
        finally:
            self._pending.pop(corr, None)
        if "error" in reply:
            raise RuntimeError(f"the global scheduler failed to admit the request: {reply['error']}")
        return Admission(**reply["adm"])

    async def _read_admissions(self) -> None:
        while True:
            payload = await self._admission.recv()
            try:
                corr, body = data_plane.admission_reply(data_plane.unpack(payload))
            except Exception as exc:  # noqa: BLE001 - any bytes at all: drop and count
                self._drop("admission", exc)
                continue
            fut = self._pending.get(corr)
            if fut is not None and not fut.done():
                fut.set_result({"error": body} if isinstance(body, str) else {"adm": body})

    def abort(self, node_id: str, request_id: str) -> None:
        """Tell ``node_id`` to stop ``request_id`` (fire and forget)."""
        self._commands[node_id].send(data_plane.pack({"op": "abort", "id": request_id}))

    def open(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        """A queue for ``request_id``'s events; open it before the request reaches a node.

        Raises:
            KeyError: ``request_id`` is open already (in flight on this gateway).
        """
        if request_id in self._queues:
            raise KeyError(request_id)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = ("", queue)
        return queue

    def bind(self, request_id: str, node_id: str) -> None:
        """Record the node serving ``request_id`` (its failure ends this stream; a node down
        already ends it at once)."""
        entry = self._queues.get(request_id)
        if entry is not None:
            self._queues[request_id] = (node_id, entry[1])
            if node_id in self.down:
                entry[1].put_nowait(_unavailable(self.down[node_id]))

    def fail_node(self, node_id: str, reason: str) -> None:
        """``node_id`` is down: end every stream bound to it with UNAVAILABLE (``reason``)."""
        self.down[node_id] = reason
        for nid, queue in list(self._queues.values()):
            if nid == node_id:
                queue.put_nowait(_unavailable(reason))

    def reconnect(self, node_id: str, address: str) -> None:
        """``node_id`` is up again with its command inbox at ``address`` (new after a restart)."""
        if address != self.node_inboxes.get(node_id):
            old = self._commands.pop(node_id)
            with contextlib.suppress(zmq.ZMQError):
                old.disable_monitor()  # closing it is no news
            self._connections.pop(node_id).cancel()
            old.close(linger=0)
            self._connect_node(node_id, address)
            self.node_inboxes[node_id] = address
        self.down.pop(node_id, None)

    def close(self, request_id: str) -> None:
        """Stop routing ``request_id``'s events (later ones are dropped)."""
        self._queues.pop(request_id, None)

    async def _read_events(self, inbox: Any) -> None:
        while True:
            payload = await inbox.recv()
            try:
                items = data_plane.event_items(data_plane.unpack(payload))
            except Exception as exc:  # noqa: BLE001 - any bytes at all: drop and count
                self._drop("event", exc)
                continue
            for request_id, event in items:
                entry = self._queues.get(request_id)
                if entry is not None:
                    entry[1].put_nowait(event)

    def _drop(self, what: str, exc: BaseException) -> None:
        self.bad_messages += 1
        log.warning("gateway data plane: dropped a bad %s message: %s: %.200s", what, type(exc).__name__, exc)


def _unavailable(reason: str) -> dict[str, Any]:
    return {"type": "error", "code": "UNAVAILABLE", "message": f"{reason}; retry the request"}


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


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Generate (server streaming) and CloseSession.

    Args:
        nodes: node id -> CacheNode actor handle.
        node_info: node id -> ``CacheNode.describe()`` (model identity, block size, limits,
            data-plane address); every node serves the same model.
        scheduler_address: the GlobalScheduler's admission socket (``open_data_plane``).
        security: the gateway's data-plane identity (``NodeStreams``).
    """

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 node_info: dict[str, dict[str, Any]], templater: ChatTemplater | None,
                 scheduler_address: str, security: Security | None = None) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self.info, self.templater = next(iter(node_info.values())), templater
        self.streams = NodeStreams(
            nodes, {nid: info["data_address"] for nid, info in node_info.items()}, scheduler_address,
            security=security,
        )

    async def _prepare(self, request: Any, tenant: Any, context: Any) -> tuple[NodeRequest, list[bytes]]:
        spec = tenant.spec
        try:
            sampling = convert.sampling_params_from_pb(request.sampling)
            prompt = convert.prompt_from_pb(request)
            policy = convert.policy_from_pb(request.policy, spec.policy)
            _check_policy(policy)
        except (ValueError, KeyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not spec.allows_policy(policy):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"KV policy {policy!r} is not allowed for "
                                f"this tenant; allowed: {', '.join(spec.allowed_policies)}")
        for name in ("request_id", "session_id"):
            if len(getattr(request, name)) > MAX_ID_CHARS:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is longer than {MAX_ID_CHARS} characters")
        messages: tuple[dict[str, str], ...] = ()
        tokens: tuple[int, ...] = ()
        if prompt and isinstance(prompt[0], dict):
            messages = tuple(prompt)
            if not request.session_id and self.templater is not None:
                tokens, messages = tuple(self.templater.first_turn(prompt)), ()
        else:
            tokens = tuple(prompt)
        limit = min(spec.max_context_tokens or 1 << 30, self.info["max_model_len"])
        if len(tokens) + sampling.max_tokens > limit or len(tokens) >= self.info["pool_tokens"]:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(tokens)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
                f"context limit ({limit} tokens) or the KV pool",
            )
        hashes = hash_prompt_blocks(
            tokens, self.info["block_size"], (spec.cache_namespace, self.info["model_id"], self.info["kv_format"])
        ) if tokens else []
        req = NodeRequest(
            request_id=scoped_id(tenant.tenant_id, request.request_id or uuid.uuid4().hex), tenant=tenant.tenant_id,
            cache_namespace=spec.cache_namespace, sampling=sampling, messages=messages, token_ids=tokens,
            session_id=scoped_id(tenant.tenant_id, request.session_id) if request.session_id else "",
            policy=policy,
            max_context_tokens=limit, arrival_time_s=time.monotonic(),
            extra={"slo_class": spec.slo_class.value, "ttft_slo_ms": str(spec.ttft_slo_ms),
                   "min_tokens_per_s": str(spec.min_tokens_per_s), "weight": str(spec.weight),
                   "kv_quota_bytes": str(spec.kv_quota_bytes)},
        )
        return req, hashes

    async def Generate(self, request, context) -> AsyncIterator[inference_pb2.GenerateResponse]:  # noqa: N802
        """Stream one request's events. Its ``request_id`` (client-chosen, or minted here) and
        ``session_id`` are the tenant's own: another tenant's equal ids name other requests and
        sessions; a request id in flight already for this tenant is ALREADY_EXISTS."""
        tenant = await self.auth.tenant(context)
        req, hashes = await self._prepare(request, tenant, context)
        client_id = req.request_id.split("/", 1)[1]
        try:
            queue = self.streams.open(req.request_id)
        except KeyError:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {client_id!r} is in flight already")
        adm = None
        usage: dict[str, Any] | None = None
        seen = _Seen()  # the usage of a request that ends without its finished event
        # the scheduler hands an admitted request straight to its node; every answer from the
        # node, a refusal included, comes back on this gateway's event inbox
        admission = asyncio.ensure_future(self.streams.admit(req, hashes))
        try:
            # headers now, while admission and prefill run, not with the first token
            await context.send_initial_metadata(())
            try:  # shielded: a cancelled call still learns where its request went, to abort it
                adm = await asyncio.shield(admission)
            except (RuntimeError, asyncio.TimeoutError) as exc:
                usage = {}
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) or "the global scheduler did not answer")
            if adm.code != "OK":
                usage = {}
                if adm.retry_after_s:
                    context.set_trailing_metadata((("retry-after-ms", str(int(adm.retry_after_s * 1000))),))
                await context.abort(_CODES[adm.code], adm.message)
            self.streams.bind(req.request_id, adm.node_id)
            while usage is None:
                event = await queue.get()
                seen.observe(event)
                if event["type"] == "error":
                    usage = {}
                    await context.abort(_CODES[event["code"]], event["message"])
                if event["type"] == "finished":
                    usage = event
                if event["type"] == "started":
                    event = {**event, "request_id": client_id}
                yield convert.generate_event_to_pb(event)
        finally:
            self.streams.close(req.request_id)
            if not usage:  # interrupted: what it ran counts too, events already here included
                while not queue.empty():
                    seen.observe(queue.get_nowait())
            if usage is None:  # cancelled or past its deadline
                if adm is None:  # while being admitted: abort once the node is known
                    asyncio.get_running_loop().create_task(self._abort_admitted(admission, req.request_id))
                else:
                    self.streams.abort(adm.node_id, req.request_id)
            if adm is None or adm.code == "OK":
                self.scheduler.release.remote(req.request_id, usage or seen.usage())

    async def _abort_admitted(self, admission: Any, request_id: str) -> None:
        try:
            adm = await admission
        except Exception:  # noqa: BLE001 - nothing was admitted, nothing runs
            return
        if adm.code == "OK":
            self.streams.abort(adm.node_id, request_id)

    async def CloseSession(self, request, context):  # noqa: N802
        """Close the caller's session ``session_id`` (another tenant's equal id is another
        session); NOT_FOUND when the caller has none by that id."""
        tenant = await self.auth.tenant(context)
        session_id = scoped_id(tenant.tenant_id, request.session_id)
        node_id = await self.scheduler.close_session.remote(session_id, tenant.tenant_id)
        freed = -1 if node_id is None else await self.nodes[node_id].close_session.remote(
            session_id, tenant.tenant_id
        )
        if freed < 0:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r} for this tenant")
        return inference_pb2.CloseSessionResponse(freed_tokens=freed)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Operator calls. A node the ``monitor`` (``services.node_monitor``) knows down is not
    asked (Stats lists it with ``healthy`` false and why; Flush and Drain skip it: its KV and
    requests died with it), and a node that does not answer within ``node_timeout_s`` counts
    as down for that call."""

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 monitor: Any = None, node_timeout_s: float = 30.0) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self.monitor, self.node_timeout_s = monitor, node_timeout_s

    def _live(self) -> dict[str, Any]:
        if self.monitor is None:
            return dict(self.nodes)
        return {nid: n for nid, n in self.nodes.items() if self.monitor.state[nid].healthy}

    async def _ask_live(self, call: Any, extra_s: float = 0.0) -> dict[str, Any]:
        """node id -> ``call(node)`` awaited, for every live node; an exception in place of the
        answer of a node that failed or did not answer within ``node_timeout_s + extra_s``."""
        live = self._live()
        answers = await asyncio.gather(
            *(asyncio.wait_for(call(n), self.node_timeout_s + extra_s) for n in live.values()),
            return_exceptions=True,
        )
        return dict(zip(live, answers))

    async def Stats(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        answers = await self._ask_live(
            lambda n: n.integrity_stats.remote() if request.check_integrity else n.stats.remote())
        node_stats = []
        for nid in self.nodes:
            answer = answers.get(nid)
            if isinstance(answer, dict):
                node_stats.append(answer)
            else:
                why = self.monitor.state[nid].failure if answer is None else f"no answer: {_message(answer)}"
                node_stats.append({"node_id": nid, "healthy": False, "failure": why})
        sched = await self.scheduler.stats.remote()
        health = self.monitor.snapshot() if self.monitor is not None else {}
        return admin_pb2.StatsResponse(
            nodes=[convert.node_stats_to_pb(s) for s in node_stats], queued=sched["queued"],
            sessions=sched["sessions"],
            stats_json=json.dumps({"scheduler": sched, "nodes": node_stats, "health": health}),
        )

    async def Flush(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        answers = await self._ask_live(lambda n: n.flush.remote())
        freed = [a for a in answers.values() if isinstance(a, int)]
        await self.scheduler.flush_index.remote()
        return admin_pb2.FlushResponse(freed_blocks=sum(freed))

    async def Drain(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be >= 0 seconds, got {timeout_s}")
        # running requests get timeout_s to finish, then the rest are aborted (CacheNode.drain)
        answers = await self._ask_live(lambda n: n.drain.remote(timeout_s), extra_s=timeout_s)
        return admin_pb2.DrainResponse(aborted=sum(a for a in answers.values() if isinstance(a, int)))

    async def RotateAdminKey(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        key = await self.scheduler.rotate_admin_key.remote()
        self.auth.forget()
        return admin_pb2.RotateAdminKeyResponse(api_key=key)
