"""Decode attention (unpadded, GQA folded into query rows) against a padded, masked SDPA reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cache_node.attention import decode_attention, gather_slots


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               contexts: list[torch.Tensor], scale: float) -> torch.Tensor:
    """The engine's former decode path: padded slots, boolean mask, SDPA ``enable_gqa``."""
    width = max(len(c) for c in contexts)
    padded = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), 1, 1, width, dtype=torch.bool)
    for i, c in enumerate(contexts):
        padded[i, : len(c)] = c
        mask[i, 0, 0, : len(c)] = True
    k = k_cache[padded].transpose(1, 2)
    v = v_cache[padded].transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def test_decode_attention_matches_padded_masked_gqa_reference() -> None:
    """Guards the unpadded decode path: wrong head grouping or offsets would mix sequences/heads."""
    g = torch.Generator().manual_seed(0)
    num_slots, heads, kv_heads, head_dim = 512, 6, 2, 16
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_slots, generator=g)
    lengths = [1, 17, 64, 5, 130]
    contexts, start = [], 0
    for n in lengths:
        contexts.append(perm[start : start + n])
        start += n
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    slots = torch.cat(contexts)
    offsets = tuple(int(x) for x in torch.tensor([0, *lengths]).cumsum(0))
    got = decode_attention(q, gather_slots(k_cache, slots), gather_slots(v_cache, slots), offsets, 0.25)
    want = _reference(q, k_cache, v_cache, contexts, 0.25)
    assert got.shape == (len(lengths), heads, head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gather_slots_equals_advanced_indexing() -> None:
    cache = torch.arange(10 * 2 * 3, dtype=torch.float32).view(10, 2, 3)
    slots = torch.tensor([[7, 0, 3], [3, 9, 9]])
    assert torch.equal(gather_slots(cache, slots), cache[slots])
