"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its token ids and, for the first block of a
sequence, the extra keys (cache namespace, model identity, KV format). The bytes hashed are a
msgpack array, which length-prefixes every element, so no two different key tuples can
collide by concatenation ("ab" + "c" vs "a" + "bc"). BLAKE2b-256 gives the same value in every
process and after a restart (unlike Python's ``hash``). Idea: vLLM v1 prefix caching
(``kv_cache_utils.hash_block_tokens``); chained hashing as in nano-vllm's block manager.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgpack

BlockHash = bytes
HashFn = Callable[[bytes], bytes]


def blake2b_256(data: bytes) -> bytes:
    """Stable 32-byte cryptographic digest of ``data``."""
    return hashlib.blake2b(data, digest_size=32).digest()


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
    hash_fn: HashFn = blake2b_256,
) -> BlockHash:
    """Hash one full block.

    Args:
        parent_hash: hash of the previous block of the sequence, None for the first block.
        token_ids: exactly ``block_size`` token ids.
        extra_keys: keys that must match for reuse (first block: namespace, model, KV format).
        hash_fn: digest over canonical bytes (injectable so tests can force collisions).

    Returns:
        The block hash (bytes).
    """
    payload = msgpack.packb([parent_hash or b"", [int(t) for t in token_ids], list(extra_keys)])
    return hash_fn(payload)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...],
    hash_fn: HashFn = blake2b_256,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, len(token_ids) // block_size, block_size, extra_keys, hash_fn)


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    num_full_blocks: int,
    block_size: int,
    extra_keys: tuple[str, ...],
    hash_fn: HashFn = blake2b_256,
) -> list[BlockHash]:
    """Append to ``hashes`` (the chained hashes of the first ``len(hashes)`` blocks of
    ``token_ids``) until it holds ``num_full_blocks``; returns ``hashes``.

    The one chaining loop: the gateway (``hash_prompt_blocks``, for routing) and the cache
    manager (memoized per sequence) must compute the same hashes.
    """
    while len(hashes) < num_full_blocks:
        i = len(hashes)
        parent = hashes[-1] if i else None
        keys = extra_keys if i == 0 else ()
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], keys, hash_fn))
    return hashes
