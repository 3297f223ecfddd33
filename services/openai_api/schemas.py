"""Request bodies of the OpenAI-compatible API (pydantic), as ``GenerateInput``.

Fields follow OpenAI's API reference for ``POST /v1/chat/completions`` and
``POST /v1/completions``. Any field not declared here is refused with a 400 naming it
(``extra="forbid"``); a few OpenAI fields are declared only so that their no-op value is
accepted (``store`` false, a completion's ``tool_choice`` "none": frameworks send these
defaults, and vLLM accepts them) and any other value is refused naming the field. A chat's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` are served (``services.openai_api.tools``). ``seed`` is any 64-bit integer,
as OpenAI and vLLM take it; a negative one is used as its two's complement (``seed % 2**64``),
so each seed names one stream of samples. ``n`` (OpenAI's choices) is an integer in [1,
``MAX_N``] (16; else a 400 naming it): past 1 the body is served as ``n`` requests with the same
prompt, started all or none, choice ``i`` seeded ``(seed + i) mod 2**64`` when a seed is given
(``choices``); greedy (``temperature`` 0) choices are the same text, as OpenAI's; with a
``session_id`` (one history, one continuation) only 1 is taken (400 naming ``n``).
kvstrata's extension fields ride in the body, as vLLM's extra parameters do: ``session_id``
(append the messages to that session's history, whose KV the node keeps), ``policy`` (the KV
policy override), ``cache_salt`` (partitions the tenant's prefix cache further, and its
sessions: under another salt, or none, a ``session_id`` names another session; a salted one is
closed by ``DELETE /v1/sessions/{id}?cache_salt=``: ``close_session_salt``), ``priority``
(vLLM's: an integer in [-1000, 1000], lower is served earlier, default 0; it reorders only the
caller's own waiting requests on the node,
never ahead of another tenant's), ``prefix_tokens`` (``/v1/completions``) and
``prefix_messages`` (``/v1/chat/completions``): the prompt's leading tokens or messages form
a reusable document prefix, compressed once under a compressing KV policy and reused by later
requests starting with it (bounded by the gateway: 400), and OpenAI's own
``prompt_cache_key`` is a routing hint (same key, same cache node while it has room).
``stop`` strings travel to the node in ``SamplingParams.stop``; the node ends the request at
the token that completes one. OpenAI's ``frequency_penalty`` and ``presence_penalty`` ([-2, 2])
and vLLM's extra sampling parameters ``top_k`` (0 or -1: off), ``min_tokens``,
``repetition_penalty`` ([0.01, 2]), ``min_p`` ([0, 1]) and ``ignore_eos`` go to ``SamplingParams``
as they are. Log probabilities (``services.openai_api.logprobs``): a chat's ``logprobs`` (a
boolean) with ``top_logprobs`` (an integer in [0, 20]; past 0 only with ``logprobs`` true, as
vLLM), a text completion's ``logprobs`` (an integer in [0, 20]: vLLM's bound, past OpenAI's
legacy 5); each is ``SamplingParams.logprobs`` (a completion's ``top_logprobs``, which OpenAI's
completions do not have, is taken as null only). OpenAI's ``logit_bias`` (an object of token ids,
as strings of decimal digits, to biases in [-100, 100]; at most 4,096; any other key is a 400
naming ``logit_bias``) and vLLM's extra ``allowed_token_ids`` (a non-empty list of at most 4,096
ids) go to ``SamplingParams`` (every choice of ``n`` > 1 too); the gateway refuses ids past the
model's vocabulary (400 naming the field). Structured outputs (OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and older ``guided_*`` extras: one constraint a body) become
``SamplingParams.structured_output`` (``services.openai_api.structured``).

A JSON ``null`` for any field that is not required means "not given", as with OpenAI, vLLM
and SGLang: the field takes its default (``max_tokens: null`` on ``/v1/completions`` is 16,
OpenAI's default, not "up to the context limit"); so does ``null`` for an OpenAI field this
server does not serve (``functions``, a completion's ``tools``, ...: any other value of one is refused
naming it). Types are strict: no string is read as a boolean or a number (``"stream": "yes"``
is a 400), nor a number as a boolean, nor a decimal as an integer; a JSON integer is a valid
float (``"temperature": 1``). Errors name their field; ``app`` turns them into 400s with
``param`` set to it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import Field, field_validator

from cache_node.sampling_params import MAX_LOGPROBS
from services import client_ids
from services.chat import content_chars
from services.chat_tools import check_arguments, check_arguments_values
from services.convert import MAX_CHAT_MESSAGES, MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS
from services.gateway import MAX_ID_CHARS, GenerateInput
from services.openai_api.messages import MAX_CONTENT_PARTS, ChatMessage, TextPart  # noqa: F401 - re-exported
from services.openai_api.prompt_logprobs import check_prompt_logprobs
from services.openai_api.sampling_fields import (  # noqa: F401 - MAX_N, StreamOptions re-exported
    MAX_N,
    NO_OP_VALUES,
    SamplingFields,
    StreamOptions,
)
from services.openai_api.strict import bounded_list
from services.openai_api.tools import Tool, ToolFields, check_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``/v1/completions``' ``max_tokens`` when none is given (OpenAI's default)."""


