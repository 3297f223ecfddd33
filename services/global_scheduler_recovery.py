"""A restarted global scheduler rebuilds what lived only in its memory (docs/architecture.md,
'Failure handling': Scheduler gone and back).

Ray restarts the scheduler's actor (``scheduler_max_restarts``) with its constructor arguments:
the tenant store (SQLite) and the data-plane keys are the same, but routes, sessions, requests
in flight and the block index are gone. Before it serves anything (in its constructor) it asks
every cache node for a ``CacheNode.recovery_report`` and every spill node for its
``SpillNode.held_blocks``, waits at most ``RecoveryPeers.report_timeout_s`` for them, and feeds
them through the paths a rejoining node already takes: ``node_up`` (command inbox, process
identity), ``node_down`` (a node that does not answer in time, is unhealthy or sends a bad
report), ``report_events(..., reset=True)`` (its blocks, as a restarted spill node reports its
disk tier). Sessions and requests in flight are rebuilt from the reports; each gateway, once it
sees the scheduler back, attaches again and says which of the rebuilt requests it still waits
for (``reconcile_gateway``); the others are released.

Every report is untrusted input: each field is checked (types, sizes, ids scoped to their
tenant, tenants of the store: ``services.recovery_report``), and what fails a check is dropped
and counted in ``bad_messages``.

``Recovery`` is a part of ``services.global_scheduler_admission.GlobalSchedulerService``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.actor_refs import ActorRef
from services.block_index import NODE_TIERS, SPILL_TIERS
from services.recovery_report import (
    BadReport,
    address,
    block_events,
    int_field,
    request_row,
    rows,
    session_row,
)
from services.spill_watch import START_GRACE_S

if TYPE_CHECKING:
    from collections import Counter

    from services.global_scheduler_checks import NodeLoad
    from services.spill_recreate import RecreatePolicy, SpillRecipe

log = logging.getLogger(__name__)

GATEWAY_REATTACH_S = 60.0
"""How long requests rebuilt for a gateway wait for it to attach again; past it, it counts as
gone (``gateway_gone``: its requests released, aborted on the nodes)."""


@dataclass(frozen=True)
class RecoveryPeers:
    """Where a restarted scheduler finds the actors it rebuilds its state from (by name: a
    restart never depends on handles the creating driver owned, ``services.actor_refs``).

    ``namespace``: the Ray namespace of the deployment (its cache nodes are named by their
    ids); ``spill_nodes``: the spill nodes' actor names; ``report_timeout_s``: how long the
    restarted scheduler waits for their reports before a cache node that has not answered
    counts as down (it rejoins through a gateway's ``NodeMonitor``, as any down node), and how
    long the spill watch waits for a node's ``report_held``; ``spill_recipe`` and
    ``spill_recreate``: how the launcher created the spill nodes and how often a dead one is
    created again (``services.spill_recreate``; None: never); ``start_grace_s``: on a first
    start, how long a spill node name with no actor yet is not taken for a dead node, unless the
    launcher's ``attach_nodes`` ends it sooner (``SpillWatch.grace_s``; the launcher passes its
    ``start_timeout_s``)."""

    namespace: str
    spill_nodes: tuple[str, ...] = ()
    report_timeout_s: float = 10.0
    spill_recipe: SpillRecipe | None = None
    spill_recreate: RecreatePolicy | None = None
    start_grace_s: float = START_GRACE_S

    def __post_init__(self) -> None:
        if not math.isfinite(self.report_timeout_s) or self.report_timeout_s <= 0:
            raise ValueError(f"report_timeout_s must be a finite number > 0, got {self.report_timeout_s}")
        if not self.start_grace_s >= 0:
            raise ValueError(f"start_grace_s must be >= 0, got {self.start_grace_s}")


class Recovery:
    """The recovery part of ``GlobalSchedulerService`` (which provides these attributes)."""

    nodes: dict[str, NodeLoad]
    session_nodes: dict[str, tuple[str, str]]
    kept_sessions: set[str]
    sessions_per_tenant: Counter[str]
    max_sessions_per_tenant: int
    queue_limit: int
    requests: dict[str, tuple[str, str, str, str]]
    request_gateways: dict[str, str]
    node_inboxes: dict[str, str]
    commands: Any
    bad_messages: int
    down: dict[str, str]
    index: Any

    if TYPE_CHECKING:
        def knows_tenant(self, tenant_id: str) -> bool: ...
        def node_down(self, node_id: str, reason: str) -> None: ...
        def node_up(self, node_id: str, inbox: str, pid: int = 0, previous_pid: int = 0,
                    restarts: int = -1, previous_restarts: int = -1) -> None: ...
        def report_events(self, holder_id: str, events: Any, reset: bool = False) -> int: ...
        def record_metrics_port(self, node_id: str, port: int) -> bool: ...
        def release(self, request_id: str, usage: dict[str, Any] | None = None) -> None: ...
        def gateway_gone(self, subscriber: str) -> list[str]: ...
        def _urgent(self, tenant_id: str) -> bool: ...
        def route_unconfirmed(self, tenant_id: str, session_id: str, node_id: str) -> None: ...
        def confirm_session(self, session_id: str) -> None: ...
        def drop_session_route(self, session_id: str) -> None: ...
        def _detach_turns(self, session_id: str, node_id: str) -> list[str]: ...
        def mark_lost(self, tenant_id: str, session_id: str) -> None: ...
        def lost_of(self, tenant_id: str) -> dict[str, float]: ...

    # the requests rebuilt from the nodes' reports, by id -> their gateway's event inbox, until
    # released or reconciled (``reconcile_gateway``)
    recovered_requests: dict[str, str]
    # event inbox -> the requests rebuilt for it that ``forget_unattached`` released
    released_unattached: dict[str, list[str]]
    # sessions two reports claimed (``_claim``): routed to no node
    contested_sessions: set[str]

    # ---- gathering the reports (Ray) ---------------------------------------------------------
    def recover(self, peers: RecoveryPeers) -> None:
        """Ask every cache node and spill node for its report, wait at most
        ``peers.report_timeout_s`` for all of them, and apply each (``apply_node_report``,
        ``apply_spill_report``). A cache node that is not found, fails the call, does not answer
        in time or sends a bad report is down (``node_down``); a spill node's blocks are then
        unknown until it reports new ones. Blocks the caller (the actor's constructor: nothing
        is served before the state is rebuilt)."""
        import ray  # only the actor recovers; the plain class is tested without Ray

        self.recovered_requests, self.contested_sessions = {}, set()
        asked: dict[Any, tuple[str, str]] = {}  # ref -> (kind, name)
        for kind, names in (("node", list(self.nodes)), ("spill", list(peers.spill_nodes))):
            for name in names:
                try:
                    actor = ActorRef(name, peers.namespace).resolve()
                    ref = actor.recovery_report.remote() if kind == "node" else actor.held_blocks.remote()
                except Exception as exc:  # noqa: BLE001 - not placed, or gone: it is down
                    self._not_reported(kind, name, f"not found: {type(exc).__name__}: {exc}")
                    continue
                asked[ref] = (kind, name)
        ready, late = (ray.wait(list(asked), num_returns=len(asked), timeout=peers.report_timeout_s)
                       if asked else ([], []))
        for ref in late:
            kind, name = asked[ref]
            self._not_reported(kind, name, f"did not answer within {peers.report_timeout_s:g} s")
            ray.cancel(ref)
        for ref in ready:
            kind, name = asked[ref]
            try:
                report = ray.get(ref)
                if kind == "node":
                    self.apply_node_report(name, report)
                else:
                    self.apply_spill_report(name, report)
            except BadReport as exc:
                self.bad_messages += 1
                self._not_reported(kind, name, f"sent a bad report: {exc}")
            except Exception as exc:  # noqa: BLE001 - a failed call: as no answer
                self._not_reported(kind, name, f"failed: {type(exc).__name__}: {str(exc)[:200]}")
        log.warning("restarted global scheduler: %d sessions, %d requests in flight, %d blocks rebuilt; down: %s",
                    len(self.session_nodes), len(self.requests), len(self.index), self.down or "none")
        self.contested_sessions = set()  # no report comes after these

    def _not_reported(self, kind: str, name: str, why: str) -> None:
        if kind == "node":
            self.node_down(name, f"cache node {name} {why} (scheduler restart)")
        log.warning("restarted global scheduler: %s %s %s", "cache node" if kind == "node" else "spill node", name, why)

    # ---- applying them (plain) --------------------------------------------------------------
    def apply_node_report(self, node_id: str, report: Any) -> None:
        """Rebuild what cache node ``node_id`` holds from its ``CacheNode.recovery_report``:
        an unhealthy node is down (``node_down``); a healthy one is routed to again
        (``node_up`` with its inbox and process identity), its device- and host-tier blocks
        replace what the index held for it, its sessions some turn of which finished there
        are routed to it again (their next turn ``continues_session``), and its requests in
        flight are admitted again (at most ``request_share``; the rest run on uncounted),
        released when their gateway does (or does not, at ``reconcile_gateway``). A session no turn of which finished there is routed only when
        a turn of it is among those requests: that turn opened it, as at admission, so its
        failure drops the route (``release``); without one the node holds no history of it.
        Sessions that another node claims too (both are refused: ``_claim``), and those past
        their tenant's ``max_sessions_per_tenant``, are left out (counted in
        ``bad_messages``); the routes rebuilt last ``session_ttl_s`` unless a turn confirms
        them (``route_unconfirmed``).

        Regression (review 24r F1): every reported session was routed before the requests were
        rebuilt, so a first turn in flight (a node reports its session, created when the turn
        started) was not recorded as the one that opened it; when it failed, its route stayed
        for the scheduler's lifetime and counted against ``max_sessions_per_tenant``.

        Raises:
            BadReport: a field fails its check (nothing applied); KeyError: an unknown node.
        """
        if node_id not in self.nodes:
            raise KeyError(f"unknown cache node {node_id!r}")
        if not isinstance(report, dict):
            raise BadReport(f"a report is a dict, got {type(report).__name__}")
        if report.get("healthy") is not True:
            failure = report.get("failure")
            self.node_down(node_id, failure[:500] if isinstance(failure, str) and failure
                           else f"cache node {node_id} reported itself unhealthy")
            return
        pid, restarts = int_field(report, "pid", 0), int_field(report, "restarts", 0)
        inbox = address(report.get("data_address"), "data_address")
        events = block_events(report.get("blocks"), NODE_TIERS)
        sessions = rows(report.get("sessions"), 3, "sessions", session_row)
        requests = rows(report.get("requests"), 4, "requests", request_row)
        limit = self.nodes[node_id].capacity + 2 * self.queue_limit  # what admission ever lets in
        if len(requests) > limit:
            raise BadReport(f"{len(requests)} requests in flight, more than the {limit} admission allows")
        self.node_up(node_id, inbox, pid, pid, restarts, restarts)
        self.report_events(node_id, events, reset=True)
        metrics = report.get("metrics_address")
        if isinstance(metrics, str) and metrics.rpartition(":")[2].isdigit():
            self.record_metrics_port(node_id, int(metrics.rpartition(":")[2]))
        for session_id, tenant_id, kept in sessions:
            if kept:  # one whose first turn runs is opened by that turn (``_readmit``), as at admission
                self._route_session(node_id, session_id, tenant_id, kept)
        share = self.request_share(node_id)
        left_out = 0
        for request_id, tenant_id, session_id, subscriber in requests:
            # a flood, or a queue past the share at the crash: not counted, so aborted
            counted = len(self.nodes[node_id].in_flight) < share
            if not (counted and self._readmit(node_id, request_id, tenant_id, session_id, subscriber)):
                left_out += 1
                self._abort_on(node_id, request_id)
        if left_out:
            log.warning("restarted global scheduler: %d of %d requests on %s left out and aborted (share %d)",
                        left_out, len(requests), node_id, share)

    def _abort_on(self, node_id: str, request_id: str) -> None:
        """Tell ``node_id`` to abort ``request_id``: a rebuilt request this scheduler does not
        count must not run on (its client gets the abort and retries).

        Regression (review 24s S1): requests past a node's share were left out but ran on; a
        first session turn among them finished with its session's history on the node and no
        route to it here, so the session's next turn went elsewhere by load and ran without its
        history, silently."""
        inbox = self.node_inboxes.get(node_id)
        if inbox is not None and self.commands is not None:
            self.commands.send(inbox, {"op": "abort", "id": request_id})

    def request_share(self, node_id: str) -> int:
        """How many rebuilt requests ``node_id`` may hold: its running capacity and its share of
        ``queue_limit``, by capacity (rounded down). All nodes' shares together queue at most
        ``queue_limit``, where admission's fair share starts: no one report fills the queue.

        Regression (review 24r F3): a report was bounded by what admission lets in overall
        (capacity + twice ``queue_limit``), so one node's made-up requests filled the global
        queue and every tenant was refused ``queue_full`` until ``GATEWAY_REATTACH_S``."""
        capacity = self.nodes[node_id].capacity
        total = sum(node.capacity for node in self.nodes.values())
        return capacity + self.queue_limit * capacity // max(1, total)

    def _route_session(self, node_id: str, session_id: str, tenant_id: str, kept: bool) -> bool:
        """Route ``session_id`` to ``node_id`` again (``kept``: a turn of it finished there),
        unconfirmed (``route_unconfirmed``: a report is a node's word alone), unless another
        node claims it (``_claim``), it is marked lost (its mark restored from the store: review
        24s S2, a close and a reopen elsewhere in the seconds before a crash brought the mark
        back beside the new route, counted twice against the cap), or the tenant has
        ``max_sessions_per_tenant`` sessions, its lost ones included."""
        if not self.knows_tenant(tenant_id) or session_id in self.lost_of(tenant_id) or (
                not self._claim(node_id, session_id, tenant_id)) or (
                session_id not in self.session_nodes
                and self.sessions_per_tenant[tenant_id] + len(self.lost_of(tenant_id)) >= self.max_sessions_per_tenant):
            self.bad_messages += 1
            log.warning("restarted global scheduler: session %.100s on %s left out", session_id, node_id)
            return False
        if session_id not in self.session_nodes:
            self.route_unconfirmed(tenant_id, session_id, node_id)
        if kept:
            self.kept_sessions.add(session_id)
        return True

    def _claim(self, node_id: str, session_id: str, tenant_id: str) -> bool:
        """Whether ``node_id``'s report may route ``session_id`` (or a turn of it) there: it is
        routed nowhere, or there. Claimed by a second node, it is routed to neither: the route
        the first claim made goes (its turns in flight detached from it), the session is lost
        (``mark_lost``: its next turn is refused until it is closed or ``session_ttl_s``
        passed, never run on either node's word), and every later claim is refused.

        Regression (review 24r F2): the first report to arrive won, so a node could take
        another node's sessions (their tenant's next turns were sent to it as continuations)."""
        if session_id in self.contested_sessions:
            return False
        routed = self.session_nodes.get(session_id)
        if routed is None or routed[1] == node_id:
            return True
        log.warning("restarted global scheduler: session %.100s claimed by %s and %s: lost", session_id,
                    routed[1], node_id)
        self.contested_sessions.add(session_id)
        self.drop_session_route(session_id)
        self._detach_turns(session_id, routed[1])
        self.mark_lost(tenant_id, session_id)
        return False

    def _readmit(self, node_id: str, request_id: str, tenant_id: str, session_id: str, subscriber: str) -> bool:
        """Count ``request_id``, running on ``node_id`` for the gateway at ``subscriber``, as
        admitted (as ``admit`` does; its usage is recorded at its release); whether it was. A
        session turn whose session has no route yet (its first turn) opens it, as at admission."""
        if not self.knows_tenant(tenant_id) or request_id in self.requests or (
                session_id and not self._claim(node_id, session_id, tenant_id)):
            self.bad_messages += 1
            log.warning("restarted global scheduler: request %.100s on %s left out", request_id, node_id)
            return False
        opened = session_id if session_id and session_id not in self.session_nodes else ""
        if opened and not self._route_session(node_id, session_id, tenant_id, kept=False):
            return False
        self.requests[request_id] = (tenant_id, node_id, opened, session_id)
        self.request_gateways[request_id] = subscriber
        self.recovered_requests[request_id] = subscriber
        self.nodes[node_id].in_flight.add(request_id)
        if self._urgent(tenant_id):
            self.nodes[node_id].urgent.add(request_id)
        return True

    def apply_spill_report(self, holder_id: str, blocks: Any) -> None:
        """Replace what the index held for spill node ``holder_id`` by ``blocks``, its
        ``SpillNode.held_blocks`` (``(block_hash, tier)`` pairs, tiers ``spill_ram`` and
        ``spill_disk``).

        Raises:
            BadReport: a malformed list (nothing applied).
        """
        self.report_events(holder_id, block_events(blocks, SPILL_TIERS), reset=True)

    def reconcile_gateway(self, subscriber: str, open_requests: Sequence[str]) -> list[str]:
        """The gateway whose event inbox is ``subscriber`` attached again after this scheduler's
        restart and still waits for ``open_requests``: each request rebuilt for it
        (``apply_node_report``) that is not among them is released now, without usage, and
        aborted on its node (as ``gateway_gone`` aborts a gone gateway's): it ended while the
        scheduler was down (its release was lost; the abort is a no-op), or it still runs for
        a gateway that no longer waits for it. Returns those released.

        Regression (review 24r F4): they were released here and left running on their nodes:
        a request whose submit reached its node but whose admission the gateway failed at the
        crash ran to ``max_tokens`` uncounted and unbilled (its client had retried)."""
        if not isinstance(subscriber, str) or not isinstance(open_requests, (list, tuple)):
            self.bad_messages += 1
            return []
        still = {rid for rid in open_requests if isinstance(rid, str)}
        for rid in still:  # a turn its tenant sent: its session is no node's word alone
            if self.recovered_requests.get(rid) == subscriber and rid in self.requests and self.requests[rid][3]:
                self.confirm_session(self.requests[rid][3])
        ended = [rid for rid, sub in self.recovered_requests.items()
                 if sub == subscriber and rid not in still and rid in self.requests]
        for rid in ended:
            inbox = self.node_inboxes.get(self.requests[rid][1])
            self.release(rid)
            if inbox is not None and self.commands is not None:
                self.commands.send(inbox, {"op": "abort", "id": rid})
        for rid in [rid for rid, sub in self.recovered_requests.items() if sub == subscriber]:
            del self.recovered_requests[rid]
        return ended

    def forget_unattached(self, attached: set[str]) -> list[str]:
        """Gateways that have requests rebuilt for them and did not attach again (their event
        inboxes are not in ``attached``) are gone (``gateway_gone``); returns their inboxes.
        What each had released is kept for it (``released_unattached``): should it attach
        later, it is told (``GlobalSchedulerService.attach_gateway``)."""
        gone = sorted({sub for sub in self.recovered_requests.values() if sub not in attached})
        for subscriber in gone:
            log.warning("gateway %s did not attach again after the scheduler restart: gone", subscriber)
            self.released_unattached[subscriber] = self.gateway_gone(subscriber)
            for rid in [rid for rid, sub in self.recovered_requests.items() if sub == subscriber]:
                del self.recovered_requests[rid]
        return gone
