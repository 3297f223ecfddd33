"""The store of compressed prefixes: each a copy of the state a request had when it had
compressed its first N prompt tokens, kept to be forked by later requests with the same first
N tokens (issue 22, build 1b). What a request does with a stored prefix, and when one is
stored, is decided in ``cache_node.compressed_prefix`` (``CompressedPrefixCache``, which
extends ``CompressedPrefixStore`` with the bookkeeping of the live requests that named one).

Key: the chained hash of the prefix's full blocks (``cache_node.hashing``; its first block
covers the cache namespace, model and KV format) extended over the tail's tokens, plus N and
the policy spec string. An entry is owned by a sequence of its own (``PrefixEntry.seq``): its
blocks and its ``SequenceKV``, device part (the compacted blocks, the policy's extras and the
charge blocks paying for them) and host part (demoted sentences in host-tier slots or cold
codes). A fork's device part is its own copy (it is rewritten at the fork's next compaction
anyway) and the host slots it shares are refcounted (``TierHostKV.fork``), so no request
depends on an entry: entries are evicted least recently used first whenever the engine needs
blocks (with idle sessions, ``LLMEngine._unpin_idle_sessions``), freeing their blocks and
charge blocks, and their host slots once no fork holds them either.
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
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV

log = logging.getLogger(__name__)

PrefixKey = tuple[bytes, int, str]
"""(hash of the prefix's tokens chained from its namespace, N, policy spec)."""


@dataclass(eq=False)
class PrefixEntry:
    """One stored compressed prefix: ``seq`` owns its blocks and its ``SequenceKV``."""

    key: PrefixKey
    seq: Sequence
    last_used_s: float = field(default_factory=time.monotonic)
    num_hits: int = 0


class CompressedPrefixStore:
    """The node's stored compressed prefixes, least recently used first.

    Not thread-safe: the engine calls it under its lock.

    Attributes:
        entries: stored prefixes, least recently used first.
        num_hits: requests that forked a stored prefix; ``num_stores``: prefixes stored;
            ``num_lossy_skipped``: prefixes not stored because their state had lost KV.
    """

    def __init__(self, pool: KVPool, kv_manager: KVCacheManager) -> None:
        self.pool, self.kv_manager, self.block_pool = pool, kv_manager, kv_manager.pool
        self.entries: OrderedDict[PrefixKey, PrefixEntry] = OrderedDict()
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

    def fork_into(self, entry: PrefixEntry, seq: Sequence) -> bool:
        """Give ``seq`` (no blocks of its own yet) its copy of ``entry``, counted as a hit.
        False, with nothing held, when ``seq``'s first N tokens differ, the pool is short or
        the policy's fork raised (logged; ``seq`` then computes the prefix itself: one policy
        fault never leaves a request waiting)."""
        try:
            return self._fork(entry, seq)
        except Exception:
            log.exception("compressed prefix: request %s could not fork the stored prefix", seq.request_id)
            return False

    def put(self, key: PrefixKey, seq: Sequence) -> bool:
        """Store a copy of ``seq``'s blocks and policy state as the entry ``key``. False, with
        nothing stored, when the pool is short or the policy's fork raised (logged)."""
        n = key[1]
        owner = Sequence(f"prefix-{key[0].hex()[:16]}", seq.prompt_token_ids[:n], SamplingParams(max_tokens=1),
                         extra_keys=seq.extra_keys, policy=seq.policy)
        try:
            if not self._copy_state(seq, owner):
                return False
        except Exception:  # nothing stored; ``seq`` continues from its own state
            log.exception("compressed prefix: request %s could not store its prefix", seq.request_id)
            return False
        self.entries[key] = PrefixEntry(key, owner)
        return True

    def _fork(self, entry: PrefixEntry, seq: Sequence) -> bool:
        n = entry.key[1]
        if seq.prompt_token_ids[:n] != entry.seq.prompt_token_ids or not self._copy_state(entry.seq, seq):
            return False
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
            "compressed_prefix_lossy_skipped": self.num_lossy_skipped,
        }
