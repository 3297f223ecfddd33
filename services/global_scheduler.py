"""The global scheduler: tenants, admission, routing, and the global block index.

One named Ray actor. Gateways call ``authenticate`` and ``release`` per request through Ray and
send admissions on the data plane (``GlobalSchedulerService``, ``services.data_plane``;
``services.global_scheduler_admission``).
Cache nodes push their device- and host-tier block events and spill nodes their RAM- and
disk-tier events (``report_events``, batched, one call in flight per holder so they apply in
order: ``services.block_reports``) into one tier-aware
``BlockIndex``: block hash -> the ``(holder, tier)`` pairs holding it.

- Admission is a bounded queue across all nodes. With the ``kvstrata`` scheduler it also
  estimates each request's TTFT on its node (a fluid model of the node's prefill backlog by
  class and tenant, weighted as the node interleaves tenants; the request's cached prompt
  tokens per tier from the index, a prompt of the tenant in flight on the node counted once:
  an ``n`` > 1 body's later choices; the node's measured prefill speed, slowed by the pace its
  finished requests' first tokens showed; ``cache_node.scheduling.admission``) and rejects
  early with RESOURCE_EXHAUSTED and a retry hint when its class allows.
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

import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_node.scheduling import check_policy_name
from cache_node.scheduling.admission import FluidBacklog
from services import data_plane
from services.block_index import NODE_TIERS, SPILL_TIERS, BlockIndex, CommonPrefix
from services.data_plane_auth import Security
from services.global_scheduler_checks import Admission, AdmissionChecks, NodeLoad, prompt_key
from services.global_scheduler_members import GatewayRecord, Membership
from services.global_scheduler_pending import PendingRows
from services.global_scheduler_released import EarlyReleases
from services.global_scheduler_routing import Routing, RoutingKeys, prompt_size, tools_digest
from services.global_scheduler_sessions import Sessions
from services.global_scheduler_tenants import Tenants
from services.node_request import NodeRequest
from services.private_dir import ensure_private_dir
from services.recovery_report import MAX_REPORTED_BLOCKS, BadReport, block_changes
from tenants.model import TenantSpec
from tenants.store import TenantStore
from tenants.usage import UsageLedger

log = logging.getLogger(__name__)

NODE_RETRY_S = 1.0
"""The retry hint (``Admission.retry_after_s``, the gateway's ``retry-after-ms``) of a refusal
that passes once a node is routed to again: no node is healthy (``no_healthy_node``), the
session's node is down (``session_node_down``), the chosen node does not read its commands
(``node_not_reading``). A gateway's ``NodeMonitor`` asks a down node again every ``retry_s``
(0.5 s) and has it routed to at its first healthy answer; a second covers that poll and its
``node_up``."""

SESSION_LOST = ("this session's history was lost (its cache node or the service restarted): close the "
                "session (gRPC CloseSession, HTTP DELETE /v1/sessions/{session_id}, or `kvstrata "
                "close-session`) and start it again; its turns are refused until then, or until "
                "session_ttl_s has passed since its last turn")
"""The message of an ABORTED ``session_lost`` refusal (``lost_of``). It names the close of each
API (fresh-user trial 26d: HTTP clients were told only the gRPC method) and when the refusal
ends by itself."""


@dataclass(frozen=True)
class IndexHolders:
    """Who reports block events to the scheduler's index (``report_events``), and how many
    ``(holder, tier)`` pairs each may hold there: its capacity.

    ``node_blocks``: device pool blocks + host-tier slots of one cache node (every node of a
    deployment has the same sizing; the launcher derives it from ``NodeConfig``);
    ``spill_blocks``: spill node id -> its RAM + disk budgets in blocks. The cache nodes are the
    scheduler's ``nodes``. The default (tests of the plain class): no spill node, and a cache
    node at most ``MAX_REPORTED_BLOCKS``, what a restarted scheduler takes from one report.
    """

    node_blocks: int = MAX_REPORTED_BLOCKS
    spill_blocks: Mapping[str, int] = field(default_factory=dict)


REPORT_REFUSALS = ("unknown_holder", "malformed", "over_capacity")
"""Why ``report_events`` refused a batch (the keys of ``stats()["refused_block_reports"]``)."""


class GlobalScheduler(Sessions, AdmissionChecks, Tenants, Membership, Routing):
    """Plain class behind the ``GlobalSchedulerActor`` (``services.global_scheduler_admission``):
    admission, routing, release, the block index and stats. Its parts: ``Sessions`` (session
    routes, lost and closed sessions: ``services.global_scheduler_sessions``),
    ``AdmissionChecks`` (refusals, queue and node load: ``services.global_scheduler_checks``),
    ``Tenants`` (``services.global_scheduler_tenants``), ``Membership`` (nodes up and down,
    gateways attached and gone: ``services.global_scheduler_members``) and ``Routing``
    (``services.global_scheduler_routing``).

    Args:
        state_dir: where the tenant database lives (survives restarts); this user's alone, else
            UnsafeDirectoryError (``services.private_dir``).
        nodes: node id -> running capacity (max_num_seqs).
        queue_limit: requests allowed to wait beyond the nodes' running capacity. A full queue
            still admits a tenant holding less than its fair share of the whole (running
            capacity + ``queue_limit``, split evenly among the tenants with requests in flight,
            itself included), up to twice ``queue_limit`` waiting: one tenant's flood does not
            refuse the others (``_over_queue``).
        affinity_min_blocks: shortest device+host prefix (blocks) that routes by affinity.
        scheduler: the nodes' scheduling policy; "kvstrata" turns on TTFT-based admission.
        block_size: the nodes' tokens per block (prefix matches in the index count in blocks).
        clock: monotonic seconds (tests inject one).
        security: the scheduler's data-plane identity (``services.data_plane_auth``): its
            admission socket admits only gateways, its submits reach nodes only with its key.
            None: plaintext on loopback (unit tests only).
        max_sessions_per_tenant: a tenant's sessions (routed, or lost with a restarted node
            and not closed) past which a new one is refused.
        session_ttl_s: the nodes' session TTL: how long a session lost with its node's
            process stays refused (``lost_of``).
        holders: who may report block events, and each one's capacity (``IndexHolders``;
            None: its defaults).
        recovering: a restarted scheduler's recovery follows (``Recovery``): the sessions a
            previous process stored are marked lost after the nodes' reports
            (``lose_stored_sessions``), not here.
    """

    def __init__(
        self, state_dir: str, nodes: dict[str, int], queue_limit: int = 256, affinity_min_blocks: int = 4,
        scheduler: str = "fcfs", block_size: int = 16, clock: Any = time.monotonic,
        security: Security | None = None, max_sessions_per_tenant: int = 1024, session_ttl_s: float = 900.0,
        holders: IndexHolders | None = None, recovering: bool = False,
    ) -> None:
        self.security = security
        self.holders = holders or IndexHolders()
        self.refused_reports: Counter[str] = Counter()  # ``report_events`` batches refused, by why
        self.bad_messages = 0  # data-plane messages dropped as malformed
        self.ignored_speeds: Counter[str] = Counter()  # a node's speeds out of range (``NodeLoad.take_speeds``)
        ensure_private_dir(state_dir)  # tenants, keys: the owner's alone (another user's or a writable one: refused)
        self.store = TenantStore(Path(state_dir) / "tenants.sqlite")
        self.usage = UsageLedger()  # its counters as stored at the last flush (``flush_usage``)
        self.usage.restore(self.store.load_usage())
        self.usage_flush_lock = threading.Lock()  # one flush at a time, in the order taken
        self.own_rotations = self.own_rotation_limiter(clock)
        self.scheduler = check_policy_name(scheduler)
        self.clock = clock
        self.block_size = block_size
        by_class = scheduler in ("priority", "kvstrata")
        self.nodes = {nid: NodeLoad(nid, cap, backlog=FluidBacklog(by_class)) for nid, cap in nodes.items()}
        # tenant_id -> spec: every tenant of the store at start, then kept by register_tenant,
        # update_tenant, delete_tenant and authenticate (admission never reads the store); no
        # other id is admitted (``knows_tenant``)
        self.specs: dict[str, TenantSpec] = {t.tenant_id: t.spec for t in self.store.list()}
        # deleted tenants' ids (newest last, at most ``MAX_DELETED_TENANTS``; the store keeps
        # them across restarts): their requests are refused as the deleted tenant's
        self.deleted_tenants: OrderedDict[str, None] = OrderedDict.fromkeys(self.store.deleted_tenant_ids())
        self.queue_limit = queue_limit
        self.affinity_min_blocks = affinity_min_blocks
        self.index = BlockIndex()
        self.common_prefix = CommonPrefix()
        self.session_nodes: dict[str, tuple[str, str]] = {}  # session -> (tenant_id, node_id)
        # sessions a turn of which finished on their node: it holds their history, so a turn
        # routed there ``continues_session`` (one of a session whose first turn has not
        # finished does not: its retry would find no session)
        self.kept_sessions: set[str] = set()
        # session -> ``tools_digest`` of the tools its last finished turn was rendered with (the
        # tools its node's history holds); request -> that of a session turn in flight, until
        # its release: admission counts a turn's tools unless they are the session's
        # (``prompt_size``), as the node renders other tools into the whole conversation anew
        self.session_tools: dict[str, bytes] = {}
        self.turn_tools: dict[str, bytes] = {}
        # tenant -> its sessions whose history went with their node's process (``node_up``
        # after a restart) -> when, oldest first: a turn of one is refused until the session
        # is closed or ``session_ttl_s`` passed; they count as the tenant's sessions
        # (``max_sessions_per_tenant``), so each tenant's are bounded and none is ever dropped
        # for another's
        self.lost_sessions: dict[str, dict[str, float]] = {}
        self.max_sessions_per_tenant = max_sessions_per_tenant
        # not stored yet (``flush_sessions``): marks, and routes (``note_route``)
        self.lost_changes = PendingRows(max_sessions_per_tenant)
        self.open_changes = PendingRows(max_sessions_per_tenant)
        self.lost_changes_lock = threading.Lock()
        self.session_ttl_s = session_ttl_s
        self.restore_lost_sessions()  # a previous process's marks: its sessions stay refused
        self.sessions_per_tenant: Counter[str] = Counter()  # routes in ``session_nodes``
        # tenant -> its routes rebuilt from a node's report (``route_unconfirmed``) that no
        # turn confirmed yet -> when, oldest first: dropped ``session_ttl_s`` later
        self.unconfirmed_sessions: dict[str, dict[str, float]] = {}
        # a previous process's routes: those no node reports are lost (``lose_stored_sessions``)
        self.stored_sessions: dict[str, tuple[str, float]] = {}
        self.restore_open_sessions()
        if not recovering:  # a first start: no node holds any session yet
            self.lose_stored_sessions()
        # routing key (OpenAI's prompt_cache_key, tenant-scoped) -> node, per tenant
        self.routing_keys = RoutingKeys()
        # request -> (tenant_id, node_id, the session it opened: "" when none or already
        # known, its session: "" when none)
        self.requests: dict[str, tuple[str, str, str, str]] = {}
        # request -> the event inbox of the gateway that admitted it (``admit_and_submit``)
        self.request_gateways: dict[str, str] = {}
        self.gateways: dict[str, GatewayRecord] = {}  # gateway actor id -> ``attach_gateway``
        self.gone_gateways: OrderedDict[str, bool] = OrderedDict()  # dead gateways' event inboxes
        self.node_inboxes: dict[str, str] = {}  # node id -> data-plane command inbox (attach_nodes)
        self.down: dict[str, str] = {}  # node id -> why it is not routed to (node_down .. node_up)
        self.node_pids: dict[str, tuple[int, int]] = {}  # node id -> (pid, restarts) at its last ``node_up``
        self.metrics_ports: dict[str, int] = {}  # node id -> the port of its /metrics (``record_metrics_port``)
        # node id -> {session: (tenant, its turns in flight)} closed while the node was down:
        # sent on at its ``node_up``
        self.closed_while_down: dict[str, dict[str, tuple[str, list[str]]]] = {}
        self.commands: Any = None  # sends submit commands to node inboxes
        # request ids released before their admission arrived: it is refused (``admit_and_submit``)
        self.released_early = EarlyReleases(clock)
        self.refused_released_early = 0  # admissions refused so

    # ---- admission and routing ------------------------------------------------------------
    def admit(
        self, tenant_id: str, request_id: str, session_id: str = "", block_hashes: list[bytes] | None = None,
        prompt_tokens: int = 0, routing_key: str = "", key_id: str = "", spec: str = "",
        siblings: tuple[str, ...] = (),
    ) -> Admission:
        """Pick a node for a request or reject it (RESOURCE_EXHAUSTED with a retry hint).

        Args:
            block_hashes: chained hashes of the prompt's full blocks as the node will compute
                them (``cache_node.hashing.hash_prompt_blocks``); [] when unknown (a session
                turn, whose prompt starts with history the gateway does not see).
            prompt_tokens: prompt length in tokens (0 when unknown).
            routing_key: a routing hint (``_keyed_route``); "" = none.
            key_id: the id of the API key the gateway authenticated the request with ("" =
                not said): one removed since (``TenantStore.key_removed``) is refused.
            spec: the digest of the tenant spec the gateway prepared the request with
                (``tenants.model.spec_digest``; "" = not said): one other than the tenant's
                current spec's is refused, ``tenant_changed`` (``_changed_spec``).
            siblings: the request ids of the earlier choices of this request's ``n`` > 1 body
                (the gateway's word, ``MAX_SIBLINGS`` at most: ``_admission_request``); only
                those of the tenant in flight on the node with this prompt count
                (``_own_body``): no work ahead of it for early rejection.

        Returns:
            An ``Admission``: the node and ``spill_blocks`` (the prefetch hint), or a code
            "RESOURCE_EXHAUSTED" / "PERMISSION_DENIED" / "UNAVAILABLE" (no node is healthy,
            or the session's node is down) / "ABORTED" (the session's history was lost with
            its node's process: ``node_up``) / "UNAUTHENTICATED" (the tenant was deleted:
            ``delete_tenant``; or it is no tenant of the store at all: ``knows_tenant``; or
            its key was rotated away: ``key_revoked``) / "UNAVAILABLE" ``tenant_changed``
            (the gateway's spec is stale: it prepares the request anew) with a
            message. A refusal that passes with time has a ``retry_after_s`` > 0: ``queue_full``
            and ``ttft_estimate`` (how long the backlog needs), and every UNAVAILABLE
            (``NODE_RETRY_S``; ``tenant_changed``: ``TENANT_CHANGED_RETRY_S``). ``too_many_sessions`` has none: it stands until the tenant
            closes a session or one expires; nor do the others, which no wait undoes.

        Regression: when a node was marked down (a missed health poll was enough) its
        sessions' routes were dropped; the next turn of one was routed by load as a first
        turn and answered from its new tokens alone, silently, while the node still held the
        history. Now a session's turn waits for its node (UNAVAILABLE, retry) and is refused
        once the history is known lost, never computed without it.

        Regression (secrev18 E): a deleted tenant's requests still in a gateway's pipeline
        were admitted after its ``end_tenant`` (they ran, and opened session routes nothing
        closed), and each re-read every tenant from SQLite on this loop (``_spec_by_id``: 33 ms
        at 300 tenants). They are refused UNAUTHENTICATED now, and no admission reads the store.

        Regression (secrev18 E residue): only the deleted ids remembered in memory were refused,
        none after a scheduler restart, and any id not in ``specs`` (deleted before a restart,
        or never a tenant) was admitted with the default class. Only tenants of the store are
        admitted now (``_unknown_tenant``), and deletions are kept by the store.
        """
        refused = self._unknown_tenant(tenant_id) or self._removed_key(key_id) or self._changed_spec(tenant_id, spec)
        if refused is not None:
            return refused
        self.expire_unconfirmed(tenant_id)
        if len(self.down) == len(self.nodes):
            # why each is down stays with operators (``down``: Stats, the logs), never in a
            # tenant's refusal (review s35 C S1: a step loop's exception text reached every tenant)
            return Admission(code="UNAVAILABLE", message="no cache node is healthy; retry",
                             reason="no_healthy_node", retry_after_s=NODE_RETRY_S)
        sticky = self.session_nodes.get(session_id) if session_id else None
        if sticky is not None and sticky[0] != tenant_id:
            return Admission(code="PERMISSION_DENIED", message=f"session {session_id!r} belongs to another tenant",
                             reason="session_of_another_tenant")
        if sticky is not None and sticky[1] in self.down:
            self.usage.record_rejected(tenant_id)
            return Admission(code="UNAVAILABLE", reason="session_node_down", retry_after_s=NODE_RETRY_S,
                             message="the cache node holding this session's history is down: "
                             "retry once it is back")
        lost = self.lost_of(tenant_id)
        if sticky is None and session_id in lost:
            self.usage.record_rejected(tenant_id)
            return Admission(code="ABORTED", reason="session_lost", message=SESSION_LOST)
        if (session_id and sticky is None
                and self.sessions_per_tenant[tenant_id] + len(lost) >= self.max_sessions_per_tenant):
            # regression (security review): every new session id kept its history, a route
            # here and its messages on a node until its TTL, without bound: one tenant's
            # thousands of sessions grew every node's memory and per-step scans. Sessions lost
            # with a restarted node count until closed (security review F6: their markers
            # were capped for all tenants together, and past the cap a lost session's next
            # turn ran without its history)
            # no retry hint, deliberately: the refusal stands until the tenant closes a
            # session or one idles out (``session_ttl_s``), which no wait of ours predicts
            self.usage.record_rejected(tenant_id)
            return Admission(code="RESOURCE_EXHAUSTED", reason="too_many_sessions",
                             message=f"the tenant has {self.max_sessions_per_tenant} open sessions "
                             f"(max_sessions_per_tenant; {len(lost)} of them lost in a restart): "
                             "close one (CloseSession) or let an idle one expire")
        queued = self._queued()
        if self._over_queue(tenant_id, queued):
            self.usage.record_rejected(tenant_id)
            return Admission(
                code="RESOURCE_EXHAUSTED", reason="queue_full",
                message=f"queue full ({queued} waiting, limit {self.queue_limit})",
                retry_after_s=1.0 + queued / max(1, sum(n.capacity for n in self.nodes.values())),
            )
        urgent = self._urgent(tenant_id)
        node_id = (sticky[1] if sticky is not None
                   else self._keyed_route(routing_key, block_hashes or [], urgent, tenant_id))
        prefix = self.index.prefix_tiers(node_id, block_hashes or [])
        prompt = prompt_key(tenant_id, block_hashes or []) if sticky is None else None
        cached = self._sibling_cached(self.nodes[node_id], prompt, len(block_hashes or []),
                                      self._cached_tokens(prefix, prompt_tokens))
        rejected = self._slo_admission(tenant_id, node_id, cached, request_id,
                                       self._own_body(tenant_id, node_id, prompt, siblings))
        if rejected is not None:
            self.usage.record_rejected(tenant_id)
            return rejected
        self.nodes[node_id].in_flight.add(request_id)
        self.nodes[node_id].hold_prompt(request_id, prompt)
        if urgent:
            self.nodes[node_id].urgent.add(request_id)
        self.requests[request_id] = (tenant_id, node_id, session_id if sticky is None else "", session_id)
        if session_id and sticky is None:
            self.session_nodes[session_id] = (tenant_id, node_id)
            self.sessions_per_tenant[tenant_id] += 1
            self.note_route(tenant_id, session_id, new=True)
            self.sessions_store_due()  # the actor stores it at once (in a worker thread)
        elif sticky is not None:
            self.confirm_session(session_id)
            self.note_route(tenant_id, session_id)
        self.usage.record_request(tenant_id)  # prompt and cached tokens: at release, from the node
        return Admission(node_id=node_id, spill_blocks=prefix.spill,
                         continues_session=sticky is not None and session_id in self.kept_sessions)

    def _own_body(self, tenant_id: str, node_id: str, prompt: Any, siblings: tuple[str, ...]) -> list[str]:
        """Of ``siblings`` (ids the gateway named as the earlier choices of a request's body:
        untrusted), each once, those in flight on ``node_id`` for ``tenant_id`` with the
        request's ``prompt`` (``prompt_key``; None, a session turn's: none).

        Regression (eefd578's residue): every request of the tenant in flight on the node with
        the same prompt counted as the body's own, so two separate identical requests sent at
        once were no work ahead of each other, and the second was admitted missing its target
        where it had been refused with a retry hint."""
        if prompt is None:
            return []
        node = self.nodes[node_id]
        return [rid for rid in dict.fromkeys(siblings)
                if node.prompt_of.get(rid) == prompt and self.requests.get(rid, ("",))[0] == tenant_id]

    def admit_and_submit(self, req: NodeRequest, subscriber: str, block_hashes: list[bytes],
                         key_id: str = "", spec: str = "", siblings: tuple[str, ...] = ()) -> Admission:
        """``admit`` ``req``, and when admitted start it on the chosen node, whose events for it
        go to ``subscriber`` (a gateway's event inbox, ``services.data_plane``).

        The node hears of the request from here (a data-plane message to its command inbox),
        one hop sooner than if the gateway waited for this reply and sent it on. A session-less
        prompt the index places partly in the spill tier is marked for prefetch. A session turn's
        ``continues_session`` and ``opens_session`` (``NodeRequest``) are set here from the
        admission, whatever the gateway sent.

        A request released before its admission arrived (``release``: its gateway gave up on
        it) is refused CANCELLED (reason ``released_early``) and sent to no node. Regression
        (review s34 B F7): after a scheduler stall past the gateway's ``admit_timeout_s``, the
        gateway's ``release`` (a Ray call, run first when the loop resumes) overtook the
        admission still unread in the socket; the admission was then admitted and held a place
        in its node's ``in_flight`` and its tenant's share for as long as the scheduler ran.

        Raises:
            KeyError: the chosen node was never attached (``attach_nodes``).
        """
        if self.released_early.take(req.request_id):
            self.refused_released_early += 1
            n = self.refused_released_early
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...
                log.warning("refused an admission its gateway had released before it arrived (%d so far): %.200s",
                            n, req.request_id)
            return Admission(code="CANCELLED", reason="released_early",
                             message="the gateway released this request before its admission arrived (it had "
                             "given up waiting for the scheduler)")
        if subscriber in self.gone_gateways:
            # no retry hint: this gateway's requests are refused while it runs (review of 4bf5623,
            # L2: a client honouring the hint retried it for ever)
            return Admission(code="UNAVAILABLE", message="the gateway that sent this request is gone",
                             reason="gateway_gone")
        tools = tools_digest(req.tools)
        # its tools count unless they are those its session's history holds (a first turn's
        # never are; regression F3: a later turn's were never counted, whatever they were)
        new_tools = (not req.session_id or req.session_id not in self.session_nodes
                     or self.session_tools.get(req.session_id) != tools)
        adm = self.admit(req.tenant, req.request_id, req.session_id, block_hashes, prompt_size(req, new_tools),
                         req.extra.get("routing_key", ""), key_id, spec, siblings)
        if adm.code == "OK":
            if req.session_id:
                self.turn_tools[req.request_id] = tools
            self.request_gateways[req.request_id] = subscriber
            if req.sampling.structured_output is not None:  # its first token waits for its grammar's
                # compile too: a sample only with that wait taken out (``NodePace.finished``).
                # Regression (review 31): it was no sample, and a tenant sending only structured
                # requests was judged by another's pace for ever (admitted on probes alone)
                self.nodes[adm.node_id].pace.structured(req.request_id)
            if block_hashes and not req.session_id:
                req = dataclasses.replace(req, prefetch=adm.spill_blocks > 0)
            # ours to say, not the gateway's: a turn opens its session when this admission
            # made its route (``requests``' opened session), and a node drops a stale session
            # of that id for it (regression: such a turn was appended there to the history of
            # a session the client had closed, or the scheduler had expired or lost)
            opens = bool(self.requests[req.request_id][2])
            if (req.continues_session, req.opens_session) != (adm.continues_session, opens):
                req = dataclasses.replace(req, continues_session=adm.continues_session, opens_session=opens)
            sent = self.commands.send(self.node_inboxes[adm.node_id], {
                "op": "submit", "req": data_plane.request_to_wire(req), "sub": subscriber})
            if sent is False:  # the node's inbox is full: nothing will ever answer this request
                # (regression: its gateway waited for events forever)
                self.release(req.request_id, None)
                return Admission(code="UNAVAILABLE", reason="node_not_reading", retry_after_s=NODE_RETRY_S,
                                 message=f"cache node {adm.node_id} is not reading its commands; retry")
        return adm

    def _spec_by_id(self, tenant_id: str) -> TenantSpec | None:
        """The spec of ``tenant_id`` (``specs``: loaded at start and kept current, so this never
        reads the store; regression, secrev18 E: a miss re-read every tenant on the loop)."""
        return self.specs.get(tenant_id)

    def release(self, request_id: str, usage: dict[str, Any] | None = None) -> None:
        """A request ended (any way); account its tokens.

        Args:
            usage: the node's ``finished`` event, or for a request that ended without one
                (cancelled, past its deadline, failed) the gateway's count of what it ran:
                ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``; None: nothing ran.

        A release of a request not admitted here is remembered (``released_early``): its
        admission may still arrive (its gateway gave up waiting for it, and the release,
        a Ray call, can overtake the admission on the data plane), and is then refused.
        """
        if request_id not in self.requests:
            self.released_early.note(request_id)
        tenant_id, node_id, opened, session = self.requests.pop(request_id, ("", "", "", ""))
        self.request_gateways.pop(request_id, None)
        tools = self.turn_tools.pop(request_id, None)
        # finished on its node, not aborted or failed there: its session keeps the turn
        # (``LLMEngine._finish`` keeps no session whose first turn ends so)
        kept = (bool(usage) and "prefill_tokens_per_s" in usage
                and usage.get("finish_reason") not in ("abort", "error", "rejected"))
        if (opened and not kept and self.session_nodes.get(opened) == (tenant_id, node_id)
                and not any(session == opened for *_, session in self.requests.values())):
            # the first turn of a session did not finish (the node refused it, it was cancelled,
            # drained or failed) and no other turn of it is in flight: the node holds no
            # history the session must return to and never reports it ended (regression: such
            # entries stayed forever; unique session ids grew this map without bound, and then
            # used up the tenant's ``max_sessions_per_tenant``). Regression: a cancelled first
            # turn's late release dropped the route its retry, admitted meanwhile, had set; the
            # next turn went to another node and answered without the history
            self.drop_session_route(opened)
        if opened and not kept:
            # its node restarted before the first turn ended: nothing was lost, the session
            # never held a turn (regression, diff review: the retry was refused session_lost)
            self.forget_lost(tenant_id, opened)
        if kept and session and self.session_nodes.get(session) == (tenant_id, node_id):
            self.kept_sessions.add(session)
            if tools is not None:  # its node's history holds them now (a turn not kept leaves the last's)
                self.session_tools[session] = tools
            self.note_route(tenant_id, session)  # its node's TTL counts from the turn's end
        if node_id in self.nodes:
            self.nodes[node_id].in_flight.discard(request_id)
            self.nodes[node_id].urgent.discard(request_id)
            self.nodes[node_id].drop_prompt(request_id)
            # what the fluid backlog has not drained of it yet: never prefilled now (cancelled,
            # refused on its node, an ``n`` > 1 body's choice rolled back) or already done
            # (regression, review 28b F3/F4: only the clock took it out, and a tenant dropping
            # its requests, or one client's refused n > 1 bodies, kept others refused)
            self.nodes[node_id].backlog.release(request_id)
            # its first token's time, against what admission predicted, is how much slower than
            # its meter the node's prefill queue runs (``NodePace``; the node's word, bounded; a
            # structured request's less its grammar's compile, ``grammar_wait_ms``)
            if kept and usage is not None:
                self.nodes[node_id].pace.finished(request_id, usage.get("ttft_ms"), self.clock(),
                                                  usage.get("grammar_wait_ms"))
            else:
                self.nodes[node_id].pace.forget(request_id)
        if usage and node_id in self.nodes and "prefill_tokens_per_s" in usage:  # a finished one
            for name in self.nodes[node_id].take_speeds(usage):  # a number out of range: ignored
                self.ignored_speeds[name] += 1
                if self.ignored_speeds[name] & (self.ignored_speeds[name] - 1) == 0:  # 1, 2, 4, ...: bounded
                    log.warning("ignored cache node %s's %s %.100r (%d ignored so far)", node_id, name,
                                usage[name], self.ignored_speeds[name])
        if usage and self.knows_tenant(tenant_id):  # not one deleted since its admission
            self.usage.record_completion_tokens(tenant_id, int(usage.get("completion_tokens", 0)))
            if "prompt_tokens" in usage:
                cached = {k: int(v) for k, v in (usage.get("cached_tokens") or {}).items()}
                self.usage.record_prompt(tenant_id, prompt_tokens=int(usage["prompt_tokens"]),
                                         cached_tokens=cached)
            if usage.get("preempted"):
                self.usage.record_preempted(tenant_id)

    # ---- global block index ---------------------------------------------------------------
    def report_events(
        self, holder_id: str, events: list[tuple[str, bytes, str]] | list[tuple[str, bytes]],
        reset: bool = False,
    ) -> int:
        """Apply a holder's block events to the index; returns how many were applied.

        Every batch is untrusted input, checked whole before anything is applied, as a restarted
        scheduler checks a holder's report (``recovery_report.block_changes``: hashes of at most
        ``MAX_HASH_BYTES`` bytes, at most ``MAX_REPORTED_BLOCKS`` events). A batch is refused
        (nothing applied, 0 returned, counted in ``stats()["refused_block_reports"]`` and logged:
        the 1st, 2nd, 4th, ... of each kind) when ``holder_id`` is none of ``nodes`` and
        ``holders.spill_blocks`` ("unknown_holder"), an event is malformed or names a tier not
        the holder's own ("malformed"), or the holder would then hold more pairs than its
        capacity ("over_capacity": ``IndexHolders``). It never raises: a holder's reporter
        (``services.block_reports``) only logs a failed call, and a refusal is its answer.

        A Ray call carries no caller identity, so a holder is known by the id it gives: a
        process inside the cluster (Ray, token-authenticated, is the trust boundary) can report
        as another known holder, its ``reset`` included. What is bounded is the index: known
        holders only, each within its capacity, so a wrong report costs routing quality (the
        index steers; the node's token-checked cache decides), never scheduler memory.

        Regression (review 25a D): any holder id, tier, hash length and number of events was
        taken: one call stored a 16 MiB hash, another 4,194,305 events (+2.2 GB), and a holder
        that never reported removals grew the index without end.

        Args:
            holder_id: a cache node id (tiers "device", "host") or a spill node id (tiers
                "spill_ram", "spill_disk").
            events: ``(event, block_hash, tier)`` in the order they happened, ``event``
                "stored" or "removed"; a 2-tuple ``(event, block_hash)`` means tier "device".
            reset: forget everything ``holder_id`` held first (it restarted and reports its
                surviving blocks as stored).
        """
        try:
            if type(holder_id) is not str or (holder_id not in self.nodes
                                              and holder_id not in self.holders.spill_blocks):
                raise _Refused("unknown_holder", "not a cache node or spill node of this scheduler")
            node = holder_id in self.nodes
            try:
                checked = block_changes(events, NODE_TIERS if node else SPILL_TIERS)
            except BadReport as exc:
                raise _Refused("malformed", str(exc)) from None
            capacity = self.holders.node_blocks if node else self.holders.spill_blocks[holder_id]
            held = self.index.pairs_after(holder_id, checked, reset)
            if held > capacity:
                raise _Refused("over_capacity", f"it would hold {held} blocks, its capacity is {capacity}")
        except _Refused as refused:
            self.refused_reports[refused.why] += 1
            n = self.refused_reports[refused.why]
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood of them logs little
                log.warning("refused block events reported as %.100r (%s, %d refused so far): %s", holder_id,
                            refused.why, n, refused.detail)
            return 0
        if reset:
            self.index.forget(holder_id)
        return self.index.apply(holder_id, checked)

    def flush_index(self) -> None:
        """Forget every block in every tier.

        Admin ``Flush`` calls it after every cache node's ``flush`` dropped its device and
        host blocks and, through its spill client, every spill node's blocks; the removals
        those report afterwards are no-ops here.
        """
        self.index.clear()

    def stats(self) -> dict[str, Any]:
        """Queue and load per node, sessions, and the index: ``indexed_blocks`` distinct
        hashes, ``indexed_blocks_by_tier`` block copies per tier (summed over holders).
        ``ignored_speeds``: speeds nodes reported out of range, by name (``release``);
        ``refused_block_reports``: batches of block events refused, by why (``report_events``);
        ``refused_released_early``: admissions refused as released before they arrived
        (``admit_and_submit``)."""
        return {
            "queued": self._queued(),
            "in_flight": {nid: len(n.in_flight) for nid, n in self.nodes.items()},
            "scheduler": self.scheduler,
            "prefill_tokens_per_s": {nid: n.prefill.tokens_per_s for nid, n in self.nodes.items()},
            "sessions": len(self.session_nodes),
            "bad_messages": self.bad_messages,
            "refused_released_early": self.refused_released_early,
            "ignored_speeds": dict(self.ignored_speeds),
            "down": dict(self.down),
            "indexed_blocks": len(self.index),
            "indexed_blocks_by_tier": self.index.pairs_per_tier(),
            "refused_block_reports": dict(self.refused_reports),
            "time_s": time.time(),
        }


class _Refused(Exception):
    """A batch of block events ``report_events`` refuses: ``why`` (one of
    ``REPORT_REFUSALS``) and its ``detail``."""

    def __init__(self, why: str, detail: str) -> None:
        super().__init__(why, detail)
        self.why, self.detail = why, detail
