"""Block pool and hashing: exact block ids, ref counts, free-queue order, stable hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cache_node.block_pool import BlockPool
from cache_node.hashing import hash_block_tokens, hash_prompt_blocks


def test_allocate_takes_queue_head_in_order() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    assert pool.allocate(4) is None  # "cannot" is None, and nothing changed
    assert pool.free_queue.block_ids() == [3, 4, 5]
    pool.check_integrity()


def test_free_appends_to_tail_in_given_order_and_is_lru() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free(list(reversed(a)))  # tail of the chain first
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert [b.block_id for b in pool.allocate(2)] == [3, 2]


def test_touch_revives_cached_free_block_and_counts_refs() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h" * 32, [1, 2])
    pool.free([b])
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    hit = pool.lookup(b"h" * 32, [1, 2])
    assert hit is b
    pool.touch([hit, hit])
    assert hit.ref_cnt == 2 and pool.free_queue.block_ids() == [1, 2, 3]
    pool.free([hit])
    assert hit.ref_cnt == 1
    pool.check_integrity()


def test_allocation_evicts_cached_hash_and_emits_events() -> None:
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, b"x" * 32, [7])
    pool.free([b0, b1])
    (again,) = pool.allocate(1)
    assert again is b0 and again.block_hash is None
    assert pool.lookup(b"x" * 32, [7]) is None
    assert pool.take_events() == [("stored", b"x" * 32), ("removed", b"x" * 32)]
    assert pool.take_events() == []


def test_lookup_token_check_rejects_collision() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"same", [1, 2, 3])
    assert pool.lookup(b"same", [1, 2, 4]) is None


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])


def test_integrity_detects_leak() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # simulate a lost reference: neither in use nor free
    with pytest.raises(RuntimeError, match="leak"):
        pool.check_integrity()


def test_block_hash_is_stable_across_processes() -> None:
    expected = "cce120f5b92f9aa7d54c51f3c24d1f74e3af174337fd3fa11b329e01b1ca4488"
    assert hash_block_tokens(None, list(range(16)), ("ns", "m", "f")).hex() == expected
    code = (
        "from cache_node.hashing import hash_block_tokens;"
        "print(hash_block_tokens(None, list(range(16)), ('ns','m','f')).hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_extra_keys_are_framed_not_concatenated() -> None:
    a = hash_block_tokens(None, [1], ("ab", "c"))
    b = hash_block_tokens(None, [1], ("a", "bc"))
    c = hash_block_tokens(None, [1], ("abc",))
    assert len({a, b, c}) == 3


def test_prompt_hashes_chain_and_skip_partial_block() -> None:
    hashes = hash_prompt_blocks(list(range(40)), 16, ("ns",))
    assert len(hashes) == 2
    assert hashes[1] == hash_block_tokens(hashes[0], list(range(16, 32)))
    other_ns = hash_prompt_blocks(list(range(40)), 16, ("other",))
    assert not set(hashes) & set(other_ns)
