"""HostTier and block copies: exact slots, LRU order, victim bytes, token checks, events."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_node.tiers.block_copy import copy_stack_to_view, copy_view_to_view, view_to_stack
from cache_node.tiers.host import BlockMeta, HostTier, TierEvent
from cache_node.tiers.runs import runs
from cache_node.tiers.spill_api import from_numpy, leading_hits, to_numpy
from cache_node.tiers.spill_store import SpillHits

SHAPE = (2, 2, 8, 4, 4, 2)  # (L, 2, num_blocks, block_size, H_kv, d)
BLOCK_BYTES = 2 * 2 * 4 * 4 * 2 * 4


def pool_view() -> torch.Tensor:
    """A pool view whose every block b holds values b*1000 + position (distinct bytes)."""
    base = torch.arange(int(np.prod(SHAPE)), dtype=torch.float32).reshape(SHAPE)
    return base + 1000 * torch.arange(SHAPE[2]).view(1, 1, -1, 1, 1, 1)


def meta(i: int, namespace: str | None = None) -> BlockMeta:
    return BlockMeta(bytes([i]) * 32, (i, i + 1), f"ns{i % 2}" if namespace is None else namespace)


def test_runs_coalesce_consecutive_pairs() -> None:
    assert runs([3, 4, 5, 9, 1], [0, 1, 2, 3, 7]) == [(1, 7, 1), (3, 0, 3), (9, 3, 1)]
    # pairs are taken in source order, so a batch listed tail first still coalesces
    assert runs([6, 5, 4], [12, 11, 10]) == [(4, 10, 3)]


def test_view_and_stack_copies_are_exact() -> None:
    src = pool_view()
    stack = view_to_stack(src, [5, 6, 1])
    assert torch.equal(stack[0], src[:, :, 5]) and torch.equal(stack[2], src[:, :, 1])
    dst = torch.zeros(SHAPE)
    copy_stack_to_view(dst, [0, 1, 7], stack)
    copy_view_to_view(dst, [2, 3], src, [3, 4])
    for d, s in ((0, 5), (1, 6), (7, 1), (2, 3), (3, 4)):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert dst[:, :, 4:7].abs().sum() == 0


def test_put_lookup_take_release_keep_exact_slots_and_events() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=3 * BLOCK_BYTES + 5)
    assert (host.num_slots, host.block_nbytes) == (3, BLOCK_BYTES)
    victims = host.put([meta(1), meta(2)], pool_view(), [1, 2])
    assert victims.metas == [] and victims.blocks.shape[0] == 0
    assert [e.slot for e in host.entries.values()] == [0, 1]
    assert torch.equal(host.data[:, :, 1], pool_view()[:, :, 2])
    assert host.lookup(meta(1).block_hash, (1, 2)) is not None
    assert host.lookup(meta(1).block_hash, (1, 3)) is None  # token check: a collision is a miss
    entries = host.take([meta(1).block_hash])
    assert len(host) == 1 and entries[0].slot == 0
    host.release(entries)
    assert host.take_events() == [
        TierEvent("stored", meta(1).block_hash, "host"),
        TierEvent("stored", meta(2).block_hash, "host"),
        TierEvent("removed", meta(1).block_hash, "host"),
    ]


def test_a_prefix_demoted_tail_first_lands_in_ascending_slots() -> None:
    """The free queue hands a prefix over tail first; its blocks still get consecutive slots
    in prefix order, so promoting the prefix back is one copy run."""
    host = HostTier(SHAPE, torch.float32, budget_bytes=8 * BLOCK_BYTES)
    host.put([meta(6), meta(5), meta(4)], pool_view(), [6, 5, 4])
    assert [host.entries[meta(i).block_hash].slot for i in (4, 5, 6)] == [0, 1, 2]
    assert list(host.entries) == [meta(i).block_hash for i in (6, 5, 4)]  # LRU order kept
    for i in (4, 5, 6):
        assert torch.equal(host.data[:, :, host.entries[meta(i).block_hash].slot], pool_view()[:, :, i])
    slots = [host.entries[meta(i).block_hash].slot for i in (4, 5, 6)]
    assert runs(slots, [1, 2, 3]) == [(0, 1, 3)]


def test_lru_victims_carry_their_bytes_and_touch_protects() -> None:
    """One tenant's blocks leave in LRU order (across tenants, see tests/test_tier_fair_share.py)."""
    host = HostTier(SHAPE, torch.float32, budget_bytes=2 * BLOCK_BYTES)
    src = pool_view()
    host.put([meta(1, 'ns0'), meta(2, 'ns0')], src, [1, 2])
    host.put([meta(1, 'ns0')], src, [1])  # touch: 2 is now LRU
    victims = host.put([meta(3, 'ns0')], src, [3])
    assert [m.block_hash for m in victims.metas] == [meta(2, 'ns0').block_hash]
    assert victims.metas[0].namespace == "ns0"
    assert torch.equal(victims.blocks[0], src[:, :, 2])
    assert list(host.entries) == [meta(1, 'ns0').block_hash, meta(3, 'ns0').block_hash]


