"""Per-request decoding parameters (validated at construction)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cache_node.structured_output import StructuredOutputSpec

GREEDY_BELOW = 1e-5
"""Temperatures under this decode greedily (vLLM's ``_SAMPLING_EPS``)."""

MAX_SEED = 2**64 - 1
"""Largest ``seed`` (a torch generator's seed is an unsigned 64-bit integer)."""

MAX_REQUEST_TEMPERATURE = 2.0
"""Largest ``temperature`` a client's request may ask, on both front ends (OpenAI's range is
[0, 2]; ``services.convert`` and ``services.openai_api.schemas`` check it). Internal callers may
go up to 100 (``SamplingParams``). Regression (review 24h M1): gRPC took up to 100 while HTTP
refused over 2."""

MAX_STOP_TOKEN_IDS = 64
"""Most ``stop_token_ids`` one request may name (each is checked on every decode step)."""

MAX_STOP_STRINGS = 4
"""Most ``stop`` strings one request may give (OpenAI's limit)."""

MAX_STOP_STRING_CHARS = 256
"""Longest ``stop`` string (the node searches the text it holds back for each, every step)."""

MAX_PENALTY = 2.0
"""``presence_penalty`` and ``frequency_penalty`` lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's
and vLLM's range)."""

MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
"""``repetition_penalty`` lies in [0.01, 2]. vLLM asks only > 0, but a penalty that is 0 in
float32 (e.g. 1e-50) divides a positive logit to inf, whose softmax is NaN (a failed draw);
values past 2 are not used in practice (CTRL's paper suggests 1.2)."""

MAX_TOP_K = 2**31 - 1
"""Largest ``top_k`` (an int32 on the wire); a ``top_k`` over the vocabulary keeps every token
(the sampler clamps it, as vLLM does)."""

MAX_LOGPROBS = 20
"""Most alternatives ``logprobs`` may ask for per token (OpenAI's ``top_logprobs`` maximum,
vLLM's default ``max_logprobs``)."""

MAX_LOGIT_BIAS = 100.0
"""A ``logit_bias`` value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's documented range;
-100 in effect bans a token, +100 makes it the only one drawn)."""

MAX_LOGIT_BIAS_TOKENS = 4096
"""Most token ids one request's ``logit_bias`` may name. The sampler pays per entry on every
step of the request (one scatter into its logits row), so the count is bounded; 4,096 covers
banning or favouring every spelling of hundreds of words."""

MAX_ALLOWED_TOKEN_IDS = 4096
"""Most ids one request's ``allowed_token_ids`` may list (duplicates counted), for the same
reason: each step scatters them into the request's mask row."""

MAX_SAMPLING_TOKEN_ID = (1 << 31) - 1
"""Largest token id ``logit_bias`` and ``allowed_token_ids`` may name here (an int32, as on
the data plane); the engine refuses ids past its vocabulary."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    Attributes:
        max_tokens: most new tokens to generate (> 0).
        temperature: 0 (or under ``GREEDY_BELOW``) means greedy; otherwise logits are
            divided by it (>= 0, <= 100).
        top_p: nucleus mass kept when sampling, in (0, 1].
        seed: per-request RNG seed for sampling, in [0, 2^64 - 1]; None draws from the
            engine RNG.
        stop_token_ids: extra token ids that end the request (the model's EOS always does
            unless ``ignore_eos``); non-negative, at most ``MAX_STOP_TOKEN_IDS``.
        ignore_eos: keep generating past EOS (benchmarks).
        stop: stop strings (OpenAI's ``stop``): the cache node, which detokenizes, ends the
            request at the token whose text completes one, with finish_reason "stop", and
            sends the text only up to it (``cache_node.stop_strings.StopMatcher``); at most
            ``MAX_STOP_STRINGS``, each 1 to ``MAX_STOP_STRING_CHARS`` characters.
        top_k: keep only the ``top_k`` most probable tokens when sampling (0 = all; vLLM's -1
            is taken and stored as 0); in [0, ``MAX_TOP_K``].
        min_tokens: generate at least this many tokens before the model's EOS (unless
            ``ignore_eos``) or a ``stop_token_ids`` token may be drawn: their logits are -inf
            until then (vLLM's ``min_tokens``; the cache node does not look for stop strings
            in the text of these first tokens either, as vLLM's detokenizer:
            ``services.cache_node_streams``, ``StopMatcher.feed``); in
            [0, ``max_tokens``].
        presence_penalty: OpenAI's: subtracted once from the logit of every token the
            request generated so far; in [-2, 2].
        frequency_penalty: OpenAI's: subtracted from a token's logit once per time the
            request generated it; in [-2, 2].
        repetition_penalty: CTRL's (Keskar et al. 2019), as vLLM and transformers apply it:
            the logit of every token in the prompt or the output is divided by it when
            positive, multiplied when negative; 1 = off; in [0.01, 2].
        logprobs: None = off; k in [0, ``MAX_LOGPROBS``]: each generated token comes with its
            own log probability and the k most probable tokens' (``TokenLogprobs``). They are
            those of the model's raw distribution, log_softmax of its logits before penalties,
            temperature and any filter (vLLM V1's default ``logprobs_mode="raw_logprobs"``),
            whatever the token was drawn with.
        prompt_logprobs: vLLM's: None = off; k in [0, ``MAX_LOGPROBS``]: each prompt token after
            the first (which has none) comes with its own log probability, its rank and the k
            most probable tokens' at its position (``PromptLogprob``), the log_softmax of the
            logits of the position before it. Computing them needs every prompt position's
            logits, so such a request reads no prefix cache and continues no session's KV: it
            computes its whole prompt (``cache_node.prompt_logprobs``).
        min_p: vLLM's: when sampling, tokens whose probability (after temperature) is under
            ``min_p`` times the most probable token's are dropped; 0 = off; in [0, 1]. It does
            not change a greedy request's token.

        logit_bias: OpenAI's: (token id, bias) pairs, added to those tokens' logits before
            anything else but ``allowed_token_ids`` (greedy requests too); each bias a finite
            number in [-100, 100], ids in [0, 2^31) (the engine: in its vocabulary), at most
            ``MAX_LOGIT_BIAS_TOKENS``, none twice. Given as a mapping id -> bias (or pairs);
            kept as pairs sorted by id. Empty: off.
        allowed_token_ids: vLLM's: None = off; else only these token ids may be generated
            (every other logit is -inf, greedy requests too); non-empty, ids in [0, 2^31) (the
            engine: in its vocabulary), at most ``MAX_ALLOWED_TOKEN_IDS``; kept sorted and
            unique. The model's EOS stops the request only when it is allowed.

        The order is vLLM V1's (``cache_node.sampler``): ``allowed_token_ids``, then
        ``logit_bias`` and the ``min_tokens`` mask, then the penalties (all of these apply to
        greedy requests too); then temperature, min-p, top-k and top-p. Log probabilities are
        taken before all of them.

        structured_output: None = off; else what the output must match (a JSON object or
            schema, a regex, a choice, an EBNF grammar: ``StructuredOutputSpec``). The engine
            compiles it before the request is scheduled and masks each step's logits to the
            tokens it allows, before everything else (vLLM V1's order: ``cache_node.grammar_mask``);
            the request ends "stop" when the grammar is complete and allows no more text.

    Raises:
        ValueError: any field out of range, with the field name in the message.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    top_k: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    structured_output: StructuredOutputSpec | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2^64 - 1], got {self.seed!r}")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(stop)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        self._check_extras()

    def _check_extras(self) -> None:
        """top_k, min_tokens, the penalties, logprobs, min_p, logit_bias and allowed_token_ids
        (vLLM's and OpenAI's ranges)."""
        top_k = self.top_k
        if not _is_int(top_k) or not -1 <= top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 or -1 = off), got {top_k!r}")
        object.__setattr__(self, "top_k", max(int(top_k), 0))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
            object.__setattr__(self, name, value)
        value = _number("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= value <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got {value!r}"
            )
        object.__setattr__(self, "repetition_penalty", value)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (unset or null: off), got {self.logprobs!r}")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (unset or null: off), got {k!r}")
        min_p = _number("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _allowed_token_ids(self.allowed_token_ids))
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise ValueError(f"structured_output must be a StructuredOutputSpec or None, got "
                             f"{type(self.structured_output).__name__}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raise ValueError naming ``logit_bias`` or ``allowed_token_ids`` when either names a
        token id past a vocabulary of ``vocab_size`` tokens (the engine's check, and the
        gateway's with its nodes' vocabulary)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("allowed_token_ids",
                                                                             self.allowed_token_ids or ())):
            if ids and max(ids) >= vocab_size:
                raise ValueError(f"{name}: token id {max(ids)} is outside the model's vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        """Temperatures under ``GREEDY_BELOW`` decode greedily, as vLLM's do: dividing the
        logits by them overflows float32 to inf, whose softmax is NaN (regression: a request
        with temperature 1e-300 raised inside the step)."""
        return self.temperature < GREEDY_BELOW


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(name: str, value: object) -> float:
    """``value`` as a finite float; ValueError naming ``name`` otherwise (NaN, inf, bool, str)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _token_id(name: str, value: object) -> int:
    """``value`` as a token id in [0, ``MAX_SAMPLING_TOKEN_ID``]; ValueError naming ``name``."""
    if not _is_int(value) or not 0 <= value <= MAX_SAMPLING_TOKEN_ID:  # type: ignore[operator]
        raise ValueError(f"{name} must hold token ids in [0, {MAX_SAMPLING_TOKEN_ID}] (integers), got {value!r:.40}")
    return int(value)  # type: ignore[call-overload]


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``value`` (a mapping id -> bias, or a list of (id, bias) pairs) as pairs sorted by id.
    Raises ValueError naming ``logit_bias``: too many entries, an id twice, a bad id or bias."""
    if isinstance(value, Mapping):
        items: list[Any] | tuple[Any, ...] = list(value.items()) if len(value) <= MAX_LOGIT_BIAS_TOKENS else ()
        count = len(value)
    elif isinstance(value, (tuple, list)):
        items, count = value, len(value)
    else:  # a ValueError like every bad field here: callers map it to INVALID_ARGUMENT
        raise ValueError(f"logit_bias must map token ids to biases, got {type(value).__name__}")  # noqa: TRY004
    if count > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {count}")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r:.40}")
        token, bias = _token_id("logit_bias", item[0]), item[1]
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {bias!r:.40} for token id {token}")  # (NaN fails the range)
        if token in pairs:
            raise ValueError(f"logit_bias names token id {token} twice")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _allowed_token_ids(value: object) -> tuple[int, ...]:
    """``value`` as sorted unique token ids. Raises ValueError naming ``allowed_token_ids``:
    empty, too many, or a bad id."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (tuple, list)):
        raise ValueError(f"allowed_token_ids must be a list of token ids, got {type(value).__name__}")  # noqa: TRY004
    if not value:
        raise ValueError("allowed_token_ids must hold at least one token id (leave it unset to allow all)")
    if len(value) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"allowed_token_ids must hold at most {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(value)}")
    return tuple(sorted({_token_id("allowed_token_ids", t) for t in value}))


def _stop_strings(value: object) -> tuple[str, ...]:
    """``value`` as a tuple of stop strings. Raises ValueError naming ``stop`` and the bound."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)):
        # a ValueError like every bad field here: callers map it to INVALID_ARGUMENT
        raise ValueError(f"stop must be a list of strings, got {type(value).__name__}")  # noqa: TRY004
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for text in value:
        if not isinstance(text, str) or not 0 < len(text) <= MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters, got {text!r:.80}")
    return tuple(value)
