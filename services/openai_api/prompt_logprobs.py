"""A completion's ``echo`` and vLLM's ``prompt_logprobs`` on the OpenAI API, from a request's
prompt logprobs (``SamplingParams.prompt_logprobs``: delta events' ``prompt_logprobs`` entries,
``services.node_request.prompt_logprobs_entry``, checked at the gateway).

- ``prompt_logprobs`` k in [0, 20] (both endpoints, vLLM's extra; not with ``stream``, as
  vLLM refuses it): the response's ``prompt_logprobs`` (a completion's on each choice, a chat's
  on the body, as vLLM's) is one item per prompt token, the first null, each other a map
  token id (a JSON key) -> ``{"logprob", "rank", "decoded_token"}`` of the prompt token and the
  k most probable tokens at its position (k or k + 1 entries: the prompt token may be among
  them), the top ones ranked 1..k.
- ``echo`` (``/v1/completions``): the choice's text is the prompt's (the prompt string as sent,
  or its token ids decoded) followed by the completion's; with ``logprobs`` k, the prompt's
  tokens come first in the choice's ``logprobs`` (the first with a null ``token_logprobs`` and
  ``top_logprobs``, as OpenAI and vLLM), each with the k most probable at its position, and the
  request asks the node for prompt logprobs of at least k. ``max_tokens`` 0 is taken with
  ``echo`` only (vLLM's): the node generates one token, which the response leaves out (the
  prompt alone, ``completion_tokens`` 0, ``finish_reason`` "length").

The values are floored at -9999.0, as every logprob the API reports. A whole response holds
at most ``MAX_WHOLE_LOGPROBS`` log probabilities, counted as ``prompt_values``: 1 + k per prompt
token for each of ``prompt_logprobs`` and an echo's ``logprobs``; so does a streamed echo's
prompt over its ``n`` choices. A completion's prompt counts before it is admitted
(``check_prompt_logprobs``); a chat's rendered prompt when its ``started``
event tells its length, before any prompt entry is read (``PromptExtras.check_prompt``: the
request ends with a 400 naming ``prompt_logprobs`` and is aborted on its node). The entries
that arrive are counted in the same unit (``PromptExtras.feed``), a guard against a node
sending more than its prompt has. Regression (review 28c F3): the up-front check counted 1 + k
per token, the feed the 3 + 2k numbers of each entry, so a completion with 6,097..12,483 prompt
tokens and k 20 ran its whole prefill and was then refused; a chat was checked only then.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from typing import Any

import grpc

from services.openai_api.context import CallAborted
from services.openai_api.logprobs import MAX_WHOLE_LOGPROBS, Logprobs, Token, _floor


def prompt_values(prompt_tokens: int, prompt_k: int | None, echo_k: int | None) -> int:
    """The most log probabilities one choice's prompt adds: 1 + k per prompt token for
    ``prompt_logprobs`` k and for an echo's ``logprobs`` k (None: not asked)."""
    return prompt_tokens * sum(1 + k for k in (prompt_k, echo_k) if k is not None)


def check_prompt_logprobs(n: int, prompt_tokens: int, max_tokens: int, prompt_k: int | None,
                          echo_k: int | None, stream: bool = False) -> None:
    """Refuse a completion whose prompt logprobs (``prompt_logprobs`` and an echoed prompt's
    ``logprobs``) over its ``n`` choices may hold more than ``MAX_WHOLE_LOGPROBS``: a whole
    response's with its tokens' (``max_tokens`` x (1 + ``echo_k``) a choice), a stream's
    without them (its generated tokens' go out as its node makes them, read by its client; its
    prompt's all come from one prefill, and the gateway's event loop takes and encodes every
    choice's). Regression (review s33 F2): a stream was checked only per choice
    (``PromptExtras``), so n 16 echoed 16 x 262,144 values (15 MB, the event loop stalled up to
    4.7 s) where the same body not streamed is refused.

    Raises:
        ValueError: naming ``prompt_logprobs`` (or ``logprobs`` for an echo's), with the
            values it may hold from ``n``, the prompt's tokens and the alternatives asked.
    """
    per_choice = prompt_values(prompt_tokens, prompt_k, echo_k) + (0 if stream else max_tokens * (1 + (echo_k or 0)))
    held = n * per_choice
    if held > MAX_WHOLE_LOGPROBS:
        field = "prompt_logprobs" if prompt_k is not None else "logprobs"
        asked = ", ".join(f"{name} {k}" for name, k in (("prompt_logprobs", prompt_k), ("logprobs", echo_k))
                          if k is not None)
        raise ValueError(f"{field}: a response{', streamed or not,' if stream else ''} may hold at most "
                         f"{MAX_WHOLE_LOGPROBS} log probabilities over its n choices; with the prompt's "
                         f"{prompt_tokens} tokens this one may hold {held} (n {n}, {asked}"
                         f"{'' if stream else f', max_tokens {max_tokens}'}): ask for fewer alternatives or "
                         "choices (n), or send a shorter prompt")


