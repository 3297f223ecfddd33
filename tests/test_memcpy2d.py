"""Pitched tier copies (cache_node/tiers/memcpy2d.py): the plan of one ``cudaMemcpy2DAsync``
per run, checked on the CPU by doing its copies over byte views (``emulate``).

Regression (H200, 2026-12-04, ``bench.tiers --device cuda --quick``): a 1 GiB demotion of a
Llama-3.1-8B-shaped pool was ``2 * L`` ``cudaMemcpyAsync`` calls per run of blocks, and the
decode step that enqueued it took 26.3 ms against 8.8 ms without (target: within 10%)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.tiers.device_copy import DeviceCopier
from cache_node.tiers.memcpy2d import Copy2D, emulate, plan_runs
from cache_node.tiers.runs import runs


def _pool(layers: int, blocks: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((layers, 2, blocks, 4, 2, 3), generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), src_blocks=st.integers(1, 24), dst_blocks=st.integers(1, 24),
       data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_pitched_plan_copies_exactly_the_paired_blocks(layers: int, src_blocks: int, dst_blocks: int,
                                                        data: st.DataObject, dtype: torch.dtype) -> None:
    n = data.draw(st.integers(0, min(src_blocks, dst_blocks)))
    src_ids = data.draw(st.permutations(range(src_blocks)))[:n]
    dst_ids = data.draw(st.permutations(range(dst_blocks)))[:n]
    src, dst = _pool(layers, src_blocks, 1, dtype), _pool(layers, dst_blocks, 2, dtype)
    want = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        want[:, :, d] = src[:, :, s]
    plan = plan_runs(dst, dst_ids, src, src_ids)
    assert plan is not None and len(plan) == len(runs(src_ids, dst_ids))  # one call per run
    emulate(plan, dst, src)
    assert torch.equal(dst, want)


def test_plan_works_on_views_that_start_inside_a_larger_tensor() -> None:
    """Pool views are slices of bigger allocations: addresses include the view's offset."""
    big_src, big_dst = _pool(3, 12, 3), _pool(3, 10, 4)
    src, dst = big_src[:, :, 2:], big_dst[:, :, 5:]  # still evenly pitched (row pitch of the big one)
    want = dst.clone()
    want[:, :, [0, 1, 3]] = src[:, :, [4, 5, 9]]
    plan = plan_runs(dst, [0, 1, 3], src, [4, 5, 9])
    assert plan is not None and [c.height for c in plan] == [6, 6]
    emulate(plan, dst, src)
    assert torch.equal(dst, want)
    assert torch.equal(big_dst[:, :, :5], _pool(3, 10, 4)[:, :, :5])  # nothing outside the view


def test_a_layout_that_is_not_evenly_pitched_has_no_plan() -> None:
    pool = _pool(2, 6, 5)
    assert plan_runs(pool.transpose(0, 1), [0], pool.transpose(0, 1), [1]) is None
    assert plan_runs(pool[:, :, :, :, :1], [0], pool[:, :, :, :, :1], [1]) is None  # blocks not contiguous


def test_mismatched_views_or_ids_are_refused() -> None:
    a, b = _pool(2, 4, 6), _pool(3, 4, 7)
    with pytest.raises(ValueError, match="pool views differ"):
        plan_runs(a, [0], b, [0])
    with pytest.raises(ValueError, match="ids"):
        plan_runs(a, [0, 1], a.clone(), [0])


def test_copy2d_rows_are_pitch_apart() -> None:
    pool = _pool(2, 8, 8)
    (c,) = plan_runs(pool.clone(), [2, 3], pool, [5, 6])  # type: ignore[misc]
    row = pool.stride(1) * pool.element_size()
    block = pool.stride(2) * pool.element_size()
    assert c == Copy2D(c.dst, row, pool.data_ptr() + 5 * block, row, 2 * block, 4, 5, 2, 2)


def test_cpu_copier_has_no_cuda_backend() -> None:
    copier = DeviceCopier(torch.device("cpu"))
    assert copier.copy_backend is None and copier.copy_calls == 0


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 3), blocks=st.integers(1, 20), cap_blocks=st.integers(1, 6), data=st.data())
def test_capped_plan_splits_runs_and_still_copies_exactly(layers: int, blocks: int, cap_blocks: int,
                                                          data: st.DataObject) -> None:
    """``max_bytes`` splits each run into pieces of at most that many bytes (one block at
    least): the step's own small copies never queue behind a whole 1 GiB demotion."""
    n = data.draw(st.integers(0, blocks))
    src_ids = sorted(data.draw(st.permutations(range(blocks)))[:n])
    dst_ids = list(range(n))
    src, dst = _pool(layers, blocks, 9), _pool(layers, max(n, 1), 10)
    want = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        want[:, :, d] = src[:, :, s]
    block_bytes = src[0, 0, 0].numel() * src.element_size() * layers * 2
    cap = cap_blocks * block_bytes + data.draw(st.integers(0, block_bytes - 1))
    plan = plan_runs(dst, dst_ids, src, src_ids, max_bytes=cap)
    assert plan is not None and all(c.width * c.height <= cap for c in plan)
    assert len(plan) >= len(runs(src_ids, dst_ids))
    emulate(plan, dst, src)
    assert torch.equal(dst, want)
    tiny = plan_runs(dst.clone(), dst_ids, src, src_ids, max_bytes=1)  # below one block: one block each
    assert tiny is not None and len(tiny) == n


def test_k_or_v_only_views_and_empty_copies() -> None:
    """Review F3: a view of K (or V) alone has one row per layer, ``stride(0)`` apart; the plan
    took the K->V distance and copied the wrong bytes into the other half. F4: an empty copy
    (no ids, or a view of no blocks) plans nothing instead of raising IndexError."""
    src, dst = _pool(3, 10, 11), _pool(3, 6, 12)
    for kv in (0, 1):
        s_view, d_view = src[:, kv : kv + 1], dst[:, kv : kv + 1]
        want = dst.clone()
        want[:, kv : kv + 1, [1, 2, 5]] = src[:, kv : kv + 1, [3, 4, 9]]
        plan = plan_runs(d_view, [1, 2, 5], s_view, [3, 4, 9])
        assert plan is not None
        emulate(plan, d_view, s_view)
        assert torch.equal(dst, want)
    assert plan_runs(dst, [], src, []) == []
    assert plan_runs(dst[:, :, :0], [], src[:, :, :0], []) == []
