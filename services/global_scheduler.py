"""The global scheduler: tenants, admission, routing, and the global block index.

One named Ray actor. Gateways call ``authenticate`` / ``admit`` / ``release`` per request;
cache nodes push block events (``report_events``). Admission is a bounded queue across all
nodes; with the ``kvstrata`` scheduler it also estimates each request's TTFT on its node (a
fluid model of the node's prefill backlog by class, the request's device-cached tokens from the
block index, the node's measured prefill speed; ``cache_node.scheduling.admission``) and
rejects early with RESOURCE_EXHAUSTED and a retry hint when its class allows. Routing: a session's turns stick to the node
holding its KV; otherwise the node with the longest prefix match in the block index wins when
the match is longer than ``affinity_min_blocks``, else the least loaded node.
"""

from __future__ import annotations

import time
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
from tenants.model import Tenant, TenantSpec
from tenants.store import TenantStore
from tenants.usage import UsageLedger


@dataclass
class NodeLoad:
    """A node as admission sees it: in-flight requests, prefill backlog, measured speeds."""

    node_id: str
    capacity: int
    in_flight: set[str] = field(default_factory=set)
    backlog: FluidBacklog = field(default_factory=FluidBacklog)
    prefill: SpeedMeter = field(default_factory=SpeedMeter)
    step_s: Ewma = field(default_factory=lambda: Ewma(prior=0.05))


@dataclass(frozen=True)
class Admission:
    """Outcome of ``admit``: a node to run on, or a rejection with a gRPC status name."""

    node_id: str = ""
    code: str = "OK"
    message: str = ""
    retry_after_s: float = 0.0


