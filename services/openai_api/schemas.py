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
policy override), ``cache_salt`` (partitions the tenant's prefix cache further), ``priority``
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

import json
import re
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_REQUEST_TEMPERATURE,
    MAX_SAMPLING_TOKEN_ID,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from services.chat import content_chars
from services.convert import (
    MAX_CHAT_MESSAGES,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    chat_message,
    check_policy_spec,
)
from services.gateway import MAX_ID_CHARS, GenerateInput
from services.openai_api.prompt_logprobs import check_prompt_logprobs
from services.openai_api.strict import Strict, bounded_list, json_brief, json_text, same_json
from services.openai_api.structured import StructuredFields
from services.openai_api.tools import MAX_TOOL_CALLS, ToolCall, ToolFields, check_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``/v1/completions``' ``max_tokens`` when none is given (OpenAI's default)."""

MAX_N = 16
"""Most choices (``n``) one body may ask for (OpenAI takes up to 128, vLLM any number): each is
a request of its own (``choices``), with its own slot on a node and its own stream in the
tenant's ``max_streams_per_tenant``."""

_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": (), "parallel_tool_calls": (),
    "tool_choice": ("none",), "store": (False,),
}
"""OpenAI fields accepted at these values only (what the request gets anyway), and at null."""

_TOKEN_ID_KEY = re.compile(r"[0-9]+")
"""A ``logit_bias`` key: a token id in decimal ASCII digits (``int()`` would also take signs,
spaces, underscores and other scripts' digits); its range is ``SamplingParams``' and the
gateway's (the vocabulary)."""

MAX_CONTENT_PARTS = 1024
"""Most ``{"type": "text"}`` parts in one message's content."""


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    """One message; ``developer`` is OpenAI's newer name for ``system``. ``name`` (any role)
    and a tool message's ``tool_call_id`` (the call it answers) reach the chat template as
    given; so do an assistant's ``tool_calls`` (``services.openai_api.tools``: its ``content``
    may then be null, taken as ""). The deprecated ``function_call`` is refused naming it."""

    _unserved = frozenset({"refusal", "audio"})

    # declared first, so that its refusal is the one reported, whatever else is wrong with the
    # message (such a message usually has ``content`` null)
    function_call: Any = None
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: bounded_list(ToolCall, MAX_TOOL_CALLS) | None = None  # type: ignore[valid-type]  # after role
    content: str | bounded_list(TextPart, MAX_CONTENT_PARTS)  # type: ignore[valid-type]
    name: str | None = Field(None, max_length=MAX_MESSAGE_ID_CHARS)
    tool_call_id: str | None = Field(None, max_length=MAX_MESSAGE_ID_CHARS)

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data: Any) -> Any:
        """An assistant message with tool calls may have ``content`` null or left out ("")."""
        if isinstance(data, dict) and data.get("content") is None and data.get("tool_calls"):
            return {**data, "content": ""}
        return data

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value is not None:  # (null is dropped before: not given)
            raise ValueError("the deprecated function_call is not served; send the call in tool_calls")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        role = info.data.get("role")
        if value is not None and role not in (None, "assistant"):
            raise ValueError(f"applies to assistant messages, not to role {role!r}")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _on_tool_messages_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")  # (declared before: absent when it was bad)
        if value is not None and role not in (None, "tool"):  # as the gRPC API's check_message_ids
            raise ValueError(f"applies to tool messages (role \"tool\"), not to role {role!r}")
        return value

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (``convert.chat_message``: ``name`` and
        ``tool_call_id`` when given, as vLLM passes them): a list of text parts is their texts
        joined with "\n", as vLLM joins them (``vllm.entrypoints.chat_utils``,
        ``_parse_chat_message_content_parts``: ``"\n".join(texts)``).

        Regression (oairev20 O1): parts were joined with nothing, so words at part boundaries
        merged ("Hello" + "World" reached the model as "HelloWorld"): another prompt, other
        tokens and other prefix-cache keys than on vLLM.

        Regression (review 25b N3): ``tool_call_id`` was an unsupported field (400) and
        ``name`` was dropped."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message: dict[str, Any] = chat_message(self.role, content, self.name or "", self.tool_call_id or "")
        if self.tool_calls:
            message["tool_calls"] = [call.as_template() for call in self.tool_calls]
        return message

    def call_chars(self) -> int:
        """Characters of the message's tool calls (ids, names, arguments)."""
        return sum(call.chars() for call in self.tool_calls or ())


