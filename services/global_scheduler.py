"""The global scheduler: tenants, admission, routing, and the global block index.

One named Ray actor. Gateways call ``authenticate`` and ``release`` per request through Ray and
send admissions on the data plane (``GlobalSchedulerService``, ``services.data_plane``).
Cache nodes push their device- and host-tier block events and spill nodes their RAM- and
disk-tier events (``report_events``, batched, fire-and-forget) into one tier-aware
``BlockIndex``: block hash -> the ``(holder, tier)`` pairs holding it.

- Admission is a bounded queue across all nodes. With the ``kvstrata`` scheduler it also
  estimates each request's TTFT on its node (a fluid model of the node's prefill backlog by
  class, the request's cached prompt tokens per tier from the index, the node's measured
  prefill speed; ``cache_node.scheduling.admission``) and rejects early with
  RESOURCE_EXHAUSTED and a retry hint when its class allows.
- Routing: a session's turns stick to the node holding its KV; otherwise the node with the
  longest prefix held on its device or in its host tier wins when that prefix is at least
  ``affinity_min_blocks`` long and longer than the prefix most recent traffic shares
  (``block_index.CommonPrefix``: a system prompt every request carries says nothing about
  where a request's own context lives), else the least loaded node. Spill-held blocks do not favour
  a node: every cache node reads the spill tier at the same cost.
- Prefetch hint: ``Admission.spill_blocks`` says how many prompt blocks past the node's own
  tiers sit in spill, so the node starts a spill prefetch only when there is one to make.

The index is eventually consistent (events travel asynchronously), so it steers decisions
but never decides what is reused: the cache node's token-checked prefix cache does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from cache_node.scheduling import SLO_CLASS_RANK, check_policy_name
from cache_node.scheduling.admission import (
    CachedTokens,
    Ewma,
    FluidBacklog,
    SpeedMeter,
    decide,
    estimate_ttft_s,
)
from services import data_plane
from services.block_index import BlockIndex, CommonPrefix, PrefixTiers
from services.data_plane_auth import Security, secure_push
from services.node_request import NodeRequest
from tenants.model import Tenant, TenantSpec
from tenants.store import TenantStore
from tenants.usage import UsageLedger

log = logging.getLogger(__name__)


@dataclass
class NodeLoad:
    """A node as admission sees it: in-flight requests, prefill backlog, measured speeds."""

    node_id: str
    capacity: int
    in_flight: set[str] = field(default_factory=set)
    backlog: FluidBacklog = field(default_factory=FluidBacklog)
    prefill: SpeedMeter = field(default_factory=SpeedMeter)
    step_s: Ewma = field(default_factory=lambda: Ewma(prior=0.05))


GONE_GATEWAYS_MAX = 1024
"""Event inboxes of dead gateways remembered (oldest forgotten first)."""

GATEWAY_POLL_S = 5.0
"""Length of the scheduler's long poll of a gateway (``Gateway.serves``)."""


@dataclass(frozen=True)
class GatewayRecord:
    """A gateway as the scheduler knows it: its gRPC ``host:port`` and its event inbox."""

    address: str
    subscriber: str


@dataclass(frozen=True)
class Admission:
    """Outcome of ``admit``: a node to run on, or a rejection with a gRPC status name.

    ``spill_blocks``: leading prompt blocks (past those on the node's device and host tiers)
    that the index places in the spill tier; > 0 means the node should prefetch them.
    """

    node_id: str = ""
    code: str = "OK"
    message: str = ""
    retry_after_s: float = 0.0
    spill_blocks: int = 0


