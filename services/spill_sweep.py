"""A spill node's sweep of deleted tenants: it drops each deleted tenant's own cache namespace
(``tenants.model.own_namespace``) from its RAM and disk, whatever it missed.

Deleting a tenant drops its own namespace on the spill nodes through the cache nodes
(``services.cache_node_commands.end_tenant``), once, while the deletion happens. A spill node
that was down, restarting or slow then kept the tenant's group files, whose headers hold its
prompts' token ids, and a restarted node indexed them again at start. So each spill node also
pages through the deletions the tenant store keeps (``GlobalScheduler.deleted_tenants_after``)
at its start and every ``interval_s``, from the last one it saw: a deletion it missed is
purged at its next sweep, at the latest ``interval_s`` after it is back. The answer is checked
like any message from the network (types, sizes, order); a bad or failed answer is logged,
counted and asked again at the next sweep. Each sweep also deletes the quarantined files past
their age limit (``SpillStore.expire_quarantine``): a file whose corrupt header names no
tenant is not kept longer than that, even on an idle node; and it tries again the deletions
that failed (a read-only or failing volume: the files stay counted meanwhile) and the write of
the store's list of dropped holders, which a restart reads before it indexes anything, so a
deleted tenant's file that could not be deleted is deleted at the restart, never served, even
before this sweep's first answer (review 30e F5). A page whose drop could neither delete the
tenants' files nor record the drop (``SpillDeletionNotDurable``: a read-only volume) is asked
and dropped again at the next sweep, the cursor left before it (session 32: it was passed,
and a restart served the tenants' files again).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

import ray

from cache_node.tiers.spill_disk import SpillDeletionNotDurable
from cache_node.tiers.spill_store import SpillStore
from services.actor_refs import ActorRef, resolve
from tenants.model import own_namespace
from tenants.store import DELETED_PAGE

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 30.0
"""Seconds between a spill node's sweeps of deleted tenants."""
ASK_TIMEOUT_S = 30.0
"""How long one ask of the scheduler may take before the sweep gives up until the next."""
_TENANT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

# deletion seq -> [(seq, tenant_id), ...] after it, oldest first (GlobalScheduler.deleted_tenants_after)
DeletedTenants = Callable[[int], Any]


class AskScheduler:
    """A ``DeletedTenants`` asking the GlobalScheduler actor (looked up by name at each ask, so
    a restarted scheduler is found), at most ``timeout_s`` per ask.

    Raises (when called): whatever Ray raises for a dead, restarting or slow scheduler.
    """

    def __init__(self, scheduler: ActorRef | Any, timeout_s: float = ASK_TIMEOUT_S) -> None:
        self.scheduler, self.timeout_s = scheduler, timeout_s

    def __call__(self, seq: int) -> Any:
        handle = resolve(self.scheduler)
        return ray.get(handle.deleted_tenants_after.remote(seq=seq, limit=DELETED_PAGE), timeout=self.timeout_s)


class DeletedTenantSweep:
    """Drop deleted tenants' own namespaces from ``store``, paging through ``deleted`` from the
    last deletion seen (``cursor``; 0 at start: every deletion kept, so a restarted node purges
    what it indexed again from disk). ``on_dropped`` runs after blocks were dropped (the node
    pushes their "removed" events to the index).

    Args:
        store: the spill node's store.
        deleted: the deletions after a seq (``AskScheduler``).
        on_dropped: called after a page dropped something.
        node_id: for log lines.
        interval_s: seconds between sweeps of ``start``'s thread.
    """

    def __init__(self, store: SpillStore, deleted: DeletedTenants, on_dropped: Callable[[], None] = lambda: None,
                 node_id: str = "", interval_s: float = SWEEP_INTERVAL_S) -> None:
        self.store, self.deleted, self.on_dropped = store, deleted, on_dropped
        self.node_id, self.interval_s = node_id, interval_s
        self.cursor = 0
        self.counters = {"sweeps": 0, "sweep_failures": 0, "sweep_bad_answers": 0, "swept_blocks": 0}
        self._stop = threading.Event()
        self.first_done = threading.Event()  # set once the first sweep of ``start`` has ended
        self._thread: threading.Thread | None = None

    def sweep(self) -> int:
        """One sweep: every deletion after ``cursor``, page by page; returns blocks dropped. A
        failed or malformed answer ends the sweep (counted, logged); ``cursor`` stays at the
        last page applied, so the next sweep asks again from there. So does a page whose drop
        raised ``SpillDeletionNotDurable`` (re-raised: files of its tenants could neither be
        deleted nor their drop recorded, so a restart might serve them). Then the quarantined files
        past their age limit are deleted, whatever the answer."""
        try:
            return self._sweep()
        finally:
            try:
                self.store.expire_quarantine()
            finally:
                self.counters["sweeps"] += 1  # ended (a reader waiting for one sees its drops)

    def _sweep(self) -> int:
        dropped = 0
        while True:
            try:
                answer = self.deleted(self.cursor)
            except Exception as exc:  # noqa: BLE001 - scheduler down or restarting: next sweep
                self.counters["sweep_failures"] += 1
                logger.warning("spill node %s: deleted tenants not swept (asked after %d): %s",
                               self.node_id, self.cursor, exc)
                return dropped
            page = self._checked(answer)
            if page is None:
                self.counters["sweep_bad_answers"] += 1
                logger.warning("spill node %s: a malformed answer of deleted tenants was ignored", self.node_id)
                return dropped
            if not page:
                return dropped
            try:
                n = self.store.drop_namespaces(own_namespace(tenant_id) for _, tenant_id in page)
            except SpillDeletionNotDurable:  # not recorded: this page again at the next sweep; its
                self.on_dropped()  # blocks left the store all the same (their events go out)
                raise
            if n:
                dropped += n
                self.counters["swept_blocks"] += n
                self.on_dropped()
                logger.info("spill node %s: dropped %d blocks of deleted tenants", self.node_id, n)
            self.cursor = page[-1][0]
            if len(page) < DELETED_PAGE:
                return dropped

    def _checked(self, answer: Any) -> list[tuple[int, str]] | None:
        """``answer`` as ``[(seq, tenant_id), ...]`` when it is one: at most ``DELETED_PAGE``
        pairs, seqs ints rising past ``cursor``, tenant ids short and plain; else None."""
        if not isinstance(answer, (list, tuple)) or len(answer) > DELETED_PAGE:
            return None
        page: list[tuple[int, str]] = []
        last = self.cursor
        for item in answer:
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                return None
            seq, tenant_id = item
            if type(seq) is not int or seq <= last or not isinstance(tenant_id, str) \
                    or not _TENANT_ID.fullmatch(tenant_id):
                return None
            page.append((seq, tenant_id))
            last = seq
        return page

    def start(self) -> None:
        """Sweep now and every ``interval_s`` on a daemon thread, until ``stop``."""
        def run() -> None:
            while not self._stop.is_set():
                try:
                    self.sweep()
                except Exception:  # a store fault must not end the sweeps
                    logger.exception("spill node %s: sweep of deleted tenants failed", self.node_id)
                finally:
                    self.first_done.set()
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=run, name=f"sweep-{self.node_id}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
