"""Block bookkeeping for the paged KV pool: ref counts, free queue, prefix-cache map."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from cache_node.block import FreeBlockQueue, KVBlock
from cache_node.hashing import BlockHash

BlockEvent = tuple[str, BlockHash]  # ("stored" | "removed", block_hash)
EvictHook = Callable[[list[KVBlock]], None]


class BlockPool:
    """Owns every ``KVBlock`` of one pool.

    A block is in exactly one state: *in use* (ref_cnt > 0), *cached* (ref_cnt == 0, has a hash,
    sits in the free queue and can be revived by a prefix hit), or *free* (ref_cnt == 0, no hash).
    Allocation takes the free-queue head and drops its hash (LRU eviction of cached blocks).

    Args:
        num_blocks: number of blocks in the pool tensor.

    ``evict_hook`` (set by the tier mover) is called with the cached blocks an allocation is
    about to take, before their hashes drop, so their KV can be copied to a lower tier.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[BlockEvent] = []
        self.evict_hook: EvictHook | None = None
        self.num_released_hashes = 0  # prefix-cached blocks rewritten in place (``release_hashes``)
        self.num_deferred_rewrites = 0  # compactions put off for want of free blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free + evictable cached)."""
        return self.free_queue.num_free_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_queue.num_free_blocks

    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take ``n`` blocks from the free-queue head (evicting their cached hashes). None if short."""
        if not self.can_allocate(n):
            return None
        if self.evict_hook is not None:
            victims = self.peek_cached(n)
            if victims:
                self.evict_hook(victims)
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._drop_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit); revive cached free blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free-queue tail.

        Pass blocks in the order they should be evicted (callers pass a sequence's blocks
        tail-first, so the end of a chain is evicted before its shared beginning).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """Cached block for ``block_hash`` whose tokens equal ``token_ids``; None on miss.

        The token comparison turns a hash collision into a miss instead of wrong KV.
        """
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def peek_cached(self, n: int) -> list[KVBlock]:
        """Cached blocks among the first ``n`` of the free queue (the next evictions); no change."""
        out = []
        for i, block in enumerate(self.free_queue):
            if i == n:
                break
            if block.block_hash is not None:
                out.append(block)
        return out

    def cache_block(
        self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int], namespace: str = ""
    ) -> None:
        """Make a computed full block matchable. A hash already cached keeps its first block."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.namespace = namespace
        self.cached[block_hash] = block
        self._events.append(("stored", block_hash))

    def evict_cached(self) -> int:
        """Drop every cached hash held by free blocks (Flush). Returns how many were dropped."""
        dropped = 0
        for block in list(self.free_queue):
            if block.block_hash is not None:
                self._drop_hash(block)
                dropped += 1
        return dropped

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the hashes of free cached blocks (their KV moved below) and queue them first.

        Raises ValueError for a block that is in use (ref_cnt > 0).
        """
        for block in blocks:
            if block.ref_cnt > 0:
                raise ValueError(f"block {block.block_id} is in use; only free blocks are uncached")
            self._drop_hash(block)
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)

    def release_hashes(self, blocks: Sequence[KVBlock]) -> None:
        """Drop the hashes of in-use blocks that one holder alone uses (ref_cnt == 1) and is
        about to rewrite in place (``compaction.rewrite_kv`` on a pool too full to copy on
        write). The ``evict_hook`` first copies their KV to a lower tier, as for an evicted
        cached block, so the prefix stays reachable from there.

        Raises ValueError for a block that is free or shared (ref_cnt != 1).
        """
        bad = [b.block_id for b in blocks if b.ref_cnt != 1]
        if bad:
            raise ValueError(f"blocks {bad} are free or shared; only a sole holder's blocks are released")
        hashed = [b for b in blocks if b.block_hash is not None]
        if hashed and self.evict_hook is not None:
            self.evict_hook(hashed)
        for block in hashed:
            self._drop_hash(block)
        self.num_released_hashes += len(hashed)

    def forget_hashes(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the hashes of ``blocks`` whatever holds them: their KV is about to change
        (``KVCacheManager._guard_writes``), so no later prefix hit may match them."""
        for block in blocks:
            self._drop_hash(block)

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self._events.append(("removed", block.block_hash))
        block.reset_hash()

    def take_events(self) -> list[BlockEvent]:
        """Block stored/removed events since the last call (feeds the global prefix index)."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise RuntimeError naming the broken invariant when bookkeeping is inconsistent.

        Holds: free + cached-free + in-use == total; free-queue members have ref_cnt 0; every
        cached hash maps to a block carrying that hash.
        """
        in_queue = self.free_queue.block_ids()
        if len(in_queue) != self.free_queue.num_free_blocks or len(set(in_queue)) != len(in_queue):
            raise RuntimeError("free queue length/count mismatch: the linked list is corrupted")
        queued = set(in_queue)
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        if any(b.block_id in queued for b in in_use):
            raise RuntimeError("a block with ref_cnt > 0 sits in the free queue")
        if any(b.ref_cnt < 0 for b in self.blocks):
            raise RuntimeError("negative ref_cnt: a block was freed twice")
        if len(queued) + len(in_use) != self.num_blocks:
            raise RuntimeError(
                f"leak: free({len(queued)}) + in_use({len(in_use)}) != total({self.num_blocks})"
            )
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise RuntimeError(f"cached map entry points at block {block.block_id} with another hash")
