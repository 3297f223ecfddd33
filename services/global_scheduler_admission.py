"""The global scheduler's actor: ``GlobalSchedulerService`` answers admissions on the data
plane (``services.data_plane``, step 1) and watches the gateways attached to it;
``GlobalSchedulerActor`` is its Ray actor class.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import sqlite3
import time
import uuid
from typing import Any

import ray

from services import data_plane
from services.actor_refs import actor_restarts
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_recovery import GATEWAY_REATTACH_S, Recovery, RecoveryPeers
from services.node_request import NodeRequest
from services.ray_errors import actor_died
from services.spill_recreate import RecreatePolicy, SpillRecipe, SpillRecreator
from services.spill_watch import SPILL_POLL_S, SPILL_TIMEOUT_S, SpillWatch
from tenants.keys import is_key_id
from tenants.model import SPEC_DIGEST_CHARS, Tenant, TenantSpec
from tenants.store import DELETED_PAGE
from tenants.store_key_ids import KeyIdsDelta

log = logging.getLogger(__name__)

DRAIN_IDLE_S = 1.0
"""``flush_durable``'s drain ends once no request in flight was released for this long."""

GATEWAY_POLL_S = 5.0
"""Length of the scheduler's long poll of a gateway (``Gateway.serves``)."""

GATEWAY_POLL_FAILURES = 3
"""Failed polls in a row before a gateway that is not known dead counts as gone."""

GATEWAY_RETRY_S = 1.0
"""Wait before polling again after a failed poll."""

GATEWAY_TELL_TRIES = 60
"""Tries of telling a gateway counted gone which of its requests were released
(``_tell_counted_gone``), ``GATEWAY_RETRY_S`` apart, each bounded by ``GATEWAY_POLL_S``: about
6 minutes in all for a gateway whose loop stalls (a stop, a pause) past its watch's polls.
A gateway Ray reports dead is not tried again."""

GATEWAY_ANSWER_SLACK_S = 5.0
"""How much later than its ``GATEWAY_POLL_S`` long poll a gateway's answer may come before the
poll counts as failed (``_watch_gateway``)."""

USAGE_FLUSH_S = 5.0
"""Seconds between the scheduler's flushes of changed usage counters, session routes and
lost-session marks to the tenant store (``flush_durable``): what a crash may lose of them
(``kvstrata down`` and ``stop_services`` flush first). A route opened or dropped and a session
marked lost or unmarked are stored at once besides (``sessions_store_due``): the flush carries
only the routes' later uses."""

STORE_RETRY_S = 1.0
"""Pause of the at-once session store after a failed write (one log line a second at most)."""




