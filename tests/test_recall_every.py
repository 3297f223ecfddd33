"""SentenceKV's ``recall_every`` (issue 22, point 6: recall cost): a decode step re-selects a
layer's region only at multiples of k computed tokens, keeps the last selection between, and
prefill chunks always select."""

from __future__ import annotations

from collections import Counter

import pytest

from cache_node.policies import PolicyEnv
from cache_node.policies.sentencekv import SentenceKV
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def recalls_per_step(tiny, monkeypatch, spec: str, max_tokens: int = 9) -> tuple[Counter, list[int]]:
    """Serve one request under ``spec``; (recall calls per computed-token count at the call,
    the output tokens)."""
    calls: Counter = Counter()
    real = SentenceKV.recall

    def counting(self, state, layer_idx, q):
        calls[(state.seq.num_computed_tokens, q.shape[0] > 1)] += 1
        return real(self, state, layer_idx, q)

    monkeypatch.setattr(SentenceKV, "recall", counting)
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True), policy=spec)[0]
    eng.check_integrity()
    return calls, out.output_token_ids


def test_decode_steps_reselect_only_at_multiples_of_k(tiny, monkeypatch) -> None:
    every, _ = recalls_per_step(tiny, monkeypatch, "sentencekv-96")
    layers = tiny.model.config.num_hidden_layers
    decode_every = {n for (n, chunk), c in every.items() if not chunk and c == layers}
    assert len(decode_every) >= 8  # k = 1: every decode step selects in every layer
    got, tokens = recalls_per_step(tiny, monkeypatch, "sentencekv-96-recall_every_4")
    assert len(tokens) == 9
    decode = {n for (n, chunk), _ in got.items() if not chunk}
    assert decode and all(n % 4 == 0 for n in decode)
    assert all(got[(n, False)] == layers for n in decode)
    assert {n for (n, chunk) in got if chunk} == {n for (n, chunk) in every if chunk}  # prefill as before


def test_spec_validates_recall_every() -> None:
    assert SentenceKV(budget=0.25, recall_every=4).recall_every == 4
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="recall_every"):
            SentenceKV(budget=0.25, recall_every=bad)