class ChatCompletionRequest(ToolFields, SamplingFields):
    """``POST /v1/chat/completions``; tool calling: ``ToolFields``."""

    messages: bounded_list(ChatMessage, MAX_CHAT_MESSAGES)  # type: ignore[valid-type]
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    prefix_messages: int = 0  # kvstrata: bounded by the gateway (400)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = {
        k: v for k, v in NO_OP_VALUES.items() if k not in ("tool_choice", "parallel_tool_calls")}

    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_input(self) -> GenerateInput:
        """Raises ValueError: no message, every message empty, too much text, or an
        unsupported field."""
        if not self.messages:
            raise ValueError("messages: must hold at least one message")
        self.tool_mode()  # a tool_choice without tools, or naming none of them: 400
        messages = template_messages(self.messages, self.tools)
        if not any(m["content"].strip() for m in messages):
            raise ValueError("messages: every message is empty; the prompt needs some text")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens: give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:  # (0 without it is accepted, as vLLM's)
            raise ValueError(f"top_logprobs: needs logprobs true (got top_logprobs {self.top_logprobs} "
                             "with logprobs false)")
        return self.generate_input(messages, self.max_completion_tokens or self.max_tokens,
                                   prefix_messages=self.prefix_messages)


def template_messages(messages: list[ChatMessage], tools: list[Tool] | None) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them (``ChatMessage.as_dict``), bounded as a
    chat's prompt: at most ``MAX_PROMPT_CHARS`` characters with their names, tool call ids,
    the history's tool calls and ``tools`` as JSON. The one conversion of a chat completion's
    messages and of ``/tokenize``'s (``services.openai_api.tokenize``), so both render the same.

    Before any message is converted (whose ``as_dict`` parses each call's ``arguments``,
    ``chat_tools.template_call``), the work is bounded on the pydantic models: the characters
    as sent (``ChatMessage.chars``, the calls' arguments as given), then the calls' arguments'
    JSON values together, counted on their text (``chat_tools.check_arguments_values``,
    ``MAX_ARGUMENTS_VALUES``), then each call's arguments for a lone surrogate (a parse, within
    that bound: ``chat_tools.check_arguments``). Regression (review s33 F1): the messages were
    converted first, so an 8 MiB body whose one call's arguments text held 2.6M empty lists
    (the body's shape check sees one string) was parsed whole before its 1 Mi-character bound
    refused it, stalling the gateway's event loop 2-3.5 s (``/tokenize`` too); and the
    surrogate check parsed each call in the model's validator, before the request's bound.

    Then the converted messages' characters are counted as the template takes them
    (``chat.content_chars``: the arguments as compact JSON, as the gRPC API counts them): a
    number written ``1E15`` renders as 18 characters. Regression (diff review s33, of review
    30j F4): only the count as sent was kept, and a body under the bound rendered past it.

    Raises ValueError naming ``messages``: none, or too many characters; or naming the call
    (``messages.N.tool_calls.J.function.arguments``) at which the arguments pass their bound
    or that holds a lone surrogate."""
    if not messages:
        raise ValueError("messages: must hold at least one message")
    tools_chars = check_tools(tools) if tools else 0
    # names, tool call ids and the history's tool calls too; the tools the template renders
    chars = sum(m.chars() for m in messages) + tools_chars
    if chars > MAX_PROMPT_CHARS:
        raise ValueError(f"messages: hold {chars} characters{' with the tools' if tools else ''}; at most "
                         f"{MAX_PROMPT_CHARS} are allowed")
    calls = [(f"messages.{i}.tool_calls.{j}.function.arguments", call.function.arguments)
             for i, m in enumerate(messages) for j, call in enumerate(m.tool_calls or ())]
    check_arguments_values(calls)
    for where, arguments in calls:
        check_arguments(f"{where}:", arguments)  # (``<field path>: ...``: the 400 names it)
    dicts = [m.as_dict() for m in messages]
    chars = content_chars(dicts) + tools_chars
    if chars > MAX_PROMPT_CHARS:
        raise ValueError(f"messages: hold {chars} characters{' with the tools' if tools else ''} as the chat "
                         f"template takes them; at most {MAX_PROMPT_CHARS} are allowed")
    return dicts


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one is accepted)."""

    prompt: (str | bounded_list(int, MAX_PROMPT_TOKEN_IDS)  # type: ignore[valid-type]
             | bounded_list(str) | bounded_list(bounded_list(int, MAX_PROMPT_TOKEN_IDS)))  # type: ignore[valid-type]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)  # 0: with echo only
    echo: bool = False  # the prompt's text (and logprobs) first (``openai_api.prompt_logprobs``)
    best_of: int = 1
    suffix: str | None = None
    prefix_tokens: int = 0  # kvstrata: of the prompt's tokens; gateway-bounded (400)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's bound (OpenAI's legacy one is 5)

    _unserved = SamplingFields._unserved | {"top_logprobs", "tools"}  # a chat's fields: null only
    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = {k: v for k, v in NO_OP_VALUES.items() if k != "echo"}

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def asked_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, and at least ``logprobs`` for an echoed prompt's tokens (vLLM's)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A list of prompts, or of more token ids than allowed, is refused before any of it is
        validated (each element costs)."""
        if isinstance(value, list) and len(value) > 1 and isinstance(value[0], (str, list)):
            raise ValueError(f"only one prompt per request is supported, got {len(value)}")
        if isinstance(value, list) and len(value) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"holds {len(value)} tokens; at most {MAX_PROMPT_TOKEN_IDS} are allowed")
        return value

    def to_input(self, encode: Any) -> GenerateInput:
        """``encode``: text -> token ids (the model's tokenizer, no special tokens added).

        Raises ValueError: an empty prompt, more than one prompt, or too long a prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"prompt: only one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt: holds {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are allowed")
            prompt = encode(prompt)
        if not prompt:
            raise ValueError("prompt: must not be empty")
        if len(prompt) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"prompt: holds {len(prompt)} tokens; at most {MAX_PROMPT_TOKEN_IDS} are allowed")
        if any(t < 0 for t in prompt):
            raise ValueError("prompt: token ids must be non-negative")
        max_tokens = self.max_tokens
        if max_tokens == 0:  # (vLLM's: the node generates one token, left out of the response)
            if not self.echo:
                raise ValueError("max_tokens: must be > 0, or 0 with echo true (the prompt alone), got 0")
            max_tokens = 1
        # across n, streamed too (a stream's prompt part: review s33 F2)
        if self.prompt_logprobs is not None or (self.echo and self.logprobs is not None):
            check_prompt_logprobs(self.n, len(prompt), max_tokens or 1, self.prompt_logprobs,
                                  self.logprobs if self.echo else None, stream=self.stream)
        return self.generate_input(list(prompt), max_tokens, prefix_tokens=self.prefix_tokens)


