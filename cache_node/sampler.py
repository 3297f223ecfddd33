"""Next-token selection: greedy, or temperature + top-p (nucleus) sampling with per-request seeds.

Everything runs on the logits' device: greedy rows take one batched argmax, each sampled
row draws from its request's own generator (created on that device, ``LLMEngine.add_request``),
and the chosen ids come back to the host in one ``tolist()``, the step's only host sync.
"""

from __future__ import annotations

import torch

from cache_node.outputs import SequenceFault
from cache_node.sequence import Sequence


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches ``top_p``; (V,) -> (V,).
    The most probable token is always kept (vLLM's ``apply_top_k_top_p`` keeps "at least
    one"), so any ``top_p`` in (0, 1] leaves a distribution to draw from.

    No host sync (no boolean indexing): the kept sorted probabilities are scattered back.
    Source: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR'20), §3.1.

    Regression (oairev20 O7): a ``top_p`` under float32's smallest value (5e-324, valid in
    the HTTP API) compared as 0 against the float32 masses, kept no token, and the 0/0 row
    failed the draw: the request ended INTERNAL (HTTP 500).
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    keep[0] = True
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return filtered / filtered.sum()


def sample(logits: torch.Tensor, seqs: list[Sequence], failed: list[int] | None = None) -> list[int]:
    """Pick one token per row.

    Args:
        logits: (num_seqs, vocab_size) float32, on any device.
        seqs: the row's sequences (their ``sampling_params`` and ``generator``, which lives
            on ``logits``' device).
        failed: given, a row whose draw fails is appended to it (its token is then
            meaningless) and the other rows are still drawn, instead of raising.

    Returns:
        num_seqs token ids: argmax for greedy rows; for the others, one draw from
        softmax(logits / temperature) after top-p filtering, with the sequence's generator.

    Raises:
        SequenceFault: without ``failed``, a sampled row's draw failed (e.g. non-finite
            logits); names its request.
    """
    if not seqs:
        return []
    tokens = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if params.greedy:
            continue
        try:
            probs = top_p_filter(torch.softmax(logits[i] / params.temperature, dim=-1), params.top_p)
            tokens[i : i + 1] = torch.multinomial(probs, 1, generator=seq.generator)
        except Exception as exc:  # e.g. non-finite logits: this request's fault alone
            if failed is None:
                raise SequenceFault(seq.request_id) from exc
            failed.append(i)
    return tokens.tolist()
