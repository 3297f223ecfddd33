"""gRPC servicers: thin translation between protobuf and the Ray services.

Each servicer authenticates, converts (services.convert), delegates to the GlobalScheduler or
a CacheNode actor, and maps failures to precise status codes for that call alone.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from cache_node.hashing import hash_prompt_blocks
from kvstrata.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from services import convert
from services.auth import Authenticator
from services.chat import ChatTemplater
from services.node_request import NodeRequest
from tenants.errors import TenantExistsError, TenantNotFoundError

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


class NodeStreams:
    """Per-request event queues fed by one long-poll loop per cache node.

    A node posts each engine step's events for this gateway into one mailbox and
    ``CacheNode.poll`` returns them together, so ``n`` concurrent streams cost one actor call
    per step instead of ``n`` streamed Ray objects (bench.service measures the difference).
    When a node cannot be reached, every stream open on it gets an UNAVAILABLE error event.

    Args:
        nodes: node id -> CacheNode actor handle.
        poll_timeout_s: how long one poll waits on an idle node before returning empty.
    """

    def __init__(self, nodes: dict[str, Any], poll_timeout_s: float = 1.0) -> None:
        self.nodes, self.poll_timeout_s = nodes, poll_timeout_s
        self.subscriber = f"gateway-{uuid.uuid4().hex[:12]}"
        self._queues: dict[str, tuple[str, asyncio.Queue[dict[str, Any]]]] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}

    def open(self, request_id: str) -> asyncio.Queue[dict[str, Any]]:
        """A queue for ``request_id``'s events; open it before the request reaches a node."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = ("", queue)
        for node_id in self.nodes:  # every node is polled while any stream is open
            pump = self._pumps.get(node_id)
            if pump is None or pump.done():
                self._pumps[node_id] = asyncio.get_running_loop().create_task(self._pump(node_id))
        return queue

    def bind(self, request_id: str, node_id: str) -> None:
        """Record the node serving ``request_id`` (its failure ends this stream)."""
        entry = self._queues.get(request_id)
        if entry is not None:
            self._queues[request_id] = (node_id, entry[1])

    def close(self, request_id: str) -> None:
        """Stop routing ``request_id``'s events (later ones are dropped)."""
        self._queues.pop(request_id, None)

    async def _pump(self, node_id: str) -> None:
        node = self.nodes[node_id]
        while True:
            try:
                batch = await node.poll.remote(self.subscriber, self.poll_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a dead or unreachable node ends its streams
                for nid, queue in list(self._queues.values()):
                    if nid == node_id:
                        queue.put_nowait({"type": "error", "code": "UNAVAILABLE",
                                          "message": f"cache node {node_id}: {_message(exc)}"})
                await asyncio.sleep(self.poll_timeout_s)
                continue
            for request_id, event in batch:
                entry = self._queues.get(request_id)
                if entry is not None:
                    entry[1].put_nowait(event)


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Generate (server streaming) and CloseSession.

    Args:
        nodes: node id -> CacheNode actor handle.
        node_info: ``CacheNode.describe()`` of any node (model identity, block size, limits).
    """

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 node_info: dict[str, Any], templater: ChatTemplater | None) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self.info, self.templater = node_info, templater
        self.streams = NodeStreams(nodes)

    async def _prepare(self, request: Any, tenant: Any, context: Any) -> tuple[NodeRequest, list[bytes]]:
        spec = tenant.spec
        try:
            sampling = convert.sampling_params_from_pb(request.sampling)
            prompt = convert.prompt_from_pb(request)
            _check_policy(request.policy or spec.policy)
        except (ValueError, KeyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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
            request_id=request.request_id or uuid.uuid4().hex, tenant=tenant.tenant_id,
            cache_namespace=spec.cache_namespace, sampling=sampling, messages=messages, token_ids=tokens,
            session_id=request.session_id, policy=request.policy or spec.policy,
            max_context_tokens=limit, arrival_time_s=time.monotonic(),
            extra={"slo_class": spec.slo_class.value, "ttft_slo_ms": str(spec.ttft_slo_ms),
                   "min_tokens_per_s": str(spec.min_tokens_per_s), "weight": str(spec.weight),
                   "kv_quota_bytes": str(spec.kv_quota_bytes)},
        )
        return req, hashes

    async def Generate(self, request, context) -> AsyncIterator[inference_pb2.GenerateResponse]:  # noqa: N802
        tenant = await self.auth.tenant(context)
        req, hashes = await self._prepare(request, tenant, context)
        # headers now, while admission and prefill run, not with the first token
        await context.send_initial_metadata(())
        queue = self.streams.open(req.request_id)
        adm = None
        usage: dict[str, Any] | None = None
        # the scheduler hands an admitted request straight to its node; every answer from the
        # node, a refusal included, comes back through that node's poll
        admission = self.scheduler.admit_and_submit.remote(req, self.streams.subscriber, hashes)
        try:
            adm = await admission
            if adm.code != "OK":
                usage = {}
                if adm.retry_after_s:
                    context.set_trailing_metadata((("retry-after-ms", str(int(adm.retry_after_s * 1000))),))
                await context.abort(_CODES[adm.code], adm.message)
            self.streams.bind(req.request_id, adm.node_id)
            while usage is None:
                event = await queue.get()
                if event["type"] == "error":
                    usage = {}
                    await context.abort(_CODES[event["code"]], event["message"])
                if event["type"] == "finished":
                    usage = event
                yield convert.generate_event_to_pb(event)
        finally:
            self.streams.close(req.request_id)
            if usage is None:  # cancelled or past its deadline
                if adm is None:  # while being admitted: abort once the node is known
                    asyncio.get_running_loop().create_task(self._abort_admitted(admission, req.request_id))
                else:
                    self.nodes[adm.node_id].abort.remote(req.request_id)
            if adm is None or adm.code == "OK":
                self.scheduler.release.remote(req.request_id, usage)

    async def _abort_admitted(self, admission: Any, request_id: str) -> None:
        try:
            adm = await admission
        except Exception:  # noqa: BLE001 - nothing was admitted, nothing runs
            return
        if adm.code == "OK":
            self.nodes[adm.node_id].abort.remote(request_id)

    async def CloseSession(self, request, context):  # noqa: N802
        tenant = await self.auth.tenant(context)
        node_id = await self.scheduler.close_session.remote(request.session_id, tenant.tenant_id)
        freed = -1 if node_id is None else await self.nodes[node_id].close_session.remote(
            request.session_id, tenant.tenant_id
        )
        if freed < 0:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r} for this tenant")
        return inference_pb2.CloseSessionResponse(freed_tokens=freed)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any]) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes

    async def Stats(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        node_stats = await asyncio.gather(
            *(n.stats.remote(request.check_integrity) for n in self.nodes.values())
        )
        sched = await self.scheduler.stats.remote()
        return admin_pb2.StatsResponse(
            nodes=[convert.node_stats_to_pb(s) for s in node_stats], queued=sched["queued"],
            sessions=sched["sessions"], stats_json=json.dumps({"scheduler": sched, "nodes": node_stats}),
        )

    async def Flush(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        freed = await asyncio.gather(*(n.flush.remote() for n in self.nodes.values()))
        await self.scheduler.flush_index.remote()
        return admin_pb2.FlushResponse(freed_blocks=sum(freed))

    async def Drain(self, request, context):  # noqa: N802
        await self.auth.admin(context)
        aborted = await asyncio.gather(*(n.drain.remote() for n in self.nodes.values()))
        return admin_pb2.DrainResponse(aborted=sum(aborted))