CLOSE_SESSION_PARAMS = ("cache_salt",)
"""The query parameters ``DELETE /v1/sessions/{session_id}`` takes."""


def close_session_salt(query: Sequence[tuple[str, str]]) -> str:
    """The ``cache_salt`` the session to close was opened under ("" = none), from the
    ``(name, value)`` pairs of ``DELETE /v1/sessions/{session_id}``'s query string
    (``?cache_salt=...``, URL-encoded): a session is one (``session_id``, ``cache_salt``) of its
    tenant (``gateway_inputs.session_scope``), so the close names the salt its turns were sent
    with, as the body of each turn did. A parameter it does not take is refused, as a body's
    unknown field is: a misspelt ``cache_salt`` would otherwise close the session opened without
    a salt.

    Raises:
        ValueError: worded ``<name>: ...``: a parameter other than ``cache_salt``, ``cache_salt``
            given twice, over ``MAX_ID_CHARS`` characters or holding a character
            ``services.client_ids`` refuses.
    """
    salt: str | None = None
    for name, value in query:
        if name not in CLOSE_SESSION_PARAMS:  # (a name as the client sent it, when it reads as one)
            shown = name if re.fullmatch(r"[A-Za-z0-9_.]{1,64}", name) else f"query parameter {name[:64]!r}"
            raise ValueError(f"{shown}: unsupported query parameter (DELETE /v1/sessions/{{session_id}} takes "
                             f"only {', '.join(CLOSE_SESSION_PARAMS)})")
        if salt is not None:
            raise ValueError(f"{name}: given more than once")
        if len(value) > MAX_ID_CHARS:
            raise ValueError(f"{name}: is longer than {MAX_ID_CHARS} characters")
        client_ids.check(name, value)
        salt = value
    return salt or ""
