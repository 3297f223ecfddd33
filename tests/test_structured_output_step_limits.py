"""Structured outputs' per-step bounds in the engine (real SmolLM2-135M, xgrammar): a grammar
whose matcher is too slow in one step (``grammar_step_budget_ms``), and a grammar that reaches
a state allowing no token at all, are refused INVALID_ARGUMENT ("rejected" with a message naming
structured_output), no token drawn for them, their blocks freed; the requests beside them go on
unchanged.

Regressions (review 27c F1, F4): the 68-byte ambiguous grammar below ran unbounded on the step
thread (~10 ms per row per step at first, ~78 ms by token 100, its matcher's memory growing
quadratically), slowing every tenant's step; a dead-end grammar ended "error" (INTERNAL, logged
at ERROR, counted as a failed request), greedy first sending token 0."""

from __future__ import annotations

import json
import time

import pytest

from cache_node.sampling_params import SamplingParams
from tests.test_structured_output_engine import (
    SCHEMA,
    _check_schema,
    _engine,
    _prompt,
    _run,
    _spec,
    _text,
)

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

# Ambiguous and left-recursive: xgrammar's Earley matcher does more work every token.
AMBIGUOUS = "root ::= a\na ::= a b | b\nb ::= [a-z]* | c\nc ::= [a-z]* [a-z]* [a-z]*"
DEAD_END = 'root ::= "a" b\nb ::= b "c"'  # after "a" nothing may follow, not even the end


def test_a_grammar_past_its_step_budget_is_refused_and_its_neighbours_go_on(real_model) -> None:
    """Two requests on the ambiguous grammar (max_tokens 400, EOS held back), a JSON-schema request and an
    unconstrained greedy one in one batch: the ambiguous ones are refused within a few tokens
    naming structured_output and grammar_step_budget_ms; the JSON one (a normal grammar, ~10-50 us
    a step) completes valid; the greedy one's tokens equal its run alone; the pool is whole."""
    lm = real_model
    eng = _engine(lm)
    free_before = eng.kv_manager.pool.num_free_blocks()
    plain_prompt = _prompt(lm, "Tell me about the Roman empire.")
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = next(iter(_run(eng, [plain_prompt], [plain]).values())).output_token_ids
    evil = [SamplingParams(max_tokens=400, min_tokens=400, temperature=1.0, seed=s,
                           structured_output=_spec("grammar", AMBIGUOUS))
            for s in (1, 2)]
    person = SamplingParams(max_tokens=60, structured_output=_spec("json_schema", SCHEMA))
    ns = eng.config.cache_namespace_default  # the requests' (grammars are kept per namespace)
    eng.grammars.compile(evil[0].structured_output, "", ns).result(timeout=300)  # all start in one batch
    eng.grammars.compile(person.structured_output, "", ns).result(timeout=300)
    words = _prompt(lm, "Write some words.")
    start = time.monotonic()
    *refused, json_out, plain_out = _run(
        eng, [words, words, _prompt(lm, "Give me a person as JSON with a name and an age."), plain_prompt],
        [*evil, person, plain]).values()
    for out in refused:
        assert out.finish_reason == "rejected", (out.finish_reason, out.num_output_tokens)
        assert out.num_output_tokens <= 20, out.num_output_tokens
        assert out.error is not None and out.error.startswith("structured_output: its grammar took "), out.error
        assert "past this node's limit of 2 ms (grammar_step_budget_ms)" in out.error, out.error
    assert json_out.finish_reason == "stop", json_out
    _check_schema(json.loads(_text(lm, json_out)))
    assert plain_out.finish_reason == "length" and plain_out.output_token_ids == alone
    assert time.monotonic() - start < 120
    assert not eng.requests and not eng.scheduler.has_work()
    assert eng.kv_manager.pool.num_free_blocks() == free_before
    assert eng.num_failed_requests == 0


@pytest.mark.parametrize(("kind", "spec", "emitted"), [
    ("grammar", DEAD_END, "a"),  # a dead end after its first token
    ("regex", r"[^\s\S]", ""),  # no string at all: dead from the start
])
def test_a_grammar_that_allows_no_token_is_refused_without_drawing_one(real_model, kind: str, spec: str,
                                                                        emitted: str) -> None:
    """Greedy and sampled, beside an unconstrained greedy request: the request is "rejected" with
    "structured_output: the grammar allows no token after N output tokens", the grammar's own
    tokens only (greedy no longer draws token 0 from an all -inf row), not counted as a failure;
    the neighbour's tokens are those of its run alone."""
    lm = real_model
    eng = _engine(lm)
    prompt = _prompt(lm, "Say something.")
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = next(iter(_run(eng, [prompt], [plain]).values())).output_token_ids
    for temperature in (0.0, 1.0):
        out, plain_out = _run(eng, [prompt, prompt], [
            SamplingParams(max_tokens=8, temperature=temperature, seed=4, structured_output=_spec(kind, spec)),
            plain]).values()
        n = len(lm.tokenizer.encode(emitted)) if emitted else 0
        assert (out.finish_reason, _text(lm, out), out.num_output_tokens) == ("rejected", emitted, n)
        assert out.error == f"structured_output: the grammar allows no token after {n} output tokens (it cannot complete)"
        assert 0 not in out.output_token_ids
        assert plain_out.output_token_ids == alone
    assert eng.num_failed_requests == 0
    assert not eng.requests and not eng.scheduler.has_work()
