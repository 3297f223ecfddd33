"""The gRPC server, the OpenAI-compatible HTTP server beside it (``services.openai_api``), and
the Gateway Ray actor that hosts both on one event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_node.model_files import DEFAULT_MODEL, cache_dir
from kvstrata.v1 import admin_pb2_grpc, inference_pb2_grpc, tenant_pb2_grpc
from services import scheduler_replies as replies
from services.actor_calls import SCHEDULER_CALL_TIMEOUT_S, BoundedActor
from services.actor_refs import resolve
from services.auth import Authenticator
from services.chat import ChatTemplater, encode_text
from services.data_plane_auth import Security
from services.gateway import InferenceServicer
from services.gateway_admin import AdminServicer, TenantServicer
from services.gateway_render import GatewayTemplater
from services.gateway_served import API_NAMES, ServedRecord, prune_dead
from services.gateway_stream_bounds import StreamLimits
from services.gateway_streams import NodeStreams
from services.grpc_bounds import GrpcLimits
from services.grpc_call_gate import BoundedHealthServicer, CallGate
from services.metrics import GatewayMetrics, MetricsEndpoint, MetricsServer
from services.node_monitor import NodeMonitor
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.connections import ConnectionLimits
from services.openai_api.context import BodyLimits
from services.openai_api.logprobs import TokenTexts
from services.tls import ServerTls, warn_cleartext

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CONCURRENT_STREAMS = 256
"""HTTP/2 streams (calls) one client connection may have open at once (the server's
``SETTINGS_MAX_CONCURRENT_STREAMS``; a gRPC client queues calls past it). Regression (security
review B): it was unbounded, so one connection could hold any number of unread streams
(each tenant's are bounded again by ``StreamLimits.max_streams_per_tenant``)."""

DESCRIBE_TIMEOUT_S = 30.0
"""The most ``Gateway.start`` waits for a cache node's ``describe``: a node silent past it is
down from the start (the ``NodeMonitor`` rejoins it when it answers), not a start that waits
for it for ever (review s34 B F4)."""

SERVICE_NAMES = ("", "kvstrata.v1.InferenceService", "kvstrata.v1.TenantService", "kvstrata.v1.AdminService")
"""gRPC health names: the server overall and each service; all SERVING while a node is healthy.
Health/Watch answers only these (``BoundedHealthServicer``)."""

ADMIN_METHODS = frozenset(
    [f"/kvstrata.v1.AdminService/{m}" for m in ("Stats", "Flush", "Drain", "RotateAdminKey")]
    + [f"/kvstrata.v1.TenantService/{m}" for m in ("RegisterTenant", "UpdateTenant", "DeleteTenant", "ListTenants")])
"""Methods only the admin key may call: a call of one with a missing or unknown key is refused
at its headers with the admin refusal's message (``CallGate``), as its handler would."""

TENANT_METHODS = frozenset(f"/kvstrata.v1.InferenceService/{m}" for m in ("Generate", "CloseSession"))
"""Methods only a tenant's key may call (their handlers check ``Authenticator.tenant``; the other
TenantService methods take the admin key too): ``CallGate`` checks a key so before refusing a
malformed message, as the handler would before a well-formed one's fields."""


async def create_server(
    scheduler: Any, nodes: dict[str, Any], node_info: dict[str, dict[str, Any]],
    templater: ChatTemplater | None, scheduler_address: str, address: str = "127.0.0.1:0",
    security: Security | None = None, metrics: GatewayMetrics | None = None,
    stream_limits: StreamLimits | None = None, grpc_limits: GrpcLimits | None = None,
    credentials: grpc.ServerCredentials | None = None, scheduler_timeout_s: float = SCHEDULER_CALL_TIMEOUT_S,
    tool_call_parser: str = "", down_nodes: dict[str, str] | None = None,
) -> tuple[grpc.aio.Server, int, BoundedHealthServicer, InferenceServicer, NodeMonitor]:
    """Build the server with every service registered, the data plane connected and the
    nodes watched (on the running loop). Returns (server, bound port, health, the inference
    servicer, whose ``streams`` is the gateway's data plane, the node monitor, which keeps
    ``health`` SERVING while a node is healthy and NOT_SERVING while none is).

    Args:
        node_info: node id -> ``CacheNode.describe()``, for the nodes that answered it (at
            least one); the others are in ``down_nodes``.
        scheduler_address: the GlobalScheduler's admission socket (``open_data_plane``).
        security: the gateway's data-plane identity (``services.data_plane_auth``).
        metrics: the request metrics ``Generate`` observes (``services.metrics.requests``).
        stream_limits: what clients that read slowly or not at all may hold (None: the defaults).
        grpc_limits: the gRPC connections' bounds and those of calls not yet running (None: the
            defaults). Regression (secrev19 H4/H5): connections that completed the handshake
            and sent nothing were held forever with no cap, and calls that sent headers alone
            were held before any key check with no deadline (``services.grpc_call_gate``).
        credentials: serve TLS with these (``services.tls.ServerTls.grpc_credentials``); None:
            plaintext.
        scheduler_timeout_s: the most any of the gateway's calls waits for the scheduler's answer
            (``services.actor_calls.BoundedActor``; past it UNAVAILABLE with a retry hint).
        tool_call_parser: how ``Generate`` reads tool_choice "auto"'s calls ("": off, "auto"
            refused; ``InferenceServicer``).
        down_nodes: node id -> why it is down from the start (its ``describe`` did not answer
            in time or failed: ``Gateway.start``); the ``NodeMonitor`` holds it down, its
            streams UNAVAILABLE, until its health poll rejoins it.
    """
    grpc_limits = grpc_limits or GrpcLimits()
    scheduler = BoundedActor(scheduler, scheduler_timeout_s)  # every awaited call within it (review 29a F2)
    auth = Authenticator(scheduler)
    server = grpc.aio.server(options=grpc_limits.server_options(MAX_CONCURRENT_STREAMS),
                             interceptors=[CallGate(auth, grpc_limits, ADMIN_METHODS, TENANT_METHODS)])
    inference = InferenceServicer(scheduler, auth, nodes, node_info, templater, scheduler_address, security,
                                  metrics, stream_limits, tool_call_parser)
    await inference.streams.start()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(inference, server)
    health = BoundedHealthServicer(SERVICE_NAMES, grpc_limits.max_health_watchers)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    # the monitor bounds each of its calls itself, and must reach a scheduler it holds silent
    monitor = NodeMonitor(nodes, node_info, inference.streams, scheduler.handle,
                          on_change=lambda healthy: asyncio.ensure_future(set_health(health, healthy > 0)),
                          down=down_nodes)
    scheduler.silent = monitor.scheduler_silence  # known silent: calls fail at once (trial 29k P5)
    tenant_pb2_grpc.add_TenantServiceServicer_to_server(
        TenantServicer(scheduler, auth, nodes, monitor, metrics=inference.metrics), server)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(
        scheduler, auth, nodes, monitor, key_staleness_max_s=inference.limits.key_staleness_max_s), server)
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError:  # grpc raises, or returns 0, when the address is taken
        port = 0
    if port == 0:
        inference.streams.shutdown()
        raise OSError(f"could not bind the gateway to {address}")
    monitor.start()
    return server, port, health, inference, monitor