class GlobalSchedulerService(Recovery, GlobalScheduler):
    """The actor's class: a GlobalScheduler that also answers admissions on the data plane.

    It has an async method, so Ray runs every method on one event loop thread, and the
    admission socket served on that loop never runs concurrently with a Ray method call.

    Args:
        peers: where its cache and spill nodes are found by name. With it, an actor that Ray
            restarted (``scheduler_max_restarts``) rebuilds its state before it serves
            (``services.global_scheduler_recovery``): it attaches the nodes, reopens its
            admission socket (same keys) and asks every node to report again. None (tests of
            the plain class, a first start): nothing to rebuild; the launcher attaches.
        spill_poll_s: the pause between two rounds of its spill nodes' watch
            (``services.spill_watch``; tests set it small). A restarted actor's watch takes a
            name with no live actor for a dead node at once (no start grace).
        Other arguments: ``GlobalScheduler``'s.
    """

    data_address = ""  # the admission socket, once open
    _sessions_due: asyncio.Event | None = None  # set: store the session changes (``_store_sessions``)
    _usage_flushes: asyncio.Task[None] | None = None  # ``_flush_durable_every``, while serving
    _session_stores: asyncio.Task[None] | None = None  # ``_store_sessions``, while serving

    def __init__(self, *args: Any, peers: RecoveryPeers | None = None, spill_poll_s: float = SPILL_POLL_S,
                 **kwargs: Any) -> None:
        self.restarts = actor_restarts() if peers is not None else 0
        recovering = peers is not None and self.restarts > 0  # Ray restarted this actor
        super().__init__(*args, recovering=recovering, **kwargs)
        self._gateway_watches: dict[str, asyncio.Task[None]] = {}  # by event inbox
        self.recovered_requests, self.contested_sessions, self.released_unattached = {}, set(), {}
        self._tells: set[asyncio.Task[None]] = set()  # ``_tell_counted_gone`` calls running
        self._report_timeout_s = peers.report_timeout_s if peers is not None else SPILL_TIMEOUT_S
        self._reindexing: dict[str, asyncio.Future[Any]] = {}  # a spill node's report_held still running
        recreator = (self._spill_recreator(peers.spill_recipe, peers.spill_recreate)
                     if peers is not None and peers.spill_recipe is not None and peers.spill_recreate is not None
                     else None)
        self.spill_watch = SpillWatch(peers.namespace, peers.spill_nodes, spill_poll_s, on_dead=self._forget_spill_holder,
                                      grace_s=0.0 if recovering else peers.start_grace_s,
                                      on_back=self._index_spill_holder, recreator=recreator) if peers is not None else None
        self._spill_watching: asyncio.Task[None] | None = None
        if self.spill_watch is not None and peers is not None and peers.spill_nodes:
            with contextlib.suppress(RuntimeError):  # no loop (the plain class in a test): not watched
                self._spill_watching = asyncio.get_running_loop().create_task(self.spill_watch.run())
        if peers is not None and recovering:  # (the constructor runs on its loop)
            self.attach_nodes({})
            self.recover(peers)
            self.lose_stored_sessions()  # the stored routes no node reported
            self._bind_admissions()
            loop = asyncio.get_running_loop()
            loop.call_later(GATEWAY_REATTACH_S, lambda: self.forget_unattached(
                {g.subscriber for g in self.gateways.values()}))

    def _spill_recreator(self, recipe: SpillRecipe, policy: RecreatePolicy) -> SpillRecreator:
        """The spill watch's recreator, its recreations kept in the tenant store: a scheduler
        Ray restarted (``self.restarts`` > 0) goes on from those within ``policy.window_s``
        (regression, s39: they were in memory only, so a spill node crashing with the scheduler
        was created again for ever); a first start (``kvstrata up``) deletes them and counts
        from none, so ``kvstrata down`` and ``up`` reset a capped node's count (regression,
        s39 review: the previous deployment's recreations capped it for the rest of the window;
        a store that cannot delete them is logged and the count starts from none all the same)."""
        if self.restarts > 0:
            history = self.store.load_spill_recreations(time.time() - policy.window_s)
        else:
            history = {}
            try:
                self.store.forget_spill_recreations()
            except sqlite3.Error as exc:
                log.warning("stored spill node recreations not deleted (%s: %s): a restart of this scheduler "
                            "will count them", type(exc).__name__, exc)
        return SpillRecreator(recipe, policy, history=history, on_recreate=self.store.add_spill_recreation)

    def health(self) -> dict[str, Any]:
        """Who answers, for a gateway's ``NodeMonitor``: ``pid`` and ``restarts`` (Ray's count
        of this actor's restarts: a new value means a new process, whose state was rebuilt),
        ``data_address`` (the admission socket, "" until open), ``down`` (``down_nodes``) and
        ``spill_down``: spill node name -> why it does not serve (``SpillWatch.not_serving``: the
        gateways' HTTP ``/health`` says "degraded" naming them) and ``spill_recreations``: spill node
        name -> how often the watch created it again since this process started (those it did;
        the gateways' ``spill_node_recreations_total``)."""
        recreator = self.spill_watch.recreator if self.spill_watch is not None else None
        return {"pid": os.getpid(), "restarts": self.restarts, "data_address": self.data_address,
                "down": self.down_nodes(),
                "spill_down": self.spill_watch.not_serving() if self.spill_watch is not None else {},
                "spill_recreations": dict(recreator.totals) if recreator is not None else {}}

    def _forget_spill_holder(self, name: str) -> None:
        """A spill node died for good (``SpillWatch``): its blocks leave the index (a reset with
        none); a node of that name that serves again reports what it holds (its reset push)."""
        if name in self.holders.spill_blocks:  # else the index holds none of it (a refusal counted)
            log.warning("spill node %s is dead: its blocks leave the global block index", name)
            self.report_events(name, [], reset=True)

    def attach_nodes(self, inboxes: dict[str, str], sender: Any = None) -> None:
        """``GlobalScheduler.attach_nodes``; the launcher calls it once its spill nodes serve, so
        the spill watch's start grace ends: a spill node with no live actor from now on is dead
        (``SpillWatch.end_grace``). Regression (s38): one that died right after ``kvstrata up``
        read "unknown" (``/health`` "ok") for the 120 s grace."""
        super().attach_nodes(inboxes, sender)
        if self.spill_watch is not None:
            self.spill_watch.end_grace()

    async def _index_spill_holder(self, name: str, handle: Any) -> None:
        """A spill node marked dead (``_forget_spill_holder``) serves again: it reports every
        block it holds (``SpillNode.report_held``): through its own ordered event push, a reset
        that replaces what the index holds for it after the events it pushed before, never
        after later ones; a node with no event push answers the list, applied here as
        ``recover`` does. The call is awaited at most ``RecoveryPeers.report_timeout_s``
        (``scheduler_report_timeout_s``); one that timed out is awaited again next round, never
        sent again, and its late answer applied once.

        Regression (s38): the wait was a hard-coded 10 s whatever the config; each round after a
        timeout sent a new ``held_blocks`` (they piled up on a slow node), and an answer applied
        after events the node pushed meanwhile left the index stale (a block stored since gone
        from it, one removed since back).

        Raises:
            asyncio.TimeoutError: no answer within ``report_timeout_s``; the call's error;
            ``BadReport``: a malformed list (the watch retries next round)."""
        pending = self._reindexing.get(name)
        if pending is None:
            pending = self._reindexing[name] = asyncio.ensure_future(_awaited(handle.report_held.remote()))
        try:
            held = await asyncio.wait_for(asyncio.shield(pending), self._report_timeout_s)
        finally:
            if pending.done():
                self._reindexing.pop(name, None)
        if held is not None:
            self.apply_spill_report(name, held)
        log.info("spill node %s serves again: its blocks are back in the global block index", name)

    def stats(self) -> dict[str, Any]:
        """``GlobalScheduler.stats`` and ``spill_nodes``: each spill node's state
        (``services.spill_watch``: serving, waiting and for whom, dead, ...; ``kvstrata status``)."""
        return super().stats() | {"spill_nodes": self.spill_watch.snapshot() if self.spill_watch is not None else {}}

    async def attach_gateway(self, gateway_id: str, address: str, subscriber: str, handle: Any = None) -> str:
        """``GlobalScheduler.attach_gateway``, and with the gateway's actor ``handle``, watch
        it: once it no longer serves ``subscriber`` (its process died: the call fails; or Ray
        restarted it with a new inbox) its requests are released (``gateway_gone``), so the
        nodes' slots never depend on a dead gateway's ``release``. A gateway that attaches
        after ``forget_unattached`` counted it gone is told which requests were released
        (``counted_gone``: it ends their streams).

        Regression (review 24r A2): such a gateway was never told; the streams of its released
        requests (aborted on their nodes without an event) waited for their own deadlines."""
        previous = super().attach_gateway(gateway_id, address, subscriber)
        released = self.released_unattached.pop(subscriber, None)
        if released and handle is not None:
            tell = asyncio.get_running_loop().create_task(self._tell_counted_gone(handle, subscriber, released))
            self._tells.add(tell)  # held until done (the loop keeps weak references)
            tell.add_done_callback(self._tells.discard)
        running = self._gateway_watches.get(subscriber)
        if handle is not None and (running is None or running.done()):
            task = asyncio.get_running_loop().create_task(self._watch_gateway(handle, subscriber))
            self._gateway_watches[subscriber] = task  # held until done (the loop keeps weak references)
            task.add_done_callback(lambda t: self._gateway_watches.pop(subscriber, None)
                                   if self._gateway_watches.get(subscriber) is t else None)
        return previous

    async def _watch_gateway(self, handle: Any, subscriber: str) -> None:
        """Long-poll ``handle.serves(subscriber, GATEWAY_POLL_S)`` until it says no, Ray says
        the gateway died, or ``GATEWAY_POLL_FAILURES`` polls in a row failed.

        Regression: one failed poll (a slow or briefly unreachable gateway) counted a live
        gateway as gone, and every request it sent from then on was refused ``gateway_gone``
        for as long as it ran. A poll not answered within ``GATEWAY_POLL_S`` +
        ``GATEWAY_ANSWER_SLACK_S`` fails: regression (review 29a F3), a stopped or deadlocked
        gateway's poll never returned, so it was never counted gone and its admitted requests
        kept their slots and queue share (and their nodes decoding them) for as long as it hung.

        The gateway's methods are called with keyword arguments (here and in
        ``_tell_counted_gone``): Ray checks a call's arguments in the caller against the
        callee's class as this process loaded it, and when that load failed once (the
        gateway's module would not import here: its files changed on disk under the running
        scheduler, say) Ray keeps for the process's life a stand-in whose methods take keywords
        only, so a positional call failed here, before it left, every time. Regression (s40
        security hunt, a live ``kvstrata up`` while another checkout's commit landed):
        ``TypeError: too many positional arguments`` on every poll, so the live gateway was
        counted gone every few seconds after each attach, its requests in flight were released
        (stopped on their nodes without an event), and the ``counted_gone`` telling it failed
        the same way: an HTTP client of it waited with no answer for over 10 minutes."""
        failures, died = 0, False
        while subscriber not in self.gone_gateways:
            try:
                serves = await asyncio.wait_for(handle.serves.remote(subscriber=subscriber, wait_s=GATEWAY_POLL_S),
                                                GATEWAY_POLL_S + GATEWAY_ANSWER_SLACK_S)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a dead, restarting or slow gateway's call fails
                failures += 1
                log.warning("gateway %s did not answer (%d in a row): %s: %.200s", subscriber, failures,
                            type(exc).__name__, exc)
                died = actor_died(exc)
                if not died and failures < GATEWAY_POLL_FAILURES:
                    await asyncio.sleep(GATEWAY_RETRY_S)
                    continue
                serves = False
            if not serves:
                released = self.gateway_gone(subscriber)
                if failures and not died:  # it may still run: tell it (a dead one's call fails),
                    # on a task of its own, so a re-attach meanwhile starts its new watch at once
                    tell = asyncio.get_running_loop().create_task(self._tell_counted_gone(handle, subscriber, released))
                    self._tells.add(tell)  # held until done (the loop keeps weak references)
                    tell.add_done_callback(self._tells.discard)

    @staticmethod
    async def _tell_counted_gone(handle: Any, subscriber: str, released: list[str]) -> None:
        """``handle.counted_gone(subscriber, released)``: a gateway that still runs ends the
        streams of the ``released`` requests (the nodes stopped them without an event) and
        attaches again; a dead one's call fails (ignored). A failed call is tried again,
        ``GATEWAY_RETRY_S`` apart, ``GATEWAY_TELL_TRIES`` times in all, until Ray reports the
        gateway dead.

        Regression (s40 security hunt): one try, bounded by ``GATEWAY_POLL_S``: a gateway whose
        watch failed because its loop stalled (past ``GATEWAY_POLL_FAILURES`` polls) and that
        had not resumed within that try was never told, so the streams of its released
        requests, which no event would end any more, waited for ever once it ran again.

        A call not answered within its bound is awaited again at the next try, never sent
        again (only one that failed is): Ray runs a call the caller stopped waiting for once
        the gateway's loop runs again. Regression (s40 diff review r4): each try sent a new
        call, so a gateway stalled for minutes ran up to ``GATEWAY_TELL_TRIES`` of them at once
        when it resumed (each ending the same streams, attaching again and logging)."""
        sent: asyncio.Future[Any] | None = None  # the call in flight
        for attempt in range(1, GATEWAY_TELL_TRIES + 1):
            if sent is None:
                sent = asyncio.ensure_future(_awaited(
                    handle.counted_gone.remote(subscriber=subscriber, request_ids=released)))
            try:
                await asyncio.wait_for(asyncio.shield(sent), GATEWAY_POLL_S)
                return
            except Exception as exc:  # noqa: BLE001 - a dead, stalled or unreachable gateway
                if sent.done():  # the call failed (not only unanswered): sent again
                    sent = None
                if actor_died(exc) or attempt == GATEWAY_TELL_TRIES:
                    (log.info if actor_died(exc) else log.warning)(
                        "gateway %s not told it was counted gone (%d tries): %s", subscriber, attempt,
                        type(exc).__name__)
                    if sent is not None:  # stop waiting (Ray still runs the call should the gateway resume)
                        sent.cancel()
                    return
            await asyncio.sleep(GATEWAY_RETRY_S)

    async def authenticate(self, api_key: str, allow_pbkdf2: bool = True) -> Tenant | None:
        """``GlobalScheduler.authenticate`` in a worker thread (an earlier version's PBKDF2
        row costs ~60-200 ms), so that a key check never stalls the loop that serves
        admissions."""
        return await asyncio.to_thread(super().authenticate, api_key, allow_pbkdf2)

    async def verify_admin_key(self, key: str, allow_pbkdf2: bool = True) -> bool:
        """``GlobalScheduler.verify_admin_key``, in a worker thread (as ``authenticate``)."""
        return await asyncio.to_thread(super().verify_admin_key, key, allow_pbkdf2)

    async def rotate_tenant_key(self, name: str, api_key: str | None = None) -> str:
        """``GlobalScheduler.rotate_tenant_key`` in a worker thread (a SQLite commit: 1-12 ms
        on a file store, which a tenant's own rotations made on the loop that serves
        admissions; secrev18 A), as ``authenticate``."""
        return await asyncio.to_thread(super().rotate_tenant_key, name, api_key)

    async def rotate_admin_key(self, api_key: str | None = None) -> str:
        """``GlobalScheduler.rotate_admin_key`` in a worker thread (a key check, up to a PBKDF2
        run, and a SQLite commit), as ``rotate_tenant_key``. Regression (review s33): it ran
        on the loop that serves admissions."""
        return await asyncio.to_thread(super().rotate_admin_key, api_key)

    async def register_tenant(self, spec: TenantSpec) -> tuple[Tenant, str]:
        """``GlobalScheduler.register_tenant`` in a worker thread (a SQLite commit), as
        ``rotate_tenant_key``."""
        return await asyncio.to_thread(super().register_tenant, spec)

    async def update_tenant(self, name: str, spec: TenantSpec) -> Tenant:
        """``GlobalScheduler.update_tenant`` in a worker thread (a SQLite commit)."""
        return await asyncio.to_thread(super().update_tenant, name, spec)

    async def delete_tenant(self, name: str) -> str:
        """``GlobalScheduler.delete_tenant``: the store's commit in a worker thread, then
        ``end_deleted_tenant`` on this loop (a request admitted meanwhile is ended by it);
        returns the deleted tenant's id."""
        tenant_id = await asyncio.to_thread(self.delete_stored_tenant, name)
        self.end_deleted_tenant(tenant_id)
        return tenant_id

    async def deleted_tenants_after(self, seq: int, limit: int = DELETED_PAGE) -> list[tuple[int, str]]:
        """``GlobalScheduler.deleted_tenants_after`` in a worker thread (a SQLite read)."""
        return await asyncio.to_thread(super().deleted_tenants_after, seq, limit)

    async def flush_durable(self, drain_s: float = 0.0) -> int:
        """Store what a restarted scheduler must find again, in a worker thread (SQLite commits):
        the usage counters (``flush_usage``), the session routes and the lost-session marks
        (``flush_sessions``) changed since the last flush; returns the rows stored. A failed
        write is logged and left for the next flush.

        Args:
            drain_s: first wait, at most this many seconds, until no request is in flight on
                any node (each released, with its usage): ``stop_services`` passes it after
                the gateway stopped, whose cancelled calls' ``release`` calls are still on
                their way (Ray orders no calls of two callers: a release applied after this
                flush was lost with the process, its tokens never stored; review s35 D S1).
                The wait also ends once no request was released for ``DRAIN_IDLE_S``.
        """
        def in_flight() -> int:
            return sum(len(node.in_flight) for node in self.nodes.values())

        now = time.monotonic()
        deadline, last, changed = now + max(0.0, drain_s), in_flight(), now
        # ends early once nothing was released for DRAIN_IDLE_S: a request no release is coming
        # for (its gateway gone) must not cost every stop the whole drain_s (diff review s35 S2)
        while last and now < deadline and now - changed < DRAIN_IDLE_S:
            await asyncio.sleep(0.02)
            now, held = time.monotonic(), in_flight()
            if held != last:
                last, changed = held, now
        if drain_s > 0 and last:
            log.warning("%d requests still in flight at stop: their usage since the last flush is not stored", last)
        stored = 0
        for flush, what in ((self.flush_usage, "usage counters"), (self.flush_sessions, "sessions")):
            try:
                stored += await asyncio.to_thread(flush)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop admissions
                log.warning("%s not stored (next flush retries): %s", what, exc)
        return stored

    async def _flush_durable_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.flush_durable()

    def sessions_store_due(self) -> None:
        """A route was opened or dropped, or a session marked lost or unmarked:
        ``_store_sessions`` stores it now, not at the next periodic flush (a crash of the
        scheduler within those seconds would otherwise lose an opened route, and its next
        turn would run as a first had its node restarted too, or bring a closed session back
        as lost). Only sets an event, on this loop: the write runs in a worker thread, with
        every change made until it starts."""
        if self._sessions_due is not None:
            self._sessions_due.set()

    async def _store_sessions(self, due: asyncio.Event) -> None:
        """``flush_sessions`` in a worker thread each time ``due`` was set since the last (the
        routes opened meanwhile go in one transaction, off this loop). A failed write is
        logged and left to the next (the periodic flush retries it)."""
        while True:
            await due.wait()
            due.clear()
            try:
                await asyncio.to_thread(self.flush_sessions)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop admissions
                log.warning("sessions not stored (the next flush retries): %s", exc)
                await asyncio.sleep(STORE_RETRY_S)

    async def key_ids_since(self, epoch: str, version: int) -> KeyIdsDelta:
        """``GlobalScheduler.key_ids_since`` in a worker thread (a full answer reads every key
        id of the store), as ``authenticate``."""
        return await asyncio.to_thread(super().key_ids_since, epoch, version)

    async def key_ids_exist(self, key_ids: list[str]) -> tuple[str, ...]:
        """``GlobalScheduler.key_ids_exist`` in a worker thread: its read takes the store's lock,
        which a full ``key_ids_since`` read holds for up to hundreds of ms, so on this loop it
        would stall every admission meanwhile. Regression (s37 review r4, F4): it ran on the
        loop, blocked 114-146 ms behind another gateway's full directory read.

        Raises:
            ValueError: ``key_ids`` is not a list of at most ``MAX_KEY_IDS_ASKED`` strings.
        """
        return await asyncio.to_thread(super().key_ids_exist, key_ids)

    async def open_data_plane(self) -> str:
        """Bind the admission socket (``services.data_plane``, step 1; CURVE, admitting
        gateways only, with ``security``) and serve it; returns its address (idempotent)."""
        return self._bind_admissions()

    def _bind_admissions(self) -> str:
        """``open_data_plane`` on the running loop (a restarted actor's constructor calls it)."""
        if self.data_address:
            return self.data_address
        self._admission_context = ctx = data_plane.context(asyncio_=True)
        self._authenticator = self.security.start_authenticator(ctx) if self.security is not None else None
        sock, self.data_address = data_plane.serving_socket(ctx, data_plane.zmq.ROUTER, self.security)
        self._admissions = asyncio.get_running_loop().create_task(self._serve_admissions(sock))
        if self._usage_flushes is None:  # serving: usage counts from now on
            self._usage_flushes = asyncio.get_running_loop().create_task(self._flush_durable_every(USAGE_FLUSH_S))
            self._sessions_due = due = asyncio.Event()
            self._session_stores = asyncio.get_running_loop().create_task(self._store_sessions(due))
            due.set()  # the changes made before (a start's lost sessions)
        return self.data_address

    def close_data_plane(self) -> None:
        """Stop serving admissions, and the periodic flushes serving started
        (``_flush_durable_every``, ``_store_sessions``: ``open_data_plane`` starts them again),
        and close every data-plane socket (on the serving loop).

        Regression (s40 diff review r4): only the admission server was cancelled; the flushes
        ran on against a store the caller closes next, and a loop stopped after the close
        destroyed them pending ("Task was destroyed but it is pending!")."""
        for task in (self._usage_flushes, self._session_stores):
            if task is not None:
                task.cancel()
        self._usage_flushes = self._session_stores = self._sessions_due = None
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
        readable (the gateway then need not wait for its timeout).

        The loop is yielded after each message: pyzmq's ``recv`` of a message already queued
        returns a done future, and awaiting one does not yield. Regression (review s34 B F3):
        a backlog in the socket (a burst, or what queued during a stall) was read in one loop
        turn, and every Ray call (``health``, ``release``, ``authenticate``) waited behind all
        of it: 6-15 s for 100-256 admissions of 131,072 token ids."""
        while True:
            frames = await sock.recv_multipart()
            reply = self._answer(frames[-1]) if len(frames) == 2 else None
            if reply is None:
                self.bad_messages += 1
            else:
                await sock.send_multipart([frames[0], data_plane.pack(reply)])
            await asyncio.sleep(0)  # Ray's calls and the other tasks run between two messages

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
            req, subscriber, hashes, key_id, spec, siblings = _admission_request(msg)
        except (TypeError, ValueError) as exc:
            self.bad_messages += 1
            return {"id": corr, "error": f"malformed admission: {type(exc).__name__}: {exc}"[:data_plane.MAX_TEXT_CHARS]}
        try:
            adm = self.admit_and_submit(req, subscriber, hashes, key_id, spec, siblings)
        except Exception:
            # the exception's text stays in the log, under an error id the reply names: the
            # gateway hands the reply's text to the tenant (regression, review s35 C S1: the
            # scheduler's exception text did). It fits what the gateway reads (``REPLY_LIMITS``)
            error_id = uuid.uuid4().hex[:12]
            log.exception("admission failed (error id %s)", error_id)
            return {"id": corr, "error": f"the global scheduler failed on this admission (error id {error_id})"}
        return {"id": corr, "adm": dataclasses.asdict(adm)}


def _admission_request(msg: dict[str, Any]) -> tuple[NodeRequest, str, list[bytes], str, str, tuple[str, ...]]:
    """``(request, subscriber, block hashes, key id, spec digest, sibling ids)`` of an
    admission message, every field checked; the key id (``"key"``: that of the API key the
    gateway authenticated the request with) and the spec digest (``"spec"``:
    ``tenants.model.spec_digest`` of the tenant spec the gateway prepared it with) are "" when
    the message has none; the sibling ids (``"sibs"``: the request ids of the earlier choices
    of the request's ``n`` > 1 body, ``MAX_SIBLINGS`` at most, each 1 to ``MAX_ID_CHARS``
    characters) () when it has none. The scheduler takes only those of the request's tenant
    in flight with its prompt (``GlobalScheduler._own_body``).

    Raises:
        TypeError, ValueError: a missing or mistyped field.
    """
    hashes, subscriber, key_id = msg.get("hashes"), msg.get("sub"), msg.get("key", "")
    spec, siblings = msg.get("spec", ""), msg.get("sibs", [])
    if not isinstance(siblings, list) or not set(map(type, siblings)) <= {str}:
        raise TypeError("sibs must be a list of request ids")
    if len(siblings) > MAX_SIBLINGS or not all(0 < len(s) <= data_plane.MAX_ID_CHARS for s in siblings):
        raise ValueError(f"sibs must hold at most {MAX_SIBLINGS} request ids of 1 to "
                         f"{data_plane.MAX_ID_CHARS} characters")
    if not isinstance(hashes, list) or not set(map(type, hashes)) <= {bytes}:  # (a C-speed scan)
        raise TypeError("hashes must be a list of bytes")
    if not isinstance(subscriber, str) or not subscriber.startswith("tcp://"):
        raise TypeError("sub must be a tcp:// address")
    if key_id != "" and not is_key_id(key_id):
        raise ValueError("key must be a key id")
    if spec != "" and not (isinstance(spec, str) and _SPEC_DIGEST.fullmatch(spec)):
        raise ValueError(f"spec must be a spec digest ({SPEC_DIGEST_CHARS} lowercase hex characters)")
    # routed, not rendered: the tools' and tool calls' JSON is bounded, parsed by the node
    # only, and the token ids counted, checked by the node only (review s34 B F3)
    req = data_plane.request_from_wire(msg.get("req"), parse_tools=False, check_tokens=False)
    return req, subscriber, hashes, key_id, spec, tuple(siblings)


MAX_SIBLINGS = 15
"""The most sibling ids an admission may name: the earlier choices of a body of ``n`` <=
``services.openai_api.sampling_fields.MAX_N`` (16) choices."""

_SPEC_DIGEST = re.compile(f"[0-9a-f]{{{SPEC_DIGEST_CHARS}}}")

GlobalSchedulerActor = ray.remote(GlobalSchedulerService)
"""The actor: the launcher gives it ``peers`` and ``max_restarts`` (``scheduler_max_restarts``)."""


async def _awaited(ref: Any) -> Any:
    """``ref`` (a Ray ``ObjectRef``) awaited, as a coroutine ``asyncio.ensure_future`` takes."""
    return await ref
