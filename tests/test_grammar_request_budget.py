"""A structured request's matcher time over all its steps is bounded (``grammar_request_budget_ms``),
and with it its matcher's memory (xgrammar 0.2.9 keeps every output byte's parser states for
the matcher's life and exposes no size of them; ``cache_node.grammar_mask``).

Regression (session 28): only each step was bounded (``grammar_step_budget_ms``, 2 ms). The
grammar of 256 ``[a-z]*`` in a row stays at ~0.2 ms a step, far under it, while its matcher
grows by tens of KB a token: ~200-330 MB over 8,192 tokens for one request, and a tenant may
run 16 at once.
"""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cache_node.grammar_mask import constrain

xgr = pytest.importorskip("xgrammar")

VOCAB = 49152
STARS = "root ::= " + " ".join(["[a-z]*"] * 256)


@pytest.fixture(scope="module")
def compiler() -> Any:
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[2])
    return tokenizer, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _malloc_bytes() -> int | None:
    """Bytes the C heap has in use (glibc's ``mallinfo2``), None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    info.restype = MallInfo2
    got = info()
    return int(got.uordblks + got.hblkhd)


def _decode(grammar: Any, tokens: list[int], step_budget_s: float, total_budget_s: float) -> Any:
    """Feed ``tokens`` one a step as the engine does (``constrain``, then ``accept_token`` timed
    into the next step's charge) until one is refused; the row's state (its matcher, kept
    alive), ``num_accepted`` and ``refused`` (the refusal or None)."""
    state = SimpleNamespace(matcher=xgr.GrammarMatcher(grammar, override_stop_tokens=[2]), accept_s=0.0,
                            total_s=0.0, num_accepted=0, refused=None)
    grammars = SimpleNamespace(bitmask=xgr.allocate_token_bitmask(1, VOCAB), stop_token_ids=[2], xgr=xgr,
                               vocab_size=VOCAB)
    logits = torch.zeros(1, VOCAB)
    for token in tokens:
        _, refused = constrain(grammars, logits, [state], [()], [None], step_budget_s, total_budget_s)
        if refused:
            state.refused = refused[0]
            return state
        start = time.thread_time()
        assert state.matcher.accept_token(token)
        state.accept_s = time.thread_time() - start
        state.num_accepted += 1
    return state


def test_a_grammar_under_its_step_budget_is_refused_past_its_request_budget(compiler) -> None:
    """256 ``[a-z]*``: every step stays under a 2 ms step budget, yet with a 40 ms request
    budget it is refused after some tokens, naming grammar_request_budget_ms, its matcher then
    holding a few MB (~0.2 MB per ms of matcher time at most); without the request budget it
    runs all 600 tokens and its matcher holds over 10 MB. A JSON object's matcher takes 600
    tokens within a few ms: far under the same budget."""
    tokenizer, comp = compiler
    stars = comp.compile_grammar(STARS)
    words = tokenizer.encode("abcd" * 600, add_special_tokens=False)[:600]
    before = _malloc_bytes()
    bounded = _decode(stars, words, 0.5, 0.040)  # (a 500 ms step budget: a loaded host never trips it)
    grown = None if before is None else _malloc_bytes() - before  # type: ignore[operator]
    n, why = bounded.num_accepted, bounded.refused
    assert why is not None and 0 < n < 600, (n, why)
    assert why.startswith("structured_output: its grammar took ") and f"over {n} output tokens, past this " \
        "node's limit of 40 ms per request (grammar_request_budget_ms)" in why, why
    if grown is not None:
        assert grown < 16 << 20, grown  # 40 ms x ~0.2 MB per ms, with room for a loaded host
    del bounded
    before = _malloc_bytes()
    unbounded = _decode(stars, words, 0.5, float("inf"))  # the step budget alone: no bound
    assert (unbounded.num_accepted, unbounded.refused) == (600, None)
    if before is not None:
        assert _malloc_bytes() - before > 10 << 20  # type: ignore[operator]
    del unbounded
    json_tokens = tokenizer.encode('{"a": [' + ", ".join(str(i) for i in range(400)), add_special_tokens=False)[:600]
    plain = _decode(comp.compile_json_schema('{"type": "object"}'), json_tokens, 0.5, 0.040)
    assert (plain.num_accepted, plain.refused) == (600, None), plain.refused
