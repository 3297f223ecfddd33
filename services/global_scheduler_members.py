"""The global scheduler's membership: the cache nodes' command inboxes and which nodes are
down (a gateway's ``services.node_monitor`` reports them), and the gateways: where a restarted
one serves again, and what happens to a dead one's requests (``gateway_gone``).

``Membership`` is a part of ``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from services import data_plane
from services.data_plane_auth import secure_push

log = logging.getLogger(__name__)

GONE_GATEWAYS_MAX = 1024
"""Event inboxes of dead gateways remembered (oldest forgotten first)."""

ADMITTED_QUERY_MAX = 4096
"""Request ids one ``admitted_from`` call may ask about (a gateway asks in batches of this)."""

@dataclass(frozen=True)
class GatewayRecord:
    """A gateway as the scheduler knows it: its gRPC ``host:port``, its event inbox, and the
    ``host:port`` of its OpenAI-compatible API and of its ``/metrics`` ("" when it serves none)."""

    address: str
    subscriber: str
    http_address: str = ""
    metrics_address: str = ""


class Membership:
    """The membership part of ``GlobalScheduler``."""

    # ---- where a restarted cache node serves its /metrics again ------------------------------
    def record_metrics_port(self, node_id: str, port: int) -> bool:
        """Cache node ``node_id`` serves ``/metrics`` on ``port``: after a restart it serves there
        again while the port is free (``metrics_port_of``; ``metrics.server.serve_again``).
        False (nothing recorded) for an unknown node or a port outside 1..65535."""
        if node_id not in self.nodes or type(port) is not int or not 0 < port <= 65535:
            return False
        self.metrics_ports[node_id] = port
        return True

    def metrics_port_of(self, node_id: str) -> int:
        """The port ``record_metrics_port`` recorded for ``node_id`` (0: none)."""
        return self.metrics_ports.get(node_id, 0)

    # ---- nodes' command inboxes -------------------------------------------------------------
    def attach_nodes(self, inboxes: dict[str, str], sender: Any = None) -> None:
        """The cache nodes' command inboxes (``CacheNode.open_data_plane``), so
        ``admit_and_submit`` can hand requests on to them.

        Args:
            inboxes: node id -> ZeroMQ address.
            sender: has ``send(address, message)``, and ``forget(address)`` when it keeps a
                socket per address; default ``data_plane.PushSockets``. Attaching again keeps
                the sender in use (or closes it for a new ``sender``) and forgets the
                addresses no longer attached.
        """
        if sender is None and self.commands is not None:
            for address in set(self.node_inboxes.values()) - set(inboxes.values()):
                self._forget_inbox(address)
        else:
            if self.commands is not None and hasattr(self.commands, "close"):
                self.commands.close()
            self.commands = sender or data_plane.PushSockets(secure_push(self.security, "node"))
        self.node_inboxes = dict(inboxes)

    def _forget_inbox(self, address: str) -> None:
        """Close the command socket to ``address``, a node inbox no longer in use (its process
        is gone): what it still queued for that process is dropped.

        Regression (review 23b F1): a restarted node's old inbox kept its PUSH socket for the
        life of the scheduler, reconnecting to the dead port every 100 ms with the commands
        queued since the node died; one more socket per restart, without bound."""
        forget = getattr(self.commands, "forget", None)
        if forget is not None:
            forget(address)

    # ---- gateways: where a restarted one serves again, and a dead one's requests -------------
    def gateway_address(self, gateway_id: str) -> str:
        """The ``host:port`` the gateway ``gateway_id`` (its Ray actor id) last served gRPC on,
        "" if it never did: a gateway Ray restarted serves on it again (``attach_gateway``)."""
        return self.gateway_addresses(gateway_id)["grpc"]

    def gateway_addresses(self, gateway_id: str) -> dict[str, str]:
        """Where the gateway ``gateway_id`` last served: ``grpc``, ``http`` (the OpenAI API)
        and ``metrics``, each a ``host:port`` ("" if it did not): a gateway Ray restarted
        serves on them again (``attach_gateway``, ``attach_gateway_apis``)."""
        record = self.gateways.get(gateway_id, GatewayRecord("", ""))
        return {"grpc": record.address, "http": record.http_address, "metrics": record.metrics_address}

    def attach_gateway_apis(self, gateway_id: str, http_address: str, metrics_address: str) -> bool:
        """Gateway ``gateway_id``, attached (``attach_gateway``), serves its OpenAI API on
        ``http_address`` and ``/metrics`` on ``metrics_address`` ("": none). False (nothing
        recorded) for a gateway not attached.

        Regression (review 23b F4): only the gRPC address was kept, so with port 0 a
        restarted gateway moved its HTTP API and /metrics to new ports, and the addresses
        ``kvstrata up`` saved and the Prometheus targets pointed at dead ones."""
        record = self.gateways.get(gateway_id)
        if record is None:
            return False
        self.gateways[gateway_id] = dataclasses.replace(record, http_address=http_address,
                                                        metrics_address=metrics_address)
        return True

    def attach_gateway(self, gateway_id: str, address: str, subscriber: str) -> str:
        """Gateway ``gateway_id`` serves gRPC on ``address`` with its event inbox at
        ``subscriber``. The inbox it had before (it was restarted) is gone (``gateway_gone``);
        an inbox counted as gone is served again. Returns that previous inbox ("" if none)."""
        previous = self.gateways.get(gateway_id)
        if previous is not None and previous.subscriber != subscriber and subscriber in self.gone_gateways:
            # a late attach with an inbox this gateway had before its restart: reviving it would
            # count the live inbox as gone (review 21b, G2)
            log.warning("gateway %s: a stale attach with its old inbox %s was ignored", gateway_id, subscriber)
            return ""
        # the API addresses stay until ``attach_gateway_apis``: a gateway that dies in between
        # serves them again
        self.gateways[gateway_id] = (dataclasses.replace(previous, address=address, subscriber=subscriber)
                                     if previous is not None else GatewayRecord(address, subscriber))
        # a gateway counted as gone that attaches again still serves that inbox: what it had
        # admitted was released, and from now on it is served again (``Gateway`` re-attaches
        # when it is refused ``gateway_gone``)
        self.gone_gateways.pop(subscriber, None)
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

    def admitted_from(self, subscriber: str, request_ids: list[str]) -> list[str]:
        """Which of ``request_ids`` this scheduler counts as admitted from the gateway whose
        event inbox is ``subscriber`` (in flight on their nodes for it), for the gateway's
        periodic ``NodeStreams.reconcile``: a stream of its whose request is not among them was
        released here (``gateway_gone``, ``reconcile_gateway``, or lost with a scheduler
        restart) and stopped on its node without an event, so the gateway ends it UNAVAILABLE.
        A query: nothing changes. At most ``ADMITTED_QUERY_MAX`` ids a call.

        Raises:
            ValueError: ``subscriber`` is not a str, or ``request_ids`` not a list of at most
                ``ADMITTED_QUERY_MAX`` strs (counted in ``bad_messages``).
        """
        if (not isinstance(subscriber, str) or not isinstance(request_ids, (list, tuple))
                or len(request_ids) > ADMITTED_QUERY_MAX or not all(isinstance(r, str) for r in request_ids)):
            self.bad_messages += 1
            raise ValueError(f"admitted_from takes an inbox (str) and at most {ADMITTED_QUERY_MAX} request ids (str)")
        gateways = self.request_gateways
        return [rid for rid in request_ids if gateways.get(rid) == subscriber]

    # ---- node membership (a gateway's ``services.node_monitor``) ----------------------------
    def node_down(self, node_id: str, reason: str) -> None:
        """Stop routing to ``node_id`` (failed, dead, restarting or not answering): its index
        entries are forgotten. Its sessions' routes stay: their turns are refused UNAVAILABLE
        until ``node_up`` says whether the history is still there. Unknown ids are ignored."""
        if node_id not in self.nodes or node_id in self.down:
            return
        self.down[node_id] = reason
        self.index.forget(node_id)

    def down_nodes(self) -> dict[str, str]:
        """Node id -> why it is not routed to, for each node down now (``node_down``)."""
        return dict(self.down)

    def node_up(self, node_id: str, inbox: str, pid: int = 0, previous_pid: int = 0,
                restarts: int = -1, previous_restarts: int = -1) -> None:
        """Route to ``node_id`` again; its command inbox is now ``inbox`` (new after a restart:
        the socket to the old one is closed).
        The process is told by ``pid`` (0: unknown, taken as a new process) and Ray's count of
        the actor's ``restarts`` (-1: unknown); ``previous_pid``/``previous_restarts``: those
        the caller knew it by, for a node no ``node_up`` reported yet (0 and -1: the caller
        never knew it, a gateway that started while the node was silent: with no record here
        either, nothing says it restarted, and its sessions go on; a turn of one it no longer
        holds is refused by the node itself. Regression, diff review s34 F1: such a node was
        taken for a new process and every session routed there marked lost). From a new process (its
        KV, sessions included, is gone) each session routed there is lost: its next turns are
        refused ABORTED until it is closed or the nodes' session TTL passed (``admit``,
        ``lost_of``); it keeps its place in its tenant's ``max_sessions_per_tenant``. When the same process is back (it
        missed a health poll), its sessions go on there; from a new one, its index entries are
        forgotten too (as at ``node_down``). Idempotent: every gateway's monitor
        reports it; a report of an older process (fewer restarts than one reported already,
        from a gateway that learnt late) is ignored.

        Raises:
            KeyError: ``node_id`` is not one of this scheduler's nodes.
        """
        if node_id not in self.nodes:
            raise KeyError(f"unknown cache node {node_id!r}")
        known = self.node_pids.get(node_id) or ((previous_pid, previous_restarts) if previous_pid else None)
        if known is not None and 0 <= restarts < known[1]:
            log.warning("ignored a stale report of cache node %s (restarts %d < %d)", node_id, restarts, known[1])
            return
        # a pid may repeat in a new process; no record of the old one: no sign of a restart
        restarted = not pid or (known is not None and known != (pid, restarts))
        self.node_pids[node_id] = (pid, restarts)
        if restarted:
            # the old process's blocks went with it; kept, they would count against the new
            # one's capacity in the index (``report_events``) and its reports be refused for good
            self.index.forget(node_id)
            for sid, (tenant_id, _) in [(sid, e) for sid, e in self.session_nodes.items() if e[1] == node_id]:
                self.drop_session_route(sid)
                self.mark_lost(tenant_id, sid)  # in its route's place: bounded per tenant
        closed = self.closed_while_down.pop(node_id, {})
        if not restarted and self.commands is not None:  # regression (diff review): a session
            # closed while its node only missed a poll held its KV there until its TTL
            for sid, (tenant_id, turns) in closed.items():
                self.commands.send(inbox, {"op": "close_session", "session": sid, "tenant": tenant_id,
                                           "turns": turns})
        previous = self.node_inboxes.get(node_id)
        if previous is not None and previous != inbox:
            self._forget_inbox(previous)
        self.node_inboxes[node_id] = inbox
        self.down.pop(node_id, None)
