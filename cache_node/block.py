"""The KV block record and the O(1) free queue that is also the eviction order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from cache_node.hashing import BlockHash


@dataclass(eq=False)
class KVBlock:
    """Metadata of one paging unit of the pool (no tensors here).

    Attributes:
        block_id: index of the block in the pool tensor.
        ref_cnt: number of running sequences (or pinned sessions) using the block.
        block_hash: chained hash, set once the block is full and its KV computed; None otherwise.
        token_ids: the block's tokens, kept with the hash so every hit is token-checked.
        namespace: cache namespace of the sequence that computed it (recorded when demoted).
        owner: tenant of the last sequence that released the block ("" = none yet); a free
            cached block counts against that tenant's device-tier quota.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()
    namespace: str = ""
    owner: str = ""
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = ()
        self.namespace = ""


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    The head is the next block handed out (least recently freed, so it is also the LRU
    eviction victim when it still carries a cached hash); freed blocks go to the tail.
    ``remove`` is O(1), which is what a prefix hit on a free cached block needs.
    Idea: vLLM v1 ``FreeKVCacheBlockQueue``.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head: KVBlock | None = None
        self._tail: KVBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Take the head block. Raises IndexError when empty (a caller bug: check first)."""
        block = self._head
        if block is None:
            raise IndexError("free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None and self._head is not block:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        if block.prev_free is not None:
            block.prev_free.next_free = block.next_free
        else:
            self._head = block.next_free
        if block.next_free is not None:
            block.next_free.prev_free = block.prev_free
        else:
            self._tail = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or self._head is block:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free = self._tail
        block.next_free = None
        if self._tail is not None:
            self._tail.next_free = block
        else:
            self._head = block
        self._tail = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVBlock) -> None:
        """Put ``block`` at the head (handed out next): used for blocks whose hash was dropped."""
        if block.prev_free is not None or self._head is block:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free = None
        block.next_free = self._head
        if self._head is not None:
            self._head.prev_free = block
        else:
            self._tail = block
        self._head = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head
        while block is not None:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return [b.block_id for b in self]
