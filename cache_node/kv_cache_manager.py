"""The scheduler-facing cache manager: prefix lookup, slot allocation, freeing.

Narrow API (vLLM v1 ``KVCacheManager`` / nano-vllm ``BlockManager`` shape):
``get_computed_blocks``, ``allocate_slots`` (None when it cannot), ``cache_full_blocks``, ``free``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_node.block import KVBlock
from cache_node.block_pool import BlockPool
from cache_node.hashing import HashFn, blake2b_256, extend_block_hashes
from cache_node.sequence import Sequence

log = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps sequences to pool blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        hash_fn: digest used for block hashes (tests inject a weak one to force collisions).
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = blake2b_256) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.hash_fn = hash_fn
        self.promote_hook: Callable[[Sequence, list[KVBlock]], list[KVBlock]] | None = None
        self.num_cached_writes = 0  # prefix-cached blocks a sequence was about to write into (a bug)

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the sequence's first ``num_full_blocks`` blocks (memoized on seq)."""
        extend_block_hashes(seq.block_hashes, seq.all_token_ids, num_full_blocks, self.block_size,
                            seq.extra_keys, self.hash_fn)
        return seq.block_hashes[:num_full_blocks]

    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Chained hashes of the first ``num_full_blocks`` blocks of ``seq`` (memoized on seq)."""
        return self._extend_hashes(seq, num_full_blocks)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of ``seq`` (does not modify the cache).

        At most ``num_tokens - 1`` tokens are reported, so a fully cached prompt still
        recomputes its last token (its logits are needed to sample).

        Returns:
            (blocks, num_computed_tokens) with ``num_computed_tokens == len(blocks) * block_size``.
        """
        bs = self.block_size
        tokens = seq.all_token_ids
        max_blocks = (len(tokens) - 1) // bs
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(self._extend_hashes(seq, max_blocks)):
            block = self.pool.lookup(block_hash, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def promote_blocks(self, seq: Sequence, hits: list[KVBlock]) -> list[KVBlock]:
        """Blocks that extend the device hit ``hits`` from lower tiers (the tier mover's hook).

        Promoted blocks arrive as cached free device blocks, ready for ``allocate_slots``;
        [] without tiers. Unlike ``get_computed_blocks`` this may allocate and evict.
        """
        if self.promote_hook is None:
            return []
        return self.promote_hook(seq, hits)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Reserve pool slots for ``num_new_tokens`` more tokens of ``seq``.

        Args:
            seq: the sequence; its ``block_table`` grows in place.
            num_new_tokens: tokens to be computed this step (beyond num_computed_tokens and
                the computed prefix blocks).
            computed_blocks: prefix-hit blocks from ``get_computed_blocks`` (new sequences).

        Returns:
            The newly allocated blocks, or None (nothing changed) when the pool cannot fit them
            together with the charge blocks the sequence's KV policy still owes
            (``SequenceKV.charge_debt``, paid in the same call).
        """
        computed_blocks = computed_blocks or []
        # physical slots in use: a compressing policy may have evicted some computed tokens
        num_computed = seq.num_computed_tokens - seq.num_evicted_tokens
        num_computed += len(computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(seq.block_table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        debt = seq.kv.charge_debt if seq.kv is not None else 0
        if max(num_new_blocks, 0) + revived + debt > self.pool.num_free_blocks():
            return None
        held = seq.block_table + computed_blocks if computed_blocks else seq.block_table
        self._guard_writes(seq, held, num_computed, num_new_tokens)
        self.pool.touch(computed_blocks)  # before allocating: allocation may evict free cached blocks
        seq.block_table.extend(computed_blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0)) or []
        seq.block_table.extend(new_blocks)
        if debt:
            seq.kv.pay_debt(self.pool.allocate(debt))
        return new_blocks

    def _guard_writes(self, seq: Sequence, blocks: list[KVBlock], first_slot: int, num_slots: int) -> None:
        """The invariant: a block whose hash is registered in the prefix cache is never written
        again (a hit on its tokens would read the new KV). ``seq`` is about to write physical
        slots ``[first_slot, first_slot + num_slots)`` of ``blocks`` (its block table, the
        prefix hit included): any of them carrying a hash is a bug upstream (e.g. a session
        history keeping a block its turn filled and the cache hashed: ``SessionTable._seal``).
        It is logged and counted (``num_cached_writes``: ``check_integrity`` fails on it), and
        the hash dropped, so no later hit reads the overwritten KV."""
        bs = self.block_size
        hit = [b for b in blocks[first_slot // bs : cdiv(first_slot + num_slots, bs)] if b.block_hash is not None]
        if hit:
            log.error("request %s would write into prefix-cached blocks %s: their hashes are dropped",
                      seq.request_id, [b.block_id for b in hit])
            self.num_cached_writes += len(hit)
            self.pool.forget_hashes(hit)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make every full block whose KV is computed matchable by later prompts."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        hashes = self._extend_hashes(seq, num_full)
        tokens = seq.all_token_ids
        namespace = seq.extra_keys[0] if seq.extra_keys else ""
        for i in range(num_full):
            block = seq.block_table[i]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[i], tokens[i * bs : (i + 1) * bs], namespace)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first (so a chain's end is evicted first)."""
        for block in seq.block_table:
            block.owner = seq.tenant
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table = []
        if seq.kv is not None:  # a policy's compacted layout is gone with the blocks
            seq.kv.reset()

    def check_integrity(self) -> None:
        """Raise RuntimeError when pool bookkeeping is inconsistent (``BlockPool``), or when a
        sequence was about to write into a prefix-cached block (``_guard_writes``)."""
        self.pool.check_integrity()
        if self.num_cached_writes:
            raise RuntimeError(f"{self.num_cached_writes} prefix-cached blocks were about to be written again: a "
                               f"prefix hit on their tokens would have read other KV")
