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
waits for it up to ``LOCK_WAIT_S`` in its constructor; past that the constructor still returns
and the node keeps trying in the background (``LOCK_RETRY_S`` doubling to
``LOCK_RETRY_MAX_S``), serving nothing meanwhile (``status``): a node never runs on a directory
another store uses, which would delete that store's files and forget its deleted tenants.
Regression (s36): the constructor raised ``SpillDirLocked`` after 15 s, and Ray's
``max_restarts`` does not cover a constructor's failure, so a restart that raced its old
worker's exit (or any wait past 15 s) left the deployment without that spill node for good,
with nothing but a log line to tell. Now, while the holder is this node's own previous process
(the lock file names the same owner: Ray namespace, actor name and deployment, the state
directory's ``deployment_id``; and the same host) the node waits for it,
logging a warning now and then; while it is another store (another deployment on the same
``spill_dir``) the node logs an error naming it, ``ready`` raises ``SpillDirLocked`` (a start
fails with that message) and ``status``/``stats`` say so, and the node still opens the directory
once that store lets it go. Until the node serves, every data call (``put``, ``get``,
``contains``, ``match_prefix``, ``held_blocks``, ``flush``, ``drop_namespace``) raises
``SpillDirLocked``: its clients count and log a failed node as a dead one's. A node whose
``/metrics`` port is still held keeps its store open and retries only the bind; its reset push
goes out once it serves.

With an ``event_sink`` (``create_spill_node(..., scheduler=...)``) the node pushes
its stored/removed events to the global scheduler's block index after every call
that changed the store, in order (``services.block_reports``: one call at a time,
none for a clean read). Construction pushes with ``reset=True``, so a restarted
node replaces what the index believed it held by its rebuilt disk tier.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from cache_node.tiers.spill_format import BlockFormat, open_regular, write_small_file
from cache_node.tiers.spill_lock import SpillDirLocked, stored_owner
from cache_node.tiers.spill_store import SpillEvent, SpillHits, SpillStore
from kvstrata.code_path import actor_runtime_env
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
"""How long a starting node's constructor waits for its directory's lock while another process
holds it (an old worker of this node that Ray has not finished killing lets go within it); past
it the node waits in the background (``LOCK_RETRY_S``)."""

LOCK_RETRY_S = 0.5
"""First pause between a waiting node's tries to take its directory's lock; it doubles per try."""

LOCK_RETRY_MAX_S = 10.0
"""Longest pause between a waiting node's tries."""

LOCK_LOG_EVERY_S = 60.0
"""How often a waiting node logs that it still waits (and for whom)."""

# (node_id, [(event, block_hash, tier), ...], reset) -> None; GlobalScheduler.report_events
EventSink = Callable[[str, list[tuple[str, bytes, str]], bool], None]


def _restarted() -> bool:
    """Whether this process runs a Ray actor that Ray restarted (False outside an actor)."""
    try:
        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return False
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - another Ray's API: taken for a first start
        return False


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

        lock_wait_s: how long the constructor waits while another store holds ``root_dir``
            (``LOCK_WAIT_S``); then the node waits in the background (see the module).
        lock_owner: this node's owner in its directory's lock file (``"<ray namespace>/<actor
            name>@<deployment>"``: ``create_spill_node`` passes it); a holder on this host naming
            the same owner is this node's previous process, waited for; "" (the default):
            ``node_id``.

    Raises:
        UnsafeDirectoryError: ``root_dir`` is another user's or writable by its group or others
            (``services.private_dir``).
        OSError: the store or ``/metrics`` could not start once the directory was locked (a
            port taken, a bad directory), unless ``retry_start``. Another store holding
            ``root_dir`` raises nothing (``ready`` does).
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
        lock_owner: str = "",
        retry_start: bool | None = None,
        **store_options: Any,
    ) -> None:
        if event_sink is not None and not node_id:
            raise ValueError("a spill node with an event_sink needs a node_id")
        ensure_private_dir(root_dir)  # prompts' KV and token ids: another user's or a writable one is refused
        if num_spill_nodes is not None:
            remove_retired_spill_dirs(Path(root_dir).parent, num_spill_nodes)
        self.node_id = node_id
        self.root_dir = Path(root_dir)
        self.block_format = block_format
        self.owner = lock_owner or node_id
        self._open_store = lambda wait_s: SpillStore(root_dir, block_format, ram_bytes, disk_bytes,
                                                     lock_wait_s=wait_s, lock_owner=self.owner, **store_options)
        self._sink = event_sink
        self._sink_lock = threading.Lock()  # events leave in order even from a threaded actor
        self._deleted_tenants, self._sweep_interval_s, self._metrics_endpoint = \
            deleted_tenants, sweep_interval_s, metrics
        self._sweep: DeletedTenantSweep | None = None
        self.metrics_server: MetricsServer | None = None
        self.metrics = SpillMetrics(node_id, self._store_stats, block_format.block_nbytes)
        self._store: SpillStore | None = None  # set once it serves
        self._state = threading.Lock()  # the waiter's open against close
        self._closed = threading.Event()
        self._waiting: dict[str, Any] = {}  # while it waits for its directory: for whom (``status``)
        self._serves = False  # set once the reset push went out and /metrics serves
        try:
            store = self._open_store(lock_wait_s)
        except SpillDirLocked as exc:
            self._note_locked(exc, tries=1, since=time.monotonic())
            threading.Thread(target=self._open_when_free, name=f"spill-lock-{node_id}", daemon=True).start()
            return
        self._take(store)
        try:
            self._start_serving()
        except OSError as exc:  # a /metrics port taken
            if not (retry_start if retry_start is not None else _restarted()):
                self.close()  # the directory's lock goes now, not at garbage collection
                raise  # a first start: the operator's to fix, said at once
            # a restart: the old process may hold it still (review s36: dead for good otherwise);
            # the store stays open (its directory locked), only the bind is tried again
            self._waiting = {"since": time.monotonic()}
            self._note_failed(f"could not start serving {self.root_dir}: {exc}", tries=1)
            threading.Thread(target=self._open_when_free, name=f"spill-lock-{node_id}", daemon=True).start()
        except BaseException:
            self.close()
            raise

    def _take(self, store: SpillStore) -> None:
        """Keep ``store`` (its directory locked) and run the deleted tenants' first sweep. On
        failure the store is closed and the exception raised."""
        self._store = store
        try:
            if self._deleted_tenants is not None:
                self._sweep = DeletedTenantSweep(store, self._deleted_tenants, self._push, self.node_id,
                                                 self._sweep_interval_s)
                self._sweep.start()
                # serve nothing a deleted tenant left on disk: the first sweep's end is awaited, within
                # a bound (a scheduler that does not answer delays the start by FIRST_SWEEP_WAIT_S)
                if not self._sweep.first_done.wait(FIRST_SWEEP_WAIT_S):
                    logger.warning("spill node %s: the first sweep of deleted tenants has not ended within %g s; "
                                   "serving meanwhile", self.node_id, FIRST_SWEEP_WAIT_S)
        except BaseException:
            self._stop()
            self._store, self._sweep = None, None
            raise

    def _start_serving(self) -> None:
        """Bind ``/metrics`` (unless bound), then push the reset of every block held and serve.
        Raises OSError when the port is taken: the store stays open and nothing was pushed.

        Regression (review R3 F2, s36): the reset push of every held block went out before the
        bind; a bind that failed then closed the store without an empty reset, so the global
        scheduler's index listed blocks this node answered as misses, and each retry reopened
        the store (its disk index rebuilt, swept again) and pushed them all again."""
        if self._metrics_endpoint is not None and self.metrics_server is None:
            self.metrics_server = self._serve_metrics(self.root_dir, self._metrics_endpoint)
        self._push(reset=True)
        self._waiting = {}
        self._serves = True

    def _is_previous(self, exc: SpillDirLocked) -> bool:
        """Whether the holder ``exc`` names is this node's previous process: the same owner (Ray
        namespace, actor name and deployment), as the lock file stores it (``stored_owner``:
        cleaned, cut), on this host; another host's holder (a spill_dir over NFS) never is
        (review R3 F3). A holder of the version before de8b111 wrote its owner without
        ``@<deployment>``: that owner, ``<ns>/<name>``, is taken as the previous process too.

        Regression (review s36 R4 F1): the first restart after the upgrade took the old worker
        still exiting for another store and failed the start, advising another spill_dir; and
        an owner longer than ``MAX_OWNER_CHARS`` or holding whitespace never matched itself."""
        if not exc.owner or exc.host != socket.gethostname()[:255]:
            return False
        if exc.owner == stored_owner(self.owner):
            return True
        before, at, _ = self.owner.rpartition("@")
        return bool(at) and "@" not in exc.owner and exc.owner == stored_owner(before)

    def _note_locked(self, exc: SpillDirLocked, tries: int, since: float) -> None:
        """Record (``status``) and log who holds the directory: this node's previous process
        (warning) or another store (error, which an operator must resolve)."""
        previous = self._is_previous(exc)
        last = self._waiting.get("logged_at", -LOCK_LOG_EVERY_S)
        now = time.monotonic()
        self._waiting = {"error": str(exc), "holder_pid": exc.pid, "holder_host": exc.host,
                         "holder_owner": exc.owner, "previous_process": previous, "tries": tries,
                         "since": since, "logged_at": last}
        if now - last < LOCK_LOG_EVERY_S and tries > 1:
            return
        self._waiting["logged_at"] = now
        if previous:
            logger.warning("spill node %s: its previous process (pid %d on %s) still holds %s; serving once it "
                           "has exited (waiting %.0f s so far)", self.node_id, exc.pid, exc.host, self.root_dir,
                           now - since)
        else:
            logger.error("spill node %s does not serve: %s. It opens the directory as soon as that store lets "
                         "it go (waiting %.0f s so far)", self.node_id, exc, now - since)

    def _note_failed(self, error: str, tries: int) -> None:
        """Record (``status``) and log, at most every ``LOCK_LOG_EVERY_S``, a try that took the
        directory but could not serve (or could not open it for another reason than its lock)."""
        now = time.monotonic()
        last = self._waiting.get("failure_logged_at", -LOCK_LOG_EVERY_S)
        self._waiting = {**self._waiting, "error": error, "tries": tries, "previous_process": False,
                         "failure_logged_at": last}
        if now - last >= LOCK_LOG_EVERY_S:
            self._waiting["failure_logged_at"] = now
            logger.error("spill node %s does not serve: %s; trying again", self.node_id, error)

    def _open_when_free(self) -> None:
        """Background: try to take the directory every ``LOCK_RETRY_S`` (doubling, at most
        ``LOCK_RETRY_MAX_S``) until it opens and serves, or the node is closed. A failure to
        serve once it opened (a ``/metrics`` port the old process still holds) is logged and
        tried again the same way."""
        since, tries, pause = self._waiting.get("since", time.monotonic()), 1, LOCK_RETRY_S
        while not self._closed.wait(pause):
            pause = min(2 * pause, LOCK_RETRY_MAX_S)
            tries += 1
            if self._store is None:
                try:
                    store = self._open_store(0.0)
                except SpillDirLocked as exc:
                    self._note_locked(exc, tries, since)
                    continue
                except Exception as exc:  # noqa: BLE001 - a bad directory: said, and tried again
                    self._note_failed(f"could not open {self.root_dir}: {exc}", tries)
                    continue
                with self._state:
                    if self._closed.is_set():
                        store.close()
                        return
                    try:
                        self._take(store)
                    except Exception as exc:  # noqa: BLE001 - logged, tried again
                        self._note_failed(f"could not start serving {self.root_dir}: {exc}", tries)
                        continue
            with self._state:
                if self._closed.is_set():
                    return
                try:  # the store stays open: only /metrics' bind is tried again
                    self._start_serving()
                except Exception as exc:  # noqa: BLE001 - logged, tried again
                    self._note_failed(f"could not start serving {self.root_dir}: {exc}", tries)
                    continue
            logger.warning("spill node %s serves %s after waiting %.1f s for it (%d tries)", self.node_id,
                           self.root_dir, time.monotonic() - since, tries)
            return

    def status(self) -> dict[str, Any]:
        """Whether the node serves (``serving``) and, while it does not, why: ``error`` (the
        refusal's text), ``holder_pid``/``holder_host``/``holder_owner`` of the store holding
        its directory, ``previous_process`` (that holder is this node's own previous process,
        waited for; else another store, for the operator to stop), ``tries`` and
        ``waiting_s``."""
        serves, waiting = self._serves, dict(self._waiting)
        if serves:
            return {"serving": True, "root_dir": str(self.root_dir)}
        out = {"serving": False, "root_dir": str(self.root_dir)}
        if waiting:
            out |= {k: waiting[k] for k in ("error", "holder_pid", "holder_host", "holder_owner", "previous_process",
                                            "tries") if k in waiting}
            out["waiting_s"] = round(time.monotonic() - waiting.get("since", time.monotonic()), 3)
        return out

    def _serving(self) -> SpillStore | None:
        """The store once the node serves, else None."""
        store = self._store
        return store if store is not None and self._serves else None

    def _serving_or_raise(self, what: str) -> SpillStore:
        """The store once the node serves. Raises ``SpillDirLocked`` (``_not_serving``) before."""
        store = self._serving()
        if store is None:
            raise self._not_serving(what)
        return store

    def _not_serving(self, what: str) -> SpillDirLocked:
        """The error of a call (``what``) that needs the store while the node does not serve."""
        status = self.status()
        exc = SpillDirLocked(f"spill node {self.node_id or self.root_dir} cannot {what}: it does not serve yet "
                             f"({status.get('error', 'starting')})")
        exc.pid, exc.host, exc.owner = (status.get("holder_pid", 0), status.get("holder_host", ""),
                                        status.get("holder_owner", ""))
        return exc

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
        lock released: another node may open it); a node still waiting for its directory stops
        waiting. Idempotent; the node serves nothing after."""
        self._closed.set()
        with self._state:
            self._serves = False
            self._stop()

    def _stop(self) -> None:
        if self._sweep is not None:
            self._sweep.stop()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self._store is not None:
            self._store.close()

    def ready(self) -> bool:
        """True once the store is built (its disk index rebuilt); await it after creation.

        Raises:
            SpillDirLocked: the node does not serve: another store holds its directory (its
                text names the holder, and whether it is this node's own previous process);
                the node keeps trying (``status``).
        """
        if self._serving() is None:
            raise self._not_serving("serve")
        return True

    def put(
        self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str,
        token_ids: Sequence[Sequence[int]] | None = None, weight: float | dict[str, float] = 1.0,
    ) -> int:
        """``SpillStore.put``: ``blocks`` ``(len(hashes), *shape)``, ``token_ids`` per block,
        ``weight`` the weights of the namespace's tenants (tenant id -> weight) or the
        namespace's as a whole (``fair_lru.check_put_weight``, else ValueError and nothing
        stored); returns blocks newly stored.

        Raises:
            SpillDirLocked: the node does not serve (``status``): a failed call for its client,
                as a dead node's (review R3 F1, s36: it answered 0 and its clients counted no
                failure); ``get``, ``contains``, ``match_prefix`` and ``held_blocks`` too.
        """
        store = self._serving_or_raise("put")
        stored = store.put(hashes, blocks, namespace, token_ids, weight)
        self._push()
        return stored

    def get(
        self, hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None = None
    ) -> SpillHits:
        """``SpillStore.get``: the hits (token-checked when ``token_ids`` is given), their
        blocks ``(hits, *shape)`` and tiers. ``SpillDirLocked`` while the node does not serve."""
        store = self._serving_or_raise("get")
        hits = store.get(hashes, token_ids)
        self._push()  # a corrupt or missing file dropped its blocks
        return hits

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]:
        """``SpillStore.contains``: the tier of each hash, or None. ``SpillDirLocked`` while
        the node does not serve."""
        return self._serving_or_raise("look up blocks").contains(hashes)

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """``SpillStore.match_prefix``: number of leading hashes held. ``SpillDirLocked`` while
        the node does not serve."""
        return self._serving_or_raise("look up blocks").match_prefix(hashes)

    def flush(self) -> int:
        """``SpillStore.flush``: drop every block; returns how many. Raises
        ``SpillDeletionNotDurable`` when a restart might serve some of them (the caller's flush
        is then incomplete); the blocks' "removed" events are pushed either way.
        ``SpillDirLocked`` while the node does not serve (its directory untouched)."""
        store = self._serving()
        if store is None:
            raise self._not_serving("flush")
        try:
            return store.flush()
        finally:
            self._push()

    def drop_namespace(self, namespace: str) -> int:
        """``SpillStore.drop_namespace``: drop ``namespace``'s blocks (its salted variants
        too) from RAM and delete its group files; returns how many (a deleted tenant's own
        namespace). Raises ``SpillDeletionNotDurable`` as ``flush`` does, ``SpillDirLocked``
        while the node does not serve (the first sweep once it serves drops it)."""
        store = self._serving()
        if store is None:
            raise self._not_serving("drop a namespace")
        try:
            return store.drop_namespace(namespace)
        finally:
            self._push()

    def stats(self) -> dict[str, int]:
        """``SpillStore.stats``, and the deleted tenants' sweep's counters (``sweeps``,
        ``sweep_failures``, ``sweep_bad_answers``, ``swept_blocks``) when it runs; while the node
        does not serve, ``serving`` 0 and ``dir_lock_tries`` (``status`` says why)."""
        store = self._serving()
        if store is None:
            return {"serving": 0, "dir_lock_tries": int(self._waiting.get("tries", 0))}
        return store.stats() | (dict(self._sweep.counters) if self._sweep is not None else {})

    def _store_stats(self) -> dict[str, int]:
        """``SpillStore.stats`` for ``/metrics`` (served only once the store serves)."""
        store = self._store
        return store.stats() if store is not None else {}

    def held_blocks(self) -> list[tuple[bytes, str]]:
        """``SpillStore.held``: every block held now and its tier (a restarted global scheduler
        rebuilds its index from it: ``services.global_scheduler_recovery``). ``SpillDirLocked``
        while the node does not serve: the recovery takes it as not reported (its blocks unknown)
        and the node's reset push tells the index once it serves."""
        return self._serving_or_raise("list its blocks").held()

    def report_held(self) -> list[tuple[bytes, str]] | None:
        """Tell the global block index every block held now, for the scheduler's spill watch once
        a node it marked dead serves again. With an event sink: a reset of every held block goes
        out through it, in order with this node's other events, and None is returned; without
        one: ``held_blocks()``, for the caller to apply. Sending it twice is harmless (a reset
        replaces). ``SpillDirLocked`` while the node does not serve.

        Regression (s38): the watch applied a ``held_blocks`` answer itself, after the events the
        node pushed meanwhile: a block stored after the list was taken left the index, one
        removed came back; and each round that timed out asked again."""
        store = self._serving_or_raise("list its blocks")
        if self._sink is None:
            return store.held()
        self._push(reset=True)
        return None

    def take_events(self) -> list[SpillEvent]:
        """``SpillStore.take_events``: changes since the last call, oldest first (always
        empty with an ``event_sink``, which receives them instead)."""
        store = self._store
        return store.take_events() if store is not None else []

    def _push(self, reset: bool = False) -> None:
        """Send the store's events to the sink; nothing before the node serves but the reset
        that starts serving (its events stay in the store: that reset replaces them by every
        block held)."""
        store = self._store
        if self._sink is None or store is None or not (reset or self._serves):
            return
        with self._sink_lock:
            events = [(e.event, e.block_hash, e.tier) for e in store.take_events()]
            due = getattr(self._sink, "resync_due", None)  # a BlockReporter's back-off after refusals
            resync = due() if due is not None else getattr(self._sink, "needs_resync", False)
            if reset or resync:  # a reset, or a report was lost (and its resync is due):
                # all it holds, taken after the drain (an event between both is in it and follows it
                # again). Regression (review 30m F1): the constructor's reset came after its first
                # sweep's push, which had carried the rebuild's events, so it went out empty and the
                # scheduler forgot every block the node held
                events, reset = [("stored", h, tier) for h, tier in store.held()], True
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
    deployment: str = "",
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
        deployment: this deployment's identity in the node's lock owner (the launcher passes
            ``deployment_id``: its state directory's); a store on ``root_dir`` whose owner
            differs in it is another deployment's, not this node's previous process. Regression
            (review R3 F3, s36): the owner was ``<namespace>/<name>`` alone, and the namespace
            defaults to "kvstrata", so another deployment's node on the same ``spill_dir`` was
            waited for as this node's previous process (``start_timeout_s``, then a misleading
            error).

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
        runtime_env=actor_runtime_env(env_vars),  # kvstrata from its installed location (s41 F5)
    )
    sink = BlockReporter(scheduler) if scheduler is not None else None
    owner = f"{namespace if namespace is not None else ray.get_runtime_context().namespace}/{name}"
    owner += f"@{deployment}" if deployment else ""
    handle = options.remote(root_dir=str(root_dir), block_format=block_format, ram_bytes=ram_bytes,
                            disk_bytes=disk_bytes, node_id=name, lock_owner=owner,
                            event_sink=sink, metrics=metrics,
                            deleted_tenants=AskScheduler(scheduler) if scheduler is not None else None,
                            num_spill_nodes=num_spill_nodes, **store_options)
    return cast("ActorHandle[SpillNode]", handle)


