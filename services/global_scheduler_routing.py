"""The global scheduler's routing: which cache node a request that no session pins goes to.

A routing key (OpenAI's ``prompt_cache_key``) keeps its node while that node is healthy and
has room; otherwise the node holding the longest prefix on its device or host tier wins when
that prefix is long enough and longer than what recent traffic shares; otherwise the least
loaded node, where an interactive tenant's request (under a class-ordered scheduler) counts
interactive requests in flight first. Also how big a request is for admission
(``prompt_size``). ``Routing`` is a part of ``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from cache_node.scheduling import SLO_CLASS_RANK
from services.node_request import NodeRequest

MAX_ROUTING_KEYS = 65_536
"""Routing keys (``prompt_cache_key``) the scheduler remembers a node for, all tenants'."""

MAX_ROUTING_KEYS_PER_TENANT = 8_192
"""Routing keys one tenant's requests make the scheduler remember, its newest kept."""


MAX_PROMPT_ESTIMATE = 1 << 20
"""Largest prompt estimate admission takes from a request (far beyond any context)."""


class RoutingKeys:
    """Routing key -> the node that served it last, per tenant: each tenant's newest
    ``per_tenant`` keys, and at most ``total`` in all, a tenant holding the most giving up its
    oldest first when that is reached.

    Regression (security review F5): all tenants' keys shared one LRU of 65,536, so one tenant
    sending 65,536 distinct keys wiped every other tenant's node affinity."""

    def __init__(self, per_tenant: int = MAX_ROUTING_KEYS_PER_TENANT, total: int = MAX_ROUTING_KEYS) -> None:
        self.per_tenant, self.total = per_tenant, total
        self.by_tenant: dict[str, OrderedDict[str, str]] = {}
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def get(self, tenant_id: str, key: str) -> str | None:
        """The node ``tenant_id``'s ``key`` names, None when none is remembered."""
        keys = self.by_tenant.get(tenant_id)
        return None if keys is None else keys.get(key)

    def put(self, tenant_id: str, key: str, node_id: str) -> None:
        """``tenant_id``'s ``key`` names ``node_id`` now (its newest key)."""
        keys = self.by_tenant.setdefault(tenant_id, OrderedDict())
        if key not in keys:
            self.count += 1
        keys[key] = node_id
        keys.move_to_end(key)
        if len(keys) > self.per_tenant:
            self._evict(tenant_id)
        while self.count > self.total:
            self._evict(max(self.by_tenant, key=lambda t: len(self.by_tenant[t])))

    def forget(self, tenant_id: str) -> None:
        """Drop every key of ``tenant_id`` (it was deleted); an unknown id is a no-op.

        Regression (secrev18 E residue): a deleted tenant's keys held their places until
        other tenants' keys pushed them out."""
        self.count -= len(self.by_tenant.pop(tenant_id, {}))

    def _evict(self, tenant_id: str) -> None:
        keys = self.by_tenant[tenant_id]
        keys.popitem(last=False)
        self.count -= 1
        if not keys:
            del self.by_tenant[tenant_id]


def prompt_size(req: NodeRequest, new_tools: bool = False) -> int:
    """Prompt tokens of ``req`` for admission: its token ids, else the gateway's estimate for
    chat messages the node renders (``extra["prompt_tokens_estimate"]``; a malformed or
    negative value counts as 0, a huge one is capped at ``MAX_PROMPT_ESTIMATE``), with what its
    chat template renders of its tools when they are ``new_tools`` (``prompt_tokens_tools``, the
    same way): a session's first turn's, or a later turn's other than those its session's
    history holds (its last finished turn's, ``GlobalScheduler.session_tools``), which its node
    renders into the conversation anew. A later turn with the history's tools adds none.
    Regressions: a first turn's tools were never counted; then a later turn's were not, whatever
    they were (F3: a tenant added thousands of tokens of tools in a later turn, counted as 0).

    Regression (issue 21): every session turn reached admission as a 0-token prompt (its
    messages are rendered on the node), so the TTFT estimate and the prefill backlog never saw
    an agent's 500-token read, and admission never refused one that would miss."""
    if req.token_ids:
        return len(req.token_ids)
    keys = ("prompt_tokens_estimate", "prompt_tokens_tools") if new_tools else ("prompt_tokens_estimate",)
    return min(sum(_estimate(req.extra.get(key, "0")) for key in keys), MAX_PROMPT_ESTIMATE)


