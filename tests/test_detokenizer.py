"""Incremental detokenization (``cache_node.detokenizer``) with the real SmolLM2 tokenizer: step by
step it gives exactly what decoding the whole output gives, for any token ids (special tokens,
bytes of a character split over tokens and steps, invalid UTF-8 included)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_node.detokenizer import INCOMPLETE, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def steps(tokenizer, ids: Sequence[int], cuts: Sequence[int]) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """Each step's (delta, text so far) for ``ids`` split at ``cuts``; the last step is final."""
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    detok = IncrementalDetokenizer(decode)
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    out, text, start = [], "", 0
    for end in bounds:
        delta = detok.add(ids[start:end], final=end == len(ids))
        text += delta
        out.append((delta, text))
        start = end
    return out


def check(tokenizer, ids: list[int], cuts: Sequence[int]) -> None:  # type: ignore[no-untyped-def]
    """Every step's text so far is the whole decode of the tokens so far without its trailing
    U+FFFD (what the node sent when it decoded the whole output each step), the last is the
    whole decode; no delta but the last holds a character still incomplete."""
    got = steps(tokenizer, ids, cuts)
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    for end, (delta, text) in zip(bounds, got):
        whole = tokenizer.decode(ids[:end], skip_special_tokens=True)
        assert text == (whole if end == len(ids) else whole.rstrip(INCOMPLETE)), (ids[:end], text, whole)


SPLIT = ["😀", "👩‍💻", "漢字かな交じり文", "Viššénď", "€", "𝄞", "ﷺ", "\ufffd", "🇨🇿", " 你好，世界！"]
"""Text whose characters' bytes span tokens (and a literal U+FFFD, a whole character)."""


@pytest.fixture(scope="module")
def partial_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """The ids that decode, alone, to a part of a character (U+FFFD): byte tokens, and pieces
    of multi-byte characters."""
    ids = [i for i in range(len(tokenizer)) if INCOMPLETE in tokenizer.decode([i])]
    assert len(ids) > 100
    return ids


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(st.tuples(st.booleans(), st.integers(0, 49151)), min_size=1, max_size=40),
       cuts=st.lists(st.integers(0, 40)))
def test_random_token_ids_give_the_whole_decode(tokenizer, partial_ids: list[int], drawn: list[tuple[bool, int]],
                                                cuts: list[int]) -> None:
    """Any ids (special tokens, parts of characters, invalid UTF-8), in steps of any size; about
    half of them parts of characters."""
    ids = [partial_ids[n % len(partial_ids)] if part else n for part, n in drawn]
    check(tokenizer, ids, cuts)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.one_of(st.sampled_from(SPLIT), st.text(max_size=6)), min_size=1, max_size=8),
       noise=st.lists(st.sampled_from(list(range(17)) + list(range(100, 400))), max_size=4),
       cuts=st.lists(st.integers(0, 60)), at=st.integers(0, 60))
def test_multibyte_text_split_over_tokens_and_steps(tokenizer, pieces: list[str], noise: list[int],
                                                    cuts: list[int], at: int) -> None:
    """Emoji, CJK, combining text: encoded, with special tokens or byte tokens slipped in."""
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    ids[at % (len(ids) + 1):at % (len(ids) + 1)] = noise
    if ids:
        check(tokenizer, ids, cuts)


def test_one_token_at_a_time_holds_back_only_incomplete_characters(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "Viššénď 😀 漢字 (Czech) 👩‍💻"
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = steps(tokenizer, ids, range(len(ids)))
    assert "".join(d for d, _ in got) == text and not any(INCOMPLETE in d for d, _ in got)
    assert any(d == "" for d, _ in got)  # a character's first bytes waited for its last


def test_the_window_does_not_grow_with_the_output(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Each step decodes a few tokens, however long the output is (it decoded all of it)."""
    lengths: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. 漢字 😀 " * 200, add_special_tokens=False)
    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert text == tokenizer.decode(ids) and len(ids) > 2000
    assert max(lengths) <= 6, max(lengths)


@pytest.fixture(scope="module")
def lone_bytes(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Tokens of one byte that is never part of a character (a continuation byte alone, or a
    byte that starts none): each decodes to U+FFFD, however many follow."""
    ids = [i for i in range(1000) if tokenizer.decode([i]) == INCOMPLETE
           and tokenizer.decode([i] * 3) == INCOMPLETE * 3]
    assert len(ids) >= 2
    return ids


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(runs=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 49151), st.integers(1, 60)), min_size=1, max_size=6),
       cuts=st.lists(st.integers(0, 300)))
def test_long_runs_of_invalid_bytes_give_the_whole_decode(tokenizer, partial_ids: list[int], lone_bytes: list[int],
                                                          runs: list[tuple[int, int, int]], cuts: list[int]) -> None:
    """Runs of up to 60 tokens that leave the text ending in U+FFFD (lone bytes, parts of
    characters, mixed), between ordinary and special tokens, in steps of any size: the window
    moves inside the runs (``MAX_UNSETTLED``) and the text is still the whole decode."""
    ids: list[int] = []
    for kind, n, length in runs:
        if kind == 0:
            ids += [lone_bytes[(n + k) % len(lone_bytes)] for k in range(length)]
        elif kind == 1:
            ids += [partial_ids[(n * 7 + k) % len(partial_ids)] for k in range(length)]
        else:
            ids += [n % 49152, (n * 31) % 49152]
    check(tokenizer, ids, cuts)


def test_a_long_run_of_invalid_bytes_does_not_grow_the_window(tokenizer, lone_bytes: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Regression (security review F7): while the text kept ending in U+FFFD the window never
    settled and every step decoded the whole run (9.96 ms per step after 8,000 such tokens,
    on the node's step thread); now a step decodes a bounded window, and the text is the same."""
    lengths: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = [lone_bytes[k % 2] for k in range(3000)] + tokenizer.encode(" done 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(decode)
    deltas = [detok.add([t]) for t in ids[:-1]]
    assert all(d == "" for d in deltas[:2999])  # the run's U+FFFD wait for a whole character
    text = "".join(deltas) + detok.add(ids[-1:], final=True)
    assert text == tokenizer.decode(ids)
    assert max(lengths) <= 2 * 8 + 2, max(lengths)