class PromptExtras:
    """One choice's echo and prompt logprobs, fed from its deltas (``Generation.pieces``).

    Args:
        first_token: the prompt's first token id (its echoed logprobs entry, null).
        prompt_k: ``prompt_logprobs`` asked (None: the response has no such field).
        echo: the echoed prompt's text (None: no echo).
        echo_k: with ``echo``, the ``logprobs`` k of the echoed prompt tokens (None: none).
        echo_only: ``max_tokens`` 0: the generated token is left out.
        tokens: a token id's ``Token`` (its ``decoded_token``).
        budget: the most log probabilities the prompt's may add (``MAX_WHOLE_LOGPROBS``).
    """

    def __init__(self, first_token: int, prompt_k: int | None, echo: str | None, echo_k: int | None,
                 echo_only: bool, tokens: Callable[[int], Token], budget: int = MAX_WHOLE_LOGPROBS) -> None:
        self.first_token, self.prompt_k, self.echo, self.echo_k = first_token, prompt_k, echo, echo_k
        self.echo_only, self.tokens, self.budget = echo_only, tokens, budget
        self._flat, self._widths = array("d"), array("i")  # the entries kept for ``prompt_logprobs``
        self._values = 0  # the log probabilities those hold (1 + alternatives kept, per entry)
        self._echoed_values = 0  # those added to an echo's ``Logprobs``
        self._first = True  # the first entry fed is the prompt's second token's
        self.echoed = echo is None

    def __len__(self) -> int:
        """The log probabilities held for ``prompt_logprobs`` (an echo's are its ``Logprobs``')."""
        return self._values

    def check_prompt(self, prompt_tokens: int) -> None:
        """Refuse (a 400 naming ``prompt_logprobs``) a prompt of ``prompt_tokens`` tokens (its
        ``started`` event's) whose log probabilities may pass ``budget`` (``prompt_values``),
        before any of its entries is read: a chat's rendered length is known only then."""
        held = prompt_values(prompt_tokens, self.prompt_k, self.echo_k)
        if held > self.budget:
            raise self._refusal(f"with the prompt's {prompt_tokens} tokens this one may hold {held}")

    def feed(self, entries: list[list[Any]], logprobs: Logprobs | None) -> None:
        """A delta's prompt entries (``[token_id, logprob, rank, id, logprob, ...]``): kept for
        ``prompt_logprobs``, and added to ``logprobs`` for an echo asking for them."""
        if self.echo_k is not None and logprobs is not None:
            before = len(logprobs)
            if self._first:
                logprobs.add([self.first_token], [[math.nan]], echo=True)
            logprobs.add([int(e[0]) for e in entries], [e[1:2] + e[3: 3 + 2 * self.echo_k] for e in entries], echo=True)
            self._echoed_values += len(logprobs) - before
        self._first = False
        if self.prompt_k is not None:
            for entry in entries:
                width = min(len(entry), 3 + 2 * self.prompt_k)
                self._flat.extend(entry[:width])
                self._widths.append(width)
                self._values += 1 + (width - 3) // 2
        if self._values + self._echoed_values > self.budget:  # (a node sending more than its prompt has)
            raise self._refusal("this prompt's exceed it")

    def _refusal(self, why: str) -> CallAborted:
        return CallAborted(grpc.StatusCode.INVALID_ARGUMENT, (
            f"prompt_logprobs: a response may hold at most {self.budget} log probabilities; {why}: ask for fewer "
            "alternatives, or send a shorter prompt"), param="prompt_logprobs")

    def echo_now(self, logprobs: Logprobs | None) -> bool:
        """Whether the echo is due now (once: its prompt's entries are all in, before the first
        token's text); with ``logprobs`` and no prompt entry (a one-token prompt), the first
        token's null entry goes in first."""
        if self.echoed:
            return False
        self.echoed = True
        if self._first and self.echo_k is not None and logprobs is not None:
            logprobs.add([self.first_token], [[math.nan]], echo=True)
            self._first = False
        return True

    def field(self) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: null for the first prompt token, then a map per token."""
        flat, out, start = self._flat.tolist(), [None], 0
        for width in self._widths:
            entry = flat[start: start + width]
            start += width
            token = int(entry[0])
            item = {str(token): self._logprob(token, entry[1], int(entry[2]))}
            for rank, i in enumerate(range(3, width, 2), 1):
                item.setdefault(str(int(entry[i])), self._logprob(int(entry[i]), entry[i + 1], rank))
            out.append(item)
        return out

    def _logprob(self, token: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _floor(logprob), "rank": rank, "decoded_token": self.tokens(token).text}
