"""The tier mover: demotes device blocks to host and spill, promotes them back on a prefix hit.

Tiers (docs/architecture.md, 'Tiers'): device (the ``KVPool``), host (``HostTier``), spill
RAM and disk (a
``SpillClient``). Every move is a copy followed by dropping the source's hash, so a block is
matchable in one node tier at a time (spill keeps its copy: it is shared by all nodes).

- **Demotion**: when free un-cached device blocks fall below ``demote_low_watermark`` of the
  pool, the LRU cached blocks (free-queue head) are copied to host in one batch and their
  device hash dropped, up to ``demote_high_watermark``; an allocation that still reaches a
  cached block copies it down first (``BlockPool.evict_hook``), so no computed KV is lost
  silently. Host LRU victims are pushed to spill by the transfer worker (batched, async).
- **Promotion**: at admission, past the device hits, host hits are copied into fresh device
  blocks (a memcpy: synchronous on the CPU, async and event-ordered on CUDA). Spill hits are never read on the step path: ``prefetch``
  copies them into device blocks in the background while the request waits in the queue.
- **Sessions**: ``demote_blocks`` moves an idle session's blocks below; the next turn finds
  them through promotion.
- **On CUDA** (``device_copy.DeviceCopier``): host copies run on their own stream, ordered by
  events; blocks freed by watermark, session or ``demote_all`` demotion are held out of the
  free queue until their copy has finished (released by the next ``maybe_demote`` or by
  ``release_held``), blocks an allocation reuses at once make later steps wait on the copy,
  and promoted or installed blocks are read by later steps only after they land.

Every hit is exact or a miss: host hits are token-checked, spill replies are validated
(``spill_api.leading_hits``) and any exception from the spill client is a miss.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import islice

import numpy as np
import torch

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool
from cache_node.sequence import Sequence
from cache_node.tiers.block_copy import view_to_stack
from cache_node.tiers.device_copy import CopyTicket, DeviceCopier
from cache_node.tiers.fair_lru import HolderWeights, holder_of
from cache_node.tiers.host import TIER_DEVICE, TIER_HOST, BlockMeta, HostTier, TierEvent, Victims
from cache_node.tiers.prefetch import TransferWorker
from cache_node.tiers.spill_api import SPILL_HASH_BYTES, SpillClient, numpy_dtype_of
from cache_node.tiers.spill_store import MAX_CALL_BLOCKS

TIERS = (TIER_DEVICE, TIER_HOST, "spill_ram", "spill_disk")
COUNTERS = (  # block counts moved, and faults absorbed as misses or dropped writes
    "demoted_blocks", "promoted_host_blocks", "installed_spill_blocks", "spill_put_blocks",
    "dropped_blocks", "spill_put_errors", "spill_get_errors", "spill_bad_replies",
    "spill_flush_errors",
    "spill_put_dropped_blocks",  # host victims dropped over spill_put_backlog_bytes (unwritten)
    "policy_dropped_tokens",  # tokens a policy demoted while the host tier was full (lost)
)


@dataclass(frozen=True)
class TierConfig:
    """Sizing and thresholds of the tiers below the device.

    Attributes:
        host_bytes: host-tier RAM budget (0: no host tier; demotions go straight to spill).
        demote_low_watermark / demote_high_watermark: fractions of the pool; demotion starts
            when free un-cached blocks drop below the low mark and stops at the high mark.
        demote_batch_blocks: most blocks demoted per step by the watermark.
        prefetch_wait_s: longest a queued request waits for its prefetch before it recomputes.
        auto_prefetch: start a prefetch for every new request (when a spill client exists).
        spill_put_batch_blocks: most blocks per spill ``put`` call (at most the spill nodes'
            ``spill_store.MAX_CALL_BLOCKS``, which refuse larger calls).
        spill_get_batch_blocks: most blocks per spill ``get`` call of a prefetch (at most
            ``MAX_CALL_BLOCKS`` too): a long
            prompt's spilled blocks come in batches, each installed before the next is asked
            for, so neither the spill node nor this process holds a whole prompt's blocks at
            once (a 128k-token prompt of an 8B model is 16 GiB).
        spill_put_backlog_bytes: most KV bytes of host victims queued in this process for
            spill puts, the batch being written included; past it the holder with the most
            queued loses its oldest (``spill_backlog.SpillBacklog``), a later spill miss. A
            bound under one block drops every spill write.
    """

    host_bytes: int = 0
    demote_low_watermark: float = 0.05
    demote_high_watermark: float = 0.10
    demote_batch_blocks: int = 64
    prefetch_wait_s: float = 10.0
    auto_prefetch: bool = True
    spill_put_batch_blocks: int = 256
    spill_get_batch_blocks: int = 256
    spill_put_backlog_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"host_bytes must be >= 0, got {self.host_bytes}")
        if not 0 <= self.demote_low_watermark <= self.demote_high_watermark <= 1:
            raise ValueError("need 0 <= demote_low_watermark <= demote_high_watermark <= 1")
        if min(self.demote_batch_blocks, self.spill_put_batch_blocks, self.spill_get_batch_blocks) < 1:
            raise ValueError("demote_batch_blocks, spill_put_batch_blocks and spill_get_batch_blocks must be >= 1")
        if max(self.spill_put_batch_blocks, self.spill_get_batch_blocks) > MAX_CALL_BLOCKS:
            # a spill node refuses a larger call whole: every spill put or get would fail
            raise ValueError(f"spill_put_batch_blocks and spill_get_batch_blocks must be <= {MAX_CALL_BLOCKS} "
                             "(the most blocks a spill node takes per call)")
        if self.prefetch_wait_s < 0:
            raise ValueError("prefetch_wait_s must be >= 0")
        if self.spill_put_backlog_bytes < 1:
            raise ValueError(f"spill_put_backlog_bytes must be >= 1, got {self.spill_put_backlog_bytes}")


def _paired_in_order(blocks: list[KVBlock], slots: Seq[int]) -> list[KVBlock]:
    """``blocks`` reassigned so that ascending block ids go with ascending ``slots`` (the i-th
    result holds ``slots[i]``'s block): any fresh block can take any hash, and pairing them in
    order turns consecutive slots and ids into one copy per run instead of one per block."""
    out: list[KVBlock] = [blocks[0]] * len(blocks)
    by_id = sorted(blocks, key=lambda b: b.block_id)
    for block, i in zip(by_id, sorted(range(len(slots)), key=slots.__getitem__)):
        out[i] = block
    return out


class TierManager:
    """Moves blocks between the device pool, the host tier and a spill client.

    Every public method expects the engine lock (``lock``) held, except ``flush`` and the
    worker's entry points, which take it themselves.
    """

    def __init__(
        self,
        pool: KVPool,
        kv_manager: KVCacheManager,
        config: TierConfig,
        spill: SpillClient | None,
        lock: threading.RLock,
    ) -> None:
        self.pool, self.kv, self.config, self.lock = pool, kv_manager, config, lock
        self.blocks = kv_manager.pool
        L, two, _, bs, h, d = pool.blocks_view().shape
        self.block_shape = (L, two, bs, h, d)  # one block in the spill tier
        self.spill_np_dtype: np.dtype = numpy_dtype_of(pool.kv.dtype)
        self.copier = DeviceCopier(pool.kv.device)
        # each holder's latest known weight, for the fair shares of the host tier, the spill-put
        # backlog and (sent with each put) the spill tier; the engine learns them from requests
        self.weights = HolderWeights()
        self.host = HostTier(pool.blocks_view().shape, pool.kv.dtype, config.host_bytes,
                             pin=pool.kv.is_cuda, copier=self.copier, weights=self.weights)
        self.spill = spill
        self.counters: Counter[str] = Counter()
        self.worker = (TransferWorker(self, spill, config.spill_put_backlog_bytes // self.host.block_nbytes)
                       if spill is not None else None)
        # frees host slots other holders reserved (idle ones) for a reservation that does not
        # fit (``reserve_host``); the engine sets it
        self.reclaim_host: Callable[[int, str], None] | None = None
        # the running requests of other holders over their fair share of the host tier that
        # a reservation could take from by preempting them (``host_contenders``); the engine
        # sets it
        self.host_contenders: Callable[[int, str, Sequence], list[Sequence]] | None = None
        self.enabled = self.host.num_slots > 0 or spill is not None
        # reorders the free cached blocks (LRU order in) before watermark demotion takes the
        # first ones; None = LRU (the engine sets it for quota-aware scheduling policies)
        self.demotion_order: Callable[[list[KVBlock]], list[KVBlock]] | None = None
        if self.enabled:
            self.blocks.evict_hook = self.demote_blocks
            kv_manager.promote_hook = self.promote

    def note_weight(self, namespace: str, weight: float, tenant: str = "") -> None:
        """``weight`` is now ``tenant``'s (from a request of its that the node runs) for
        ``namespace``'s holder, which weighs the sum of its tenants' weights (a shared namespace;
        ``fair_lru.HolderWeights``); without a ``tenant``, the holder's weight as a whole. The
        host tier, the spill-put backlog and the spill puts of its blocks count its holding per
        unit of it from the next eviction on (``fair_lru``). Raises ValueError for a weight
        ``fair_lru.check_weight`` refuses."""
        self.weights.set(holder_of(namespace), weight, tenant)

    # ---- demotion ---------------------------------------------------------------------------
    def demote_blocks(self, blocks: Seq[KVBlock]) -> None:
        """Copy free cached device blocks below (host, else spill); their hashes stay on device.

        The caller drops the device hashes (``BlockPool.allocate`` or ``uncache``) and may
        reuse the blocks at once: on CUDA later steps wait for the copy (``order_reuse``).
        """
        self.copier.order_reuse(self._demote(blocks))

    def _demote(self, blocks: Seq[KVBlock]) -> CopyTicket | None:
        """``demote_blocks`` without ordering reuse; returns the host copy's ticket (CUDA)."""
        todo = [b for b in blocks if b.block_hash is not None and b.block_hash not in self.host]
        if not todo:
            return None
        metas = [BlockMeta(b.block_hash, b.token_ids, b.namespace) for b in todo]  # type: ignore[arg-type]
        victims = self.host.put(metas, self.pool.blocks_view(), [b.block_id for b in todo])
        self.counters["demoted_blocks"] += len(todo)
        self.push_to_spill(victims)
        return self.host.last_put_event

    def _uncache_and_hold(self, blocks: list[KVBlock], event: CopyTicket | None) -> None:
        """Drop the demoted blocks' device hashes; on CUDA keep them out of the free queue
        (one reference each) until their copy ``event`` has completed."""
        self.blocks.uncache(blocks)
        if self.copier.hold(event, blocks):
            self.blocks.touch(blocks)

    def release_held(self, wait: bool = False) -> int:
        """Return held demoted blocks whose copy finished (all, waiting, with ``wait``) to the
        free-queue head. Returns blocks released."""
        done = self.copier.release_done(wait)
        if done:
            self.blocks.free(done)
            self.blocks.uncache(reversed(done))  # back at the head, in their order
        return len(done)

    def reserve_host(self, n: int, holder: str = "") -> list[int] | None:
        """``n`` host-tier slots for a policy's own KV, held as ``holder``'s (see
        ``HostTier.reserve``); LRU entries pushed out go to spill. When they do not fit,
        ``reclaim_host(n, holder)`` (the engine's: idle sessions and stored prefixes) frees
        some first. None when the host tier still cannot hold ``n`` more for ``holder``."""
        with self.lock:
            if not self.host.can_reserve(n, holder) and self.reclaim_host is not None:
                self.reclaim_host(n, holder)
            slots, victims = self.host.reserve(n, holder)
            self.push_to_spill(victims)
            return slots

    def can_reserve_host(self, n: int, holder: str = "") -> bool:
        """``reserve_host(n, holder)`` would succeed now; idle holders' states are dropped
        first as for it (``reclaim_host``). Reserves nothing."""
        with self.lock:
            if not self.host.can_reserve(n, holder) and self.reclaim_host is not None:
                self.reclaim_host(n, holder)
            return self.host.can_reserve(n, holder)

    def release_host(self, slots: Seq[int], holder: str = "") -> None:
        with self.lock:
            self.host.release_slots(slots, holder)

    def push_to_spill(self, victims: Victims) -> None:
        """Hand host victims to the transfer worker (a later, batched spill put); past the
        backlog bound some queued ones are dropped (``spill_put_dropped_blocks``)."""
        if victims.metas and self.worker is not None:
            self.counters["spill_put_dropped_blocks"] += self.worker.submit_put(victims)
        elif victims.metas:
            self.counters["dropped_blocks"] += len(victims.metas)

    def maybe_demote(self) -> int:
        """Watermark demotion (call once per step). Returns blocks demoted."""
        if not self.enabled:
            return 0
        self.copier.pump()  # the next lot of a paced demotion (``DeviceCopier``)
        self.release_held()
        if self.copier.pending:
            # the last batch is still being enqueued, a lot per step: demoting more now would
            # only queue behind it (review of the paced demotion, F1: a 70B-shaped pool's
            # 320 MiB batches piled up and drained the device prefix cache)
            return 0
        n = self.blocks.num_blocks
        free_cached = sum(1 for b in self.blocks.cached.values() if b.ref_cnt == 0)
        # blocks held for a demotion copy in flight are free as soon as it lands
        free_plain = self.blocks.num_free_blocks() - free_cached + self.copier.num_held
        if free_plain >= self.config.demote_low_watermark * n or free_cached == 0:
            return 0
        want = int(self.config.demote_high_watermark * n + 0.999) - free_plain
        want = min(want, self.config.demote_batch_blocks)
        cached = (b for b in self.blocks.free_queue if b.block_hash is not None)
        if self.demotion_order is not None:
            cached = iter(self.demotion_order(list(cached)))
        victims = list(islice(cached, max(want, 0)))
        self._uncache_and_hold(victims, self._demote(victims))
        return len(victims)

    def demote_free_blocks(self, blocks: Seq[KVBlock], to_spill: bool = False, hold: bool = False) -> int:
        """Move free cached device blocks below now (idle sessions, tests, ``demote_all``,
        preemption swaps). ``hold``: on CUDA keep the blocks out of the free queue until their
        copy finishes (else later steps wait for it; a preemption needs the blocks at once)."""
        blocks = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]
        event = None
        if to_spill:
            self.push_to_spill(self._stack(blocks))  # a synchronous copy
        else:
            event = self._demote(blocks)
        if hold:
            self._uncache_and_hold(blocks, event)
        else:
            self.copier.order_reuse(event)
            self.blocks.uncache(blocks)
        return len(blocks)

    def demote_all(self, to_spill: bool = False) -> int:
        """Move every free cached device block below; with ``to_spill`` the host tier too."""
        n = self.demote_free_blocks([b for b in self.blocks.free_queue], to_spill, hold=True)
        if to_spill:
            self.push_to_spill(self.host.evict_all())
        return n

    def _stack(self, blocks: Seq[KVBlock]) -> Victims:
        metas = [BlockMeta(b.block_hash, b.token_ids, b.namespace) for b in blocks]  # type: ignore[arg-type]
        return Victims(metas, view_to_stack(self.pool.blocks_view(), [b.block_id for b in blocks]))

    # ---- promotion --------------------------------------------------------------------------
    def promote(self, seq: Sequence, hits: list[KVBlock]) -> list[KVBlock]:
        """Extend a device prefix hit through device and host blocks (admission time).

        Host blocks are copied into new device blocks, which become cached free blocks (the
        caller's ``allocate_slots`` takes them). Returns the blocks that follow ``hits``.
        """
        bs, tokens = self.kv.block_size, seq.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        hashes = self.kv.block_hashes(seq, max_blocks)
        found: list[KVBlock | None] = []
        from_host: list[bytes] = []
        for i in range(len(hits), max_blocks):
            span = tokens[i * bs : (i + 1) * bs]
            block = self.blocks.lookup(hashes[i], span)
            if block is None and self.host.lookup(hashes[i], span) is None:
                break
            found.append(block)
            if block is None:
                from_host.append(hashes[i])
        if from_host:
            new = self._promote_host(from_host, hits + [b for b in found if b is not None])
            if new is None:
                return []
            it = iter(new)
            found = [b if b is not None else next(it) for b in found]
            for block in new:
                seq.promoted_from.setdefault(block.block_hash, TIER_HOST)  # type: ignore[arg-type]
        return [b for b in found if b is not None]

    def _promote_host(self, hashes: list[bytes], keep: list[KVBlock]) -> list[KVBlock] | None:
        entries = self.host.take(hashes)
        self.blocks.touch(keep)  # our own prefix must not be evicted by the allocation below
        new = self.blocks.allocate(len(hashes))
        self.blocks.free(list(reversed(keep)))
        if new is None:
            self.host.untake(hashes, entries)
            return None
        new = _paired_in_order(new, [e.slot for e in entries])
        self.copier.promote(self.pool.blocks_view(), [b.block_id for b in new], self.host.data,
                            [e.slot for e in entries])
        self.host.release(entries)
        for block, h, e in zip(new, hashes, entries):
            self.blocks.cache_block(block, h, e.token_ids, e.namespace)
        self.blocks.free(list(reversed(new)))
        self.counters["promoted_host_blocks"] += len(new)
        return new

    def install(self, seq: Sequence, start: int, rows: torch.Tensor, tiers: list[str]) -> int:
        """Write prefetched spill rows for blocks ``start..`` of ``seq`` into cached device blocks.

        ``rows``: torch (k, L, 2, block_size, H_kv, d). Blocks already on device are skipped;
        stops where the pool has no free block. Returns blocks installed.
        """
        bs, tokens = self.kv.block_size, seq.all_token_ids
        hashes = self.kv.block_hashes(seq, start + len(tiers))
        todo = [i for i in range(len(tiers)) if hashes[start + i] not in self.blocks.cached]
        todo = todo[: self.blocks.num_free_blocks()]
        new = sorted(self.blocks.allocate(len(todo)) or [], key=lambda b: b.block_id)  # runs with the rows
        picked = rows if len(todo) == len(tiers) else rows[todo]
        self.copier.install(self.pool.blocks_view(), [b.block_id for b in new], picked[: len(new)])
        namespace = seq.extra_keys[0] if seq.extra_keys else ""
        for block, i in zip(new, todo):
            j = start + i
            if hashes[j] in self.host:
                self.host.release(self.host.take([hashes[j]]))
            self.blocks.cache_block(block, hashes[j], tokens[j * bs : (j + 1) * bs], namespace)
            seq.promoted_from.setdefault(hashes[j], tiers[i])
        self.blocks.free(list(reversed(new)))
        self.counters["installed_spill_blocks"] += len(new)
        return len(new)

    def spill_candidates(self, seq: Sequence) -> tuple[int, list[bytes]]:
        """(start, hashes): the blocks of ``seq``'s prompt past its device/host prefix."""
        bs, tokens = self.kv.block_size, seq.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        hashes = self.kv.block_hashes(seq, max_blocks)
        start = 0
        while start < max_blocks:
            span = tokens[start * bs : (start + 1) * bs]
            if self.blocks.lookup(hashes[start], span) is None and self.host.lookup(
                hashes[start], span
            ) is None:
                break
            start += 1
        rest = hashes[start:]
        if any(len(h) != SPILL_HASH_BYTES for h in rest):
            return start, []
        return start, rest

    # ---- prefetch, accounting, events, flush ------------------------------------------------
    def prefetch(self, seq: Sequence, now_s: float) -> bool:
        """Start a background spill -> device copy for a queued ``seq``. False if none needed."""
        if self.worker is None or seq.block_table or seq.prefetch_until_s:
            return False
        seq.prefetch_until_s = now_s + self.config.prefetch_wait_s
        self.worker.submit_prefetch(seq)
        return True

    def cached_tokens_by_tier(self, seq: Sequence) -> dict[str, int]:
        """Reused prompt tokens of ``seq`` per tier it was restored from (device/host/spill_*)."""
        out = dict.fromkeys(TIERS, 0)
        bs = self.kv.block_size
        for h in seq.block_hashes[: seq.num_cached_tokens // bs]:
            tier = seq.promoted_from.get(h)
            if tier is not None:
                out[tier] += bs
        out[TIER_DEVICE] = seq.num_cached_tokens - sum(out.values())
        return out

    def held_hashes(self) -> list[tuple[bytes, str]]:
        """``(block_hash, tier)`` of every block held now on the device (prefix-cached) and in
        the host tier: what ``take_events`` has reported, summed up (a restarted global
        scheduler's index is rebuilt from it)."""
        return ([(h, TIER_DEVICE) for h in self.blocks.cached]
                + [(h, TIER_HOST) for h in self.host.entries])

    def take_events(self) -> list[TierEvent]:
        """Device and host stored/removed events since the last call (spill nodes keep theirs)."""
        device = [TierEvent(e, h, TIER_DEVICE) for e, h in self.blocks.take_events()]
        return device + self.host.take_events()

    def flush(self, spill: bool = True) -> int:
        """Drop every cached block on device, host and (``spill``) spill; in-flight transfers
        are dropped. Without ``spill`` the caller flushes the spill tier itself
        (``flush_spill``, which may wait on a spill node: never on the step thread). Returns
        the blocks dropped, all tiers together (``flush_by_tier``)."""
        return sum(self.flush_by_tier(spill).values())

    def flush_by_tier(self, spill: bool = True) -> dict[str, int]:
        """``flush``, returning the blocks dropped per tier: ``device`` (cached blocks of the
        pool's free queue), ``host`` and ``spill`` (0 without ``spill``)."""
        with self.lock:
            self.release_held(wait=True)
            dropped = {"device": self.blocks.evict_cached(), "host": self.host.clear()}
            if self.worker is not None:
                self.worker.new_epoch()
        return dropped | {"spill": self.flush_spill() if spill else 0}

    def flush_spill(self, timeout_s: float | None = None) -> int:
        """Flush the spill tier (after the put or get in progress), all within ``timeout_s``
        (None: the client's timeouts); blocks dropped there. Takes no engine lock. Raises
        ``SpillFlushIncomplete`` (``TransferWorker.flush_spill``): a spill node may still
        hold blocks."""
        return self.worker.flush_spill(timeout_s) if self.worker is not None else 0

    def close(self, timeout_s: float = 5.0) -> bool:
        """End the transfer worker's thread (``TransferWorker.close``: queued puts written
        within ``timeout_s``, prefetches dropped); True when it ended in time (or there is
        none). Call without the engine lock, after ``release_held(wait=True)`` under it."""
        return self.worker.close(timeout_s) if self.worker is not None else True

    def stats(self) -> dict[str, int]:
        """Host tier sizes, the ``COUNTERS``, ``held_demoted_blocks`` (device blocks waiting
        for their demotion copy, CUDA only) and ``spill_put_backlog_blocks``/``_bytes`` (host
        victims queued for spill puts or being written); every key always present."""
        backlog = self.worker.backlog_blocks() if self.worker is not None else 0
        return self.host.stats() | {name: self.counters[name] for name in COUNTERS} | {
            "held_demoted_blocks": self.copier.num_held, "spill_put_backlog_blocks": backlog,
            "spill_put_backlog_bytes": backlog * self.host.block_nbytes}
