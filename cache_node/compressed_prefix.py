"""Compressed prefixes: a document prefix compressed once under a KV policy, then forked by
every later request of the same cache namespace that starts with it (issue 22, build 1b).

A request names its reusable prefix with ``prefix_tokens`` (N): under a compressing policy
the engine prefills exactly its first N tokens (``Sequence.prefix_stop``: no step crosses
the boundary), compresses them with nothing after the boundary seen (question-agnostic, as
``bench.quality_probe.Probe.compress``: budget ``policy.budget_tokens(N)``, one
``compress``), stores a copy of the resulting state and continues from it. The state is the
policy's whole ``SequenceKV``: device part (the compacted blocks, the policy's extras and the
charge blocks paying for them) and host part (demoted sentences in host-tier slots or cold
codes). Another request with the same first N tokens, namespace and policy spec forks the
entry (its own copy of the device part; the host-tier sentences' slots shared, refcounted,
``TierHostKV.fork``) and prefills only its tokens after N,
which attend through the policy over the stored state; as a session's next turn
(``cache_node.sessions``), its budget is recomputed from its whole prompt at the prompt's
end, when it is compressed as any prefill is (the producer continues the same way), so its
answer is the question-agnostic path's: the document compressed before any question, then
the question asked as a new turn. Requests that
arrive while the prefix is being computed wait (parked, outside the scheduler) and fork the
entry once it is stored, so N tokens are compressed once however many requests share them.
A prefix whose compression lost KV for want of room (``Policy.lost_tokens``: SentenceKV
sentences demoted to a full host tier) is not stored: its producer and the requests parked on
it go on from their own computations, and a later request computes it again.

Key: the chained hash of the prefix's full blocks (``cache_node.hashing``; its first block
covers the cache namespace, model and KV format) extended over the tail's tokens, plus N and
the policy spec string. A fork's device part is its own copy (it is rewritten at the fork's
next compaction anyway) and the host slots it shares are refcounted, so no request depends
on an entry: entries are evicted least recently used first whenever the engine needs
blocks (with idle sessions, ``LLMEngine._unpin_idle_sessions``), freeing their blocks and
charge blocks, and their host slots once no fork holds them either.
A preempted request recomputes its prompt (its copy is gone with its blocks): up to the
prefix, compressed there as its producer did (and stored again if the entry was evicted
meanwhile), then the rest (``Sequence.restart``); a preempted session turn recomputes only
its own tokens, over the history KV its session kept (``cache_node.sessions``). A prefix of the whole prompt (N = prompt length) is stored
but not forked by a request of that same length: it would have no token to sample from.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_node.hashing import hash_block_tokens
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.kv_pool import KVPool
from cache_node.outputs import InvalidRequestError
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV

log = logging.getLogger(__name__)

PrefixKey = tuple[bytes, int, str]
"""(hash of the prefix's tokens chained from its namespace, N, policy spec)."""


def check_prefix_tokens(value: object, num_prompt_tokens: int) -> int:
    """``value`` as a request's ``prefix_tokens``.

    Raises:
        InvalidRequestError: not an int, or outside [0, ``num_prompt_tokens``].
    """
    if type(value) is not int:
        raise InvalidRequestError(f"prefix_tokens must be an integer, got {type(value).__name__}")
    if not 0 <= value <= num_prompt_tokens:
        raise InvalidRequestError(
            f"prefix_tokens must be in [0, {num_prompt_tokens}] (the prompt's tokens), got {value}"
        )
    return value


@dataclass(eq=False)
class PrefixEntry:
    """One stored compressed prefix: ``seq`` owns its blocks and its ``SequenceKV``."""

    key: PrefixKey
    seq: Sequence
    last_used_s: float = field(default_factory=time.monotonic)
    num_hits: int = 0


class CompressedPrefixCache:
    """The node's compressed prefixes, their producers and the requests parked on them.

    Not thread-safe: the engine calls it under its lock.

    Attributes:
        entries: stored prefixes, least recently used first.
        num_hits: requests that forked a stored prefix; ``num_stores``: prefixes stored;
            ``num_lossy_skipped``: prefixes not stored because their state had lost KV.
    """

    def __init__(self, pool: KVPool, kv_manager: KVCacheManager) -> None:
        self.pool, self.kv_manager, self.block_pool = pool, kv_manager, kv_manager.pool
        self.entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()
        self.producing: dict[str, PrefixKey] = {}  # request id -> the prefix it computes
        self.producers: dict[PrefixKey, Sequence] = {}  # the request others wait for
        self.parked: dict[PrefixKey, list[Sequence]] = {}
        self.num_hits = self.num_stores = self.num_lossy_skipped = 0

    def key(self, seq: Sequence, n: int) -> PrefixKey:
        """The key of ``seq``'s first ``n`` prompt tokens under its policy spec."""
        bs = self.kv_manager.block_size
        full = n // bs
        hashes = self.kv_manager.block_hashes(seq, full)
        tail = seq.prompt_token_ids[full * bs : n]
        digest = hash_block_tokens(hashes[-1] if full else None, tail, () if full else seq.extra_keys,
                                   self.kv_manager.hash_fn)
        return digest, n, seq.policy

    # ---- arrival, boundary, finish -----------------------------------------------------------
    def admit(self, seq: Sequence, n: int) -> bool:
        """Give a new request its prefix: fork the stored entry, or make it the producer, or
        park it behind the producer in flight. False when parked (the engine schedules it
        when ``store`` or ``on_finish`` returns it). A request without a compressing policy,
        with ``n`` 0 or continuing a session's blocks is left alone."""
        if n <= 0 or seq.kv is None or seq.block_table or seq.num_computed_tokens:
            return True
        seq.prefix_tokens = n
        key = self.key(seq, n)
        entry = self.entries.get(key)
        forkable = n < seq.num_prompt_tokens
        if entry is not None and forkable and self._fork_or_log(entry, seq):
            return True
        if entry is None and forkable and key in self.producers:
            self.parked.setdefault(key, []).append(seq)
            return False
        seq.prefix_stop = n
        self.producing[seq.request_id] = key
        self.producers.setdefault(key, seq)
        return True

    def store(self, seq: Sequence) -> list[Sequence]:
        """``seq`` computed its prefix (``num_computed_tokens == prefix_stop``): compress it
        (question-agnostic) unless its prompt ended there (the engine's ``after_step`` did),
        store a copy and return the requests parked on it, forked from it (or, when nothing
        could be stored, each to compute the prefix itself). A request recomputing after a
        preemption (``Sequence.restart``) is no producer: it stores the prefix only when the
        entry is gone. A state whose policy lost KV for want of room (``Policy.lost_tokens``:
        SentenceKV sentences demoted to a full host tier) is not stored
        (``num_lossy_skipped``): the next request computes the prefix again.

        Regression (hangs review 20 W5): a prefix compressed while the host tier was full was
        stored with its sentences dropped, and every later request forked it, decoding other
        tokens than on a node that had room and reporting nothing in its ``policy_stats``."""
        key = self.producing.pop(seq.request_id, None) or self.key(seq, seq.prefix_stop)
        boundary, seq.prefix_stop = seq.prefix_stop, 0
        kv = seq.kv
        if kv.budget is None:
            try:
                kv.budget = kv.policy.budget_tokens(seq.num_computed_tokens)
                kv.policy.compress(kv)
                kv.settle_charge()
            except Exception:  # the engine fails ``seq``: ``on_finish`` hands the prefix on
                self.producing[seq.request_id] = key  # (regression: its parked requests hung)
                raise
            kv.budget = None  # the rest of the prompt is a new turn's (recomputed at its end)
            if kv.compaction_due:  # ``can_rewrite`` found the pool too full
                # Regression (hangs review R1b): a compression the pool had no free blocks
                # for was skipped for good: the request prefilled its question over the whole
                # document, compressed it question-aware at its end (other tokens than alone)
                # and stored nothing. It now stays at its boundary until the compression runs
                # (the scheduler retries it before the request's next step: ``retry``).
                seq.prefix_stop = boundary
                self.producing[seq.request_id] = key
                return []
        if key in self.entries:
            self.entries.move_to_end(key)
        elif kv.compacted and kv.policy.lost_tokens(kv):
            self.num_lossy_skipped += 1
        elif kv.compacted and self._store(key, seq):
            self.num_stores += 1
        if self.producers.get(key) is seq:
            del self.producers[key]
        ready = self.parked.pop(key, [])
        entry = self.entries.get(key)
        for other in ready:
            if entry is None or not self._fork_or_log(entry, other):
                other.prefix_stop = key[1]
                self.producing[other.request_id] = key
        return ready

    def on_finish(self, seq: Sequence) -> list[Sequence]:
        """``seq`` ended (any reason). A producer that ended before its boundary hands the
        prefix to the first request parked on it, returned for scheduling."""
        key = self.producing.pop(seq.request_id, None)
        if key is None or self.producers.get(key) is not seq:
            return []
        del self.producers[key]
        waiting = self.parked.pop(key, [])
        if not waiting:
            return []
        head, rest = waiting[0], waiting[1:]
        head.prefix_stop = key[1]
        self.producing[head.request_id] = key
        self.producers[key] = head
        if rest:
            self.parked[key] = rest
        return [head]

    def unpark(self, seq: Sequence) -> bool:
        """Drop ``seq`` from the parked requests (it ended there). False if not parked."""
        for key, waiting in self.parked.items():
            if seq in waiting:
                waiting.remove(seq)
                if not waiting:
                    del self.parked[key]
                return True
        return False

    # ---- copies --------------------------------------------------------------------------
    def _copy_blocks(self, src: Sequence, dst: Sequence) -> bool:
        blocks = self.block_pool.allocate(len(src.block_table))
        if blocks is None:
            return False
        ids = [b.block_id for b in src.block_table]
        if ids:
            self.pool.write_blocks([b.block_id for b in blocks], self.pool.read_blocks(ids))
        dst.block_table = blocks
        dst.num_computed_tokens = src.num_computed_tokens
        return True

    def _copy_state(self, src: Sequence, dst: Sequence) -> bool:
        """Copy ``src``'s blocks and policy state into ``dst`` (no blocks of its own yet).
        False, with nothing held, when the pool is short.

        Raises:
            Exception: whatever the policy's ``fork`` raised; ``dst`` holds nothing then (its
                copied blocks and the forked state's charge blocks and slots went back).
        """
        if not self._copy_blocks(src, dst):
            return False
        own = dst.kv
        try:
            dst.kv = src.kv.fork(dst)  # host-tier sentences: shared slots, nothing reserved
            dst.kv.settle_charge()
        except Exception:
            if dst.kv is not own and dst.kv is not None:
                dst.kv.reset()
            dst.kv = own
            self.block_pool.free(dst.block_table[::-1])
            dst.block_table, dst.num_computed_tokens = [], 0
            raise
        return True

    def _fork_or_log(self, entry: PrefixEntry, seq: Sequence) -> bool:
        """``_fork``, or False when the policy's fork raised (``seq`` then computes the
        prefix itself: one policy fault never leaves a parked request waiting)."""
        try:
            return self._fork(entry, seq)
        except Exception:
            log.exception("compressed prefix: request %s could not fork the stored prefix", seq.request_id)
            return False

    def _store(self, key: PrefixKey, seq: Sequence) -> bool:
        n = key[1]
        owner = Sequence(f"prefix-{key[0].hex()[:16]}", seq.prompt_token_ids[:n], SamplingParams(max_tokens=1),
                         extra_keys=seq.extra_keys, policy=seq.policy)
        try:
            if not self._copy_state(seq, owner):
                return False
        except Exception:  # nothing stored; the producer continues from its own state
            log.exception("compressed prefix: request %s could not store its prefix", seq.request_id)
            return False
        self.entries[key] = PrefixEntry(key, owner)
        return True

    def _fork(self, entry: PrefixEntry, seq: Sequence) -> bool:
        n = entry.key[1]
        if seq.prompt_token_ids[:n] != entry.seq.prompt_token_ids or not self._copy_state(entry.seq, seq):
            return False
        seq.num_cached_tokens = n
        seq.kv.budget = None  # recomputed from the whole prompt at its end, as a session turn's
        entry.num_hits += 1
        entry.last_used_s = time.monotonic()
        self.entries.move_to_end(entry.key)
        self.num_hits += 1
        return True

    # ---- eviction and accounting -------------------------------------------------------------
    def evict_lru(self, used_before: float | None = None) -> bool:
        """Drop the least recently used entry (blocks, charge blocks, host slots) if it was
        last used before ``used_before`` (None: any). False when none was dropped."""
        if not self.entries:
            return False
        key, entry = next(iter(self.entries.items()))
        if used_before is not None and entry.last_used_s >= used_before:
            return False
        self.evict(key)
        return True

    def evict(self, key: PrefixKey) -> None:
        """Drop the entry ``key`` (blocks, charge blocks, host slots)."""
        entry = self.entries.pop(key)
        self.kv_manager.free(entry.seq)  # and SequenceKV.reset: charge blocks, host-tier slots

    def clear(self) -> int:
        """Drop every entry; returns how many."""
        n = len(self.entries)
        while self.evict_lru():
            pass
        return n

    def states(self) -> list[SequenceKV]:
        """The stored ``SequenceKV`` states (their charge blocks count in the engine's stats)."""
        return [e.seq.kv for e in self.entries.values()]

    def stats(self) -> dict[str, int]:
        return {
            "compressed_prefix_hits": self.num_hits,
            "compressed_prefix_stores": self.num_stores,
            "compressed_prefixes": len(self.entries),
            "compressed_prefix_blocks": sum(e.seq.num_held_blocks for e in self.entries.values()),
            "compressed_prefix_parked": sum(len(v) for v in self.parked.values()),
            "compressed_prefix_lossy_skipped": self.num_lossy_skipped,
        }
