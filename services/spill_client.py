"""RaySpillClient: the engine's ``SpillClient`` over SpillNode actors.

See docs/architecture.md, 'Tiers'.

Hashes are sharded over the nodes by their first 8 bytes, so every cache node sends a block
to the same spill node; one call per node per batch (each Ray message costs ~1 ms). Blocks
travel as numpy arrays through the object store.

Faults never raise into the engine's transfer worker as wrong data: a call that times out,
or whose actor is dead, restarting or not serving yet (``SpillDirLocked``: it waits for its
directory or its ``/metrics`` port), is a miss for every hash of that node (``get``,
``contains``) or a dropped write (``put``), counted in ``stats()``. This is a synchronous
client for the engine's transfer thread; do not call it from an async method.

A ``put`` that timed out keeps its blocks pinned in the object store until the spill node runs
it (``ray.cancel`` does not stop an actor task already sent to its actor, so it is not tried),
and the next put to that node would add another behind it. So a node whose last put has not
returned gets no new put: that shard of the batch is a dropped write (``put_skipped``) until
the late put ends, and a stalled spill node holds at most one put from each cache node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle

from cache_node.tiers.spill_api import SpillFlushIncomplete, well_formed
from cache_node.tiers.spill_store import SpillEvent, SpillHits
from services.actor_refs import ActorRef
from services.ray_errors import actor_died

logger = logging.getLogger(__name__)

RELOOKUP_S = 5.0
"""How long after a node's actor was seen dead for good it is looked up again by name (and between
two look-ups that found no live actor)."""

FAIL_LOG_EVERY_S = 60.0
"""How often a node's failures of one kind (put, get, contains, ...) are logged at most (seconds);
the ones not logged meanwhile are counted all the same and their number said with the next."""


class RaySpillClient:
    """Batched put/get over one or more SpillNode actor handles, with per-call timeouts.

    Args:
        nodes: SpillNode actor handles (``services.spill_node.create_spill_node``); None for a
            node with no live actor when the client is made (its ``refs`` entry names it): its
            calls fail as a dead node's (misses, dropped writes, a flush error) and it is looked
            up by name as one seen dead now. Regression (s38): the cache node's constructor
            raised on such a node (``ray.get_actor``'s ValueError), so a cache node (re)started
            while a spill node was missing stayed dead for good.
        block_shape: one block's shape ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.
        dtype: numpy dtype name of the blocks.
        get_timeout_s: longest wait for ``get``/``contains``/``flush`` replies (seconds).
        put_timeout_s: longest wait for a ``put``, and for ``flush`` unless it is given its own
            (seconds).
        names: each node's name, as errors name it (its actor name; None: ``spill node <i>``).
        refs: each node's ``ActorRef`` (None: none): a node whose actor died for good is looked
            up again by name (at most every ``RELOOKUP_S``), so a spill node the global scheduler
            created again (``services.spill_recreate``) gets this client's calls. Regression
            (s38): the handles were resolved once, at the cache node's start.

    Raises ValueError for no nodes, a non-positive timeout, not one name (ref) per node or a
    missing node (None) without a ref.
    """

    def __init__(
        self,
        nodes: Sequence[ActorHandle | None],
        block_shape: Sequence[int],
        dtype: str,
        get_timeout_s: float = 5.0,
        put_timeout_s: float = 30.0,
        names: Sequence[str] | None = None,
        refs: Sequence[ActorRef | None] | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("RaySpillClient needs at least one spill node")
        if min(get_timeout_s, put_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if names is not None and len(names) != len(nodes):
            raise ValueError(f"{len(names)} names for {len(nodes)} spill nodes")
        self.nodes = list(nodes)
        self.refs = list(refs) if refs is not None else [None] * len(self.nodes)
        if len(self.refs) != len(self.nodes):
            raise ValueError(f"{len(self.refs)} refs for {len(self.nodes)} spill nodes")
        if any(node is None and ref is None for node, ref in zip(self.nodes, self.refs)):
            raise ValueError("a spill node with no handle needs a ref to look it up by")
        # node -> when its actor was last seen dead for good (monotonic); a missing one: now
        self._died: dict[int, float] = {i: time.monotonic() for i, node in enumerate(self.nodes) if node is None}
        self.names = list(names) if names is not None else [f"spill node {i}" for i in range(len(nodes))]
        self._waiting: dict[int, Any] = {}  # node -> the call of a gather in progress
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.get_timeout_s = get_timeout_s
        self.put_timeout_s = put_timeout_s
        self.counters: Counter[str] = Counter()
        self._late_puts: dict[int, Any] = {}  # node -> a put that timed out and may still run
        self._fail_lock = threading.Lock()
        # (node, kind) -> (when its failure was last logged, failures not logged since)
        self._fail_logs: dict[tuple[int, str], tuple[float, int]] = {}

    def _node(self, i: int) -> ActorHandle | None:
        """Node ``i``'s handle; one seen dead for good is looked up again by name (``refs``) once
        ``RELOOKUP_S`` passed since (no live actor yet: the old handle, whose calls fail at once,
        or None for a node never found: ``_send`` fails its calls)."""
        died, ref = self._died.get(i), self.refs[i]
        if died is None or ref is None or time.monotonic() - died < RELOOKUP_S:
            return self.nodes[i]
        try:
            self.nodes[i] = ref.resolve()
            # another thread's look-up may have found it too and cleared it (regression: the
            # second's ``del`` raised KeyError, taken below for no actor: the node marked dead again)
            self._died.pop(i, None)
            logger.info("spill node %s looked up again by name: a new actor", self.names[i])
        except Exception:  # noqa: BLE001 - no live actor of that name yet
            self._died[i] = time.monotonic()
        return self.nodes[i]

    def _send(self, nodes: Iterable[int], call: Callable[[int, ActorHandle], Any], kind: str,
              errors: dict[int, str] | None = None) -> dict[int, Any]:
        """``call(i, handle)`` (an actor call's ObjectRef) for each node ``i`` of ``nodes``; one
        with no handle (no live actor of its name found yet) is a failed ``kind`` call at once,
        counted, logged and in ``errors`` as a dead node's."""
        refs: dict[int, Any] = {}
        for i in nodes:
            handle = self._node(i)
            if handle is None:
                self._fail(kind, i, f"no live actor named {self.names[i]}")
                if errors is not None:
                    errors[i] = f"failed: no live actor named {self.names[i]}"
            else:
                refs[i] = call(i, handle)
        return refs

    def shard_of(self, block_hash: bytes) -> int:
        """Index of the node that holds ``block_hash``."""
        return int.from_bytes(block_hash[:8], "little") % len(self.nodes)

    def put(
        self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str,
        token_ids: Sequence[Sequence[int]] | None = None, weight: float | dict[str, float] = 1.0,
    ) -> int:
        """Store ``blocks[i]`` (token ids ``token_ids[i]``) under ``hashes[i]``, ``weight``
        being the namespace's tenants' (``SpillNode.put``: the nodes' fair shares); returns
        blocks newly stored (failures, a node refusing the weight or not serving among them: 0,
        counted in ``put_failures`` and logged, as a dead node's)."""
        shards = {i: rows for i, rows in self._split(hashes).items() if not self._busy(i)}
        refs = self._send(shards, lambda i, node: node.put.remote(
            hashes=[hashes[r] for r in shards[i]], blocks=blocks[shards[i]], namespace=namespace,
            token_ids=_pick(token_ids, shards[i]), weight=weight), "put")
        replies = self._gather(refs, self.put_timeout_s, "put")
        self._late_puts.update({i: ref for i, ref in refs.items() if i not in replies})
        return sum(int(v) for v in replies.values())

    def _busy(self, node: int) -> bool:
        """Whether ``node``'s last put timed out and has not ended yet (counted, logged)."""
        late = self._late_puts.get(node)
        if late is None:
            return False
        ready, _ = ray.wait([late], num_returns=1, timeout=0)
        if ready:
            del self._late_puts[node]
            return False
        self._fail("put", node, "its previous put timed out and still runs: skipped", "put_skipped")
        return True

    def get(
        self, hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None = None
    ) -> SpillHits:
        """Hits among ``hashes`` in request order (token-checked by the nodes when
        ``token_ids`` is given); a failed node's hashes are misses."""
        shards = self._split(hashes)
        refs = self._send(shards, lambda i, node: node.get.remote(
            hashes=[hashes[r] for r in shards[i]], token_ids=_pick(token_ids, shards[i])), "get")
        rows_of: dict[bytes, tuple[np.ndarray, str]] = {}
        for i, reply in self._gather(refs, self.get_timeout_s, "get").items():
            # regression: rows of another shape or dtype were broadcast or cast into the
            # pool's format, so the engine's own check never saw them
            checked = well_formed(reply, [hashes[r] for r in shards[i]], self.block_shape, self.dtype)
            if checked is None:
                self._fail("get", i, "malformed reply")
                continue
            for block_hash, row, tier in zip(*checked):
                rows_of[block_hash] = (row, tier)
        found = [h for h in hashes if h in rows_of]
        out = np.empty((len(found), *self.block_shape), dtype=self.dtype)
        for k, block_hash in enumerate(found):
            out[k] = rows_of[block_hash][0]
        return SpillHits(found, out, [rows_of[h][1] for h in found])

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]:
        """Tier of each hash on its node; None for a miss or a failed node."""
        shards = self._split(hashes)
        refs = self._send(shards, lambda i, node: node.contains.remote(hashes=[hashes[r] for r in shards[i]]), "contains")
        replies = self._gather(refs, self.get_timeout_s, "contains")
        out: list[str | None] = [None] * len(hashes)
        for i, tiers in replies.items():
            for r, tier in zip(shards[i], tiers):
                out[r] = tier
        return out

    def flush(self, timeout_s: float | None = None) -> int:
        """Flush every node, waiting at most ``timeout_s`` (None: ``put_timeout_s``); returns
        the blocks dropped.

        Raises:
            SpillFlushIncomplete: a node did not answer in time or failed (it may still hold
                its blocks: a stopped one, or a dead one whose group files a restart rebuilds
                from); it names them, with the blocks the others dropped. Before, such a node
                counted as 0 blocks dropped and the flush as done.
        """
        wait_s = self.put_timeout_s if timeout_s is None else max(0.0, float(timeout_s))
        errors: dict[int, str] = {}
        refs = self._send(range(len(self.nodes)), lambda i, node: node.flush.remote(), "flush", errors)
        replies = self._gather(refs, wait_s, "flush", errors)
        dropped = 0
        for i, reply in replies.items():
            if type(reply) is int and reply >= 0:  # an answer crossed a process boundary
                dropped += reply
            else:
                errors[i] = "malformed answer"
        if errors:
            raise SpillFlushIncomplete(dropped, {self.names[i]: why for i, why in sorted(errors.items())})
        return dropped

    def pending(self) -> list[str]:
        """Names of the nodes a call of this client waits on now (a gather in progress, from
        another thread) or whose put timed out and still runs: what a caller that waits for
        this client's call in progress waits on."""
        refs = {**self._late_puts, **self._waiting}
        if not refs:
            return []
        _, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
        waiting = set(late)
        return [self.names[i] for i, ref in sorted(refs.items()) if ref in waiting]

    def drop_namespace(self, namespace: str) -> int:
        """Drop ``namespace``'s blocks (salted variants too) on every node (a block's node
        follows its hash, not its namespace); returns blocks dropped by the nodes that
        answered (a failed node is logged and counted in ``drop_namespace_failures``)."""
        refs = self._send(range(len(self.nodes)), lambda i, node: node.drop_namespace.remote(namespace=namespace),
                          "drop_namespace")
        return sum(int(v) for v in self._gather(refs, self.put_timeout_s, "drop_namespace").values())

    def take_events(self) -> list[SpillEvent]:
        """Every node's events since the last call (a failed node contributes none)."""
        refs = self._send(range(len(self.nodes)), lambda i, node: node.take_events.remote(), "take_events")
        replies = self._gather(refs, self.get_timeout_s, "take_events")
        return [event for i in sorted(replies) for event in replies[i]]

    def stats(self) -> dict[str, int]:
        """Failed calls per kind (``<kind>_failures``) and puts not sent because the node's
        previous put timed out and still runs (``put_skipped``)."""
        return dict(self.counters)

    def _split(self, hashes: Sequence[bytes]) -> dict[int, list[int]]:
        shards: dict[int, list[int]] = {}
        for r, block_hash in enumerate(hashes):
            shards.setdefault(self.shard_of(block_hash), []).append(r)
        return shards

    def _gather(self, refs: dict[int, Any], timeout_s: float, kind: str,
                errors: dict[int, str] | None = None) -> dict[int, Any]:
        """Replies of the calls that finished in time; the others are logged and counted (and
        why each failed in ``errors`` when given)."""
        if not refs:
            return {}
        self._waiting = dict(refs)
        try:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        finally:
            self._waiting = {}
        done = set(ready)
        out: dict[int, Any] = {}
        for i, ref in refs.items():
            if ref not in done:
                self._fail(kind, i, "timed out")
                if errors is not None:
                    errors[i] = f"did not answer within {timeout_s:g} s"
                continue
            try:
                out[i] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - dead actor, crash, task error (a node that
                # does not serve yet: SpillDirLocked): a miss; its first line, not a remote traceback
                self._fail(kind, i, _first_line(exc))
                if actor_died(exc):
                    self._died.setdefault(i, time.monotonic())
                if errors is not None:
                    errors[i] = f"failed: {_first_line(exc)}"
        return out

    def _fail(self, kind: str, node: int, why: str, counter: str = "") -> None:
        """Count a failed ``kind`` call of ``node`` (``counter``, else ``<kind>_failures``) and
        log it, at most once per ``FAIL_LOG_EVERY_S`` per (node, kind), saying how many were
        not logged since.

        Regression (review s36 R4 F3): a node that does not serve (SpillDirLocked, for as long as
        another store holds its directory) logged a WARNING for every put/get batch of every
        cache node."""
        now = time.monotonic()
        with self._fail_lock:
            self.counters[counter or f"{kind}_failures"] += 1
            last, quiet = self._fail_logs.get((node, kind), (-FAIL_LOG_EVERY_S, 0))
            if now - last < FAIL_LOG_EVERY_S:
                self._fail_logs[(node, kind)] = (last, quiet + 1)
                return
            self._fail_logs[(node, kind)] = (now, 0)
        more = f"; {quiet} more {kind} failures of it in the last {now - last:.0f} s not logged" if quiet else ""
        logger.warning("spill %s on node %d failed (%s): treated as a miss%s", kind, node, why, more)


def _first_line(exc: BaseException) -> str:
    """``Type: first line of its text`` (Ray's task errors carry a whole remote traceback)."""
    cause = getattr(exc, "cause", None)
    shown = cause if isinstance(cause, BaseException) else exc
    text = str(shown).strip()
    return f"{type(shown).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _pick(token_ids: Sequence[Sequence[int]] | None, rows: list[int]) -> list[list[int]] | None:
    """The ``token_ids`` of one shard's ``rows`` (None stays None)."""
    return None if token_ids is None else [list(token_ids[r]) for r in rows]