def tools_digest(tools: str) -> bytes:
    """A 16-byte digest of a request's tools (``NodeRequest.tools``: their compact JSON, "" for
    none), which a cache node compares whole to tell a session turn's tools from its history's:
    what the scheduler keeps of a session's tools (up to ``MAX_TOOLS_CHARS`` each)."""
    return hashlib.blake2b(tools.encode(), digest_size=16).digest()


def _estimate(text: str) -> int:
    """A gateway's token estimate (untrusted text): 0 when malformed or negative, at most
    ``MAX_PROMPT_ESTIMATE``."""
    try:
        return min(max(int(text), 0), MAX_PROMPT_ESTIMATE)
    except ValueError:
        return 0


class Routing:
    """Routing methods of ``GlobalScheduler`` (its ``nodes``, ``down``, ``index``,
    ``common_prefix``, ``routing_keys``, ``specs``, ``scheduler`` and
    ``affinity_min_blocks``)."""

    nodes: dict[str, Any]
    down: dict[str, str]
    index: Any
    common_prefix: Any
    routing_keys: RoutingKeys
    specs: dict[str, Any]
    scheduler: str
    affinity_min_blocks: int

    def _spec_by_id(self, tenant_id: str) -> Any: ...

    def _urgent(self, tenant_id: str) -> bool:
        """Whether ``tenant_id``'s requests are routed apart from each other: an interactive
        tenant's, when the nodes serve classes in order (``priority``, ``kvstrata``)."""
        if self.scheduler not in ("priority", "kvstrata"):
            return False
        spec = self.specs.get(tenant_id) or self._spec_by_id(tenant_id)
        return spec is not None and SLO_CLASS_RANK[spec.slo_class.value] == 0

    def _keyed_route(self, routing_key: str, block_hashes: list[bytes], urgent: bool = False,
                     tenant_id: str = "") -> str:
        """The node that served ``tenant_id``'s ``routing_key`` last while it is healthy and
        has room (fewer requests in flight than its capacity), else ``_route``'s pick, which
        the key then names (``RoutingKeys``: each tenant's newest keys are kept)."""
        if not routing_key:
            return self._route(block_hashes, urgent, tenant_id)
        node_id = self.routing_keys.get(tenant_id, routing_key)
        node = self.nodes.get(node_id or "")
        if node_id is None or node is None or node_id in self.down or len(node.in_flight) >= node.capacity:
            node_id = self._route(block_hashes, urgent, tenant_id)
        self.routing_keys.put(tenant_id, routing_key, node_id)
        return node_id

    def _route(self, block_hashes: list[bytes], urgent: bool = False, tenant_id: str = "") -> str:
        """The node holding the longest prefix of ``block_hashes`` on its device or host tier
        (first such node on a tie) when that is at least ``affinity_min_blocks`` blocks and
        longer than the common prefix of ``tenant_id``'s recent prompts in its namespace
        (``CommonPrefix.blocks_for``), else the node with the fewest requests
        in flight. Spill-held blocks count for no node.

        ``urgent`` (an interactive tenant's request under a class-ordered scheduler): the
        least loaded node is the one with the fewest interactive requests in flight, then the
        fewest requests. Nodes serve interactive prefills first, so what delays one is another
        interactive prefill on the same node: a lead agent's sub-agents, which start together
        and read at about the same time, are spread over the nodes rather than stacked on the
        node that has the least batch work at that instant (issue 21: two 500-token reads on
        one CPU node need more than the 2 s TTFT target between them)."""
        self.common_prefix.observe(block_hashes, tenant_id)
        healthy = [n for nid, n in self.nodes.items() if nid not in self.down]
        best, best_len = "", 0
        for node in healthy:
            n = self.index.node_prefix(node.node_id, block_hashes)
            if n > best_len:
                best, best_len = node.node_id, n
        common = self.common_prefix.blocks_for(block_hashes, tenant_id)
        if best and best_len >= self.affinity_min_blocks and best_len > common:
            return best
        if urgent:
            return min(healthy, key=lambda n: (len(n.urgent), len(n.in_flight), n.node_id)).node_id
        return min(healthy, key=lambda n: (len(n.in_flight), n.node_id)).node_id

