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


def test_decode_attention_takes_a_non_contiguous_sdpa_output(monkeypatch) -> None:
    """Regression (H200, 2026-12-04: ``full`` and every plain request on the torch backend
    failed their second step, "view size is not compatible with input tensor's size and
    stride"): CUDA's SDPA returns ``(1, H_kv, group, d)`` in a layout ``view`` cannot fold; the
    CPU's was contiguous, so CI never saw it. Here SDPA's output is made non-contiguous."""
    import cache_node.attention_backends as backends

    sdpa = F.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides

    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    q = torch.randn(2, 6, 8, generator=g)
    slots = torch.arange(40)
    want = decode_attention(q, gather_slots(k_cache, slots), gather_slots(v_cache, slots), (0, 15, 40), 0.3)
    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", strided_sdpa)
    assert not strided_sdpa(q[:1].view(1, 2, 3, 8), k_cache[:5].transpose(0, 1).unsqueeze(0),
                            v_cache[:5].transpose(0, 1).unsqueeze(0)).is_contiguous()
    got = decode_attention(q, gather_slots(k_cache, slots), gather_slots(v_cache, slots), (0, 15, 40), 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
