"""The global scheduler's sessions: where each session's turns are routed (the node holding its
history), the sessions whose history went with a restarted node's process (``lost_of``: their
turns are refused until closed or ``session_ttl_s`` passed), routes a restarted scheduler
rebuilt from a node's report that no turn confirmed (``expire_unconfirmed``), closing a session
(its turns in flight detached from it, the close kept for a node that is down), and a node's
expired sessions.
``Sessions`` is a part of ``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any


class Sessions:
    """Session routing of ``GlobalScheduler`` (which provides these attributes)."""

    session_nodes: dict[str, tuple[str, str]]
    kept_sessions: set[str]
    lost_sessions: dict[str, dict[str, float]]
    lost_changes: dict[tuple[str, str], float | None]  # marks made (wall time) or removed (None) since the last flush
    lost_changes_lock: threading.Lock
    usage_flush_lock: threading.Lock
    store: Any
    sessions_per_tenant: Counter[str]
    unconfirmed_sessions: dict[str, dict[str, float]]
    session_ttl_s: float
    requests: dict[str, tuple[str, str, str, str]]
    down: dict[str, str]
    closed_while_down: dict[str, dict[str, tuple[str, list[str]]]]
    clock: Any

    if TYPE_CHECKING:
        def knows_tenant(self, tenant_id: str) -> bool: ...

    def sessions_ended(self, node_id: str, session_ids: list[str]) -> None:
        """``node_id`` closed these sessions (expired): forget their routing there (an id
        routed to another node stays)."""
        for sid in session_ids:
            entry = self.session_nodes.get(sid)
            if entry is not None and entry[1] == node_id:
                self.drop_session_route(sid)

    def close_session(self, session_id: str, tenant_id: str) -> tuple[str, list[str]] | None:
        """Forget a session's routing; returns ``(node, turns)``: the node holding it ("" when
        none can be asked: the node is down, or the history was lost: ``node_up``) and the ids
        of its turns admitted and not yet released, which the node must refuse should they
        reach it after the close (``CacheNode.close_session``). None when the session is
        unknown or another tenant's, or ``tenant_id`` is no tenant's (``knows_tenant``).

        Regression: a first turn still on the data plane when the close reached its node
        opened the session there after the close, with no route to it (no turn could reach
        it, no close could free it: it held its KV until its TTL), and the close answered
        NOT_FOUND for a session the client had opened.

        Regression (secrev18 E residue): an id that is no tenant's was looked up (and its
        lost-session marks touched) as a tenant's."""
        if not self.knows_tenant(tenant_id):
            return None
        entry = self.session_nodes.get(session_id)
        if entry is None or entry[0] != tenant_id:
            return ("", []) if self.forget_lost(tenant_id, session_id) else None
        self.drop_session_route(session_id)
        self.forget_lost(tenant_id, session_id)  # a mark beside a route (review 24s S2): closed too
        turns = self._detach_turns(session_id, entry[1])
        if entry[1] in self.down:  # told at its ``node_up``, if the same process comes back
            # bounded as the sessions routed to the node when it went down are (no session is
            # routed to a node while it is down): no cap shared by all tenants, which dropped
            # the close of one tenant's session (its KV held until its TTL) for another's
            self.closed_while_down.setdefault(entry[1], {})[session_id] = (tenant_id, turns)
            return "", []
        return entry[1], turns

    def _detach_turns(self, session_id: str, node_id: str) -> list[str]:
        """The ids of ``session_id``'s turns in flight to ``node_id``. Every turn of the session
        in flight is no longer of that session: its release leaves the routing of a session
        opened anew under that id untouched. Regression: such a late release dropped the new
        session's route (unreachable on its node until its TTL) or marked it kept early."""
        turns = []
        for rid, (tenant_id, node, _, session) in list(self.requests.items()):
            if session == session_id:
                self.requests[rid] = (tenant_id, node, "", "")
                if node == node_id:
                    turns.append(rid)
        return turns

    def lost_of(self, tenant_id: str) -> dict[str, float]:
        """``tenant_id``'s lost sessions (``lost_sessions``), those lost ``session_ttl_s`` or
        longer ago forgotten: idle at least that long, each would have expired on its node
        too, and its next turn opens it anew as after that expiry."""
        lost = self.lost_sessions.get(tenant_id)
        if lost is None:
            return {}
        horizon = self.clock() - self.session_ttl_s
        while lost and next(iter(lost.values())) <= horizon:
            del lost[next(iter(lost))]
        if not lost:
            del self.lost_sessions[tenant_id]
            return {}
        return lost

    def mark_lost(self, tenant_id: str, session_id: str) -> None:
        """``session_id``'s history went with its node's process: refuse its turns until it is
        closed (its route must be dropped first: the mark takes its place in the tenant's
        ``max_sessions_per_tenant``). Stored at the next ``flush_lost_sessions``."""
        lost = self.lost_sessions.setdefault(tenant_id, {})
        lost.pop(session_id, None)
        lost[session_id] = self.clock()
        with self.lost_changes_lock:
            self.lost_changes[(tenant_id, session_id)] = time.time()

    def forget_lost(self, tenant_id: str, session_id: str) -> bool:
        """Unmark ``tenant_id``'s lost ``session_id``; whether it was marked."""
        lost = self.lost_sessions.get(tenant_id)
        if lost is None or session_id not in lost:
            return False
        del lost[session_id]
        if not lost:
            del self.lost_sessions[tenant_id]
        with self.lost_changes_lock:
            self.lost_changes[(tenant_id, session_id)] = None
        return True

    def flush_lost_sessions(self) -> int:
        """Store the lost-session marks made or removed since the last flush (one transaction);
        returns how many changes. A failed write hands them back for the next flush (a change
        made meanwhile wins).

        Regression: the marks lived only in this actor's memory, so after a crash of the
        scheduler a session whose node had restarted (its history gone) was unknown, and its
        next turn opened it anew and ran without its history, silently.

        Raises:
            sqlite3.Error: the write failed.
        """
        with self.usage_flush_lock:  # one flush at a time, in the order taken
            with self.lost_changes_lock:
                changes, self.lost_changes = self.lost_changes, {}
            if not changes:  # (stale rows then wait for the next change, or a restart's load)
                return 0
            try:  # and the marks past their TTL, forgotten here by ``lost_of`` (review 24s S3)
                self.store.save_lost_sessions(changes, prune_before_s=time.time() - self.session_ttl_s)
            except Exception:
                with self.lost_changes_lock:
                    self.lost_changes = changes | self.lost_changes
                raise
            return len(changes)

    def restore_lost_sessions(self) -> int:
        """Load the lost-session marks a previous process stored, those younger than
        ``session_ttl_s`` (older ones are dropped), for tenants that still exist; returns how
        many. Their ages carry over (wall clock then, this process's ``clock`` now)."""
        now_wall, now = time.time(), self.clock()
        restored = 0
        for tenant_id, session_id, lost_at in self.store.load_lost_sessions(now_wall - self.session_ttl_s):
            if self.knows_tenant(tenant_id):
                self.lost_sessions.setdefault(tenant_id, {})[session_id] = now - max(now_wall - lost_at, 0.0)
                restored += 1
        return restored

    def route_unconfirmed(self, tenant_id: str, session_id: str, node_id: str) -> None:
        """Route ``session_id`` of ``tenant_id`` to ``node_id`` on a node's word alone (a
        restarted scheduler's ``Recovery``): until a turn of it is admitted or its gateway
        says it waits for one (``confirm_session``) the route lasts ``session_ttl_s``, as the
        node's own idle session does (``expire_unconfirmed``)."""
        self.session_nodes[session_id] = (tenant_id, node_id)
        self.sessions_per_tenant[tenant_id] += 1
        self.unconfirmed_sessions.setdefault(tenant_id, {})[session_id] = self.clock()

    def confirm_session(self, session_id: str) -> None:
        """A turn of ``session_id`` came from its tenant: its route stays (``route_unconfirmed``)."""
        entry = self.session_nodes.get(session_id)
        rebuilt = self.unconfirmed_sessions.get(entry[0]) if entry is not None else None
        if rebuilt is not None and rebuilt.pop(session_id, None) is not None and not rebuilt:
            del self.unconfirmed_sessions[entry[0]]

    def expire_unconfirmed(self, tenant_id: str) -> None:
        """Drop ``tenant_id``'s routes rebuilt ``session_ttl_s`` or longer ago that no turn
        confirmed: an honest node expired each such idle session by then and said so
        (``sessions_ended``); a made-up one stops counting against the tenant's
        ``max_sessions_per_tenant``.

        Regression (review 24r F2): a node's report could fill a tenant's session quota with
        made-up sessions that nothing at the scheduler ever expired (only ``sessions_ended``
        from that node dropped them): every new session of the tenant was refused."""
        rebuilt = self.unconfirmed_sessions.get(tenant_id, {})
        horizon = self.clock() - self.session_ttl_s
        while rebuilt and next(iter(rebuilt.values())) <= horizon:
            self.drop_session_route(next(iter(rebuilt)))

    def drop_session_route(self, session_id: str) -> None:
        """Forget where ``session_id`` lives (its next turn opens it anew wherever it goes)."""
        tenant_id, _ = self.session_nodes.pop(session_id)
        rebuilt = self.unconfirmed_sessions.get(tenant_id)
        if rebuilt is not None and rebuilt.pop(session_id, None) is not None and not rebuilt:
            del self.unconfirmed_sessions[tenant_id]
        self.kept_sessions.discard(session_id)
        self.sessions_per_tenant[tenant_id] -= 1
        if self.sessions_per_tenant[tenant_id] <= 0:
            del self.sessions_per_tenant[tenant_id]
