"""Per-request decoding parameters (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_STOP_TOKEN_IDS = 64
"""Most ``stop_token_ids`` one request may name (each is checked on every decode step)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    Attributes:
        max_tokens: most new tokens to generate (> 0).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0, <= 100).
        top_p: nucleus mass kept when sampling, in (0, 1].
        seed: per-request RNG seed for sampling; None draws from the engine RNG.
        stop_token_ids: extra token ids that end the request (the model's EOS always does
            unless ``ignore_eos``); non-negative, at most ``MAX_STOP_TOKEN_IDS``.
        ignore_eos: keep generating past EOS (benchmarks).

    Raises:
        ValueError: any field out of range, with the field name in the message.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if len(stop) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(stop)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
