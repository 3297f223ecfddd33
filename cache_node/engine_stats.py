"""The engine's introspection (mixed into ``LLMEngine``): the pool's integrity check, what each
tenant's live requests hold, and the counters behind ``kvstrata status`` and the node's metrics.
"""

from __future__ import annotations

import threading

from cache_node.compressed_prefix import CompressedPrefixCache
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool
from cache_node.scheduler import Scheduler
from cache_node.sequence import Sequence
from cache_node.sessions import SessionTable
from cache_node.tiers.manager import TierManager


class EngineStatsMixin:
    """Introspection of ``LLMEngine`` (which provides these attributes)."""

    _lock: threading.RLock
    pool: KVPool
    kv_manager: KVCacheManager
    scheduler: Scheduler
    requests: dict[str, Sequence]
    sessions: SessionTable
    prefixes: CompressedPrefixCache
    tiers: TierManager
    num_failed_requests: int
    num_cut_short: int
    num_host_reclaims: int
    num_settle_fallbacks: int

    def check_integrity(self) -> None:
        """Raise RuntimeError when pool bookkeeping is inconsistent (see BlockPool), or an idle
        session counts KV it holds no blocks for (``SessionTable.check_integrity``)."""
        with self._lock:
            self.kv_manager.check_integrity()
            self.sessions.check_integrity()

    def held_by_tenant(self) -> dict[str, dict[str, int]]:
        """Per tenant with live requests: ``blocks`` (pool blocks its requests hold, charge
        blocks included: ``Sequence.num_held_blocks``) and ``policy_bytes`` (bytes their KV
        policies hold outside the pool blocks now, which those charge blocks pay for)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for seq in self.requests.values():
                held = out.setdefault(seq.tenant, {"blocks": 0, "policy_bytes": 0})
                held["blocks"] += seq.num_held_blocks
                held["policy_bytes"] += seq.kv.outside_pool_bytes() if seq.kv is not None else 0
        return out

    def stats(self) -> dict[str, int]:
        pool = self.kv_manager.pool
        with self._lock:
            charged = [s.kv for s in self.requests.values() if s.kv is not None]
            charged += self.sessions.idle_policy_states() + self.prefixes.states()
            used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
            free = pool.num_free_blocks()
            cached_free = sum(1 for b in pool.free_queue if b.block_hash is not None)
            return {
                "num_blocks": pool.num_blocks,
                "used_blocks": used,
                "free_blocks": free - cached_free,
                "cached_blocks": cached_free,
                "block_size": self.pool.block_size,
                "device_bytes_used": used * self.pool.bytes_per_block,
                "running": len(self.scheduler.running),
                "failed_requests": self.num_failed_requests,
                "requests_cut_short": self.num_cut_short,
                "host_reclaims": self.num_host_reclaims,
                "settle_fallbacks": self.num_settle_fallbacks,
                "waiting": len(self.scheduler.waiting),
                "sessions": len(self.sessions.sessions),
                "session_blocks": sum(s.num_held_blocks for s in self.sessions.sessions.values()
                                      if s.active_request is None),
                "session_policy_continuations": self.sessions.num_policy_continuations,
                "session_policy_fallbacks": self.sessions.num_fallbacks,
                "session_states_dropped": self.sessions.num_states_dropped,
                "policy_bytes": sum(kv.outside_pool_bytes() for kv in charged),
                "policy_blocks": sum(len(kv.charge_blocks) for kv in charged),
                "compaction_released_hashes": pool.num_released_hashes,
                "compactions_deferred": pool.num_deferred_rewrites,
                # waiting requests passed over while a running request computes their prefix
                "compressed_prefix_parked": self.scheduler.num_awaiting_prefix(),
            } | self.tiers.stats() | self.prefixes.stats()