class GlobalScheduler:
    """Plain class behind the ``GlobalSchedulerActor``.

    Args:
        state_dir: where the tenant database lives (survives restarts).
        nodes: node id -> running capacity (max_num_seqs).
        queue_limit: requests allowed to wait beyond the nodes' running capacity.
        scheduler: the nodes' scheduling policy; "kvstrata" turns on TTFT-based admission.
        block_size: the nodes' tokens per block (prefix matches in the index count in blocks).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self, state_dir: str, nodes: dict[str, int], queue_limit: int = 256, affinity_min_blocks: int = 4,
        scheduler: str = "fcfs", block_size: int = 16, clock: Any = time.monotonic,
    ) -> None:
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
        self.block_index: dict[bytes, set[str]] = {}
        self.session_nodes: dict[str, tuple[str, str]] = {}  # session -> (tenant_id, node_id)
        self.requests: dict[str, tuple[str, str]] = {}  # request -> (tenant_id, node_id)

    # ---- tenants (the gateway checks the admin key first) ---------------------------------
    def ensure_admin_key(self) -> str | None:
        return self.store.ensure_admin_key()

    def verify_admin_key(self, key: str) -> bool:
        return self.store.verify_admin_key(key)

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
        """Pick a node for a request or reject it (RESOURCE_EXHAUSTED with a retry hint)."""
        sticky = self.session_nodes.get(session_id) if session_id else None
        if sticky is not None and sticky[0] != tenant_id:
            return Admission(code="PERMISSION_DENIED", message=f"session {session_id!r} belongs to another tenant")
        queued = sum(max(0, len(n.in_flight) - n.capacity) for n in self.nodes.values())
        if queued >= self.queue_limit:
            self.usage.record_rejected(tenant_id)
            return Admission(
                code="RESOURCE_EXHAUSTED",
                message=f"queue full ({queued} waiting, limit {self.queue_limit})",
                retry_after_s=1.0 + queued / max(1, sum(n.capacity for n in self.nodes.values())),
            )
        node_id = sticky[1] if sticky is not None else self._route(block_hashes or [])
        rejected = self._slo_admission(tenant_id, node_id, block_hashes or [], prompt_tokens)
        if rejected is not None:
            self.usage.record_rejected(tenant_id)
            return rejected
        self.nodes[node_id].in_flight.add(request_id)
        self.requests[request_id] = (tenant_id, node_id)
        if session_id:
            self.session_nodes[session_id] = (tenant_id, node_id)
        self.usage.record_request(tenant_id, prompt_tokens=prompt_tokens)
        return Admission(node_id=node_id)

    def _slo_admission(
        self, tenant_id: str, node_id: str, block_hashes: list[bytes], prompt_tokens: int
    ) -> Admission | None:
        """Queue the request's uncached tokens on the node's backlog, or reject it (kvstrata
        only) when its estimated TTFT misses what its class allows. None = admitted."""
        spec = self.specs.get(tenant_id) or self._spec_by_id(tenant_id)
        node = self.nodes[node_id]
        rank = SLO_CLASS_RANK[spec.slo_class.value] if spec else 1
        node.backlog.drain(self.clock(), node.prefill.tokens_per_s)
        device = min(prompt_tokens, self._match_blocks(node_id, block_hashes) * self.block_size)
        cached = CachedTokens(device=device, miss=max(0, prompt_tokens - device))
        if self.scheduler == "kvstrata" and spec is not None:
            ahead = node.backlog.ahead(rank)
            est_ms = 1000.0 * estimate_ttft_s(ahead, cached, node.prefill.tokens_per_s, node.step_s.value)
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

    def _match_blocks(self, node_id: str, block_hashes: list[bytes]) -> int:
        n = 0
        for h in block_hashes:
            if node_id not in self.block_index.get(h, ()):
                break
            n += 1
        return n

    def _route(self, block_hashes: list[bytes]) -> str:
        best, best_len = "", 0
        for nid in self.nodes:
            n = 0
            for h in block_hashes:
                if nid not in self.block_index.get(h, ()):
                    break
                n += 1
            if n > best_len:
                best, best_len = nid, n
        if best and best_len >= self.affinity_min_blocks:
            return best
        return min(self.nodes.values(), key=lambda n: (len(n.in_flight), n.node_id)).node_id

    def release(self, request_id: str, usage: dict[str, Any] | None = None) -> None:
        """A request ended (any way); account its tokens."""
        tenant_id, node_id = self.requests.pop(request_id, ("", ""))
        if node_id in self.nodes:
            self.nodes[node_id].in_flight.discard(request_id)
        if usage and node_id in self.nodes:
            node = self.nodes[node_id]
            node.prefill.set(float(usage.get("prefill_tokens_per_s", 0.0)))
            if usage.get("step_s"):
                node.step_s.update(float(usage["step_s"]))
        if tenant_id and usage:
            self.usage.record_completion_tokens(tenant_id, int(usage.get("completion_tokens", 0)))
            if usage.get("preempted"):
                self.usage.record_preempted(tenant_id)

    def close_session(self, session_id: str, tenant_id: str) -> str | None:
        """Forget a session's routing; returns the node holding it (None when unknown/foreign)."""
        entry = self.session_nodes.get(session_id)
        if entry is None or entry[0] != tenant_id:
            return None
        del self.session_nodes[session_id]
        return entry[1]

    # ---- global block index ---------------------------------------------------------------
    def report_events(self, node_id: str, events: list[tuple[str, bytes]]) -> None:
        for kind, block_hash in events:
            holders = self.block_index.setdefault(block_hash, set())
            if kind == "stored":
                holders.add(node_id)
            else:
                holders.discard(node_id)
                if not holders:
                    del self.block_index[block_hash]

    def flush_index(self) -> None:
        self.block_index.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "queued": sum(max(0, len(n.in_flight) - n.capacity) for n in self.nodes.values()),
            "in_flight": {nid: len(n.in_flight) for nid, n in self.nodes.items()},
            "scheduler": self.scheduler,
            "prefill_tokens_per_s": {nid: n.prefill.tokens_per_s for nid, n in self.nodes.items()},
            "sessions": len(self.session_nodes),
            "indexed_blocks": len(self.block_index),
            "time_s": time.time(),
        }


GlobalSchedulerActor = ray.remote(GlobalScheduler)
