"""Per-token log probabilities in OpenAI's shapes, from a request's delta events (their
``logprobs`` entries: ``services.node_request.logprobs_entry``, checked at the gateway for
shape, values and what the request asked).

- ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs`` k in [0, 20]): a choice's
  ``logprobs`` is ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
  "logprob", "bytes"}, ...]}, ...]}``, ``top_logprobs`` the k most probable tokens, most
  probable first (OpenAI's; vLLM lists the chosen token first in it).
- ``/v1/completions`` (``logprobs`` k in [0, 20]: vLLM's bound, past OpenAI's legacy 5): a
  choice's ``logprobs`` is ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  each ``top_logprobs`` entry a map token -> logprob of the chosen token and the k most
  probable (up to k + 1 entries, as OpenAI and vLLM; tokens with the same text share one key).

The values are the model's raw distribution's (``cache_node.sampler``: log_softmax of its
logits before penalties, temperature and filters; vLLM V1's default ``raw_logprobs``), floored
at -9999.0 as vLLM's API floors them (JSON has no -inf; a node sends -inf for a value its
logits made NaN or +inf: ``cache_node.sampler.token_logprobs``).

Token texts and bytes (``TokenTexts``): ``token`` is the id decoded alone with the served
model's tokenizer (as vLLM's ``convert_ids_list_to_tokens``: special tokens included; a token
holding part of a character's bytes decodes to U+FFFD), ``bytes`` the bytes the token really
holds, as OpenAI documents them: joined in order, a completion's tokens' bytes are the UTF-8 of
its text, so a character split across tokens is rebuilt from them. They are read from the
tokenizer's vocabulary for the two schemes found from its backend's decoder: byte-level BPE
(GPT-2, Llama 3, SmolLM2, Qwen: each character of a token's string stands for one byte,
``bytes_to_unicode``) and SentencePiece (Llama 2, Mistral: ``<0xNN>`` byte-fallback tokens are
byte NN, ``▁`` is a space); an added token's bytes are its text's. Any other tokenizer (a slow
one, WordPiece, ...) gets its decoded text's UTF-8 (U+FFFD's for a partial character), as
before. ``text_offset`` is the character offset, in the returned text, of the character that a
token's first byte belongs to: the characters completed by the bytes of the tokens before it
(tokens the text skips, special ones such as an end-of-sequence, add none; an echoed prompt's
text keeps its special tokens, so each of them adds its text's characters).

A stream's chunk carries the entries of the tokens that arrived since the previous chunk (a
token whose text is held back, by a stop string's possible start or an incomplete character,
comes with the next text or the finish chunk), at most ``LOGPROB_TOKENS_PER_CHUNK``: more
(tokens that add no text, such as a run of special ones, or a delta coalesced while its client
read slowly) go out first in chunks of empty text. A chunk with none has ``logprobs`` null.

A whole (non-streamed) response collects every entry until it is built, compactly (flat
arrays, shaped when the body is built); how many it may hold is bounded before the request
runs (``check_whole_logprobs``, ``MAX_WHOLE_LOGPROBS``), and a body with many is built on a
worker thread (``OFF_LOOP_LOGPROBS``; ``OpenAIEdge.render``).
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import re
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

TOKEN_TEXTS_CACHED = 1 << 16
"""Token texts a gateway keeps decoded (``TokenTexts``): a vocabulary's worth for most models;
bounded, since a node's events may name any id up to ``MAX_TOKEN_ID``."""

LOGPROB_FLOOR = -9999.0
"""The least logprob the API reports (vLLM's ``max(logprob, -9999.0)``): -inf is no JSON."""

MAX_WHOLE_LOGPROBS = 1 << 18
"""The most log probabilities a whole (non-streamed) response may hold, summed over its
choices: ``n * max_tokens * (1 + k)`` for k alternatives per token (``check_whole_logprobs``).
At it a chat body is ~22 MiB of JSON, a completion's ~5 MiB. Regression (review 26c F2): a
body with n 16, top_logprobs 20 and no max_tokens held ~816 MiB of Python objects for an
8192-token context and built a 192 MiB body on the event loop in 7.9 s."""

OFF_LOOP_LOGPROBS = 1 << 14
"""A whole response holding more log probabilities than this is built on a worker thread
(chat: ~1.4 MiB of JSON), one at a time per tenant (``InferenceServicer.off_loop``)."""

LOGPROB_TOKENS_PER_CHUNK = 64
"""The most tokens whose entries one streamed chunk carries (chat with 20 alternatives: ~115
KiB of JSON)."""


