"""The sampler at the edges of its valid inputs (OpenAI API review 20, O7): every ``top_p`` in
(0, 1] and every temperature in [0, 100] draws a token, never a failed step, however the
values round in float32 and whatever the logits' scale (-inf entries included). Top-k and the
penalties: ``tests/test_sampler_penalties.py``."""

from __future__ import annotations

import itertools

import pytest
import torch

from cache_node.sampler import sample, top_p_filter
from cache_node.sampling_params import GREEDY_BELOW, SamplingParams
from cache_node.sequence import Sequence

TINY_TOP_P = (5e-324, 1e-45, 1e-300)
"""Valid ``top_p`` values that are 0 in float32 (``5e-324`` is the smallest positive double)."""


def _logits(scale: float, masked: bool, seed: int) -> torch.Tensor:
    """(300,) float32 logits of ``scale``; ``masked``: every other one -inf."""
    row = torch.randn(300, generator=torch.Generator().manual_seed(seed)) * scale
    if masked:
        row[::2] = float("-inf")
    return row


def test_a_top_p_that_is_zero_in_float32_keeps_the_most_probable_token_alone() -> None:
    """Regression (oairev20 O7, /tmp/oairev20/r11_tiny_temp.py): top_p 5e-324 compared as 0
    with the float32 masses, kept no token, and the row was 0/0 = NaN (the draw raised, the
    request ended INTERNAL: HTTP 500). Now the most probable token is always kept."""
    probs = torch.softmax(_logits(3.0, False, 0), dim=-1)
    top = int(probs.argmax())
    for top_p in TINY_TOP_P:
        filtered = top_p_filter(probs, top_p)
        assert filtered.nonzero().flatten().tolist() == [top] and float(filtered[top]) == 1.0, top_p
    assert torch.equal(top_p_filter(probs, 1.0), probs)
    flat = torch.softmax(_logits(1.0, False, 0), dim=-1)
    half = top_p_filter(flat, 0.5)  # the smallest set reaching 0.5: exactly what it kept before
    ranked = flat.sort(descending=True)
    kept = int((ranked.values.cumsum(0) - ranked.values < 0.5).sum())
    assert sorted(half.nonzero().flatten().tolist()) == sorted(ranked.indices[:kept].tolist()) and kept > 1


@pytest.mark.parametrize("temperature", [0.0, GREEDY_BELOW / 2, GREEDY_BELOW, 1e-4, 1.0, 2.0, 100.0])
def test_every_valid_temperature_and_top_p_draws_a_token_of_its_kept_set(temperature: float) -> None:
    """Each (temperature, top_p) at the edges of their ranges, over logits of scale 1e-3 to
    1e4 with and without -inf entries: one draw per row, no ``SequenceFault``, the token among
    those top-p keeps at that temperature; a top_p under 1e-9 (and a greedy temperature)
    gives the argmax. Before the fix every tiny top_p here failed its step."""
    top_ps = (*TINY_TOP_P, 1e-9, 0.5, 1.0 - 1e-12, 1.0)
    cases = list(itertools.product(top_ps, (1e-3, 1.0, 1e4), (False, True)))
    logits = torch.stack([_logits(scale, masked, i) for i, (_, scale, masked) in enumerate(cases)])
    seqs = []
    for i, (top_p, _, _) in enumerate(cases):
        seq = Sequence(str(i), [1], SamplingParams(temperature=temperature, top_p=top_p, seed=i))
        seq.generator = torch.Generator().manual_seed(i)
        seqs.append(seq)
    tokens = sample(logits, seqs)
    for token, row, seq in zip(tokens, logits, seqs):
        params = seq.sampling_params
        if params.greedy or params.top_p <= 1e-9:
            assert token == int(row.argmax()), (params, token)
        else:
            kept = top_p_filter(torch.softmax(row / temperature, dim=-1), params.top_p)
            assert float(kept[token]) > 0.0 and row[token] > float("-inf"), (params, token)
