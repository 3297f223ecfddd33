"""``python -m bench.grammar_mask``: the host cost structured outputs add to a step, on this
machine: median ``grammar_mask.constrain`` (fill the constrained rows' bitmask, copy it to the
logits' device, apply it) for a 4-row batch with 0, 2 and 4 constrained rows, and median
``accept_token``; SmolLM2-135M's tokenizer (vocabulary 49,152). One JSON line per figure."""

from __future__ import annotations

import json
import statistics
import time

import torch

from cache_node.grammar_mask import GrammarState, constrain
from cache_node.grammars import Grammars
from cache_node.model_loader import load_model
from cache_node.structured_output import StructuredOutputSpec

REPS = 300


def _median_us(fn: object) -> float:
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    lm = load_model()
    grammars = Grammars.create(lm.tokenizer, lm.model.config.vocab_size, lm.eos_token_ids, 8)
    assert isinstance(grammars, Grammars), grammars
    spec = StructuredOutputSpec("json_schema", json.dumps({"type": "object", "properties": {"d": {"type": "string"}}}))
    prefix = lm.tokenizer.encode('{"d": "')
    states: list[GrammarState | None] = []
    for constrained in (0, 2, 4):
        states = []
        for row in range(4):
            state = None
            if row < constrained:
                state = GrammarState(grammars, spec)
                state.future.result()
                state.poll()
                assert all(state.matcher.accept_token(t) for t in prefix)
            states.append(state)
        logits = torch.randn(4, lm.model.config.vocab_size)
        cost = _median_us(lambda x=logits, s=states: constrain(grammars, x, s, [()] * 4, [None] * 4))
        print(json.dumps({"constrained_rows": constrained, "median_constrain_us": cost}))
    matcher = states[0].matcher  # type: ignore[union-attr]  (inside the string: any letter goes)
    letter = lm.tokenizer.encode("a")[0]
    print(json.dumps({"median_accept_token_us": _median_us(lambda: matcher.accept_token(letter))}))


if __name__ == "__main__":
    main()
