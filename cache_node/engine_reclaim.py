"""What the engine gives up when memory runs short (mixed into ``LLMEngine``): device blocks
from idle sessions, compressed prefixes and the histories that sessions keep for running turns
(``_reclaim``, the scheduler's last resort), host-tier slots from idle holders' policy states
(``_reclaim_host``), the running requests a host reservation may preempt (``_host_contenders``,
weighted max-min fair across holders, as the tiers' eviction), and a request cut short when nothing more can be freed
(``_cut_short``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from cache_node.compressed_prefix import CompressedPrefixCache
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.scheduler import Scheduler
from cache_node.sequence import Sequence, SequenceStatus
from cache_node.sessions import SessionTable
from cache_node.tiers.fair_lru import holder_of
from cache_node.tiers.manager import TierManager

log = logging.getLogger(__name__)


class EngineReclaimMixin:
    """Memory reclaim of ``LLMEngine`` (which provides these attributes)."""

    requests: dict[str, Sequence]
    scheduler: Scheduler
    kv_manager: KVCacheManager
    sessions: SessionTable
    prefixes: CompressedPrefixCache
    tiers: TierManager
    num_cut_short: int
    num_host_reclaims: int
    _unpin_idle_sessions: Callable[[int, str], None]

    def _cut_short(self, seq: Sequence) -> None:
        """``seq`` ran alone and still could not get its next blocks (``Preemption._reserve``):
        what its policy keeps outside the pool (a cold tier's or quant's codes, SentenceKV's
        sentences without a host tier) grew past the pool. It finishes "length" with its
        output so far (as at a context limit), marked ``policy_stats["cut_short"]`` and
        counted (``requests_cut_short``), and logged.

        Regression (hangs review 19 C1): such requests (snapkv-0.25-cold_bits_4: 536 of
        1000 tokens on a 10-block pool) finished "length" with nothing telling them from a
        request that reached its max_tokens: no counter, no log, no mark.
        """
        self.num_cut_short += 1
        seq.policy_stats["cut_short"] = 1.0
        log.warning("request %s (policy %r): cut short at %d of max_tokens %d output tokens: its KV and what its "
                    "policy keeps outside the pool outgrew this node's pool", seq.request_id, seq.policy,
                    len(seq.output_token_ids), seq.sampling_params.max_tokens)

    def _reclaim(self, need: int, holder: str = "", keep_kept: bool = False) -> None:
        """The scheduler's last resort for blocks (``Preemption._free_held_elsewhere``: a
        lone running sequence short of them, or the queue's head when nothing runs), for a
        request of ``holder``: idle sessions and compressed prefixes, the holder holding most per weight first
        (``_unpin_idle_sessions``), then, unless ``keep_kept``, the history KV that
        sessions keep for their running turns (``Sequence.kept``). A waiting turn whose kept
        history goes frees what it was lent and will compute its whole prompt, as every
        preempted turn did before sessions kept histories.

        Regression guard: a kept history holds the blocks that the scheduler freed here
        before (a waiting turn's, lent again by ``Sequence.restart``), so keeping them must
        not cost a request that needs them its progress.
        """
        self._unpin_idle_sessions(need, holder)
        if keep_kept:  # (``Scheduler.settle_compaction``)
            return
        pool = self.kv_manager.pool
        for seq in list(self.requests.values()):
            if pool.num_free_blocks() >= need:
                return
            if seq.kept is None:
                continue
            if seq.status is not SequenceStatus.WAITING and seq.kept.num_blocks_beside(seq) == 0:
                # a running turn shares every block of its kept history (a full-cache turn's,
                # lent: ``SessionTable.attach``): dropping it frees nothing and only loses what
                # a cancel of the turn would fall back on (diff review s34 F7)
                continue
            seq.kept.drop()
            if seq.status is SequenceStatus.WAITING and seq.block_table:
                self.kv_manager.free(seq)
                seq.restart()

    def _reclaim_host(self, need: int, holder: str = "") -> None:
        """A policy's host-tier reservation of ``need`` slots for ``holder`` (a cache
        namespace without its salt) does not fit: drop the policy states that idle holders keep
        there (sessions between turns, stored compressed prefixes) until it fits or none may
        go. The states of the holder then holding the most per unit of its weight go first,
        least recently used first within it (sessions before prefixes on a tie); another
        holder's only while it holds more per weight than ``holder`` would with the reservation
        (weighted max-min fair, as the tier's eviction: ``tiers.fair_lru``; the weights are
        ``TierManager.weights``, a holder's latest known). A dropped session's next turn prefills its history again; a
        dropped prefix is compressed again.

        Regressions (security reviews): one tenant's idle SentenceKV sessions or stored
        prefixes held every host slot until their TTL; another tenant's running request then
        lost the sentences it demoted (``dropped_tokens``) and silently decoded other tokens
        than on an idle node. Only idle holders give way: a running request's sentences never
        do. Then any tenant's reservation dropped every other tenant's idle states, least
        recently used first, so one tenant's running requests took the whole tier.
        """
        host = self.tiers.host
        share = host.entries.share  # (holder, size) -> size per unit of the holder's weight
        while not host.can_reserve(need, holder):
            holdings = Counter(host.entries.held()) + host.reserved_by
            idle = [(s.kv, s.last_used_s, 0, s.session_id) for s in self.sessions.sessions.values()
                    if s.active_request is None and s.kv is not None and s.kv.policy.host_slots(s.kv)]
            idle += [(e.seq.kv, e.last_used_s, 1, key) for key, e in self.prefixes.entries.items()
                     if e.seq.kv is not None and e.seq.kv.policy.host_slots(e.seq.kv)]
            mine = share(holder, holdings[holder] + need)
            candidates = []
            for kv, last_used_s, kind, key in idle:
                owner = holder_of(kv.seq.cache_namespace)
                theirs = share(owner, holdings[owner])
                if owner == holder or theirs > mine:
                    candidates.append((-theirs, owner != holder, last_used_s, kind, key))
            if not candidates:
                return
            *_, kind, key = min(candidates)
            if kind == 0:
                self.sessions.unpin(key)  # a compacted state is dropped whole
            else:
                self.prefixes.evict(key)
            self.num_host_reclaims += 1

    def _host_contenders(self, need: int, holder: str, incoming: Sequence) -> list[Sequence]:
        """The running requests of other holders than ``holder`` whose policy states hold
        host-tier slots that a reservation of ``need`` more for ``holder`` (by ``incoming``)
        may take, by preempting them (``Scheduler._compact_due``): of ``incoming``'s SLO class
        or a lower one (the scheduling policy's ``rank``: a batch tenant's compaction never
        preempts an interactive tenant's request), and the request's holder holds more
        (entries and reservations) per unit of its weight than ``holder`` would with ``need``
        more (weighted max-min fair, as the tier's eviction), and keeps at least what
        ``holder`` holds now per weight without the request's slots. The second condition
        keeps a preempted request's restart from preempting back the request it gave way to
        (a ping-pong of restarts: a request of 30 slots preempted for one slot). Largest
        holder per weight first, then the request holding the most slots."""
        host = self.tiers.host
        holdings = Counter(host.entries.held()) + host.reserved_by
        share = host.entries.share  # (holder, size) -> size per unit of the holder's weight
        mine, now = share(holder, holdings[holder] + need), share(holder, holdings[holder])
        found, rank = [], self.scheduler.policy.rank
        for seq in self.scheduler.running:
            if rank(seq) < rank(incoming):
                continue
            owner = holder_of(seq.cache_namespace)
            slots = seq.kv.policy.host_slots(seq.kv) if seq.kv is not None else 0
            if slots and owner != holder and share(owner, holdings[owner]) > mine \
                    and share(owner, holdings[owner] - slots) >= now:
                found.append((-share(owner, holdings[owner]), -slots, seq.arrival_time_s, seq))
        return [seq for *_, seq in sorted(found, key=lambda f: f[:3])]