class GlobalScheduler:
    """Plain class behind the ``GlobalSchedulerActor``.

    Args:
        state_dir: where the tenant database lives (survives restarts).
        nodes: node id -> running capacity (max_num_seqs).
        queue_limit: requests allowed to wait beyond the nodes' running capacity.
        affinity_min_blocks: shortest device+host prefix (blocks) that routes by affinity.
        scheduler: the nodes' scheduling policy; "kvstrata" turns on TTFT-based admission.
        block_size: the nodes' tokens per block (prefix matches in the index count in blocks).
        clock: monotonic seconds (tests inject one).
        security: the scheduler's data-plane identity (``services.data_plane_auth``): its
            admission socket admits only gateways, its submits reach nodes only with its key.
            None: plaintext on loopback (unit tests only).
    """

    def __init__(
        self, state_dir: str, nodes: dict[str, int], queue_limit: int = 256, affinity_min_blocks: int = 4,
        scheduler: str = "fcfs", block_size: int = 16, clock: Any = time.monotonic,
        security: Security | None = None,
    ) -> None:
        self.security = security
        self.bad_messages = 0  # data-plane messages dropped as malformed
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.store = TenantStore(Path(state_dir) / "tenants.sqlite")
        self.usage = UsageLedger()
        self.scheduler = check_policy_name(scheduler)
        self.clock = clock
        self.block_size = block_size
        by_class = scheduler in ("priority", "kvstrata")
        self.nodes = {nid: NodeLoad(nid, cap, backlog=FluidBacklog(by_class)) for nid, cap in nodes.items()}
        self.specs: dict[str, TenantSpec] = {}  # tenant_id -> spec, filled by authenticate
        self.queue_limit = queue_limit
        self.affinity_min_blocks = affinity_min_blocks
        self.index = BlockIndex()
        self.common_prefix = CommonPrefix()
        self.session_nodes: dict[str, tuple[str, str]] = {}  # session -> (tenant_id, node_id)
        self.requests: dict[str, tuple[str, str]] = {}  # request -> (tenant_id, node_id)
        # request -> the event inbox of the gateway that admitted it (``admit_and_submit``)
        self.request_gateways: dict[str, str] = {}
        self.gateways: dict[str, GatewayRecord] = {}  # gateway actor id -> ``attach_gateway``
        self.gone_gateways: OrderedDict[str, bool] = OrderedDict()  # dead gateways' event inboxes
        self.node_inboxes: dict[str, str] = {}  # node id -> data-plane command inbox (attach_nodes)
        self.down: dict[str, str] = {}  # node id -> why it is not routed to (node_down .. node_up)
        self.commands: Any = None  # sends submit commands to node inboxes

    # ---- tenants (the gateway checks the admin key first) ---------------------------------
    def ensure_admin_key(self) -> str | None:
        return self.store.ensure_admin_key()

    def verify_admin_key(self, key: str) -> bool:
        return self.store.verify_admin_key(key)

    def has_admin_key(self) -> bool:
        return self.store.has_admin_key()

    def set_admin_key(self, key: str) -> bool:
        """Commit ``key`` (already saved by the caller) as the admin key; True if rotated."""
        return self.store.set_admin_key(key)

    def rotate_admin_key(self) -> str:
        return self.store.rotate_admin_key()

    def rotate_tenant_key(self, name: str) -> str:
        return self.store.rotate_key(name)

    def register_tenant(self, spec: TenantSpec) -> tuple[Tenant, str]:
        return self.store.register(spec)

    def update_tenant(self, name: str, spec: TenantSpec) -> Tenant:
        return self.store.update(name, spec)

    def delete_tenant(self, name: str) -> None:
        self.store.delete(name)

    def get_tenant(self, name: str) -> Tenant:
        return self.store.get(name)

    def list_tenants(self) -> tuple[Tenant, ...]:
        return self.store.list()

    def authenticate(self, api_key: str) -> Tenant | None:
        tenant = self.store.authenticate(api_key)
        if tenant is not None:
            self.specs[tenant.tenant_id] = tenant.spec
        return tenant

    def usage_of(self, tenant_id: str) -> Any:
        return self.usage.snapshot(tenant_id)

    # ---- admission and routing ------------------------------------------------------------
    def admit(
        self, tenant_id: str, request_id: str, session_id: str = "", block_hashes: list[bytes] | None = None,
        prompt_tokens: int = 0,
    ) -> Admission:
        """Pick a node for a request or reject it (RESOURCE_EXHAUSTED with a retry hint).

        Args:
            block_hashes: chained hashes of the prompt's full blocks as the node will compute
                them (``cache_node.hashing.hash_prompt_blocks``); [] when unknown (a session
                turn, whose prompt starts with history the gateway does not see).
            prompt_tokens: prompt length in tokens (0 when unknown).

        Returns:
            An ``Admission``: the node and ``spill_blocks`` (the prefetch hint), or a code
            "RESOURCE_EXHAUSTED" / "PERMISSION_DENIED" / "UNAVAILABLE" (no node is healthy)
            with a message.
        """
        if len(self.down) == len(self.nodes):
            return Admission(code="UNAVAILABLE", message=f"no cache node is healthy: {'; '.join(self.down.values())}")
        sticky = self.session_nodes.get(session_id) if session_id else None
        if sticky is not None and sticky[0] != tenant_id:
            return Admission(code="PERMISSION_DENIED", message=f"session {session_id!r} belongs to another tenant")
        queued = self._queued()
        if queued >= self.queue_limit:
            self.usage.record_rejected(tenant_id)
            return Admission(
                code="RESOURCE_EXHAUSTED",
                message=f"queue full ({queued} waiting, limit {self.queue_limit})",
                retry_after_s=1.0 + queued / max(1, sum(n.capacity for n in self.nodes.values())),
            )
        node_id = sticky[1] if sticky is not None else self._route(block_hashes or [])
        prefix = self.index.prefix_tiers(node_id, block_hashes or [])
        rejected = self._slo_admission(tenant_id, node_id, self._cached_tokens(prefix, prompt_tokens))
        if rejected is not None:
            self.usage.record_rejected(tenant_id)
            return rejected
        self.nodes[node_id].in_flight.add(request_id)
        self.requests[request_id] = (tenant_id, node_id)
        if session_id:
            self.session_nodes[session_id] = (tenant_id, node_id)
        self.usage.record_request(tenant_id)  # prompt and cached tokens: at release, from the node
        return Admission(node_id=node_id, spill_blocks=prefix.spill)

    def attach_nodes(self, inboxes: dict[str, str], sender: Any = None) -> None:
        """The cache nodes' command inboxes (``CacheNode.open_data_plane``), so
        ``admit_and_submit`` can hand requests on to them.

        Args:
            inboxes: node id -> ZeroMQ address.
            sender: has ``send(address, message)``; default ``data_plane.PushSockets``.
        """
        self.node_inboxes = dict(inboxes)
        self.commands = sender or data_plane.PushSockets(secure_push(self.security, "node"))

    def admit_and_submit(self, req: NodeRequest, subscriber: str, block_hashes: list[bytes]) -> Admission:
        """``admit`` ``req``, and when admitted start it on the chosen node, whose events for it
        go to ``subscriber`` (a gateway's event inbox, ``services.data_plane``).

        The node hears of the request from here (a data-plane message to its command inbox),
        one hop sooner than if the gateway waited for this reply and sent it on. A session-less
        prompt the index places partly in the spill tier is marked for prefetch.

        Raises:
            KeyError: the chosen node was never attached (``attach_nodes``).
        """
        if subscriber in self.gone_gateways:
            return Admission(code="UNAVAILABLE", message="the gateway that sent this request is gone")
        adm = self.admit(req.tenant, req.request_id, req.session_id, block_hashes, len(req.token_ids))
        if adm.code == "OK":
            self.request_gateways[req.request_id] = subscriber
            if block_hashes and not req.session_id:
                req = dataclasses.replace(req, prefetch=adm.spill_blocks > 0)
            self.commands.send(self.node_inboxes[adm.node_id], {
                "op": "submit", "req": data_plane.request_to_wire(req), "sub": subscriber})
        return adm

    def _cached_tokens(self, prefix: PrefixTiers, prompt_tokens: int) -> CachedTokens:
        """Prompt tokens per tier from a prefix in blocks, capped at ``prompt_tokens``
        (device first, then host, then spill)."""
        left = prompt_tokens
        tokens = []
        for blocks in (prefix.device, prefix.host, prefix.spill):
            n = min(left, blocks * self.block_size)
            tokens.append(n)
            left -= n
        return CachedTokens(device=tokens[0], host=tokens[1], spill=tokens[2], miss=left)

    def _slo_admission(self, tenant_id: str, node_id: str, cached: CachedTokens) -> Admission | None:
        """Queue the request's uncached tokens on the node's backlog, or reject it (kvstrata
        only) when its estimated TTFT misses what its class allows. None = admitted."""
        spec = self.specs.get(tenant_id) or self._spec_by_id(tenant_id)
        node = self.nodes[node_id]
        rank = SLO_CLASS_RANK[spec.slo_class.value] if spec else 1
        node.backlog.drain(self.clock(), node.prefill.tokens_per_s)
        if self.scheduler == "kvstrata" and spec is not None:
            ahead = node.backlog.ahead(rank)
            # an interactive prefill runs in a step of its own (isolates_urgent_prefill): it
            # waits for the step in progress, half of one on average, not for a whole one
            wait_s = node.step_s.value * (0.5 if rank == 0 else 1.0)
            est_ms = 1000.0 * estimate_ttft_s(ahead, cached, node.prefill.tokens_per_s, wait_s)
            decision = decide(spec.slo_class.value, spec.ttft_slo_ms, est_ms)
            if not decision.admit:
                return Admission(code="RESOURCE_EXHAUSTED", message=decision.reason,
                                 retry_after_s=decision.retry_after_s)
        node.backlog.add(rank, cached.miss)
        return None

    def _spec_by_id(self, tenant_id: str) -> TenantSpec | None:
        """The spec of ``tenant_id`` from the store (after a restart emptied ``specs``)."""
        for tenant in self.store.list():
            self.specs[tenant.tenant_id] = tenant.spec
        return self.specs.get(tenant_id)

    def _route(self, block_hashes: list[bytes]) -> str:
        """The node holding the longest prefix of ``block_hashes`` on its device or host tier
        (first such node on a tie) when that is at least ``affinity_min_blocks`` blocks and
        longer than the recent traffic's common prefix, else the node with the fewest requests
        in flight. Spill-held blocks count for no node."""
        self.common_prefix.observe(block_hashes)
        healthy = [n for nid, n in self.nodes.items() if nid not in self.down]
        best, best_len = "", 0
        for node in healthy:
            n = self.index.node_prefix(node.node_id, block_hashes)
            if n > best_len:
                best, best_len = node.node_id, n
        if best and best_len >= self.affinity_min_blocks and best_len > self.common_prefix.blocks:
            return best
        return min(healthy, key=lambda n: (len(n.in_flight), n.node_id)).node_id

    def release(self, request_id: str, usage: dict[str, Any] | None = None) -> None:
        """A request ended (any way); account its tokens.

        Args:
            usage: the node's ``finished`` event, or for a request that ended without one
                (cancelled, past its deadline, failed) the gateway's count of what it ran:
                ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``; None: nothing ran.
        """
        tenant_id, node_id = self.requests.pop(request_id, ("", ""))
        self.request_gateways.pop(request_id, None)
        if node_id in self.nodes:
            self.nodes[node_id].in_flight.discard(request_id)
        if usage and node_id in self.nodes and "prefill_tokens_per_s" in usage:  # a finished one
            node = self.nodes[node_id]
            node.prefill.set(float(usage["prefill_tokens_per_s"]))
            if usage.get("step_s"):
                node.step_s.update(float(usage["step_s"]))
        if tenant_id and usage:
            self.usage.record_completion_tokens(tenant_id, int(usage.get("completion_tokens", 0)))
            if "prompt_tokens" in usage:
                cached = {k: int(v) for k, v in (usage.get("cached_tokens") or {}).items()}
                self.usage.record_prompt(tenant_id, prompt_tokens=int(usage["prompt_tokens"]),
                                         cached_tokens=cached)
            if usage.get("preempted"):
                self.usage.record_preempted(tenant_id)

    # ---- gateways: where a restarted one serves again, and a dead one's requests -------------
    def gateway_address(self, gateway_id: str) -> str:
        """The ``host:port`` the gateway ``gateway_id`` (its Ray actor id) last served on, ""
        if it never did: a gateway Ray restarted serves on it again (``attach_gateway``)."""
        record = self.gateways.get(gateway_id)
        return record.address if record is not None else ""

    def attach_gateway(self, gateway_id: str, address: str, subscriber: str) -> str:
        """Gateway ``gateway_id`` serves gRPC on ``address`` with its event inbox at
        ``subscriber``. The inbox it had before (it was restarted) is gone (``gateway_gone``).
        Returns that previous inbox ("" if none)."""
        previous = self.gateways.get(gateway_id)
        self.gateways[gateway_id] = GatewayRecord(address, subscriber)
        if previous is not None and previous.subscriber != subscriber:
            self.gateway_gone(previous.subscriber)
            return previous.subscriber
        return ""

    def gateway_gone(self, subscriber: str) -> list[str]:
        """The gateway whose event inbox was ``subscriber`` died: release each request it
        admitted (once: a later ``release`` of one is a no-op), refuse any admission still on
        its way from it, and tell every node to abort its streams (their blocks are freed at the
        next step). Returns the released request ids. Idempotent."""
        if subscriber in self.gone_gateways:
            return []
        self.gone_gateways[subscriber] = True
        while len(self.gone_gateways) > GONE_GATEWAYS_MAX:
            self.gone_gateways.popitem(last=False)
        ids = [rid for rid, sub in self.request_gateways.items() if sub == subscriber]
        for rid in ids:
            self.release(rid)
        if self.commands is not None:
            for inbox in self.node_inboxes.values():
                self.commands.send(inbox, {"op": "abort_subscriber", "sub": subscriber})
        if ids:
            log.warning("gateway %s is gone: released its %d requests in flight", subscriber, len(ids))
        return ids

    # ---- node membership (a gateway's ``services.node_monitor``) ----------------------------
    def node_down(self, node_id: str, reason: str) -> None:
        """Stop routing to ``node_id`` (failed, dead or restarting): its index entries and its
        sessions are forgotten, as its KV is gone. Unknown ids are ignored."""
        if node_id not in self.nodes or node_id in self.down:
            return
        self.down[node_id] = reason
        self.index.forget(node_id)
        for sid in [sid for sid, (_, nid) in self.session_nodes.items() if nid == node_id]:
            del self.session_nodes[sid]

    def node_up(self, node_id: str, inbox: str) -> None:
        """Route to ``node_id`` again; its command inbox is now ``inbox`` (new after a restart).

        Raises:
            KeyError: ``node_id`` is not one of this scheduler's nodes.
        """
        if node_id not in self.nodes:
            raise KeyError(f"unknown cache node {node_id!r}")
        self.node_inboxes[node_id] = inbox
        self.down.pop(node_id, None)

    def sessions_ended(self, node_id: str, session_ids: list[str]) -> None:
        """``node_id`` closed these sessions (expired): forget their routing there (an id
        routed to another node stays)."""
        for sid in session_ids:
            entry = self.session_nodes.get(sid)
            if entry is not None and entry[1] == node_id:
                del self.session_nodes[sid]

    def close_session(self, session_id: str, tenant_id: str) -> str | None:
        """Forget a session's routing; returns the node holding it (None when unknown/foreign)."""
        entry = self.session_nodes.get(session_id)
        if entry is None or entry[0] != tenant_id:
            return None
        del self.session_nodes[session_id]
        return entry[1]

    # ---- global block index ---------------------------------------------------------------
    def report_events(
        self, holder_id: str, events: list[tuple[str, bytes, str]] | list[tuple[str, bytes]],
        reset: bool = False,
    ) -> int:
        """Apply a holder's block events to the index; returns how many were applied.

        Args:
            holder_id: a cache node id (tiers "device", "host") or a spill node id (tiers
                "spill_ram", "spill_disk").
            events: ``(event, block_hash, tier)`` in the order they happened, ``event``
                "stored" or "removed"; a 2-tuple ``(event, block_hash)`` means tier "device".
            reset: forget everything ``holder_id`` held first (it restarted and reports its
                surviving blocks as stored).

        Raises:
            ValueError: an unknown event or tier, or a malformed event; TypeError: a hash
                that is not bytes (nothing applied either way).
        """
        if reset:
            self.index.forget(holder_id)
        return self.index.apply(holder_id, events)

    def flush_index(self) -> None:
        """Forget every block in every tier.

        Admin ``Flush`` calls it after every cache node's ``flush`` dropped its device and
        host blocks and, through its spill client, every spill node's blocks; the removals
        those report afterwards are no-ops here.
        """
        self.index.clear()

    def _queued(self) -> int:
        """Requests waiting beyond the nodes' running capacity (what ``queue_limit`` bounds)."""
        return sum(max(0, len(n.in_flight) - n.capacity) for n in self.nodes.values())

    def stats(self) -> dict[str, Any]:
        """Queue and load per node, sessions, and the index: ``indexed_blocks`` distinct
        hashes, ``indexed_blocks_by_tier`` block copies per tier (summed over holders)."""
        return {
            "queued": self._queued(),
            "in_flight": {nid: len(n.in_flight) for nid, n in self.nodes.items()},
            "scheduler": self.scheduler,
            "prefill_tokens_per_s": {nid: n.prefill.tokens_per_s for nid, n in self.nodes.items()},
            "sessions": len(self.session_nodes),
            "bad_messages": self.bad_messages,
            "down": dict(self.down),
            "indexed_blocks": len(self.index),
            "indexed_blocks_by_tier": self.index.pairs_per_tier(),
            "time_s": time.time(),
        }


