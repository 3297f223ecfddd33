"""The engine's tier-facing API (mixed into ``LLMEngine``): prefetch, demotion, flush, events.

These are the calls the Ray layer makes on a cache node besides requests and steps. Every
method takes the engine lock; none waits on a spill transfer except ``flush`` (which waits
for a spill call in progress), ``drop_namespace`` with ``spill``, ``drop_spill_namespace`` and
``wait_for_transfers``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from cache_node.block import KVBlock
from cache_node.kv_pool import KVPool
from cache_node.sequence import Sequence
from cache_node.sessions import SessionTable
from cache_node.tiers.fair_lru import holder_of
from cache_node.tiers.host import TIER_DEVICE, TierEvent
from cache_node.tiers.manager import TierManager
from cache_node.tiers.spill_api import SpillBlockSpec, numpy_dtype_of

logger = logging.getLogger(__name__)


class EngineTiersMixin:
    """Tier operations of ``LLMEngine`` (which provides these attributes)."""

    _lock: threading.RLock
    tiers: TierManager
    pool: KVPool
    kv_format: str
    requests: dict[str, Sequence]
    sessions: SessionTable
    scheduler: Any  # cache_node.scheduler.Scheduler
    prefixes: Any  # cache_node.compressed_prefix.CompressedPrefixCache

    def prefetch(self, request_id: str) -> bool:
        """Start copying a queued request's blocks from spill into device blocks, overlapping
        with running steps; the request stays queued until the copy lands or fails
        (``TierConfig.prefetch_wait_s`` at most). New requests are prefetched automatically
        when ``TierConfig.auto_prefetch``, unless ``add_request(prefetch=...)`` (the global
        index's hint) says otherwise. Returns False when there is nothing to start
        (unknown or running request, no spill client, or one already in flight).
        """
        with self._lock:
            seq = self.requests.get(request_id)
            if seq is None or seq.num_computed_tokens or seq.is_finished:
                return False
            return self.tiers.prefetch(seq, time.monotonic())

    def demote_session(self, session_id: str, to_spill: bool = False) -> int:
        """Move an idle session's pinned KV below the device tier (host, or spill with
        ``to_spill``); its next turn promotes it back through the prefix cache. Blocks shared
        with running requests stay on the device. Returns blocks moved (0 when the session is
        unknown or has a turn running). A session holding a compacted policy state is not moved
        (its blocks match no prefix): the state is dropped whole (``SessionTable.unpin``).
        """
        with self._lock:
            blocks = self.sessions.unpin(session_id)[::-1]  # tail first, as the free queue
            return self.tiers.demote_free_blocks(blocks, to_spill, hold=True) if self.tiers.enabled else 0

    def demote_all(self, to_spill: bool = False) -> int:
        """Move every unreferenced cached device block below (host; or spill, host included).

        Returns device blocks moved. For tests, benchmarks and operators draining a node.
        """
        with self._lock:
            return self.tiers.demote_all(to_spill) if self.tiers.enabled else 0

    def flush(self, spill: bool = True) -> int:
        """Drop every cached block in every tier (device, host, and spill unless told not to:
        ``flush_spill``) and any queued transfer, and every stored compressed prefix (cached KV
        too: a fresh-user trial saw 9 blocks stay held after a flush).

        Blocks in use by running requests or pinned by sessions are kept. Returns blocks
        dropped, all tiers together (``flush_by_tier``).
        """
        return sum(self.flush_by_tier(spill).values())

    def flush_by_tier(self, spill: bool = True) -> dict[str, int]:
        """``flush``, returning the blocks dropped per kind: ``device`` (cached blocks no
        request holds), ``prefixes`` (device pool blocks the stored compressed prefixes held,
        their charge blocks included), ``host`` and ``spill`` (0 without ``spill``)."""
        held = self.prefixes.stats()["compressed_prefix_blocks"]
        self.prefixes.clear()
        self.sessions.drop_previous()  # histories kept to undo a turn: their cached blocks go too
        return {"prefixes": held, **self.tiers.flush_by_tier(spill)}

    def flush_spill(self, timeout_s: float | None = None) -> int:
        """Flush the spill tier only; blocks dropped there. May wait on the spill node (up to
        ``timeout_s``, None: its client's timeouts): call it off the step thread. Raises
        ``SpillFlushIncomplete`` naming the spill nodes that may still hold blocks."""
        return self.tiers.flush_spill(timeout_s)

    def drop_namespace(self, namespace: str, spill: bool = True) -> dict[str, int]:
        """Drop the cached KV of ``namespace``'s holder (the namespace without its salt, so its
        salted variants too) on every tier, as ``flush_by_tier`` drops everyone's: its stored
        compressed prefixes (``prefixes``: their blocks, charge blocks included), its cached
        device blocks no request holds (``device``), its host blocks (``host``) and, with
        ``spill``, its spill blocks and group files (``spill``: ``drop_spill_namespace``, which
        may wait on the spill nodes: without ``spill`` the caller runs it off the step thread).
        Blocks in use by running requests or pinned by sessions stay. Other namespaces' blocks
        are untouched. Returns the blocks dropped per kind. For a deleted tenant's own
        namespace (``services.cache_node_commands.end_tenant``)."""
        holder = holder_of(namespace)
        with self._lock:
            stored = [k for k, e in self.prefixes.entries.items() if holder_of(e.seq.cache_namespace) == holder]
            prefixes = sum(self.prefixes.entries[k].seq.num_held_blocks for k in stored)
            for key in stored:
                self.prefixes.evict(key)  # its blocks go to the free queue, still cached
            self.tiers.release_held(wait=True)
            pool = self.tiers.blocks
            cached = [b for b in pool.free_queue if b.block_hash is not None and holder_of(b.namespace) == holder]
            pool.uncache(cached)
            host = self.tiers.host
            in_host = [h for h in host.entries if host.entries.holder(h) == holder]
            host.release(host.take(in_host))
        dropped = {"prefixes": prefixes, "device": len(cached), "host": len(in_host)}
        return dropped | {"spill": self.drop_spill_namespace(namespace) if spill else 0}

    def drop_spill_namespace(self, namespace: str, wait_s: float = 10.0) -> int:
        """Drop ``namespace``'s blocks (salted variants too) on the spill nodes, after the
        queued spill puts have gone out (``wait_s`` at most, so none of its blocks lands
        after the drop). Returns blocks dropped there; 0 without a spill client or on a
        failed call (logged). Takes no engine lock while it waits: call it off the step thread."""
        worker, spill = self.tiers.worker, self.tiers.spill
        if worker is None or spill is None:
            return 0
        worker.wait_idle(wait_s)
        try:
            return int(spill.drop_namespace(namespace))
        except Exception as exc:  # noqa: BLE001 - a dead spill node: its files stay (logged)
            logger.warning("dropping namespace %s on the spill tier failed: %s", namespace, exc)
            return 0

    def take_tier_events(self) -> list[TierEvent]:
        """(event, block_hash, tier) changes of the device and host tiers since the last call.

        ``event`` is "stored" or "removed"; ``tier`` "device" or "host". A demotion reads
        removed/device then stored/host. Spill nodes report their own tiers' events.
        """
        with self._lock:
            return self.tiers.take_events()

    def tier_block_hashes(self) -> list[tuple[bytes, str]]:
        """``(block_hash, tier)`` of every block the device and host tiers hold now
        (``TierManager.held_hashes``)."""
        with self._lock:
            return self.tiers.held_hashes()

    def take_events(self) -> list[tuple[str, bytes]]:
        """Device-tier (event, block_hash) changes since the last call (drains host events too;
        prefer ``take_tier_events``)."""
        return [(e.event, e.block_hash) for e in self.take_tier_events() if e.tier == TIER_DEVICE]

    def settle_transfers(self) -> bool:
        """On an idle engine: advance paced demotion by one lot (``DeviceCopier.pump``: once
        the last lot has landed) and return held blocks whose copy has landed to the free
        queue. Paced demotion advances a lot per step, so without steps it would stand still;
        a lot at a time (not every pending piece at once) so a request that arrives meanwhile
        waits behind one lot on the copy engine at most, not a whole demotion. Returns True
        while pieces are pending or blocks held: call again soon."""
        with self._lock:
            self.tiers.copier.pump()
            self.tiers.release_held()
            return bool(self.tiers.copier.pending) or self.tiers.copier.num_held > 0

    def wait_for_transfers(self, timeout_s: float = 30.0) -> bool:
        """Block until queued spill puts and prefetches are done and every device block held
        for a demotion copy (CUDA) is free again. False on timeout."""
        worker = self.tiers.worker
        done = True if worker is None else worker.wait_idle(timeout_s)
        with self._lock:
            self.tiers.release_held(wait=True)
        return done

    def _over_quota_first(self, cached: list[KVBlock]) -> list[KVBlock]:
        """Watermark demotion order: free cached blocks (``cached``, LRU first) of the tenants
        most over their device-tier quota first, then the rest, LRU within each tenant.

        A tenant holds the blocks of its running sequences (their charge blocks for KV kept
        outside the pool included: ``Sequence.num_held_blocks``) plus the free cached blocks it
        released last (``KVBlock.owner``); over = held - ``kv_quota_blocks``. Borrowed space is
        reclaimed before anyone else's (docs/architecture.md, 'Tenants and SLO promises':
        ``kv_quota_bytes``).
        """
        policy = self.scheduler.policy
        held: Counter[str] = Counter(b.owner for b in cached if b.owner)
        for seq in self.scheduler.running:
            held[seq.tenant] += seq.num_held_blocks
        over = {t: n - policy.quota_blocks_of(t) for t, n in held.items()}
        return sorted(cached, key=lambda b: -max(over.get(b.owner, 0), 0))

    def spill_block_spec(self) -> SpillBlockSpec:
        """Shape, numpy dtype and kv_format of this node's blocks in the spill tier."""
        return SpillBlockSpec(self.tiers.block_shape, numpy_dtype_of(self.pool.kv.dtype).name,
                              self.kv_format)
