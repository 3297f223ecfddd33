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
at -9999.0 as vLLM's API floors them (JSON has no -inf). A token's text is its id decoded
alone with the served model's tokenizer (``token_text``, as vLLM's
``convert_ids_list_to_tokens``: special tokens included; a token holding part of a character's
bytes decodes to U+FFFD), ``bytes`` that text's UTF-8 bytes, and ``text_offset`` the sum of the
lengths of the texts of the completion's tokens before it. A stream's chunk carries the entries
of the tokens that arrived since the previous chunk (a token whose text is held back, by a stop
string's possible start or an incomplete character, comes with the next text or the finish
chunk); a chunk with none has ``logprobs`` null.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from services.node_request import entry_logprobs

TOKEN_TEXTS_CACHED = 1 << 16
"""Token texts a gateway keeps decoded (``tokenizer_token_text``): a vocabulary's worth for most
models; bounded, since a node's events may name any id up to ``MAX_TOKEN_ID``."""

LOGPROB_FLOOR = -9999.0
"""The least logprob the API reports (vLLM's ``max(logprob, -9999.0)``): -inf is no JSON."""


class Logprobs:
    """One choice's log probabilities, collected from its deltas and handed out in its
    endpoint's shape: all of them (``whole``) or those not handed out yet (``take``).

    Args:
        chat: a chat completion (else a text completion).
        top: the alternatives asked per token (chat's ``top_logprobs``, a completion's
            ``logprobs``).
        token_text: a token id's text (the served tokenizer's decode of that id alone).
    """

    def __init__(self, chat: bool, top: int, token_text: Callable[[int], str]) -> None:
        self.chat, self.top, self.token_text = chat, top, token_text
        self._items: list[Any] = []  # chat: content entries; completion: (token, logprob, top map, offset)
        self._taken = 0
        self._offset = 0

    def add(self, token_ids: list[int], entries: list[list[float | int]]) -> None:
        """A delta's tokens and their entries (one each)."""
        for token_id, entry in zip(token_ids, entries):
            logprob, top = entry_logprobs(entry)
            token = self.token_text(token_id)
            if self.chat:
                self._items.append({**self._token(token, logprob),
                                    "top_logprobs": [self._token(self.token_text(t), v) for t, v in top]})
            else:
                alternatives = {token: _floor(logprob)}
                for t, v in top:
                    alternatives.setdefault(self.token_text(t), _floor(v))
                self._items.append((token, _floor(logprob), alternatives, self._offset))
                self._offset += len(token)

    def take(self) -> dict[str, Any] | None:
        """The entries not handed out yet, in the endpoint's shape; None when there are none."""
        items, self._taken = self._items[self._taken:], len(self._items)
        return self._shape(items) if items else None

    def whole(self) -> dict[str, Any]:
        """Every entry, in the endpoint's shape (empty lists when there were no tokens)."""
        self._taken = len(self._items)
        return self._shape(self._items)

    def _shape(self, items: list[Any]) -> dict[str, Any]:
        if self.chat:
            return {"content": list(items), "refusal": None}
        return {"tokens": [i[0] for i in items], "token_logprobs": [i[1] for i in items],
                "top_logprobs": [i[2] for i in items], "text_offset": [i[3] for i in items]}

    @staticmethod
    def _token(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": _floor(logprob), "bytes": list(token.encode("utf-8", "replace"))}


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_id_text(token_id: int) -> str:
    """A token's text without a tokenizer: ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids`` form)."""
    return f"token_id:{token_id}"


def tokenizer_token_text(tokenizer: Any) -> Callable[[int], str]:
    """A token id's text: ``tokenizer.decode([token_id])`` (special tokens included, as vLLM's
    ``convert_ids_list_to_tokens``; an id past the vocabulary decodes to ""), the last
    ``TOKEN_TEXTS_CACHED`` ids' kept."""
    return functools.lru_cache(maxsize=TOKEN_TEXTS_CACHED)(lambda token_id: tokenizer.decode([token_id]))