def deployment_id(state_dir: str | Path) -> str:
    """A deployment's identity in its spill nodes' lock owners: 16 hex digits of the SHA-256 of
    its resolved state directory (two deployments never share one)."""
    return hashlib.sha256(str(Path(state_dir).expanduser().resolve()).encode()).hexdigest()[:16]


def await_serving(handles: Sequence[ActorHandle[SpillNode]], timeout_s: float, poll_s: float = 0.5) -> None:
    """Wait until every spill node in ``handles`` serves (``ready``), within ``timeout_s``.

    A node whose directory its own previous process still holds (``status``'s
    ``previous_process``: a deployment started again while its old spill worker was still
    exiting) is waited for; one whose directory another store holds fails the wait at once.

    Raises:
        RuntimeError: a node's directory is held by another store (the message names it; the
            node itself keeps trying until it is killed, as a failed ``start_services`` does),
            or a previous process still held one at ``timeout_s``.
        ray.exceptions.GetTimeoutError: a node did not answer within ``timeout_s`` (not placed).
    """
    deadline = time.monotonic() + timeout_s
    for handle in handles:
        while True:
            try:
                ray.get(handle.ready.remote(), timeout=max(deadline - time.monotonic(), 0.001))
                break
            except SpillDirLocked as exc:  # ray.get raises the task's error as its cause's class too
                status = ray.get(handle.status.remote(), timeout=max(deadline - time.monotonic(), 1.0))
                if status.get("serving") or "error" not in status:
                    # it began serving between the two calls (its waiting state already cleared): no
                    # verdict, ask again (regression: s36 CI, a start failed as "another store" here)
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"a spill node does not serve after {timeout_s:g} s: {exc}") from None
                    time.sleep(min(poll_s, 0.05))
                    continue
                if not status.get("previous_process"):
                    raise RuntimeError(
                        f"a spill node does not serve: {status.get('error', exc)}. Stop that store, or give "
                        "this deployment another spill_dir") from None
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"a spill node's previous process (pid {status.get('holder_pid')} on "
                        f"{status.get('holder_host')}) still holds {status.get('root_dir')} after "
                        f"{timeout_s:g} s; the node serves once it exits") from None
                time.sleep(poll_s)