class Token(NamedTuple):
    """A token id as the API reports it: ``text`` (its id decoded alone), ``data`` (the bytes
    it holds) and ``in_text`` (False: the returned text skips it, as a special token)."""

    text: str
    data: bytes
    in_text: bool


class TokenTexts:
    """A token id's ``Token`` with the served model's tokenizer (None: ``token_id:<id>``, vLLM's
    ``return_tokens_as_token_ids`` form), the last ``TOKEN_TEXTS_CACHED`` ids' kept. An id past
    the vocabulary is ``Token("", b"", True)``. The scheme of ``bytes`` (the module docstring)
    is ``scheme``: "byte_level", "sentencepiece", or None (the decoded text's UTF-8)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.scheme = None if tokenizer is None else token_bytes_scheme(tokenizer)
        self._byte_of: dict[str, int] = {}
        if self.scheme == "byte_level":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        added = tokenizer.get_added_vocab() if tokenizer is not None and hasattr(tokenizer, "get_added_vocab") else {}
        self._added = frozenset(added.values())
        self._cached = functools.lru_cache(maxsize=TOKEN_TEXTS_CACHED)(self._token)

    def __call__(self, token_id: int) -> Token:
        return self._cached(token_id)

    def _token(self, token_id: int) -> Token:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return Token(text, text.encode(), True)
        text = self.tokenizer.decode([token_id])
        in_text = not text or self.tokenizer.decode([token_id], skip_special_tokens=True) != ""
        return Token(text, self._bytes(token_id, text), in_text)

    def _bytes(self, token_id: int, text: str) -> bytes:
        if self.scheme is not None and token_id not in self._added:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except (IndexError, OverflowError, TypeError, ValueError):
                piece = None
            if isinstance(piece, str) and piece:
                if self.scheme == "byte_level" and all(c in self._byte_of for c in piece):
                    return bytes(self._byte_of[c] for c in piece)
                if self.scheme == "sentencepiece":
                    byte = _BYTE_PIECE.fullmatch(piece)
                    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()
        return text.encode("utf-8", "replace")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes_scheme(tokenizer: Any) -> str | None:
    """How ``tokenizer``'s vocabulary holds a token's bytes, from its backend's decoder
    (a ``tokenizers`` one; a slow tokenizer has none): "byte_level" (a ``ByteLevel``
    decoder), "sentencepiece" (``ByteFallback`` or ``Metaspace``), else None."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        state = json.loads(decoder.__getstate__())  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - no decoder, or one that does not say: unknown
        return None
    if not isinstance(state, dict):
        return None
    parts = [state, *(d for d in state.get("decoders") or () if isinstance(d, dict))]
    types = {d.get("type") for d in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if types & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return None


def _continues(data: bytes) -> bool:
    """``data`` starts with a UTF-8 continuation byte (10xxxxxx): it may complete a character
    that earlier bytes began."""
    return bool(data) and data[0] & 0xC0 == 0x80


class Logprobs:
    """One choice's log probabilities, collected from its deltas and handed out in its
    endpoint's shape: all of them (``whole``) or those not handed out yet (``take``).

    Kept compact until shaped (per token: its id, value, offset and where its alternatives
    end in two flat arrays), so a whole response holds ~16 bytes a value until its body is
    built (review 26c F2: a dict per entry held ~300).

    Args:
        chat: a chat completion (else a text completion).
        top: the alternatives asked per token (chat's ``top_logprobs``, a completion's
            ``logprobs``).
        tokens: a token id's ``Token`` (``TokenTexts``).
        streamed: handed out chunk by chunk (``take``: at most ``LOGPROB_TOKENS_PER_CHUNK``
            tokens' a chunk; ``Generation.pieces`` sends the rest in chunks of empty text).
    """

    def __init__(self, chat: bool, top: int, tokens: Callable[[int], Token], streamed: bool = False) -> None:
        self.chat, self.top, self.tokens, self.streamed = chat, top, tokens, streamed
        self._ids, self._values, self._offsets = array("q"), array("d"), array("q")
        self._top_ids, self._top_values, self._top_ends = array("q"), array("d"), array("q")
        self._taken = 0
        self._chars = 0  # characters completed by the bytes of the tokens so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_ids: list[int], entries: list[list[float | int]], echo: bool = False) -> None:
        """A delta's tokens and their entries (one each: ``logprobs_entry``'s
        ``[logprob, id, logprob, ...]``). ``echo``: an echoed prompt's tokens, whose text keeps
        every token (special ones included): each adds its bytes' characters to the offsets.
        Regression (review 28c F2): an echoed prompt's special tokens (``<|im_start|>``) added
        none, so every later offset fell short of the echoed text by their length."""
        for token_id, entry in zip(token_ids, entries):
            token = self.tokens(token_id)
            if echo and not token.in_text:
                token = token._replace(in_text=True)
            if token.in_text and self._utf8.getstate()[0] and not _continues(token.data):
                # the bytes left by earlier tokens end there: their U+FFFD comes before this
                # token's text. Regression (review 26f F1): counted after the offset was taken,
                # the token's offset pointed at that U+FFFD ("\ufffdarks" for "arks")
                self._chars += len(self._utf8.decode(b"", final=True))
            self._offsets.append(self._chars)
            if token.in_text:
                self._chars += len(self._utf8.decode(token.data))
            self._ids.append(token_id)
            self._values.append(float(entry[0]))
            self._top_ids.extend(int(entry[i]) for i in range(1, len(entry), 2))
            self._top_values.extend(float(entry[i]) for i in range(2, len(entry), 2))
            self._top_ends.append(len(self._top_ids))

    def __len__(self) -> int:
        """The log probabilities held: each token's and its alternatives'."""
        return len(self._values) + len(self._top_values)

    def pending(self) -> int:
        """Tokens whose entries are not handed out yet."""
        return len(self._ids) - self._taken

    def take(self) -> dict[str, Any] | None:
        """The entries not handed out yet (at most ``LOGPROB_TOKENS_PER_CHUNK`` tokens' when
        ``streamed``), in the endpoint's shape; None when there are none."""
        start = self._taken
        stop = min(len(self._ids), start + LOGPROB_TOKENS_PER_CHUNK) if self.streamed else len(self._ids)
        self._taken = stop
        return self._shape(start, stop) if stop > start else None

    def whole(self) -> dict[str, Any]:
        """Every entry, in the endpoint's shape (empty lists when there were no tokens)."""
        self._taken = len(self._ids)
        return self._shape(0, len(self._ids))

    def _alternatives(self, i: int) -> zip[tuple[int, float]]:
        first = self._top_ends[i - 1] if i else 0
        end = self._top_ends[i]
        return zip(self._top_ids[first:end], self._top_values[first:end])

    def _shape(self, start: int, stop: int) -> dict[str, Any]:
        tokens, span = self.tokens, range(start, stop)
        if self.chat:
            return {"content": [{**_entry(tokens(self._ids[i]), self._values[i]),
                                 "top_logprobs": [_entry(tokens(t), v) for t, v in self._alternatives(i)]}
                                for i in span], "refusal": None}
        texts = [tokens(self._ids[i]).text for i in span]
        top: list[dict[str, float] | None] = []
        for text, i in zip(texts, span):
            if math.isnan(self._values[i]):  # an echoed prompt's first token: none (``prompt_logprobs``)
                top.append(None)
                continue
            alternatives = {text: _floor(self._values[i])}
            for t, v in self._alternatives(i):
                alternatives.setdefault(tokens(t).text, _floor(v))
            top.append(alternatives)
        values = [None if math.isnan(self._values[i]) else _floor(self._values[i]) for i in span]
        return {"tokens": texts, "token_logprobs": values,
                "top_logprobs": top, "text_offset": list(self._offsets[start:stop])}


def _entry(token: Token, logprob: float) -> dict[str, Any]:
    return {"token": token.text, "logprob": _floor(logprob), "bytes": list(token.data)}


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def whole_logprobs(n: int, max_tokens: int, top: int) -> int:
    """The most log probabilities a whole response of ``n`` choices of ``max_tokens`` tokens
    with ``top`` alternatives each may hold."""
    return n * max_tokens * (1 + top)


def check_whole_logprobs(n: int, max_tokens: int, top: int, top_field: str, max_tokens_given: bool) -> None:
    """Refuse a whole response that may hold more than ``MAX_WHOLE_LOGPROBS`` log
    probabilities (``whole_logprobs``).

    Args:
        top_field: the body's field asking for them (``top_logprobs``, a completion's
            ``logprobs``), which the error names.
        max_tokens_given: False: ``max_tokens`` is the most the context leaves (the body
            gave none).

    Raises:
        ValueError: naming ``top_field``, telling the client to stream or ask for less.
    """
    held = whole_logprobs(n, max_tokens, top)
    if held > MAX_WHOLE_LOGPROBS:
        tokens = f"max_tokens {max_tokens}" if max_tokens_given else (
            f"no max_tokens: up to {max_tokens} tokens, what the context leaves")
        raise ValueError(
            f"{top_field}: a non-streamed response may hold at most {MAX_WHOLE_LOGPROBS} log probabilities "
            f"(n x max_tokens x (1 + {top_field})); this one may hold {held} (n {n}, {tokens}, {top_field} "
            f"{top}): stream it (stream: true), or lower max_tokens, n or {top_field}")
