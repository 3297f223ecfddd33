"""SpillNode: a thin Ray actor over ``SpillStore`` (docs/architecture.md, 'Tiers').

Every method forwards to the plain store, so the store is tested without Ray.
Blocks travel as numpy arrays: ``get`` returns them inside ``SpillHits`` and
Ray's object store hands them to the caller zero-copy (read-only). Batch many
blocks per call; each Ray message costs about 1 ms.

An actor restart loses the RAM tier; the disk tier is rebuilt from the group
files in ``root_dir`` when the restarted actor constructs its store, which is
why ``create_spill_node`` sets ``max_restarts``.

One store per directory (``cache_node.tiers.spill_lock``; review s35 D S2): the store locks
``root_dir`` for its life. A node Ray restarts after a crash takes the lock at once (the dead
process's lock went with it). A node started while another process still holds the directory
(an old worker not yet dead, a second deployment on the same ``spill_dir``) waits for it at most
``LOCK_WAIT_S``, then its constructor raises ``SpillDirLocked`` naming the directory and the
holder's pid: a node never runs on a directory another store uses, which would delete that
store's files and forget its deleted tenants.

With an ``event_sink`` (``create_spill_node(..., scheduler=...)``) the node pushes
its stored/removed events to the global scheduler's block index after every call
that changed the store, in order (``services.block_reports``: one call at a time,
none for a clean read). Construction pushes with ``reset=True``, so a restarted
node replaces what the index believed it held by its rebuilt disk tier.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from cache_node.tiers.spill_format import BlockFormat, open_regular, write_small_file
from cache_node.tiers.spill_store import SpillEvent, SpillHits, SpillStore
from services.actor_refs import ActorRef
from services.block_reports import BlockReporter
from services.metrics import MetricsEndpoint, MetricsServer, SpillMetrics
from services.metrics.server import serve_again
from services.private_dir import ensure_private_dir
from services.spill_dirs import METRICS_PORT_FILE, remove_retired_spill_dirs
from services.spill_sweep import SWEEP_INTERVAL_S, AskScheduler, DeletedTenants, DeletedTenantSweep

logger = logging.getLogger(__name__)

DEFAULT_RESOURCES: dict[str, float] = {"spill_node": 1}
FIRST_SWEEP_WAIT_S = 10.0
"""How long a starting node waits for its first sweep of deleted tenants before it serves
(review 30e F5: a restarted node served a deleted tenant's files that could not be deleted, and
that its store's list of dropped holders could not record, until that sweep's answer came)."""

LOCK_WAIT_S = 15.0
"""How long a starting node waits for its directory's lock while another process holds it (an
old worker of this node that Ray has not finished killing lets go within it), before it fails."""

# (node_id, [(event, block_hash, tier), ...], reset) -> None; GlobalScheduler.report_events
EventSink = Callable[[str, list[tuple[str, bytes, str]], bool], None]


class SpillNode:
    """Actor body: owns one ``SpillStore``; see its methods for the contracts.

    Args:
        root_dir, block_format, ram_bytes, disk_bytes, store_options: see ``SpillStore``.
        node_id: this node's holder id in the global block index (its actor name).
        event_sink: receives the store's events after each call that changed it; None keeps
            them for ``take_events``.
        metrics: where to serve Prometheus ``/metrics`` (``services.metrics.spill``; None:
            nowhere). Raises OSError when its port is taken.
        deleted_tenants: where to learn of deleted tenants (``services.spill_sweep``); their
            own namespaces are dropped at start (the constructor waits for that first sweep, at
            most ``FIRST_SWEEP_WAIT_S``) and every ``sweep_interval_s`` (None: never).
        num_spill_nodes: the deployment's spill node count, ``root_dir`` being
            ``<spill root>/<index>`` (the launcher's layout): at start the node deletes the
            directories of retired nodes, ``<spill root>/<j>`` for j >= it, on its own machine
            (``services.spill_dirs``; None: none).

        lock_wait_s: how long to wait while another store holds ``root_dir`` (``LOCK_WAIT_S``).

    Raises:
        UnsafeDirectoryError: ``root_dir`` is another user's or writable by its group or others
            (``services.private_dir``).
        SpillDirLocked: another store (another process's, or one not closed in this one) still
            holds ``root_dir`` after ``lock_wait_s``.
    """

    def __init__(
        self, root_dir: str | Path, block_format: BlockFormat, ram_bytes: int, disk_bytes: int,
        *,
        node_id: str = "",
        event_sink: EventSink | None = None,
        metrics: MetricsEndpoint | None = None,
        deleted_tenants: DeletedTenants | None = None,
        sweep_interval_s: float = SWEEP_INTERVAL_S,
        num_spill_nodes: int | None = None,
        lock_wait_s: float = LOCK_WAIT_S,
        **store_options: Any,
    ) -> None:
        if event_sink is not None and not node_id:
            raise ValueError("a spill node with an event_sink needs a node_id")
        ensure_private_dir(root_dir)  # prompts' KV and token ids: another user's or a writable one is refused
        if num_spill_nodes is not None:
            remove_retired_spill_dirs(Path(root_dir).parent, num_spill_nodes)
        self._store = SpillStore(root_dir, block_format, ram_bytes, disk_bytes, lock_wait_s=lock_wait_s,
                                 **store_options)
        self.node_id = node_id
        self._sink = event_sink
        self._sink_lock = threading.Lock()  # events leave in order even from a threaded actor
        self._sweep: DeletedTenantSweep | None = None
        self.metrics_server: MetricsServer | None = None
        try:
            if deleted_tenants is not None:
                self._sweep = DeletedTenantSweep(self._store, deleted_tenants, self._push, node_id, sweep_interval_s)
                self._sweep.start()
                # serve nothing a deleted tenant left on disk: the first sweep's end is awaited, within
                # a bound (a scheduler that does not answer delays the start by FIRST_SWEEP_WAIT_S)
                if not self._sweep.first_done.wait(FIRST_SWEEP_WAIT_S):
                    logger.warning("spill node %s: the first sweep of deleted tenants has not ended within %g s; "
                                   "serving meanwhile", node_id, FIRST_SWEEP_WAIT_S)
            self._push(reset=True)
            self.metrics = SpillMetrics(node_id, self._store.stats, block_format.block_nbytes)
            if metrics is not None:
                self.metrics_server = self._serve_metrics(Path(root_dir), metrics)
        except BaseException:
            self.close()  # the directory's lock goes now (a port taken, say), not at garbage collection
            raise

    def _serve_metrics(self, root_dir: Path, endpoint: MetricsEndpoint) -> MetricsServer:
        """``/metrics`` at ``endpoint``; with port 0, on the port this node served on before a
        restart (kept in its directory, ``METRICS_PORT_FILE``) while that is free."""
        path = root_dir / METRICS_PORT_FILE
        try:  # a regular file only, never a link followed nor a FIFO waited on (review 30e F1's kind)
            with open(open_regular(path), "rb", buffering=0) as f:
                previous = int(f.read(32).decode().strip() or 0)
        except (OSError, ValueError):  # none yet, unreadable or not a regular file: any free port
            previous = 0
        server = serve_again(self.metrics.registry, endpoint, previous)
        if endpoint.port == 0 and server.port != previous:
            try:
                write_small_file(path, f"{server.port}\n".encode())  # never through a link or into a FIFO
            except OSError as exc:
                logger.warning("spill node %s: could not keep its metrics port in %s: %s", self.node_id, path, exc)
        return server

    def metrics_address(self) -> str:
        """``host:port`` of this node's ``/metrics`` ("" when it serves none)."""
        return self.metrics_server.address if self.metrics_server is not None else ""

    def close(self) -> None:
        """Stop the deleted tenants' sweep and ``/metrics``, and close the store (its directory's
        lock released: another node may open it). Idempotent; the node serves nothing after."""
        if self._sweep is not None:
            self._sweep.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self._store.close()

    def ready(self) -> bool:
        """True once the store is built (its disk index rebuilt); await it after creation."""
        return True

    def put(
        self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str,
        token_ids: Sequence[Sequence[int]] | None = None, weight: float = 1.0,
    ) -> int:
        """``SpillStore.put``: ``blocks`` ``(len(hashes), *shape)``, ``token_ids`` per block,
        ``weight`` the namespace's tenant's (a positive finite number, else ValueError and
        nothing stored); returns blocks newly stored."""
        stored = self._store.put(hashes, blocks, namespace, token_ids, weight)
        self._push()
        return stored

    def get(
        self, hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None = None
    ) -> SpillHits:
        """``SpillStore.get``: the hits (token-checked when ``token_ids`` is given), their
        blocks ``(hits, *shape)`` and tiers."""
        hits = self._store.get(hashes, token_ids)
        self._push()  # a corrupt or missing file dropped its blocks
        return hits

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]:
        """``SpillStore.contains``: the tier of each hash, or None."""
        return self._store.contains(hashes)

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """``SpillStore.match_prefix``: number of leading hashes held."""
        return self._store.match_prefix(hashes)

    def flush(self) -> int:
        """``SpillStore.flush``: drop every block; returns how many. Raises
        ``SpillDeletionNotDurable`` when a restart might serve some of them (the caller's flush
        is then incomplete); the blocks' "removed" events are pushed either way."""
        try:
            return self._store.flush()
        finally:
            self._push()

    def drop_namespace(self, namespace: str) -> int:
        """``SpillStore.drop_namespace``: drop ``namespace``'s blocks (its salted variants
        too) from RAM and delete its group files; returns how many (a deleted tenant's own
        namespace). Raises ``SpillDeletionNotDurable`` as ``flush`` does."""
        try:
            return self._store.drop_namespace(namespace)
        finally:
            self._push()

    def stats(self) -> dict[str, int]:
        """``SpillStore.stats``, and the deleted tenants' sweep's counters (``sweeps``,
        ``sweep_failures``, ``sweep_bad_answers``, ``swept_blocks``) when it runs."""
        return self._store.stats() | (dict(self._sweep.counters) if self._sweep is not None else {})

    def held_blocks(self) -> list[tuple[bytes, str]]:
        """``SpillStore.held``: every block held now and its tier (a restarted global scheduler
        rebuilds its index from it: ``services.global_scheduler_recovery``)."""
        return self._store.held()

    def take_events(self) -> list[SpillEvent]:
        """``SpillStore.take_events``: changes since the last call, oldest first (always
        empty with an ``event_sink``, which receives them instead)."""
        return self._store.take_events()

    def _push(self, reset: bool = False) -> None:
        if self._sink is None:
            return
        with self._sink_lock:
            events = [(e.event, e.block_hash, e.tier) for e in self._store.take_events()]
            due = getattr(self._sink, "resync_due", None)  # a BlockReporter's back-off after refusals
            resync = due() if due is not None else getattr(self._sink, "needs_resync", False)
            if reset or resync:  # a reset, or a report was lost (and its resync is due):
                # all it holds, taken after the drain (an event between both is in it and follows it
                # again). Regression (review 30m F1): the constructor's reset came after its first
                # sweep's push, which had carried the rebuild's events, so it went out empty and the
                # scheduler forgot every block the node held
                events, reset = [("stored", h, tier) for h, tier in self._store.held()], True
            if events or reset:
                self._sink(self.node_id, events, reset)


SpillNodeActor = ray.remote(SpillNode)


def create_spill_node(
    name: str,
    root_dir: str | Path,
    block_format: BlockFormat,
    ram_bytes: int,
    disk_bytes: int,
    resources: dict[str, float] | None = None,
    *,
    max_restarts: int = -1,
    max_task_retries: int = 3,
    num_cpus: float = 0,
    lifetime: str | None = None,
    scheduler: ActorHandle | ActorRef | None = None,
    namespace: str | None = None,
    metrics: MetricsEndpoint | None = None,
    env_vars: dict[str, str] | None = None,
    num_spill_nodes: int | None = None,
    **store_options: Any,
) -> ActorHandle[SpillNode]:
    """Start a named spill node actor that restarts (rebuilding from disk) when it dies.

    Args:
        name: Ray actor name (unique in the Ray namespace).
        root_dir: the node's group-file directory; must be on the node it lands on.
        block_format, ram_bytes, disk_bytes, store_options: see ``SpillStore``.
        resources: custom resources to place it; None means ``{"spill_node": 1}``,
            ``{}`` places it anywhere.
        max_restarts: restarts allowed after a crash (-1: unlimited).
        max_task_retries: retries of a call interrupted by a crash; every
            method is idempotent except ``take_events``.
        num_cpus: CPUs it holds (0: it is I/O bound).
        lifetime: Ray actor lifetime ("detached" outlives the driver that created it).
        namespace: Ray namespace of the name (None: the driver's); two deployments on one
            cluster keep their spill nodes apart by namespace, as their other actors.
        scheduler: the GlobalScheduler actor whose block index receives this node's events
            (holder id ``name``), and whose tenant store's deletions the node sweeps
            (``services.spill_sweep``); None keeps the events for ``take_events`` and sweeps
            nothing. Pass an ``ActorRef``
            (``services.actor_refs``): a handle in a restartable actor's arguments makes Ray
            log an error.
        metrics: where the node serves Prometheus ``/metrics`` (None: nowhere); a restarted
            node serves it again.
        env_vars: environment of the node's worker process (the launcher passes
            ``ServiceConfig.control_env_vars``: normal priority, not Ray's nice 15).
        num_spill_nodes: see ``SpillNode`` (the launcher passes its count: the node deletes
            retired nodes' directories next to ``root_dir`` on its machine).

    Returns:
        The actor handle; ``ray.get(handle.ready.remote())`` waits for the index rebuild.
    """
    options = SpillNodeActor.options(
        name=name,
        namespace=namespace,
        resources=DEFAULT_RESOURCES if resources is None else resources,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        num_cpus=num_cpus,
        lifetime=lifetime,
        **({"runtime_env": {"env_vars": dict(env_vars)}} if env_vars else {}),
    )
    sink = BlockReporter(scheduler) if scheduler is not None else None
    handle = options.remote(str(root_dir), block_format, ram_bytes, disk_bytes, node_id=name,
                            event_sink=sink, metrics=metrics,
                            deleted_tenants=AskScheduler(scheduler) if scheduler is not None else None,
                            num_spill_nodes=num_spill_nodes, **store_options)
    return cast("ActorHandle[SpillNode]", handle)
