"""Admission: estimate a request's time to first token and decide admit / queue / reject.

TTFT estimate (docs/architecture.md, 'Admission and SLO floors')::

    ttft_s = (tokens_ahead + own_uncached) / prefill_tokens_per_s     # the prefill queue
           + host_tokens / host_tokens_per_s + spill_tokens / spill_tokens_per_s  # promotion
           + step_s                                                     # the sampling step

``tokens_ahead`` comes from a fluid model of each node's prefill backlog (``FluidBacklog``),
drained at the speed the node measures online (``SpeedMeter``), highest class first when the
node schedules by class. A request whose estimate exceeds ``REJECT_FACTOR[class] * ttft_slo``
is rejected early with a retry hint (the class allows rejection: interactive at its SLO,
standard at twice it); batch always queues. A request that misses its limit on its own (no
queue ahead would let it meet it) is admitted when nothing is ahead of it (``decide``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

REJECT_FACTOR: dict[str, float | None] = {"interactive": 1.0, "standard": 2.0, "batch": None}


class Ewma:
    """Exponentially weighted moving average; the first sample replaces the prior.

    Args:
        prior: the value before any sample.
        alpha: weight of a new sample (0 < alpha <= 1).
    """

    def __init__(self, prior: float, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.value = prior
        self.alpha = alpha
        self.num_samples = 0

    def update(self, sample: float) -> None:
        a = 1.0 if self.num_samples == 0 else self.alpha
        self.value += a * (sample - self.value)
        self.num_samples += 1


class SpeedMeter(Ewma):
    """Tokens/s, averaged over (tokens, seconds) observations (``value`` is tokens/s)."""

    def __init__(self, prior_tokens_per_s: float = 1000.0, alpha: float = 0.2) -> None:
        if not prior_tokens_per_s > 0:
            raise ValueError(f"prior_tokens_per_s must be positive, got {prior_tokens_per_s}")
        super().__init__(prior_tokens_per_s, alpha)

    @property
    def tokens_per_s(self) -> float:
        return self.value

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.update(num_tokens / seconds)

    def set(self, tokens_per_s: float) -> None:
        """Take a rate measured elsewhere (a node's own meter); non-positive values are ignored."""
        if tokens_per_s > 0:
            self.value = tokens_per_s
            self.num_samples += 1


class StepTimeModel:
    """Step seconds as ``base_s + per_token_s * prefill_tokens + per_decode_s * decodes``,
    fitted by least squares over the last ``window`` steps. A decode costs more than a prefill
    token (it reads its whole context and adds a sampled row), so one cost per token
    underestimates decode-heavy steps. ``step_budget`` plans with the fit scaled by the
    ``quantile`` of the recent steps' actual / fitted seconds (at least 1), so a planned step
    overruns its bound in about ``1 - quantile`` of steps rather than in half of them.

    Args:
        window: steps kept.
        min_samples: fewer steps than this: no fit (``step_budget`` returns None).
        quantile: of the actual / fitted ratios, for the planning margin.
    """

    def __init__(self, window: int = 64, min_samples: int = 8, quantile: float = 0.9) -> None:
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.min_samples, self.quantile = min_samples, quantile
        self._planned: tuple[float, float, float] | None = None  # the scaled fit, until a new step

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        if prefill_tokens + decodes > 0 and seconds > 0:
            self._samples.append((prefill_tokens, decodes, seconds))
            self._planned = None

    def fit(self) -> tuple[float, float, float] | None:
        """``(base_s, per_token_s, per_decode_s)``, or None before ``min_samples`` steps.

        When the steps do not separate the two costs (too little variety, or a fit with a
        negative cost), one cost per token is fitted to all tokens; with steps of one size
        only (a saturated budget), or sizes too alike to give a positive slope and base,
        ``(0, s, s)`` with ``s`` the median seconds per token: it overstates the cost of a
        smaller step, so a budget sized from it errs short.

        Regression (issue 21): steps held at a bound all cost about the same (56 or 54 tokens
        in 0.248 or 0.249 s), the line through them had a negative slope, ``step_budget``
        returned None, and the scheduler ran an unbounded 1.8 s batch-prefill step while an
        interactive tenant was active.
        """
        if len(self._samples) < self.min_samples:
            return None
        data = np.array(self._samples, dtype=np.float64)
        prefill, decodes, secs = data[:, 0], data[:, 1], data[:, 2]
        x = np.stack([np.ones_like(secs), prefill, decodes], 1)
        if np.linalg.matrix_rank(x) == 3:
            base, per_token, per_decode = np.linalg.lstsq(x, secs, rcond=None)[0]
            if base >= 0 and per_token > 0 and per_decode > 0:
                return float(base), float(per_token), float(per_decode)
        tokens = prefill + decodes
        if len(set(tokens.tolist())) >= 2:
            per_token, base = np.polyfit(tokens, secs, 1)
            if base >= 0 and per_token > 0:
                return float(base), float(per_token), float(per_token)
        per = float(np.median(secs / tokens))
        return 0.0, per, per

    def margin(self, fitted: tuple[float, float, float]) -> float:
        """The ``quantile`` of actual / fitted seconds over the kept steps, at least 1."""
        base, per_token, per_decode = fitted
        data = np.array(self._samples, dtype=np.float64)
        predicted = base + per_token * data[:, 0] + per_decode * data[:, 1]
        ratios = data[:, 2] / np.maximum(predicted, 1e-9)
        return max(1.0, float(np.quantile(ratios, self.quantile)))

    def step_budget(self, seconds: float, decodes: int, least_decodes: int, cap: int
                    ) -> tuple[int, int] | None:
        """``(decodes, prefill tokens)`` a step may carry and still take at most ``seconds``:
        up to ``decodes`` decodes (never fewer than ``least_decodes``, nor than one when there
        are any), then prefill tokens in the time left, all within ``cap`` tokens. None without
        a usable fit, or when not even one token fits ``seconds`` and no floor needs decodes
        (the floors' ``least_decodes`` still run alone: the shortest step there is)."""
        if self._planned is None:
            fitted = self.fit()
            if fitted is None or fitted[1] <= 0:
                return None
            m = self.margin(fitted)
            self._planned = (m * fitted[0], m * fitted[1], m * fitted[2])
        base, per_token, per_decode = self._planned
        eps = 1e-9  # (0.2 - 0.05 - 0.04) / 0.002 is 54.99999... in floats
        if seconds - base + eps < min(per_token, per_decode) and not least_decodes:
            return None  # not one token fits and no floor needs its decodes: bounding helps nobody
        d = max(least_decodes, min(decodes, int((seconds - base) / per_decode + eps)))
        d = max(d, min(decodes, 1))  # decodes take turns, at least one a step: never no progress
        p = max(0, min(cap - d, int((seconds - base - per_decode * d) / per_token + eps)))
        if d == 0 and p == 0:
            # no step fits ``seconds`` (a loaded machine's fixed cost alone exceeds it): a plan
            # of nothing would idle the node with work queued (regression: a batch request
            # starved while an interactive tenant's session stayed open, up to its 900 s TTL)
            return None
        return d, p


@dataclass(frozen=True)
class TierSpeeds:
    """Tokens/s at which KV comes back up from each tier (copy, not recompute)."""

    host_tokens_per_s: float = 200_000.0
    spill_tokens_per_s: float = 20_000.0


@dataclass(frozen=True)
class CachedTokens:
    """A request's prompt tokens by where their KV is: device, host, spill, or nowhere."""

    device: int = 0
    host: int = 0
    spill: int = 0
    miss: int = 0


def estimate_ttft_s(
    tokens_ahead: float,
    cached: CachedTokens,
    prefill_tokens_per_s: float,
    step_s: float,
    tiers: TierSpeeds = TierSpeeds(),
) -> float:
    """Seconds until the first token of a request with ``cached`` prompt tokens per tier when
    ``tokens_ahead`` uncached prefill tokens are served before it."""
    prefill = (tokens_ahead + cached.miss) / prefill_tokens_per_s
    promote = cached.host / tiers.host_tokens_per_s + cached.spill / tiers.spill_tokens_per_s
    return prefill + promote + step_s


@dataclass
class FluidBacklog:
    """A node's pending prefill tokens per class rank, drained at a speed, lowest rank first.

    Attributes:
        by_rank: pending tokens per class rank (0 = interactive).
        class_order: the node serves lower ranks first; False: one FCFS pool (every rank waits
            behind everything).
    """

    class_order: bool = True
    by_rank: dict[int, float] = field(default_factory=dict)
    updated_s: float = 0.0

    def drain(self, now_s: float, tokens_per_s: float) -> None:
        budget = max(0.0, now_s - self.updated_s) * tokens_per_s
        self.updated_s = now_s
        for rank in sorted(self.by_rank):
            take = min(budget, self.by_rank[rank])
            self.by_rank[rank] -= take
            budget -= take

    def ahead(self, rank: int) -> float:
        """Tokens served before a new request of class ``rank``."""
        if not self.class_order:
            return sum(self.by_rank.values())
        return sum(v for r, v in self.by_rank.items() if r <= rank)

    def add(self, rank: int, tokens: float) -> None:
        self.by_rank[rank] = self.by_rank.get(rank, 0.0) + tokens


@dataclass(frozen=True)
class AdmissionDecision:
    """``admit`` or reject with ``retry_after_s``; ``estimate_ms`` is the TTFT estimate."""

    admit: bool
    estimate_ms: float
    retry_after_s: float = 0.0
    reason: str = ""


def decide(slo_class: str, ttft_slo_ms: float, estimate_ms: float, ahead_ms: float = 0.0) -> AdmissionDecision:
    """Admit unless the class allows rejection and the estimate misses its limit.

    ``ahead_ms``: the part of ``estimate_ms`` spent on work queued before the request (the
    rest is its own prefill, promotion and step). A request that misses the limit on its own
    (a long prompt for a tight target) can never meet it: it is admitted when nothing is
    ahead of it (best effort; a refusal would be repeated at every retry), else refused with
    the hint to retry once the work ahead is done. Otherwise the hint is the time the backlog
    needs to shrink enough. Hints are at least 0.1 s.
    """
    factor = REJECT_FACTOR.get(slo_class)
    limit_ms = None if factor is None else factor * ttft_slo_ms
    if limit_ms is None or estimate_ms <= limit_ms:
        return AdmissionDecision(True, estimate_ms)
    alone = estimate_ms - ahead_ms > limit_ms
    if alone and ahead_ms < 1.0:  # regression: refused on an idle node, with a hint that never helped
        return AdmissionDecision(True, estimate_ms, reason=f"estimated TTFT {estimate_ms:.0f} ms misses the "
                                 f"{slo_class} limit {limit_ms:.0f} ms with nothing ahead: admitted")
    retry = max(0.1, (ahead_ms if alone else estimate_ms - limit_ms) / 1000.0)
    return AdmissionDecision(
        False,
        estimate_ms,
        retry,
        f"estimated TTFT {estimate_ms:.0f} ms exceeds the {slo_class} limit {limit_ms:.0f} ms",
    )
