"""Policy top-k selection is device-independent on ties (cache_node/policies/base.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node.policies.base import kept_in_order, top_k_stable


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.integers(0, 4), min_size=1, max_size=60), data=st.data())
def test_ties_go_to_the_lower_index(values: list[int], data: st.DataObject) -> None:
    """Scores with many exact ties (as max-pooled SnapKV votes have): the kept set is the
    ``k`` best by (score descending, index ascending), whatever ``torch.topk`` would pick."""
    k = data.draw(st.integers(1, len(values)))
    score = torch.tensor(values, dtype=torch.float32)
    want = sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]
    assert sorted(top_k_stable(score, k).tolist()) == sorted(want)


def test_infinite_scores_are_kept_first_and_their_ties_too() -> None:
    score = torch.tensor([1.0, float("inf"), 3.0, float("inf"), 3.0, float("inf")])
    assert top_k_stable(score, 2).tolist() == [1, 3]
    assert sorted(top_k_stable(score, 4).tolist()) == [1, 2, 3, 5]


@settings(max_examples=80, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=1, max_size=80))
def test_kept_in_order_is_nonzero_without_a_sync(mask: list[bool]) -> None:
    """The accelerator path (no ``nonzero``, which waits for the device): the same indices, in
    index order, as ``nonzero`` on every mask."""
    keep = torch.tensor(mask)
    assert kept_in_order(keep, int(keep.sum())).tolist() == keep.nonzero().flatten().tolist()
