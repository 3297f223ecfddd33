"""The node's incremental detokenizer (``cache_node.detokenizer``) on outputs that never leave a
whole character last, with the real SmolLM2 tokenizer: a step's cost stays the same however
long the run, and the text is still exactly the whole output's decode.

Regression (s36): SmolLM2 has a token for each of 235 single bytes; a run of the tokens F0 9F
98 (a 4-byte character's first 3 bytes, never completed: each run one U+FFFD) has no token
boundary with 3 characters after it among the window's last 6 tokens, and a character's first
byte followed by special tokens (which decode to nothing) has none at all, so the window grew
with the output and each step decoded all of it: 0.45 s for 1,000 such tokens, 4.0 s for 4,000,
72 s for 16,000 (one token per step). And the U+FFFD held back before the window were built as a
string each step: a run of 16,000 lone continuation bytes took 4.1 s (0.75 s now)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_node.detokenizer import INCOMPLETE, MAX_WINDOW, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def byte_token(tokenizer) -> dict[int, int]:  # type: ignore[no-untyped-def]
    """Byte -> the id of the token that is that byte alone (SmolLM2's vocabulary, read through
    the byte-level alphabet)."""
    found: dict[int, int] = {}
    alphabet = _byte_alphabet()
    for token, i in tokenizer.get_vocab().items():
        if len(token) == 1 and token in alphabet:
            found[alphabet[token]] = i
    assert len(found) > 200 and {0x80, 0x98, 0x9F, 0xB8, 0xAD, 0xE4, 0xF0} <= found.keys()
    return found


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (SmolLM2's too): the character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def run(tokenizer, ids: Sequence[int]) -> tuple[str, list[int], list[float]]:  # type: ignore[no-untyped-def]
    """One token per step: the text, each decode's length, each step's seconds."""
    lengths: list[int] = []

    def decode(window: Sequence[int]) -> str:
        lengths.append(len(window))
        return tokenizer.decode(window, skip_special_tokens=True)

    detok, parts, step_s = IncrementalDetokenizer(decode), [], []
    for k, token in enumerate(ids):
        t0 = time.perf_counter()
        parts.append(detok.add([token], final=k == len(ids) - 1))
        step_s.append(time.perf_counter() - t0)
    return "".join(parts), lengths, step_s


@pytest.mark.parametrize("stream", ["F0 9F 98 never completed", "E4 then special tokens", "lone continuation bytes"])
def test_a_run_without_a_whole_character_costs_the_same_per_step(tokenizer, byte_token: dict[int, int],
                                                                 stream: str) -> None:
    n = 16000
    if stream.startswith("F0"):
        ids = [byte_token[b] for b in b"\xf0\x9f\x98" * (n // 3)]
    elif stream.startswith("E4"):
        special = tokenizer.all_special_ids
        ids = [byte_token[0xE4]] + [special[k % len(special)] for k in range(n)]
    else:
        ids = [byte_token[0x80]] * n
    text, lengths, step_s = run(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(lengths) <= MAX_WINDOW + 2, max(lengths)  # it grew to the whole output
    first, last = statistics.median(step_s[:1000]), statistics.median(step_s[-1000:])
    assert last < 3 * first + 20e-6, (first, last)  # it grew with the held U+FFFD


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(st.one_of(st.sampled_from([0xC3, 0xE4, 0xE2, 0xF0, 0xF4, 0xED, 0xE0]),  # leads
                                st.sampled_from([0x80, 0x98, 0x9F, 0xA9, 0xB8, 0xAD, 0xBF]),  # continuations
                                st.sampled_from([-1, -2, -3])),  # a special token, a word, an emoji
                      min_size=1, max_size=300),
       cuts=st.lists(st.integers(0, 300)))
def test_runs_of_bytes_split_inside_characters_give_the_whole_decode(tokenizer, byte_token: dict[int, int],
                                                                     drawn: list[int], cuts: list[int]) -> None:
    """Byte tokens that start, continue, complete or break characters, long runs of them ending
    inside a character (the window moves to boundaries inside characters), in steps of any
    size: every step's text is the whole decode without its trailing U+FFFD, the last the whole
    decode."""
    extra = {-1: [tokenizer.all_special_ids[0]], -2: tokenizer.encode(" word", add_special_tokens=False),
             -3: tokenizer.encode("😀", add_special_tokens=False)}
    ids: list[int] = []
    for d in drawn:
        ids += extra[d] if d < 0 else [byte_token[d]]
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    detok = IncrementalDetokenizer(decode)
    bounds = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    text, start = "", 0
    for end in bounds:
        text += detok.add(ids[start:end], final=end == len(ids))
        whole = decode(ids[:end])
        assert text == (whole if end == len(ids) else whole.rstrip(INCOMPLETE)), (ids[:end], text, whole)
        start = end


def test_special_tokens_inside_a_character_are_dropped_from_the_window(tokenizer, byte_token: dict[int, int]) -> None:
    """A character's first byte, then many more special tokens than ``MAX_WINDOW`` (they
    decode to nothing), then its last bytes: the window drops them (no boundary is left to
    move to) and the character is whole, as in the whole decode; no step decodes more than a
    few tokens."""
    special = tokenizer.all_special_ids
    ids = [byte_token[0xE4]] + [special[k % len(special)] for k in range(500)] + [byte_token[0xB8], byte_token[0xAD]]
    text, lengths, _ = run(tokenizer, ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text == "中"
    assert max(lengths) <= 2 * 8 + 2, max(lengths)


def test_a_byte_fallback_decode_keeps_the_window_bounded(tokenizer, byte_token: dict[int, int]) -> None:
    """A decode that is not a lossy UTF-8 decode of the tokens' bytes, as a byte-fallback
    decoder's (Llama's, Mistral's: every byte of a run that is not valid UTF-8 becomes U+FFFD):
    the never-completed run still costs a bounded window per step, and the text is its decode."""
    alphabet = _byte_alphabet()

    def byte_fallback(window: Sequence[int]) -> str:
        data = bytes(alphabet[ch] for token in tokenizer.convert_ids_to_tokens(list(window)) for ch in token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return INCOMPLETE * len(data)

    lengths: list[int] = []

    def decode(window: Sequence[int]) -> str:
        lengths.append(len(window))
        return byte_fallback(window)

    ids = [byte_token[b] for b in b"\xf0\x9f\x98" * 1000]
    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert text == INCOMPLETE * len(ids) == byte_fallback(ids)
    assert max(lengths) <= MAX_WINDOW + 1, max(lengths)


def test_a_window_no_boundary_splits_is_given_up() -> None:
    """Whatever the decode (here one whose text ends in U+FFFD and depends on the window's
    length, so no boundary splits it and no token decodes to nothing), a step never decodes
    more than ``MAX_WINDOW`` + 1 tokens: past that the window is given up, its text sent as
    final (as vLLM's and Hugging Face's incremental detokenizers do)."""
    lengths: list[int] = []

    def decode(window: Sequence[int]) -> str:
        lengths.append(len(window))
        return f"<{len(window)}>{INCOMPLETE}" if window else ""

    detok = IncrementalDetokenizer(decode)
    text = "".join(detok.add([7]) for _ in range(1000))
    assert max(lengths) <= MAX_WINDOW + 1, max(lengths)
    assert text.count(INCOMPLETE) == 1000 // MAX_WINDOW  # each given-up window's, sent as final
