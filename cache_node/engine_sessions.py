"""The engine's session calls (mixed into ``LLMEngine``): close, rewind, history and expiry of
the sessions in its ``SessionTable``, and the unpinning of idle sessions (with compressed
prefixes, largest holder first, least recently used first within it) while a queued request
cannot get blocks.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Collection
from typing import TYPE_CHECKING

from cache_node.compressed_prefix import CompressedPrefixCache
from cache_node.config import EngineConfig
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool
from cache_node.outputs import SessionBusy
from cache_node.scheduler import Scheduler
from cache_node.sequence import Sequence
from cache_node.sessions import SessionTable, check_turn, client_session_id
from cache_node.tiers.fair_lru import holder_of

log = logging.getLogger(__name__)


class EngineSessionsMixin:
    """Session calls of ``LLMEngine`` (which provides these attributes)."""

    _lock: threading.RLock
    config: EngineConfig
    pool: KVPool
    kv_manager: KVCacheManager
    scheduler: Scheduler
    sessions: SessionTable
    prefixes: CompressedPrefixCache
    _settling: list[Sequence]
    _aborted: list[Sequence]
    num_settle_fallbacks: int

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

    def cut_session_turn(self, session_id: str, request_id: str, prompt_len: int, output: tuple[int, ...],
                         keep: int, tail: list[int], lead: tuple[int, ...] | list[int] = ()) -> bool:
        """The turn ``request_id`` that just finished in ``session_id`` (its prompt of
        ``prompt_len`` tokens, its ``output``) returned the text of its first ``keep`` output
        tokens and then that of ``tail`` (the reply its client got, as a rendering of the
        conversation tokenizes it: the cache node cut it, e.g. at a stop string, or where its
        tokens are not the rendering's): the history keeps those tokens, its KV past the cut
        freed (``SessionTable.cut_turn``; a negative ``keep`` cuts into the prompt's last
        ``lead`` tokens, which it must end with). False when the session is not at that turn's
        end, or its prompt does not end with ``lead``."""
        with self._lock:
            running = next((s for s in self._settling if s.request_id == request_id), None)
            return self.sessions.cut_turn(session_id, request_id, prompt_len, output, keep, tail, lead, running)

    def check_session_free(self, session_id: str, tenant: str, namespace: str | None = None) -> None:
        """Refuse a turn of ``tenant``'s ``session_id`` while the session runs a turn, or one that
        ended whose end the engine has yet to report (``Session.ending``: its history is cut to
        the reply its client got when the cache node delivers it), before the cache node renders
        the turn against a history and kept messages that are about to change. With
        ``namespace`` (the turn's cache namespace), a turn the session's ``add_request`` would
        refuse (``sessions.check_turn``: another tenant's session, or one opened under another
        namespace) is refused here first, before the cache node renders it against that
        session's kept messages; without it, another tenant's session is left to
        ``add_request``. No session: nothing to refuse.

        Raises:
            PermissionError: the session is another tenant's or another namespace's (with
                ``namespace``; the tenant's own under another namespace:
                ``sessions.SessionNamespaceChanged``, the node's FAILED_PRECONDITION); checked
                before it being busy, which such a turn is not told.
            SessionBusy: it runs a turn.
        """
        with self._lock:
            sess = self.sessions.sessions.get(session_id)
            if sess is None:
                return
            if namespace is not None:  # ("": the engine's default, as ``add_request`` takes it)
                check_turn(sess, session_id, tenant, namespace or self.config.cache_namespace_default)
            if sess.tenant == tenant and (sess.active_request is not None or sess.ending is not None):
                raise SessionBusy(client_session_id(session_id, tenant))

    def session_history(self, session_id: str) -> list[int] | None:
        """Token ids of an idle session's history, or None when the session is unknown."""
        with self._lock:
            sess = self.sessions.sessions.get(session_id)
            return None if sess is None else list(sess.token_ids)

    def expire_sessions(self, ttl_s: float) -> list[str]:
        with self._lock:
            return self.sessions.expire(ttl_s)

    def _hand_over(self, seq: Sequence, dropped: bool) -> None:
        """A finished turn's blocks: its session keeps them (with its policy state) as the
        history, unless the turn was ``dropped`` (aborted, rejected, failed); else freed."""
        kept = seq.session_id is not None and self.sessions.detach(seq, aborted=dropped)
        if not kept:
            self.kv_manager.free(seq)

    def _settle_finished_turns(self) -> None:
        """Hand the session turns that finished with a compaction due (``_settling``: put off
        at their last step for want of free blocks or host-tier room) over to their sessions
        once it ran (``Scheduler.settle_compaction``). One that still cannot run (the pool
        has no blocks for its copy-on-write, even after requests of its class or lower, waiting
        requests and idle states gave theirs) leaves its session the tokens and unpins the KV
        (``SessionTable.unpin``: a compacted layout goes whole, a plain one stays matchable),
        counted (``settle_fallbacks``) and logged: never a state its policy has not compacted.

        Regression (hangs review 20 W1): the session took such a turn's state as it was (400
        slots kept instead of 20 for a sentencekv-64 turn whose host-tier room other tenants
        held; a snapkv-0.5 turn whose prompt blocks another request shared), flagged due but
        never compacted, and its next turn compressed history and prompt at once: other tokens
        than on an idle node.
        """
        while self._settling:
            seq = self._settling.pop(0)
            try:
                settled = self.scheduler.settle_compaction(seq)
            except Exception:  # this turn's policy failed: it alone loses its KV
                # (review of 29983c3, D3: the fault reached the step's recovery, which failed
                # another tenant's request, and the turn's session stayed busy with its blocks held)
                log.exception("session %s: request %s: its policy %r failed running its put-off compaction",
                              seq.session_id, seq.request_id, seq.policy)
                settled = False
            if settled:
                self._hand_over(seq, dropped=False)
                continue
            self.num_settle_fallbacks += 1
            log.warning("session %s: request %s finished with a compaction its policy %r could not run: the "
                        "session keeps its tokens, not its KV", seq.session_id, seq.request_id, seq.policy)
            self._hand_over(seq, dropped=False)
            self.sessions.unpin(seq.session_id or "")

    def release_undo(self) -> None:
        """Free the histories sessions keep to undo a turn that just ended (``Session.previous``,
        ``rewind_session``), but those of turns whose end is still to be reported (ended by
        ``abort_request``: the next step outputs them). The cache node calls it once it has
        delivered (or undone) a step's outputs; ``step`` calls it first.

        Regression (review of b4a2ce4, D1, D4): a turn the node ended on a stop string had its
        kept history freed by the step that reported its end, before the node could undo it;
        and on a node going idle the last turns' kept histories stayed held, counted nowhere."""
        with self._lock:
            self.sessions.drop_previous(keep={s.session_id for s in self._aborted if s.session_id})

    def _release_idle_sessions(self) -> None:
        """Unpin idle sessions (and drop stored compressed prefixes) while a queued request
        cannot get blocks: ``_unpin_idle_sessions`` for the queue's head.

        Regression: sessions pinned between turns could fill the pool so that no new request
        was ever admitted (they waited until their deadline). Unpinned KV stays matchable as
        cached blocks (demoted below on eviction), so the next turn still finds it.
        """
        if not self.scheduler.waiting:
            return
        head = self.scheduler.waiting[0]
        # a head that forks a stored compressed prefix needs its copy and the tokens past it
        fork = self.prefixes.fork_blocks(head, head.num_tokens - head.prefix_tokens + 1)
        tokens_need = -(-(head.num_tokens + 1) // self.pool.block_size) if fork is None else fork
        need = max(self.pool.num_blocks // 10, tokens_need)
        if self.kv_manager.pool.num_free_blocks() >= need:
            return
        # the stored prefixes that the head and the requests admission starts next fork stay:
        # a fork takes its copy only when it starts (review 26a, F2), and, dropped, its prefix
        # would be computed again (seen: another tenant's queued request dropped the prefix a
        # queued fork was about to copy, and the fork recomputed 1,000 tokens); at most
        # ``max_num_seqs`` + 1 of them, counted in their holder's idle blocks (review 26e, F1)
        starting = [head, *self.scheduler.next_to_start()]
        keep = {e.key for e in map(self.prefixes.stored_entry, starting) if e is not None}
        self._unpin_idle_sessions(need, holder_of(head.cache_namespace), keep)

    def _unpin_idle_sessions(self, need: int, holder: str = "", keep: Collection[object] = ()) -> None:
        """Unpin (demote) idle sessions and drop stored compressed prefixes until ``need``
        blocks are free or none is left, for a request of ``holder`` (a cache namespace
        without its salt): the idle states of the holder then holding the most device blocks
        in idle states per unit of its weight (``TierManager.weights``, its tenant's) go first (``holder``'s own on a tie), least recently used first within
        it, sessions before prefixes on a tie. That is the max-min fair order of the tiers
        below (``tiers.fair_lru``) and of ``_reclaim_host``. Every idle state may go, so the
        waiting request gets its blocks, but the stored prefixes ``keep`` (those the requests
        admission starts next fork; the scheduler's last resort, ``_free_held_elsewhere``, may
        still drop them). Those count in their holder's idle blocks, and nothing more goes
        once the holder holding the most has only them left: no other holder gives up idle
        state for a holder's kept prefixes.

        Regression (security review 20 S1): one least-recently-used order over every tenant
        let a tenant holding 18 idle blocks send one request that took all of another tenant's
        (3-6 blocks) and none of its own; the other tenant's next turn reused 32 (full cache)
        or 0 (snapkv-40, whose compacted state went whole, so its output changed) of 104
        prompt tokens instead of 87.

        Regression (review 26e, F1): every stored prefix any queued request would fork was
        kept, and left out of its holder's count: a tenant holding 30 idle blocks in three
        stored prefixes, with a fork of each queued, made another tenant's whole compacted
        session (7 blocks) go instead, and too few blocks came free (20 of 25). Queueing
        requests let a tenant pin idle state without bound, at the others' expense.
        """
        pool = self.kv_manager.pool
        if pool.num_free_blocks() >= need:
            return
        # the histories kept to undo a turn go first: they only serve a cancel that raced the
        # turn's end (review of b4a2ce4, D8: a settling turn unpinned another session's
        # fresh compacted state while they held the blocks it needed)
        self.sessions.drop_previous()
        if pool.num_free_blocks() >= need:
            return
        by_holder: dict[str, list[tuple[float, int, object, int]]] = {}
        held: dict[str, int] = {}
        for sess in self.sessions.sessions.values():
            if sess.active_request is None and sess.num_held_blocks:
                by_holder.setdefault(holder_of(sess.namespace), []).append(
                    (sess.last_used_s, 0, sess.session_id, sess.num_held_blocks))
        for key, entry in self.prefixes.entries.items():
            kv = entry.seq.kv
            blocks = len(entry.seq.block_table) + (len(kv.charge_blocks) if kv is not None else 0)
            owner = holder_of(entry.seq.cache_namespace)
            items = by_holder.setdefault(owner, [])
            if key in keep:  # stays, but counts
                held[owner] = held.get(owner, 0) + blocks
            else:
                items.append((entry.last_used_s, 1, key, blocks))
        for owner, items in by_holder.items():
            held[owner] = held.get(owner, 0) + sum(item[3] for item in items)
        queues = {owner: deque(sorted(items, key=lambda item: item[:2])) for owner, items in by_holder.items()}
        weight = self.tiers.weights.of  # per unit of its tenant's weight, as the tiers below
        while pool.num_free_blocks() < need and queues:
            owner = max(queues, key=lambda o: (held[o] / weight(o), o == holder, bool(queues[o]),
                                               -queues[o][0][0] if queues[o] else 0.0))
            if not queues[owner]:
                break  # the holder holding the most has only kept prefixes left
            _, kind, state, blocks = queues[owner].popleft()
            held[owner] -= blocks
            if kind == 0:
                self.demote_session(state)  # type: ignore[arg-type]
            else:
                self.prefixes.evict(state)  # type: ignore[arg-type]