class GlobalSchedulerService(GlobalScheduler):
    """The actor's class: a GlobalScheduler that also answers admissions on the data plane.

    It has an async method, so Ray runs every method on one event loop thread, and the
    admission socket served on that loop never runs concurrently with a Ray method call.
    """

    data_address = ""  # the admission socket, once open

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gateway_watches: set[asyncio.Task[None]] = set()

    async def attach_gateway(self, gateway_id: str, address: str, subscriber: str, handle: Any = None) -> str:
        """``GlobalScheduler.attach_gateway``, and with the gateway's actor ``handle``, watch
        it: once it no longer serves ``subscriber`` (its process died: the call fails; or Ray
        restarted it with a new inbox) its requests are released (``gateway_gone``), so the
        nodes' slots never depend on a dead gateway's ``release``."""
        previous = super().attach_gateway(gateway_id, address, subscriber)
        if handle is not None:
            task = asyncio.get_running_loop().create_task(self._watch_gateway(handle, subscriber))
            self._gateway_watches.add(task)  # held until done (the loop keeps weak references)
            task.add_done_callback(self._gateway_watches.discard)
        return previous

    async def _watch_gateway(self, handle: Any, subscriber: str) -> None:
        """Long-poll ``handle.serves(subscriber, GATEWAY_POLL_S)`` until it says no or fails."""
        while subscriber not in self.gone_gateways:
            try:
                serves = await handle.serves.remote(subscriber, GATEWAY_POLL_S)
            except Exception as exc:  # noqa: BLE001 - a dead (or restarting) gateway's calls fail
                log.warning("gateway %s is unreachable: %s: %.200s", subscriber, type(exc).__name__, exc)
                serves = False
            if not serves:
                self.gateway_gone(subscriber)

    async def authenticate(self, api_key: str) -> Tenant | None:
        """``GlobalScheduler.authenticate`` with its PBKDF2 in a worker thread, so that a key
        check never stalls the loop that serves admissions."""
        return await asyncio.to_thread(super().authenticate, api_key)

    async def verify_admin_key(self, key: str) -> bool:
        """``GlobalScheduler.verify_admin_key``, in a worker thread (as ``authenticate``)."""
        return await asyncio.to_thread(super().verify_admin_key, key)

    async def open_data_plane(self) -> str:
        """Bind the admission socket (``services.data_plane``, step 1; CURVE, admitting
        gateways only, with ``security``) and serve it; returns its address (idempotent)."""
        if self.data_address:
            return self.data_address
        self._admission_context = ctx = data_plane.context(asyncio_=True)
        self._authenticator = self.security.start_authenticator(ctx) if self.security is not None else None
        sock, self.data_address = data_plane.serving_socket(ctx, data_plane.zmq.ROUTER, self.security)
        self._admissions = asyncio.get_running_loop().create_task(self._serve_admissions(sock))
        return self.data_address

    def close_data_plane(self) -> None:
        """Stop serving admissions and close every data-plane socket (on the serving loop)."""
        if self.data_address:
            self._admissions.cancel()
            if self._authenticator is not None:
                self._authenticator.stop()
            self._admission_context.destroy(linger=0)
            self.data_address = ""
        if self.commands is not None and hasattr(self.commands, "close"):
            self.commands.close()
            self.commands = None

    async def _serve_admissions(self, sock: Any) -> None:
        """Answer each admission; a malformed message (any bytes at all) is counted in
        ``bad_messages`` and dropped, answered with an error when its correlation id is
        readable (the gateway then need not wait for its timeout)."""
        while True:
            frames = await sock.recv_multipart()
            reply = self._answer(frames[-1]) if len(frames) == 2 else None
            if reply is None:
                self.bad_messages += 1
                continue
            await sock.send_multipart([frames[0], data_plane.pack(reply)])

    def _answer(self, payload: bytes) -> dict[str, Any] | None:
        """The reply to one admission message; None when it has no readable correlation id."""
        try:
            msg = data_plane.unpack(payload)
        except Exception:  # noqa: BLE001 - not msgpack at all
            return None
        corr = msg.get("id") if isinstance(msg, dict) else None
        if type(corr) is not int:
            return None
        try:
            req, subscriber, hashes = _admission_request(msg)
        except (TypeError, ValueError) as exc:
            self.bad_messages += 1
            return {"id": corr, "error": f"malformed admission: {type(exc).__name__}: {exc}"}
        try:
            adm = self.admit_and_submit(req, subscriber, hashes)
        except Exception as exc:  # noqa: BLE001 - the caller gets the error, the loop goes on
            log.exception("admission failed")
            return {"id": corr, "error": f"{type(exc).__name__}: {exc}"}
        return {"id": corr, "adm": dataclasses.asdict(adm)}


def _admission_request(msg: dict[str, Any]) -> tuple[NodeRequest, str, list[bytes]]:
    """``(request, subscriber, block hashes)`` of an admission message, every field checked.

    Raises:
        TypeError, ValueError: a missing or mistyped field.
    """
    hashes, subscriber = msg.get("hashes"), msg.get("sub")
    if not isinstance(hashes, list) or not all(isinstance(h, bytes) for h in hashes):
        raise TypeError("hashes must be a list of bytes")
    if not isinstance(subscriber, str) or not subscriber.startswith("tcp://"):
        raise TypeError("sub must be a tcp:// address")
    return data_plane.request_from_wire(msg.get("req")), subscriber, hashes


GlobalSchedulerActor = ray.remote(GlobalSchedulerService)