async def set_health(health: BoundedHealthServicer, serving: bool) -> None:
    """Every name in ``SERVICE_NAMES`` SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in SERVICE_NAMES:
        await health.set(name, status)


class Gateway:
    """Hosts the gRPC server, and the OpenAI-compatible HTTP server on the same host, inside a
    Ray actor (one per ingress node)."""

    def __init__(self, scheduler: Any, nodes: dict[str, Any], model_path: str | None = None,
                 security: Security | None = None, metrics: MetricsEndpoint | None = None,
                 http_port: int | None = None, http_forwarded_allow_ips: list[str] | None = None,
                 http_limits: ConnectionLimits | None = None, stream_limits: StreamLimits | None = None,
                 grpc_limits: GrpcLimits | None = None, body_limits: BodyLimits | None = None,
                 tls: ServerTls | None = None, tool_call_parser: str = "") -> None:
        """``security``: the gateway's data-plane identity (``services.data_plane_auth``);
        ``metrics``: where ``start`` serves its Prometheus ``/metrics`` (None: nowhere);
        ``http_port``: where the OpenAI-compatible API listens (0: any free port; None: off);
        ``http_forwarded_allow_ips``: proxies trusted to set its client address (``HttpServer``);
        ``http_limits``: its connections' bounds (None: ``ConnectionLimits``' defaults);
        ``stream_limits``: what both APIs' slow or idle readers may hold (None: ``StreamLimits``'
        defaults); ``grpc_limits``: the gRPC connections' bounds (None: ``GrpcLimits``' defaults);
        ``body_limits``: the HTTP request body bytes read at once, per tenant and in all (None:
        ``BodyLimits``' defaults); ``tls``: the certificate both APIs serve TLS with (its files
        read at each start; None: plaintext, with a warning on a non-loopback host);
        ``tool_call_parser``: how both APIs read tool_choice "auto"'s calls ("": off;
        ``OpenAIEdge``, ``InferenceServicer``)."""
        self.scheduler, self.nodes, self.model_path = scheduler, nodes, model_path
        self.tls, self.tool_call_parser = tls, tool_call_parser
        self.security, self.http_port = security, http_port
        self.http_forwarded_allow_ips, self.http_limits = http_forwarded_allow_ips, http_limits
        self.stream_limits, self.grpc_limits, self.body_limits = stream_limits, grpc_limits, body_limits
        self.http: HttpServer | None = None
        self.metrics, self.metrics_endpoint = GatewayMetrics(), metrics
        self.metrics_server: MetricsServer | None = None
        self.server: grpc.aio.Server | None = None
        self.streams: NodeStreams | None = None
        self.inference: InferenceServicer | None = None  # each start's own (its tokenizer threads)
        self.monitor: NodeMonitor | None = None
        self.templater: GatewayTemplater | None = None  # (its render children end with ``stop``)
        self._grpc_started = False
        # the gateway's own awaited calls to the scheduler, each within its deadline (review s34 B F4)
        self.scheduler_calls = BoundedActor(scheduler)
        self.describe_timeout_s = DESCRIBE_TIMEOUT_S

    async def start(self, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                    metrics_port: int | None = None) -> int:
        """Serve gRPC on ``host:port`` (0: any free port), and beside it the OpenAI-compatible
        API and ``/metrics`` when configured; returns the bound gRPC port. ``http_port`` and
        ``metrics_port``, when given, take the place of the configured ports this time (a
        restarted gateway's old ones); ignored for an API that is off.

        All or nothing: when a step after the gRPC bind fails, what the earlier steps made
        (gRPC server, ``NodeStreams``, ``NodeMonitor``, HTTP and metrics servers) is stopped
        and its ports freed before the error is raised, so that a retry can bind them again.

        Not every node is needed: one whose ``describe`` does not answer within
        ``describe_timeout_s`` (alive but silent, or being restarted by Ray, which queues calls
        to it meanwhile) or fails is down from the start (``_describe_nodes``): its streams
        UNAVAILABLE, and the ``NodeMonitor`` rejoins it when its health poll answers, as a node
        that went down while serving. The scheduler's ``open_data_plane`` is bounded too
        (``scheduler_calls``: ``ActorSilent`` past ``SCHEDULER_CALL_TIMEOUT_S``).

        Raises:
            OSError: a port is taken. RuntimeError: the HTTP server did not come up, or no
                node answered ``describe``. ValueError: a TLS file cannot be read or is not
                what it should be (before anything is bound). ActorSilent: the scheduler did
                not answer in time. scheduler_replies.MalformedReply: its ``open_data_plane``
                reply is no ``tcp://host:port`` (logged by the caller; a restarted gateway's
                ``_serve_again`` retries, then exits). Any failure of the scheduler's calls.

        Regression (review s34 B F4): ``describe`` and ``open_data_plane`` were awaited with no
        deadline, so one silent cache node (or a silent scheduler) kept a restarting gateway
        from ever serving, and from exiting for Ray to restart it (``_serve_again``).

        Regression (review 23b F3): a failed HTTP start left the gRPC port bound (and a
        NodeMonitor polling and NodeStreams reading), so every retry of a restarted gateway
        failed on its own gRPC port and it never served again."""
        credentials = self.tls.grpc_credentials() if self.tls is not None else None
        if self.tls is None:
            warn_cleartext(host, "the gateway's gRPC and OpenAI-compatible APIs")
        infos, down = await self._describe_nodes()
        scheduler_address = replies.data_address(  # (untrusted: a malformed reply fails this start)
            "open_data_plane", await self.scheduler_calls.open_data_plane.remote())
        for node_id, reason in down.items():
            # the scheduler stops routing there before this gateway serves: a request of its
            # admitted to a node it holds no command socket for could be neither watched nor
            # aborted, and would run unseen (diff review s34 F5: the monitor's one 1-s try, sent
            # after serving began, left the scheduler routing there)
            await self.scheduler_calls.node_down.remote(node_id=node_id, reason=reason)
        from transformers import AutoTokenizer  # (see RayGateway.__init__)

        path = self.model_path or str(cache_dir() / DEFAULT_MODEL)  # nodes converted it already
        tokenizer = AutoTokenizer.from_pretrained(path)
        # large chats render in its children, small ones here (``services.gateway_render``)
        templater = self.templater = GatewayTemplater(tokenizer) if tokenizer.chat_template else None
        if templater is not None:  # computed once, here, not on the event loop of a first call
            _ = templater.max_token_chars, templater.conversation_overhead
        self.server, bound, health, inference, self.monitor = await create_server(
            self.scheduler, self.nodes, infos, templater, scheduler_address,
            f"{host}:{port}", self.security, self.metrics, self.stream_limits, self.grpc_limits, credentials,
            tool_call_parser=self.tool_call_parser, down_nodes=down,
        )
        self.streams, self.inference, self._grpc_started = inference.streams, inference, False
        try:
            if self.http_port is not None:
                await self._start_http(host, self.http_port if http_port is None else http_port, inference,
                                       self.monitor.num_healthy, next(iter(infos.values())), tokenizer,
                                       templater)
            if self.metrics_endpoint is not None and self.metrics_server is None:
                endpoint = self.metrics_endpoint
                if metrics_port is not None:
                    endpoint = dataclasses.replace(endpoint, port=metrics_port)
                self.metrics_server = MetricsServer(self.metrics.registry, endpoint)
            await self.server.start()
            self._grpc_started = True
            await set_health(health, self.monitor.num_healthy() > 0)
        except BaseException:
            await self._unwind(health)
            raise
        return bound

    async def _describe_nodes(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Each node's ``describe()``, asked at once, each within ``describe_timeout_s``.
        Returns (node id -> its answer, for those that answered; node id -> why it is down,
        for the others: no answer in time, or the call failed).

        Raises:
            RuntimeError: no node answered (naming why, for each).
        """
        async def ask(node: Any) -> Any:
            return await node.describe.remote()

        answers = await asyncio.gather(*(asyncio.wait_for(ask(node), self.describe_timeout_s)
                                         for node in self.nodes.values()), return_exceptions=True)
        infos: dict[str, dict[str, Any]] = {}
        down: dict[str, str] = {}
        for node_id, answer in zip(self.nodes, answers):
            if isinstance(answer, asyncio.TimeoutError):
                down[node_id] = (f"cache node {node_id} did not answer describe within {self.describe_timeout_s:g} s "
                                 "when the gateway started")
            elif isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer  # a cancel (``_serve_again``'s deadline): not the node's fault
                down[node_id] = (f"cache node {node_id}: describe failed when the gateway started: "
                                 f"{type(answer).__name__}: {str(answer).strip()[:200]}")
            else:
                infos[node_id] = answer
        if not infos:
            raise RuntimeError(f"no cache node answered describe: {'; '.join(down.values())}")
        for reason in down.values():
            log.warning("gateway: starting without it: %s", reason)
        return infos, down

    async def _start_http(self, host: str, port: int, inference: InferenceServicer, num_healthy: Callable[[], int],
                          info: dict[str, Any], tokenizer: Any, templater: ChatTemplater | None) -> None:
        """The OpenAI-compatible API on ``host:port`` (``info``: a node's ``describe()``)."""
        room = min(info["max_model_len"], info["pool_tokens"])

        def encode(text: str) -> list[int]:  # a text that can never fit is refused untokenized
            if templater is not None:
                templater.check_fits(len(text), room)
            return encode_text(tokenizer, text)
        self.http = HttpServer(create_app(OpenAIEdge(inference, info["model_id"], encode,
                                                     num_healthy, self.body_limits, TokenTexts(tokenizer),
                                                     self.tool_call_parser,
                                                     lambda: self.monitor.spill_down if self.monitor else {})),
                               self.http_forwarded_allow_ips, self.http_limits, self.tls)
        await self.http.start(host, port)
        self.metrics.watch_http(lambda: self.http.guard if self.http is not None else None)
        self.metrics.watch_spill(lambda: self.monitor.spill_down if self.monitor is not None else {},
                                 lambda: self.monitor.spill_recreations if self.monitor is not None else {})

    async def _unwind(self, health: BoundedHealthServicer) -> None:
        """Stop what a failed ``start`` made and free its ports. grpc.aio frees the port of a
        server only when a started one stops (``stop`` of one never started keeps the port
        bound for the life of the process), so one not started yet is started first, for that
        instant, its ``health`` NOT_SERVING."""
        if self.server is not None and not self._grpc_started:
            try:
                await set_health(health, False)
                await self.server.start()
            except Exception:  # stopping anyway
                log.warning("gateway: starting the half-made gRPC server to free its port failed", exc_info=True)
        await self.stop(0)

    async def serves(self, subscriber: str, wait_s: float = 0.0) -> bool:
        """Whether this gateway's event inbox is ``subscriber``, answered after ``wait_s``
        seconds (the scheduler's long poll: a killed gateway's call fails, a restarted one says
        False, and either way the scheduler releases what the old one admitted)."""
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        return self.streams is not None and self.streams.subscriber == subscriber

    def node_ip(self) -> str:
        """The address of the Ray node this gateway runs on (``services.launcher.Services``
        dials it for a wildcard bind when that is not the driver's machine)."""
        return ray.util.get_node_ip_address()

    def http_address(self) -> str:
        """``host:port`` of the OpenAI-compatible API ("" when it is off)."""
        return self.http.address if self.http is not None else ""

    def metrics_address(self) -> str:
        """``host:port`` of this gateway's ``/metrics`` ("" when it serves none)."""
        return self.metrics_server.address if self.metrics_server is not None else ""

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace_s`` seconds) and drop what was served."""
        if self.monitor is not None:
            await self.monitor.aclose()
        if self.http is not None:
            await self.http.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.streams is not None:
            self.streams.shutdown()
        if self.inference is not None:  # its tokenizer threads (a later start makes its own)
            self.inference.close()
        if self.templater is not None:  # no render starts a child from now on (diff review s35 R5)
            self.templater.close()
        self.http, self.metrics_server, self.monitor, self.server, self.streams = None, None, None, None, None
        self.inference = None
        self.templater = None


RESTART_BIND_TRIES = 20
"""Tries to serve again after a restart (``RESTART_RETRY_S`` apart), while the OS frees the ports."""
RESTART_RETRY_S = 0.25
"""Pause between two of those tries."""
RESTART_TRY_TIMEOUT_S = 150.0
"""The most one of those tries may take (past it, it is a failed try): each call in it has its
own deadline (``DESCRIBE_TIMEOUT_S``, ``SCHEDULER_CALL_TIMEOUT_S``), this bounds the whole, so
a silent dependency counts as a failed try and, finally, as the exit Ray restarts."""


class RayGateway(Gateway):
    """The gateway as a Ray actor (``max_restarts``). It tells the GlobalScheduler where it
    serves and its event inbox (``attach_gateway``; the scheduler watches it and releases what
    a dead one admitted), and when Ray restarts it after a crash it serves again on its old
    ``host:port`` by itself, with a new event inbox (tenants, keys and usage live in the
    scheduler). Calls in flight when it died fail; clients reconnect to the same address."""

    def __init__(self, scheduler: Any, nodes: dict[str, Any], model_path: str | None = None,
                 security: Security | None = None, metrics: MetricsEndpoint | None = None,
                 http_port: int | None = None, http_forwarded_allow_ips: list[str] | None = None,
                 http_limits: ConnectionLimits | None = None, stream_limits: StreamLimits | None = None,
                 grpc_limits: GrpcLimits | None = None, body_limits: BodyLimits | None = None,
                 tls: ServerTls | None = None, tool_call_parser: str = "") -> None:
        super().__init__(scheduler, nodes, model_path, security, metrics, http_port, http_forwarded_allow_ips,
                         http_limits, stream_limits, grpc_limits, body_limits, tls, tool_call_parser)
        # its tokenizer's module (transformers and torch: seconds on a loaded host) imported now,
        # while the cache nodes load their models, not in ``start``: this module imports neither,
        # for the launcher (``kvstrata up``) imports it for ``GatewayActor``
        from transformers import AutoTokenizer  # noqa: F401
        # ActorRefs (the launcher's): looked up on each (re)start, before _serve_again needs them
        self.scheduler = resolve(self.scheduler)
        # every awaited call of its own within SCHEDULER_CALL_TIMEOUT_S (ActorSilent past it): a
        # silent scheduler fails start, _start_again, _attach_again, never holds them for ever
        # (review s34 B F4). Not ``silent``-wired: _scheduler_back must reach one held silent.
        self.scheduler_calls = BoundedActor(self.scheduler)
        self.nodes = {nid: resolve(node) for nid, node in self.nodes.items()}
        context = ray.get_runtime_context()
        self.gateway_id = context.get_actor_id()
        # where it served, kept by itself (Ray's GCS): for a restart the scheduler's record misses
        self.served_record = ServedRecord(self.gateway_id)
        self.restarted: asyncio.Task[int] | None = None
        self.served_address = ""  # host:port, once started
        self._reattaching: asyncio.Task[bool] | None = None
        self._pruning: asyncio.Task[None] | None = None  # (held: a task none holds may be collected)
        if context.was_current_actor_reconstructed:  # the constructor runs on the actor's loop
            self.restarted = asyncio.get_running_loop().create_task(self._serve_again())

    async def start(self, host: str = "127.0.0.1", port: int = 0, http_port: int | None = None,
                    metrics_port: int | None = None) -> int:
        """``Gateway.start``, then tell the scheduler where it serves (``attach_gateway``,
        ``attach_gateway_apis``); returns the gRPC port. All or nothing, as ``Gateway.start``:
        when the scheduler's calls fail, the gateway stops.

        The launcher's call: a restart task still trying (``_serve_again``: Ray restarted this
        gateway before it served, while the nodes loaded) is cancelled first, so the two do
        not race for the ports (review s37 r4 F3)."""
        if self.restarted is not None and not self.restarted.done():
            self.restarted.cancel()
            await asyncio.wait([self.restarted])  # its try stopped what it made (all or nothing)
        return await self._serve(host, port, http_port, metrics_port)

    async def _serve(self, host: str, port: int, http_port: int | None, metrics_port: int | None) -> int:
        """``start`` without cancelling the restart task (whose try this may be)."""
        bound = await super().start(host, port, http_port, metrics_port)
        try:
            self.served_address = f"{host}:{bound}"
            subscriber = self.streams.subscriber if self.streams is not None else ""
            await self.scheduler_calls.attach_gateway.remote(
                gateway_id=self.gateway_id, address=self.served_address, subscriber=subscriber,
                handle=ray.get_runtime_context().current_actor)
            await self.scheduler_calls.attach_gateway_apis.remote(gateway_id=self.gateway_id, http_address=self.http_address(),
                                                            metrics_address=self.metrics_address())
            await _within(self.served_record.save(
                {"grpc": self.served_address, "http": self.http_address(), "metrics": self.metrics_address()}),
                SCHEDULER_CALL_TIMEOUT_S, "keeping the served addresses")
        except BaseException:
            await self.stop(0)
            raise
        if self.streams is not None:
            self.streams.on_gone = self.reattach
            self.streams.ask_admitted = self._admitted  # its streams the scheduler released end (``reconcile``)
        if self.monitor is not None:  # the scheduler Ray restarted rebuilt its state: attach to it
            self.monitor.on_scheduler_back = self._scheduler_back
        # records of gateways that died for good on their own (no down/stop deleted them): off
        # the start's path, in a worker thread (GCS round trips)
        self._pruning = asyncio.get_running_loop().create_task(self._prune_dead_records())
        return bound

    async def _prune_dead_records(self) -> None:
        """``gateway_served.prune_dead``; a failure is logged (what it left is tried again at
        the next gateway start)."""
        try:
            await asyncio.to_thread(prune_dead)
        except Exception as exc:  # noqa: BLE001 - housekeeping: never the start's failure
            log.warning("gateway %s: pruning dead gateways' records failed: %s", self.gateway_id, exc)

    async def _scheduler_back(self) -> None:
        """The scheduler answers again after it was unreachable (Ray restarted it, or the link
        broke): attach again (a restarted one knows no gateway: ``attach_gateway``,
        ``attach_gateway_apis``), and tell it which requests this gateway still waits for
        (``reconcile_gateway``: it releases the others it rebuilt, ended while it was down)."""
        subscriber = self.streams.subscriber if self.streams is not None else ""
        await self.scheduler_calls.attach_gateway.remote(
            gateway_id=self.gateway_id, address=self.served_address, subscriber=subscriber,
            handle=ray.get_runtime_context().current_actor)
        await self.scheduler_calls.attach_gateway_apis.remote(
            gateway_id=self.gateway_id, http_address=self.http_address(), metrics_address=self.metrics_address())
        open_requests = self.streams.open_request_ids() if self.streams is not None else []
        await self.scheduler_calls.reconcile_gateway.remote(subscriber=subscriber, open_requests=open_requests)

    async def reattach(self) -> bool:
        """Attach to the scheduler again with this gateway's inbox, after it refused one of its
        admissions ``gateway_gone`` (it counted this live gateway as gone: its watch of it
        failed); concurrent refusals share one call. True once attached.

        Regression: a live gateway counted as gone had every request refused for as long as
        it ran."""
        if self._reattaching is None or self._reattaching.done():
            self._reattaching = asyncio.get_running_loop().create_task(self._attach_again())
        return await asyncio.shield(self._reattaching)

    async def counted_gone(self, subscriber: str, request_ids: list[str]) -> bool:
        """The scheduler counted this gateway's inbox ``subscriber`` as gone (its watch of it
        failed) and released ``request_ids``, the requests it had admitted from it: end their
        streams with UNAVAILABLE (the nodes stopped them without an event, so their clients
        waited for ever: review 21b, G1) and attach again. False when ``subscriber`` is not
        this gateway's inbox."""
        if self.streams is None or self.streams.subscriber != subscriber:
            return False
        ended = self.streams.fail_requests(request_ids, "this gateway lost its place at the scheduler, which "
                                                        "stopped the request: send it again")
        log.warning("gateway %s was counted as gone while serving: %d streams ended", self.gateway_id, ended)
        return await self.reattach()

    async def _admitted(self, request_ids: list[str]) -> list[str]:
        """The scheduler's ``admitted_from`` for this gateway's inbox (``NodeStreams.reconcile``),
        answered within ``SCHEDULER_CALL_TIMEOUT_S`` (``ActorSilent`` past it). Called with
        keyword arguments, as the scheduler calls the gateway (a class one process could not
        load takes keywords only)."""
        subscriber = self.streams.subscriber if self.streams is not None else ""
        return await self.scheduler_calls.admitted_from.remote(subscriber=subscriber, request_ids=request_ids)

    async def _attach_again(self) -> bool:
        subscriber = self.streams.subscriber if self.streams is not None else ""
        try:
            await self.scheduler_calls.attach_gateway.remote(
                gateway_id=self.gateway_id, address=self.served_address, subscriber=subscriber,
                handle=ray.get_runtime_context().current_actor)
        except Exception as exc:  # noqa: BLE001 - the refusal stands; the next one tries again
            log.warning("gateway %s: attaching again failed: %s: %.200s", self.gateway_id, type(exc).__name__, exc)
            return False
        log.warning("gateway %s was counted as gone while serving: attached again", self.gateway_id)
        return True

    async def _serve_again(self) -> int:
        """After a restart: serve gRPC, the OpenAI API and ``/metrics`` on the addresses this
        gateway served them on before its crash (the scheduler's record); returns the gRPC
        port. A failed try (a port not free yet, the HTTP server slow to come up, the scheduler
        not answering) is retried ``RESTART_BIND_TRIES`` times in all, ``RESTART_RETRY_S``
        apart; the last takes the configured HTTP and metrics ports (0: any free one), in case
        another process holds the old ones for good. After it the process exits, so that Ray
        restarts the actor again (``max_restarts``) rather than keep one that serves nothing.

        Regression (review 23b F3): only OSError was retried, and a try that failed after the
        gRPC bind kept that port, so every later one failed on it; the restart task then ended
        and the live actor never served again. Regression (review 23b F4): with port 0 the
        HTTP API and /metrics came back on new ports (the saved addresses went dead).
        Regression (review s34 B F4): only an exception ended a try; a call that never
        answered (a silent cache node's ``describe``, a silent scheduler) kept the first try
        waiting for ever. Each try now ends within ``RESTART_TRY_TIMEOUT_S`` (and each call in
        it within its own deadline; a silent node is left down, not waited for).
        Regression (review s37 r4 F3): a gateway restarted before its first ``start`` (the
        launcher creates it while the nodes load) failed every try on the scheduler's empty
        record and exited, over and over; now the task ends (0, serving nothing) and the
        launcher's ``start`` serves it. Regression (s38 fault 1): a gateway that had served, Ray
        restarted after the scheduler lost its record (the scheduler Ray restarted rebuilds no
        gateway record; the old gateway's ``_scheduler_back`` attach never came) was taken for
        that case: it stayed up serving nothing, for good, its clients' calls refused at
        connect and ``kvstrata status`` / ``/health`` unreachable. Now it serves again on its
        own record (``ServedRecord``, kept in Ray's GCS at each start) and attaches, which
        gives the scheduler its record back; only a gateway with neither record waits."""
        for tries in range(1, RESTART_BIND_TRIES + 1):
            try:
                return await _within(self._start_again(old_api_ports=tries < RESTART_BIND_TRIES),
                                     RESTART_TRY_TIMEOUT_S, "the try")
            except NeverServed:
                log.warning("restarted gateway %s had not served yet: left to the launcher's start", self.gateway_id)
                return 0
            except Exception as exc:  # noqa: BLE001 - any failure: retried, then exit
                log.warning("restarted gateway %s: start %d of %d failed: %s: %.300s", self.gateway_id, tries,
                            RESTART_BIND_TRIES, type(exc).__name__, exc)
            if tries < RESTART_BIND_TRIES:
                await asyncio.sleep(RESTART_RETRY_S)
        log.error("restarted gateway %s could not serve again: exiting, for Ray to restart it", self.gateway_id)
        sys.stderr.flush()
        os._exit(1)

    async def _start_again(self, old_api_ports: bool) -> int:
        """One try of ``_serve_again``: ``start`` on the scheduler's record of this gateway
        (its HTTP and metrics ports too with ``old_api_ports``; else the configured ones).

        A malformed record from the scheduler (``scheduler_replies.addresses``) is taken for none:
        the gateway serves again on its own. Regression (s38): it raised in every try (KeyError,
        ValueError from ``int``), and the gateway exited for Ray to restart it, over and over."""
        reply = await self.scheduler_calls.gateway_addresses.remote(gateway_id=self.gateway_id)
        try:
            addresses = replies.addresses("gateway_addresses", reply, API_NAMES)
        except replies.MalformedReply as exc:
            log.warning("restarted gateway %s: %s; taken for no record", self.gateway_id, exc)
            addresses = dict.fromkeys(API_NAMES, "")
        if not addresses["grpc"]:  # the scheduler lost it (restarted without it), or it never served
            addresses = await self.served_record.load()
            if not addresses["grpc"]:
                raise NeverServed("neither the scheduler nor this gateway's own record knows an address it "
                                  "served on")
            log.warning("restarted gateway %s: the scheduler has no record of it (restarted since?): serving "
                        "again on its own record, gRPC on %s", self.gateway_id, addresses["grpc"])
        host, port = addresses["grpc"].rsplit(":", 1)
        if not old_api_ports:
            log.warning("restarted gateway %s: last try, on the configured HTTP and metrics ports", self.gateway_id)
            return await self._serve(host, int(port), None, None)
        return await self._serve(host, int(port), _port_of(addresses["http"]), _port_of(addresses["metrics"]))


class NeverServed(RuntimeError):
    """A restarted gateway's scheduler and its own ``ServedRecord`` record no address it served
    on: it was restarted before its first ``start`` (``_serve_again`` leaves that to the
    launcher)."""


async def _within(call: Awaitable[T], timeout_s: float, what: str) -> T:
    """``call``'s result within ``timeout_s`` (it is cancelled past it).

    Raises:
        TimeoutError: naming ``what`` and ``timeout_s``.
    """
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} did not end within {timeout_s:g} s") from None


def _port_of(address: str) -> int | None:
    """The port of ``host:port``; None for "" (not served)."""
    return int(address.rsplit(":", 1)[1]) if address else None


GatewayActor = ray.remote(RayGateway)