def test_batch_larger_than_tier_overflows_its_oldest_blocks() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=2 * BLOCK_BYTES)
    src = pool_view()
    victims = host.put([meta(i) for i in (4, 5, 6)], src, [4, 5, 6])
    assert [m.block_hash for m in victims.metas] == [meta(4).block_hash]
    assert torch.equal(victims.blocks[0], src[:, :, 4])
    assert list(host.entries) == [meta(5).block_hash, meta(6).block_hash]
    none = HostTier(SHAPE, torch.float32, budget_bytes=0)
    assert len(none.put([meta(1)], src, [1]).metas) == 1 and len(none) == 0


def test_batch_larger_than_the_unreserved_slots_overflows() -> None:
    """Regression (issue 22): with slots reserved by a policy (SentenceKV sentences), a
    demotion larger than the free and evictable slots popped from an empty free list
    (IndexError) instead of overflowing its oldest blocks to the spill tier."""
    host = HostTier(SHAPE, torch.float32, budget_bytes=4 * BLOCK_BYTES)
    src = pool_view()
    reserved, _ = host.reserve(3)
    victims = host.put([meta(i, 'ns0') for i in (4, 5, 6)], src, [4, 5, 6])
    assert [m.block_hash for m in victims.metas] == [meta(4, 'ns0').block_hash, meta(5, 'ns0').block_hash]
    assert list(host.entries) == [meta(6, 'ns0').block_hash] and host.num_reserved == 3
    host.release_slots(reserved)


def test_evict_all_and_clear() -> None:
    host = HostTier(SHAPE, torch.float32, budget_bytes=4 * BLOCK_BYTES)
    host.put([meta(i) for i in range(3)], pool_view(), [0, 1, 2])
    assert [m.block_hash for m in host.evict_all().metas] == [meta(i).block_hash for i in range(3)]
    host.put([meta(5)], pool_view(), [5])
    assert host.clear() == 1 and len(host) == 0
    assert sorted(host._free_slots) == [0, 1, 2, 3]


def test_bfloat16_round_trips_through_numpy_bits() -> None:
    t = torch.randn(3, 2, 2, 4, 4, 2).to(torch.bfloat16)
    arr = to_numpy(t)
    assert arr.dtype == np.int16
    arr.flags.writeable = False  # as Ray hands it out
    assert torch.equal(from_numpy(arr, torch.bfloat16), t)


def test_leading_hits_distrusts_a_reply_to_another_question() -> None:
    asked = [bytes([i]) * 32 for i in range(3)]
    rows = np.ones((2, 2, 2), np.float32)
    ok = leading_hits(SpillHits(asked[:2], rows, ["spill_ram"] * 2), asked, (2, 2), np.float32)
    assert ok[1] == ["spill_ram"] * 2 and ok[0].shape == (2, 2, 2)
    gap = leading_hits(SpillHits([asked[1]], rows[:1], ["spill_ram"]), asked, (2, 2), np.float32)
    assert gap[1] == []
    other = leading_hits(SpillHits([b"x" * 32], rows[:1], ["spill_ram"]), asked, (2, 2), np.float32)
    assert other[1] == []
    bad_dtype = leading_hits(SpillHits(asked[:2], rows.astype(np.float64), ["a"] * 2), asked,
                             (2, 2), np.float32)
    assert bad_dtype[1] == []


def test_negative_budget_is_rejected() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier(SHAPE, torch.float32, budget_bytes=-1)
