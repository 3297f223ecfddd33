"""Next-token selection: greedy, or temperature + top-p (nucleus) sampling with per-request seeds."""

from __future__ import annotations

import torch

from cache_node.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches ``top_p``; (V,) -> (V,).

    Source: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR'20), §3.1.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Pick one token per row. ``logits``: (num_seqs, vocab_size) float32."""
    out = []
    for row, seq in zip(logits, seqs):
        params = seq.sampling_params
        if params.greedy:
            out.append(int(row.argmax()))
            continue
        probs = top_p_filter(torch.softmax(row / params.temperature, dim=-1), params.top_p)
        out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out
