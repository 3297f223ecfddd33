"""The global scheduler's sessions: where each session's turns are routed (the node holding its
history), the sessions whose history went with a restarted node's process (``lost_of``: their
turns are refused until closed or ``session_ttl_s`` passed), routes a restarted scheduler
rebuilt from a node's report that no turn confirmed (``expire_unconfirmed``), closing a session
(its turns in flight detached from it, the close kept for a node that is down), and a node's
expired sessions. The routes and the marks are stored in the tenant store (``flush_sessions``):
a new scheduler process marks lost every stored route that no node reports
(``lose_stored_sessions``), so a session's next turn after ``kvstrata down``/``up``, or after a
crash of the scheduler together with its node, is refused, never run without its history.
``Sessions`` is a part of ``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from services.global_scheduler_pending import PendingRows
from tenants.errors import StaleKeyError

STORE_LAG_S = 5.0
"""How much older than a session's last use its stored last use may be: the scheduler stores a
route's uses with its periodic flush (``USAGE_FLUSH_S``). A stored route counts as open that
much past ``session_ttl_s`` after its stored use (``lose_stored_sessions``): refused a few
seconds too long rather than run a few seconds too early without its history."""


class Sessions:
    """Session routing of ``GlobalScheduler`` (which provides these attributes)."""

    session_nodes: dict[str, tuple[str, str]]
    session_tools: dict[str, bytes]
    kept_sessions: set[str]
    lost_sessions: dict[str, dict[str, float]]
    lost_changes: PendingRows  # marks made (wall time) or removed (None) since the last flush
    # routes opened or used (wall time of the use) or dropped (None) since the last flush
    open_changes: PendingRows
    lost_changes_lock: threading.Lock  # guards both change maps (the flush runs in a worker thread)
    # session -> (tenant, last use, wall time) of the routes a previous process stored, until
    # ``lose_stored_sessions``
    stored_sessions: dict[str, tuple[str, float]]
    usage_flush_lock: threading.Lock
    store: Any
    specs: dict[str, Any]
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
        routed to another node stays, and so does a route whose opening turn is still in
        flight there: the node's session of that id that expired was a stale one, never this
        route's, which is not idle or not there yet).

        Regression: a stale session (its close never reached the node) that expired as a new
        session of its id opened there dropped the new session's route; its next turn opened it
        anew elsewhere and was answered without its history."""
        opening = {opened for _, node, opened, _ in self.requests.values() if node == node_id and opened}
        for sid in session_ids:
            entry = self.session_nodes.get(sid)
            if entry is not None and entry[1] == node_id and sid not in opening:
                self.drop_session_route(sid)

    def close_session(self, session_id: str, tenant_id: str, key_id: str = "") -> tuple[str, list[str]] | None:
        """Forget a session's routing; returns ``(node, turns)``: the node holding it ("" when
        none can be asked: the node is down, or the history was lost: ``node_up``) and the ids
        of its turns admitted and not yet released, which the node must refuse should they
        reach it after the close (``CacheNode.close_session``). None when the session is
        unknown or another tenant's, or ``tenant_id`` is no tenant's (``knows_tenant``).
        ``key_id``: the id of the API key the gateway authenticated the close with ("" = not
        said); one removed since (rotated away: ``TenantStore.key_removed``) closes nothing.

        Raises:
            StaleKeyError: ``key_id`` was removed (the gateway answers UNAUTHENTICATED and
                forgets the key), as admission refuses it (``key_revoked``).

        Regression (review s35 C, C1): a key rotated away through one gateway still closed
        its tenant's sessions from another gateway's key cache for up to 10 s (a leaked key
        its owner had revoked could end the owner's conversations).

        Regression: a first turn still on the data plane when the close reached its node
        opened the session there after the close, with no route to it (no turn could reach
        it, no close could free it: it held its KV until its TTL), and the close answered
        NOT_FOUND for a session the client had opened.

        Regression (secrev18 E residue): an id that is no tenant's was looked up (and its
        lost-session marks touched) as a tenant's."""
        if not self.knows_tenant(tenant_id):
            return None
        if key_id and self.store.key_removed(key_id):
            raise StaleKeyError(self.specs[tenant_id].name)
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
        ``max_sessions_per_tenant``). Stored at the next ``flush_sessions``."""
        lost = self.lost_sessions.setdefault(tenant_id, {})
        new = lost.pop(session_id, None) is None  # (a mark ``lost_of`` forgot: past its TTL, pruned)
        lost[session_id] = self.clock()
        with self.lost_changes_lock:
            self.lost_changes.put((tenant_id, session_id), time.time(), new=new)
        self.sessions_store_due()

    def forget_lost(self, tenant_id: str, session_id: str) -> bool:
        """Unmark ``tenant_id``'s lost ``session_id`` (stored at once, as ``mark_lost``); whether
        it was marked."""
        lost = self.lost_sessions.get(tenant_id)
        if lost is None or session_id not in lost:
            return False
        del lost[session_id]
        if not lost:
            del self.lost_sessions[tenant_id]
        with self.lost_changes_lock:
            self.lost_changes.remove((tenant_id, session_id))
        self.sessions_store_due()
        return True

    def sessions_store_due(self) -> None:
        """A route was opened or dropped, or a session marked lost or unmarked: store it soon.
        The plain class leaves it to the caller's ``flush_sessions``; the actor stores them at
        once, in a worker thread, those made meanwhile together (``GlobalSchedulerService``)."""

    def note_route(self, tenant_id: str, session_id: str, open_: bool = True, new: bool = False) -> None:
        """Note for the next ``flush_sessions`` that ``session_id`` is routed and was used now
        (``open_``; ``new``: it opened now, where no route of its id was), or no longer routed
        (a route that opened since the last successful flush leaves nothing to store)."""
        with self.lost_changes_lock:
            if open_:
                self.open_changes.put((tenant_id, session_id), time.time(), new=new)
            else:
                self.open_changes.remove((tenant_id, session_id))

    def flush_sessions(self) -> int:
        """Store the lost-session marks and the routes made, used or removed since the last
        flush (one transaction); returns how many changes. A failed write hands them back for
        the next flush (a change made meanwhile wins).

        Regression: the marks lived only in this actor's memory, so after a crash of the
        scheduler a session whose node had restarted (its history gone) was unknown, and its
        next turn opened it anew and ran without its history, silently.

        Regression (review 26b F2): the routes lived only in memory, so after ``kvstrata
        down``/``up`` (or a node restarting while the scheduler was down) a session's next
        turn was admitted as its first and answered from its new tokens alone, with OK.

        Raises:
            sqlite3.Error: the write failed.
        """
        with self.usage_flush_lock:  # one flush at a time, in the order taken
            with self.lost_changes_lock:
                lost, opened = self.lost_changes.take(), self.open_changes.take()
            stored = False
            try:  # and the marks past their TTL, forgotten here by ``lost_of`` (review 24s S3)
                if lost or opened:  # (else stale marks wait for the next change, or a restart's load)
                    self.store.save_sessions(lost, opened, prune_before_s=time.time() - self.session_ttl_s)
                stored = True
            finally:
                with self.lost_changes_lock:
                    self.lost_changes.done(stored)
                    self.open_changes.done(stored)
            return len(lost) + len(opened)

    def restore_open_sessions(self) -> int:
        """Load the routes a previous process stored (``stored_sessions``), those used within
        ``session_ttl_s`` (+ ``STORE_LAG_S``), of tenants that still exist; returns how many.
        ``lose_stored_sessions`` then marks lost those no node reports."""
        since = time.time() - self.session_ttl_s - STORE_LAG_S
        self.stored_sessions = {sid: (tenant_id, used_at) for tenant_id, sid, used_at
                                in self.store.load_open_sessions(since) if self.knows_tenant(tenant_id)}
        return len(self.stored_sessions)

    def lose_stored_sessions(self) -> int:
        """Mark lost (``lost_sessions``, stored at the next flush) every route a previous
        process stored (``restore_open_sessions``) that is not routed now: no node reported
        holding it (after ``kvstrata down``/``up`` no node holds any; after a crash of the
        scheduler, a node that restarted meanwhile or did not report in time). Its turns are
        refused until it is closed or ``session_ttl_s`` (+ ``STORE_LAG_S``) passed since its
        stored last use, when it would have expired on its node too. Returns how many; called
        once, after the nodes' reports (``GlobalScheduler``'s ``recovering``).

        Regression (review 26b F2): such a session's next turn was admitted as its first and
        answered from its new tokens alone, with OK: the client, which sends only a turn's new
        messages, never learnt that the history was gone."""
        now_wall, now = time.time(), self.clock()
        marked: Counter[str] = Counter()
        for session_id, (tenant_id, used_at) in self.stored_sessions.items():
            if session_id in self.session_nodes:  # a node reported it: routed there again
                continue
            self.note_route(tenant_id, session_id, open_=False)
            if not self.knows_tenant(tenant_id) or session_id in self.lost_sessions.get(tenant_id, {}):
                continue
            lost_at = used_at + STORE_LAG_S
            self.lost_sessions.setdefault(tenant_id, {})[session_id] = now - max(now_wall - lost_at, 0.0)
            with self.lost_changes_lock:  # (the marks a previous process stored are all loaded)
                self.lost_changes.put((tenant_id, session_id), lost_at, new=True)
            marked[tenant_id] += 1
        for tenant_id in marked:  # ``lost_of`` expects each tenant's marks oldest first
            self.lost_sessions[tenant_id] = dict(sorted(self.lost_sessions[tenant_id].items(), key=lambda m: m[1]))
        if self.stored_sessions:
            self.sessions_store_due()
        self.stored_sessions = {}
        return marked.total()

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
        if session_id not in self.stored_sessions:  # opened in the seconds before the crash
            self.note_route(tenant_id, session_id, new=True)  # (a stored route was loaded)
            self.sessions_store_due()

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
        """Forget where ``session_id`` lives (its next turn opens it anew wherever it goes);
        stored at once (``sessions_store_due``), as an opened route is.

        Regression (review 26e F3): a dropped route (closed, expired on its node, its first
        turn failed, lost) waited for the 5-s flush, so a crash of the scheduler in those
        seconds brought the sessions its client had closed back as lost: refused, and holding
        the tenant's ``max_sessions_per_tenant`` for ``session_ttl_s``."""
        tenant_id, _ = self.session_nodes.pop(session_id)
        self.note_route(tenant_id, session_id, open_=False)
        self.sessions_store_due()
        rebuilt = self.unconfirmed_sessions.get(tenant_id)
        if rebuilt is not None and rebuilt.pop(session_id, None) is not None and not rebuilt:
            del self.unconfirmed_sessions[tenant_id]
        self.kept_sessions.discard(session_id)
        self.session_tools.pop(session_id, None)
        self.sessions_per_tenant[tenant_id] -= 1
        if self.sessions_per_tenant[tenant_id] <= 0:
            del self.sessions_per_tenant[tenant_id]
