"""The fields both endpoints of the OpenAI-compatible API share (``SamplingFields``):
sampling, streaming, structured outputs, prompt logprobs and kvstrata's extensions; what each
means and its bounds: ``services.openai_api.schemas``' module docstring."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from pydantic import Field, field_validator

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
from services import client_ids
from services.convert import check_policy_spec
from services.gateway import MAX_ID_CHARS, GenerateInput
from services.openai_api.stream_shape import StreamShape
from services.openai_api.strict import Strict, bounded_list, json_brief, json_text, same_json
from services.openai_api.structured import StructuredFields

MAX_N = 16
"""Most choices (``n``) one body may ask for (OpenAI takes up to 128, vLLM any number): each is
a request of its own (``choices``), with its own slot on a node and its own stream in the
tenant's ``max_streams_per_tenant``."""

NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "suffix": (), "parallel_tool_calls": (),
    "tool_choice": ("none",), "store": (False,),
}
"""OpenAI fields accepted at these values only (what the request gets anyway), and at null."""

_TOKEN_ID_KEY = re.compile(r"[0-9]+")
"""A ``logit_bias`` key: a token id in decimal ASCII digits (``int()`` would also take signs,
spaces, underscores and other scripts' digits); its range is ``SamplingParams``' and the
gateway's (the vocabulary)."""

class StreamOptions(Strict):
    """OpenAI's ``stream_options`` (and vLLM's ``continuous_usage_stats``): what a stream's
    chunks carry besides their choices (``stream_shape.StreamShape``)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk, with include_usage
    include_obfuscation: bool = True  # OpenAI's (and its default): chunk events padded


class SamplingFields(StructuredFields):
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
    # an end-user id for the caller's own records; not used, kept or logged, so any text, as
    # OpenAI takes it (diff review s40 r5 of 57d8f6a: a user with a tab or an RLM was a 400)
    user: str | None = None
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
    _no_op: ClassVar[dict[str, tuple[Any, ...]]] = NO_OP_VALUES
    # kvstrata extensions
    session_id: str = Field("", max_length=MAX_ID_CHARS)
    policy: str = Field("", max_length=63)  # the policy spec pattern (secrev19 H2)
    cache_salt: str = Field("", max_length=MAX_ID_CHARS)
    prompt_cache_key: str = Field("", max_length=MAX_ID_CHARS)
    priority: int = 0  # bounded by the gateway (INVALID_ARGUMENT: 400)

    @field_validator("session_id", "cache_salt", "prompt_cache_key")  # (not ``user``: see its line)
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        """The ids, salt and key a client names things by hold no control, line break or
        bidirectional formatting character (``services.client_ids``: 400 naming the field)."""
        why = client_ids.refusal(value) if value else None
        if why is not None:
            raise ValueError(why)
        return value

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

    def stream_shape(self) -> StreamShape:
        """What this body's streamed chunks carry (``stream_options``; obfuscated when it is
        left out, as at OpenAI; continuous usage only with ``include_usage``, as at vLLM)."""
        options = self.stream_options or StreamOptions()
        return StreamShape(usage=options.include_usage,
                           continuous_usage=options.include_usage and options.continuous_usage_stats,
                           obfuscate=options.include_obfuscation)

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