class _Sampling(StructuredFields):
    """Fields both endpoints share: sampling, streaming, structured outputs (declared by
    ``StructuredFields``), and kvstrata's extensions."""

    _unserved = frozenset({
        "functions", "function_call", "service_tier",
        "metadata", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
    })

    model: str = Field(min_length=1)
    # allow_inf_nan=False: NaN is refused as "not a finite number" (review 24h M1: the refusal
    # said "less than or equal to 2"); the bound is gRPC's too (MAX_REQUEST_TEMPERATURE)
    temperature: float = Field(1.0, ge=0.0, le=MAX_REQUEST_TEMPERATURE, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | bounded_list(str) | None = None  # type: ignore[valid-type]
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # negative: as seed % 2**64
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; not used
    n: int = 1  # in [1, MAX_N]; more than 1: ``choices``
    # OpenAI's penalties, and vLLM's extra sampling parameters as vLLM names them (review 25b N4)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # 0 or -1: off
    min_tokens: int = Field(0, ge=0)  # at most max_tokens (SamplingParams)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                      allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM's
    logit_bias: dict[int, float] | None = None  # OpenAI's: {"<token id>": bias}, checked by _biases
    allowed_token_ids: bounded_list(int) | None = None  # type: ignore[valid-type]  # vLLM's
    ignore_eos: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's (``openai_api.prompt_logprobs``)
    tool_choice: Any = None
    store: Any = None
    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = _NO_OP_VALUES
    # kvstrata extensions
    session_id: str = Field("", max_length=MAX_ID_CHARS)
    policy: str = Field("", max_length=63)  # the policy spec pattern (secrev19 H2)
    cache_salt: str = Field("", max_length=MAX_ID_CHARS)
    prompt_cache_key: str = Field("", max_length=MAX_ID_CHARS)
    priority: int = 0  # bounded by the gateway (INVALID_ARGUMENT: 400)

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_N:
            raise ValueError(f"must be an integer in [1, {MAX_N}], got {value}")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _biases(cls, value: Any) -> Any:
        """OpenAI's object of token ids (JSON keys: strings of decimal digits) to biases in
        [-100, 100], at most ``MAX_LOGIT_BIAS_TOKENS`` of them, counted before any is read."""
        if not isinstance(value, dict):
            # a ValueError, as pydantic reports a validator's (a TypeError is not caught)
            raise ValueError(f"must be an object mapping token ids to biases, got {json_brief(value)}")  # noqa: TRY004
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"holds {len(value)} token ids; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
        biases = {}
        for key, bias in value.items():
            if not isinstance(key, str) or _TOKEN_ID_KEY.fullmatch(key) is None:
                raise ValueError(f"keys must be token ids (non-negative integers, as strings), got {json_text(key)}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got "
                                 f"{json_brief(bias)} for token id {key}")  # (NaN and infinities fail the range)
            if len(key) > 10 or int(key) > MAX_SAMPLING_TOKEN_ID:
                raise ValueError(f"token id {key:.20} is past the largest token id, {MAX_SAMPLING_TOKEN_ID}")
            biases[int(key)] = float(bias)
        return biases

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _allowed(cls, value: Any) -> Any:
        """vLLM's: a non-empty list of at most ``MAX_ALLOWED_TOKEN_IDS`` ids, counted before any is
        read (each must be a non-negative integer)."""
        if isinstance(value, list) and not value:
            raise ValueError("must hold at least one token id (leave it out to allow every token)")
        if isinstance(value, list) and len(value) > MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"holds {len(value)} token ids; at most {MAX_ALLOWED_TOKEN_IDS} are allowed")
        if isinstance(value, list) and any(isinstance(t, int) and not isinstance(t, bool)
                                           and not 0 <= t <= MAX_SAMPLING_TOKEN_ID for t in value):
            raise ValueError(f"token ids must be integers in [0, {MAX_SAMPLING_TOKEN_ID}]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stops(cls, value: Any) -> Any:
        """Too many stop strings are refused before any is validated."""
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def asked_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: the alternatives asked per token, None for none."""
        return None

    def asked_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: the alternatives asked per prompt token (None: none)."""
        return self.prompt_logprobs

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Raise ValueError naming the first field set to a value this server cannot honour,
        or a KV ``policy`` no cache node would build (the gateway checks it again, with the
        tenant's allowed policies)."""
        for name, accepted in self._no_op.items():
            value = getattr(self, name, None)
            if value is None or any(same_json(value, a) for a in accepted):
                continue
            send = " or ".join([json.dumps(a) for a in accepted] + ["null"])
            what = "not supported" if all(a is False for a in accepted) else f"only {json_text(accepted[0])} is supported"
            raise ValueError(f"{name}: {what} (send {send}, or leave it out), got {json_brief(value)}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:  # (vLLM's refusal too)
            raise ValueError("prompt_logprobs: not available with stream true; send stream false, or leave it out")
        if self.n > 1 and self.session_id:
            raise ValueError(f"n: must be 1 with a session_id (a session keeps one history, which one choice "
                             f"continues), got {self.n}")
        try:
            check_policy_spec(self.policy)
        except ValueError as exc:
            raise ValueError(f"policy: {exc}") from None

    def generate_input(self, prompt: list[dict[str, str]] | list[int], max_tokens: int | None,
                       prefix_tokens: int = 0, prefix_messages: int = 0) -> GenerateInput:
        """This body as the gateway's ``GenerateInput`` (``max_tokens`` None: up to the
        context limit). Raises ValueError naming the field."""
        self.check_supported()
        # without max_tokens the gateway sizes it (at least min_tokens: else the size check refuses)
        sampling = SamplingParams(max_tokens=max_tokens or max(1, self.min_tokens), temperature=self.temperature,
                                  top_p=self.top_p, seed=None if self.seed is None else self.seed % (1 << 64),
                                  stop=self.stop_strings(), top_k=self.top_k, min_tokens=self.min_tokens,
                                  presence_penalty=self.presence_penalty,
                                  frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
                                  logprobs=self.asked_logprobs(), min_p=self.min_p,
                                  logit_bias=tuple((self.logit_bias or {}).items()), allowed_token_ids=self.allowed_token_ids,
                                  structured_output=self.structured_output(),
                                  prompt_logprobs=self.asked_prompt_logprobs())
        return GenerateInput(prompt=prompt, sampling=sampling, session_id=self.session_id, policy=self.policy,
                             cache_salt=self.cache_salt, routing_key=self.prompt_cache_key,
                             fill_context=max_tokens is None, priority=self.priority,
                             prefix_tokens=prefix_tokens, prefix_messages=prefix_messages,
                             tools=self.template_tools())

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (None: none)."""
        return None


class ChatCompletionRequest(ToolFields, _Sampling):
    """``POST /v1/chat/completions``; tool calling: ``ToolFields``."""

    messages: bounded_list(ChatMessage, MAX_CHAT_MESSAGES)  # type: ignore[valid-type]
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    prefix_messages: int = 0  # kvstrata: bounded by the gateway (400)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = {
        k: v for k, v in _NO_OP_VALUES.items() if k not in ("tool_choice", "parallel_tool_calls")}

    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _check_tool_turn(self) -> None:
        """Tools and tool calls render on the gateway with the whole conversation: not in a
        session's turn (the node renders it from its kept text messages) nor with a
        ``prefix_messages`` prefix (rendered without them). Raises ValueError naming the field."""
        calls = next((i for i, m in enumerate(self.messages) if m.tool_calls), None)
        if not self.tools and calls is None:
            return
        what = "tools" if self.tools else f"messages.{calls}.tool_calls"
        if self.session_id:
            raise ValueError(f"{what}: not served with a session_id (a session keeps its history as text "
                             "messages on its node); send the whole conversation without one")
        if self.prefix_messages:
            raise ValueError(f"prefix_messages: not served with {what} (a document prefix renders without them)")

    def to_input(self) -> GenerateInput:
        """Raises ValueError: no message, every message empty, too much text, or an
        unsupported field."""
        if not self.messages:
            raise ValueError("messages: must hold at least one message")
        self.tool_mode()  # a tool_choice without tools, or naming none of them: 400
        self._check_tool_turn()
        messages = [m.as_dict() for m in self.messages]
        # names and tool call ids too; the history's tool calls and the tools the template renders
        chars = content_chars(messages) + sum(m.call_chars() for m in self.messages) + (
            check_tools(self.tools) if self.tools else 0)
        if chars > MAX_PROMPT_CHARS:
            raise ValueError(f"messages: hold {chars} characters{' with the tools' if self.tools else ''}; at most "
                             f"{MAX_PROMPT_CHARS} are allowed")
        if not any(m["content"].strip() for m in messages):
            raise ValueError("messages: every message is empty; the prompt needs some text")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_tokens: give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs and not self.logprobs:  # (0 without it is accepted, as vLLM's)
            raise ValueError(f"top_logprobs: needs logprobs true (got top_logprobs {self.top_logprobs} "
                             "with logprobs false)")
        return self.generate_input(messages, self.max_completion_tokens or self.max_tokens,
                                   prefix_messages=self.prefix_messages)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one is accepted)."""

    prompt: (str | bounded_list(int, MAX_PROMPT_TOKEN_IDS)  # type: ignore[valid-type]
             | bounded_list(str) | bounded_list(bounded_list(int, MAX_PROMPT_TOKEN_IDS)))  # type: ignore[valid-type]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)  # 0: with echo only
    echo: bool = False  # the prompt's text (and logprobs) first (``openai_api.prompt_logprobs``)
    best_of: int = 1
    suffix: str | None = None
    prefix_tokens: int = 0  # kvstrata: of the prompt's tokens; gateway-bounded (400)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's bound (OpenAI's legacy one is 5)

    _unserved = _Sampling._unserved | {"top_logprobs", "tools"}  # a chat's fields: null only
    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = {k: v for k, v in _NO_OP_VALUES.items() if k != "echo"}

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
        if not self.stream and (self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)):
            check_prompt_logprobs(self.n, len(prompt), max_tokens or 1, self.prompt_logprobs,
                                  self.logprobs if self.echo else None)
        return self.generate_input(list(prompt), max_tokens, prefix_tokens=self.prefix_tokens)
