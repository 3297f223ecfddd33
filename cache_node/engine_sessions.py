"""The engine's session calls (mixed into ``LLMEngine``): close, rewind, history and expiry of
the sessions in its ``SessionTable``, and the unpinning of idle sessions (with compressed
prefixes, least recently used first) while a queued request cannot get blocks.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from cache_node.compressed_prefix import CompressedPrefixCache
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool
from cache_node.scheduler import Scheduler
from cache_node.sessions import SessionTable


class EngineSessionsMixin:
    """Session calls of ``LLMEngine`` (which provides these attributes)."""

    _lock: threading.RLock
    pool: KVPool
    kv_manager: KVCacheManager
    scheduler: Scheduler
    sessions: SessionTable
    prefixes: CompressedPrefixCache

    if TYPE_CHECKING:  # tiers.engine_api.EngineTiersMixin
        def demote_session(self, session_id: str, to_spill: bool = False) -> int: ...

    def close_session(self, session_id: str) -> int:
        with self._lock:
            return self.sessions.close(session_id)

    def rewind_session(self, session_id: str, history: list[int] | None, prompt_len: int,
                       output: tuple[int, ...]) -> bool:
        """Undo the turn that just finished in ``session_id`` (``SessionTable.rewind``): the
        cache node cancelled it while its last step computed. False when the session is not
        idle at that turn's end."""
        with self._lock:
            return self.sessions.rewind(session_id, history, prompt_len, output)

    def session_history(self, session_id: str) -> list[int] | None:
        """Token ids of an idle session's history, or None when the session is unknown."""
        with self._lock:
            sess = self.sessions.sessions.get(session_id)
            return None if sess is None else list(sess.token_ids)

    def expire_sessions(self, ttl_s: float) -> list[str]:
        with self._lock:
            return self.sessions.expire(ttl_s)

    def _release_idle_sessions(self) -> None:
        """Unpin least-recently-used idle sessions while a queued request cannot get blocks.

        Regression: sessions pinned between turns could fill the pool so that no new request
        was ever admitted (they waited until their deadline). Unpinned KV stays matchable as
        cached blocks (demoted below on eviction), so the next turn still finds it.
        """
        if not self.scheduler.waiting:
            return
        head = self.scheduler.waiting[0]
        need = max(self.pool.num_blocks // 10, -(-(head.num_tokens + 1) // self.pool.block_size))
        self._unpin_idle_sessions(need)

    def _unpin_idle_sessions(self, need: int) -> None:
        """Unpin (demote) idle sessions and drop compressed prefixes, least recently used
        first, until ``need`` blocks are free or none is left."""
        pool = self.kv_manager.pool
        while pool.num_free_blocks() < need:
            session_id = self.sessions.lru_idle()
            idle_since = None if session_id is None else self.sessions.sessions[session_id].last_used_s
            if self.prefixes.evict_lru(idle_since):  # compressed prefixes and sessions: LRU
                continue
            if session_id is None:
                return
            self.demote_session(session_id)
