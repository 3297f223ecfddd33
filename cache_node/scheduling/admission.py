"""Admission: estimate a request's time to first token and decide admit / queue / reject.

TTFT estimate (docs/architecture.md, 'Admission and SLO floors')::

    ttft_s = (tokens_ahead + own_uncached) / prefill_tokens_per_s     # the prefill queue
           + host_tokens / host_tokens_per_s + spill_tokens / spill_tokens_per_s  # promotion
           + step_s                                                     # the sampling step

``tokens_ahead`` comes from a fluid model of each node's prefill backlog (``FluidBacklog``),
drained at the speed the node measures online (``SpeedMeter``) slowed by the pace its finished
requests' first tokens showed (``NodePace``; the estimate divides by the same speed), highest
class first when the node schedules by class and within a class across tenants by weight, as
the node's VTC order serves them: a request counts its own tenant's backlog and of each other
tenant of its class only the weighted share served meanwhile (``FluidBacklog.ahead``); a
request that ends takes
what the model has not drained of it out (``FluidBacklog.release``). A request whose estimate
exceeds ``REJECT_FACTOR[class] * ttft_slo`` is rejected early with a retry hint (the class
allows rejection: interactive at its SLO, standard at twice it); batch always queues. A request that misses its limit on its own (no
queue ahead would let it meet it) is admitted when nothing is ahead of it (``decide``).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

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


BACKLOG_EPS_TOKENS = 1e-6
"""A (class, tenant) entry of ``FluidBacklog`` with at most this many tokens left is dropped."""

BACKLOG_WEIGHT_RANGE = (1e-6, 1e6)
"""Tenant weights as ``FluidBacklog`` uses them: a spec's weight is any positive finite number,
and sums and ratios of extreme ones (1e308, 1e-300) would overflow to inf and NaN."""


def _backlog_weight(weight: float) -> float:
    if not weight > 0:
        raise ValueError(f"weight must be positive, got {weight}")
    return min(max(weight, BACKLOG_WEIGHT_RANGE[0]), BACKLOG_WEIGHT_RANGE[1])


@dataclass
class FluidBacklog:
    """A node's pending prefill tokens per (class rank, tenant), drained at a speed as the
    ``kvstrata`` node serves them: lower ranks first, and within a rank across tenants in
    proportion to their weights (the fluid form of the node's weighted VTC interleaving: each
    tenant with tokens left gets ``w / sum(w)`` of the rank's share, a drained tenant's part
    going to the others). Entries drained to nothing are dropped, with their tenant's weight,
    so the state is at most one entry per (class, tenant) with tokens pending.

    Each entry's tokens are also kept per request (``parts``), drained in arrival order within
    the entry, so a request that ends (``release``: finished, cancelled, refused on its node,
    one of an ``n`` > 1 body rolled back) takes out the part of it not yet drained: what it
    will never ask the node to prefill. A request's part is dropped once drained or released,
    so the parts are bounded by the admitted requests in flight.

    Attributes:
        class_order: the node serves lower ranks first; False: one FCFS pool (every request
            waits behind everything).
        by_tenant: pending tokens per ``(rank, tenant)`` (rank 0 = interactive); each the sum
            of its ``parts`` (up to rounding).
        weights: each tenant's weight as of its latest ``add`` (within
            ``BACKLOG_WEIGHT_RANGE``).
        parts: per ``(rank, tenant)``, each request's undrained tokens, oldest first (a
            request added with no id has a key of its own that nothing releases).
        holder: the ``(rank, tenant)`` holding each request id's part.
    """

    class_order: bool = True
    by_tenant: dict[tuple[int, str], float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    updated_s: float = 0.0
    parts: dict[tuple[int, str], OrderedDict[str | int, float]] = field(default_factory=dict)
    holder: dict[str, tuple[int, str]] = field(default_factory=dict)
    _anonymous: int = 0

    @property
    def by_rank(self) -> dict[int, float]:
        """Pending tokens per class rank, all tenants together."""
        out: dict[int, float] = {}
        for (rank, _), tokens in self.by_tenant.items():
            out[rank] = out.get(rank, 0.0) + tokens
        return out

    def drain(self, now_s: float, tokens_per_s: float) -> None:
        """Take away what the node served since the last call, at ``tokens_per_s``."""
        budget = max(0.0, now_s - self.updated_s) * tokens_per_s
        self.updated_s = now_s
        for rank in sorted(self.by_rank):
            if budget <= 0:
                break
            budget -= self._drain_rank(rank, budget)
        for key in [k for k, v in self.by_tenant.items() if v <= BACKLOG_EPS_TOKENS or not self.parts.get(k)]:
            self._drop(key)
        held = {tenant for _, tenant in self.by_tenant}
        for tenant in [t for t in self.weights if t not in held]:
            del self.weights[tenant]

    def _drop(self, key: tuple[int, str]) -> None:
        """Forget the entry ``key`` and its requests' parts."""
        self.by_tenant.pop(key, None)
        for request_id in self.parts.pop(key, {}):
            if isinstance(request_id, str):
                self.holder.pop(request_id, None)

    def _take(self, key: tuple[int, str], tokens: float) -> None:
        """``tokens`` of entry ``key`` were served: its oldest requests' parts first."""
        parts = self.parts.get(key)
        while parts and tokens > 0:
            request_id, part = next(iter(parts.items()))
            if part > tokens + BACKLOG_EPS_TOKENS:
                parts[request_id] = part - tokens
                break
            del parts[request_id]
            if isinstance(request_id, str):
                self.holder.pop(request_id, None)
            tokens -= part

    def _drain_rank(self, rank: int, budget: float) -> float:
        """Serve up to ``budget`` tokens of ``rank``'s tenants, weighted fair (water-filling:
        each tenant gets ``min(its tokens, level * weight)`` for the level the budget reaches);
        returns the tokens served."""
        entries = sorted(((tokens / self.weights.get(tenant, 1.0), tenant, tokens)
                          for (r, tenant), tokens in self.by_tenant.items() if r == rank))
        weight_left = sum(self.weights.get(tenant, 1.0) for _, tenant, _ in entries)
        level = served = 0.0
        for ratio, tenant, _ in entries:  # raise the level to where this tenant runs dry
            cost = (ratio - level) * weight_left
            if served + cost >= budget:
                level += (budget - served) / weight_left
                break
            served, level = served + cost, ratio
            weight_left -= self.weights.get(tenant, 1.0)
        else:
            level = math.inf  # the budget drains the whole rank
        taken = 0.0
        for _, tenant, tokens in entries:
            take = min(tokens, level * self.weights.get(tenant, 1.0))
            self.by_tenant[(rank, tenant)] = tokens - take
            self._take((rank, tenant), take)
            taken += take
        return taken

    def ahead(self, rank: int, tenant: str, tokens: float, weight: float) -> float:
        """Tokens served before a new request of ``tokens`` uncached tokens of ``tenant``
        (weight ``weight``) of class ``rank``: every better class's, the tenant's own of its
        class, and of each other tenant ``u`` of its class ``min(u's tokens, (own + tokens) *
        w_u / weight)``, what weighted fair interleaving serves of ``u`` while the tenant's
        own backlog and this request are served. A tenant's flood thus delays that tenant's
        next request, and another tenant's of its class only by the flood's weighted share.

        Regression (review 28b F1): every same-class tenant's tokens counted as ahead (FCFS
        within a class, weights ignored): an interactive tenant's flood of 1,300-token prompts
        got another interactive tenant's 60-token requests refused 84% of the time, though the
        node's VTC order would have served them first."""
        if not self.class_order:
            return sum(self.by_tenant.values())
        level = (self.by_tenant.get((rank, tenant), 0.0) + max(0.0, tokens)) / _backlog_weight(weight)
        out = 0.0
        for (r, u), pending in self.by_tenant.items():
            if r < rank or (r == rank and u == tenant):
                out += pending
            elif r == rank:
                out += min(pending, level * self.weights.get(u, 1.0))
        return out

    def add(self, rank: int, tenant: str, tokens: float, weight: float, request_id: str = "") -> None:
        """Queue ``tokens`` of ``tenant`` (weight ``weight``, > 0) in class ``rank``, as the part
        of request ``request_id`` (``release`` takes out what is left of it; "" = a part that
        only the drain takes). An id that already holds a part keeps its place and grows (one
        held in another entry moves here whole)."""
        weight = _backlog_weight(weight)
        if not tokens > 0:
            return
        key = (rank, tenant)
        if request_id and self.holder.get(request_id, key) != key:
            tokens += self.release(request_id)
        self.by_tenant[key] = self.by_tenant.get(key, 0.0) + tokens
        self.weights[tenant] = weight
        parts = self.parts.setdefault(key, OrderedDict())
        if not request_id:
            self._anonymous += 1
        part_id: str | int = request_id or self._anonymous
        parts[part_id] = parts.get(part_id, 0.0) + tokens
        if request_id:
            self.holder[request_id] = key

    def part(self, request_id: str) -> float:
        """Request ``request_id``'s tokens not yet drained (0 for an id holding none)."""
        key = self.holder.get(request_id)
        return 0.0 if key is None else self.parts.get(key, {}).get(request_id, 0.0)

    def release(self, request_id: str) -> float:
        """Request ``request_id`` ended: take its tokens not yet drained out of the backlog
        (it will not be prefilled, or its prefill is done); returns them (0 for an id holding
        none: drained, released before, never added).

        Regression (review 28b F3, F4): nothing but the clock took an ended request's tokens
        out. A tenant dropping each request right after admission kept another tenant of its
        class 76% refused on an idle node, and an ``n`` > 1 body whose choices were admitted one
        by one and then all aborted (a later choice refused) left every admitted choice's
        prompt in the backlog: a client served nothing kept another tenant 78% refused."""
        key = self.holder.pop(request_id, None)
        if key is None:
            return 0.0
        parts = self.parts.get(key, {})
        part = parts.pop(request_id, 0.0)
        left = self.by_tenant.get(key, 0.0) - part
        if left <= BACKLOG_EPS_TOKENS or not parts:
            self._drop(key)
            if not any(t == key[1] for _, t in self.by_tenant):
                self.weights.pop(key[1], None)
        else:
            self.by_tenant[key] = left
        return part


PACE_RANGE = (1.0, 8.0)
"""How much slower than its meter a node's prefill queue may be taken to run (``NodePace``):
never faster than the meter says, at most eight times slower, whatever a node reports."""

PACE_MIN_PREDICTED_S = 0.1
"""A finished request whose admission predicted less prefill than this (its queue and its own
uncached tokens at the metered speed) is no sample: its first token's time is mostly the step
it landed in."""

PACE_WINDOW_S = 60.0
"""A tenant's pace counts while its latest sample is at most this old (then the node's pace
falls back to the meter's, unless another tenant's samples say otherwise)."""

PACE_MIN_SAMPLES = 3
"""Samples a tenant needs before its pace counts."""

PACE_MAX_TENANTS = 256
"""Tenants whose pace a node keeps (the least recently sampled go first), and tenants whose
latest probe it keeps (``NodePace.probe``)."""

PACE_PROBE_S = 5.0
"""A tenant with no pace of its own on a node (fewer than ``PACE_MIN_SAMPLES`` samples within
``PACE_WINDOW_S``) that the other tenants' pace would refuse there has one request per this
many seconds estimated at what its own fewer samples say, or at the meter's speed without any
(``NodePace.probe``), and admitted if that meets its target: other tenants' evidence alone
never refuses a tenant for good, and the probe's first token is a sample of its own."""


@dataclass
class _TenantPace:
    """One tenant's samples of a node's pace: averages (EWMA) of the node's load ``L`` at each
    sample's admission, of its pace ``r``, ``L * L`` and ``L * r``, for the line ``r = a + b L``."""

    moments: list[float]
    last_s: float
    samples: int = 0

    def update(self, load: float, pace: float, alpha: float, now_s: float) -> None:
        x = (load, pace, load * load, load * pace)
        a = 1.0 if not self.samples else alpha
        self.moments = [m + a * (v - m) for m, v in zip(self.moments, x)]
        self.last_s, self.samples = now_s, self.samples + 1

    def at(self, load: float) -> float:
        """The pace the line gives at ``load``: with loads too alike to tell a slope, or a
        falling one, the average pace."""
        mean_l, mean_r, mean_ll, mean_lr = self.moments
        var = mean_ll - mean_l * mean_l
        slope = max(0.0, (mean_lr - mean_l * mean_r) / var) if var > 1e-6 else 0.0
        return mean_r + slope * (load - mean_l)


class NodePace:
    """How much slower a node's prefill queue really runs than its meter says, learnt from the
    first tokens of finished requests: what the fluid backlog is drained at
    (``prefill_tokens_per_s / factor``) and what a new request's estimate divides by.

    A node's meter (``SpeedMeter``, fed by the node's own ``prefill_tokens_per_s``) counts
    prefill and decode tokens per second of the steps that carried them; a node busy decoding
    a big batch, or slower than it says, serves its prefill queue slower, and the backlog
    drained on paper while requests waited in reality. The scheduler hears of a request's
    first token only in its ``finished`` event (``ttft_ms``, the gateway's ``release``): each
    admitted request's predicted prefill (its ``ahead`` and own uncached tokens at the metered
    speed, ``admitted``) is compared with what it took (``finished``: ``ttft_ms`` less its
    promotion and step wait). Their ratio, the pace, is fitted per tenant as a line in the
    node's load (its requests in flight at the admission: the more of them decode, the slower
    it prefills), so that the factor follows the load now rather than the load of the
    samples, which end a decode later. A tenant's pace counts once it has
    ``PACE_MIN_SAMPLES`` samples within ``PACE_WINDOW_S``; every ``ttft_ms`` is the node's word
    (untrusted: a sample's pace is held within [0, ``PACE_RANGE[1]``], a factor within
    ``PACE_RANGE``), and a node's factor touches only that node.

    The node's factor, what the backlog drains at and every estimate divides by, is the least
    counting pace at the load now: a node slower than its meter is slower for every tenant,
    and a tenant whose first tokens come late for its own reasons (a prefix the index missed,
    its own KV to wait for) slows no other tenant's estimates while another tenant's requests
    run at pace. A structured request's first token waits besides for its grammar's compile
    (the tenant's spec's cost, seconds for a hard one): its node reports that wait
    (``grammar_wait_ms``) and its sample is the node's pace with the wait taken out
    (``structured``, ``finished``); without that report it is no sample (regression, review 31:
    structured requests were no samples at all, so a tenant sending only structured requests
    never had a pace of its own, was judged by another's and admitted on probes alone: 67 of
    299 behind a tenant whose first tokens came 8 times late). A refused request is no
    sample, so a tenant with no pace of its own would be refused on the others' alone for as
    long as theirs stayed high (review 29i F3: an interactive tenant admitted 1 of 59 times in
    300 s while another's first tokens came 8 times late for that one's own reasons): its
    request that the factor refuses is a ``probe`` instead, at most one per ``PACE_PROBE_S`` and
    none while its last probe is in flight, estimated at its own fewer samples' pace or the
    meter's, and admitted if that meets its target; its first tokens are its samples, and once
    they count they are in the least. The least, not the median (one slow tenant of two
    halves everyone's speed) nor the least of the tenants other than the one asking (a tenant
    alone on a slow node would never drain slow), nor each tenant's own pace for its estimate
    (slow samples of a transient held a tenant out until they expired, while another's showed
    the node fast): tests/test_admission_pace.py and the commit that added the probe measure
    them.

    Attributes:
        pending: request id -> ``(tenant, predicted prefill s, rest s, load, estimate ms, own
            prefill s, structured)`` of each admitted request not yet ended (``finished`` or
            ``forget`` takes it); own prefill: the part of the predicted prefill that is its
            own uncached tokens (the rest is the queue ahead of it).
        tenants: per tenant, its samples' averages, oldest sampled first.
        probes: per tenant without a pace of its own, when its last request admitted on its
            ``probe`` factor was, and its id (``probed``), oldest first.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.pending: dict[str, tuple[str, float, float, int, float, float, bool]] = {}
        self.tenants: OrderedDict[str, _TenantPace] = OrderedDict()
        self.probes: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def _expire(self, now_s: float) -> None:
        for tenant in [t for t, p in self.tenants.items() if now_s - p.last_s > PACE_WINDOW_S]:
            del self.tenants[tenant]

    def own(self, tenant: str, now_s: float, load: int) -> float | None:
        """``tenant``'s own pace at ``load`` (within ``PACE_RANGE``) when it counts (``PACE_MIN_SAMPLES``
        samples within ``PACE_WINDOW_S``), else None."""
        self._expire(now_s)
        sampled = self.tenants.get(tenant)
        if sampled is None or sampled.samples < PACE_MIN_SAMPLES:
            return None
        return min(max(sampled.at(load), PACE_RANGE[0]), PACE_RANGE[1])

    def factor(self, now_s: float, load: int) -> float:
        """The node's prefill runs ``factor`` times slower than its meter at ``load`` requests
        in flight (within ``PACE_RANGE``): the least counting pace of its tenants."""
        self._expire(now_s)
        paces = [p.at(load) for p in self.tenants.values() if p.samples >= PACE_MIN_SAMPLES]
        return min(max(min(paces, default=1.0), PACE_RANGE[0]), PACE_RANGE[1])

    def probe(self, tenant: str, now_s: float, load: int) -> float | None:
        """The factor a request of ``tenant`` that its factor refuses may be estimated at
        instead, once per ``PACE_PROBE_S``, when ``tenant`` has no pace of its own (its factor is
        the other tenants', above the meter's) and its last probe has ended: its own fewer
        samples' pace, or the meter's (1) without any. None when no probe is due."""
        if self.own(tenant, now_s, load) is not None or self.factor(now_s, load) <= PACE_RANGE[0]:
            return None
        last_s, request_id = self.probes.get(tenant, (None, ""))
        if request_id in self.pending or (last_s is not None and 0.0 <= now_s - last_s < PACE_PROBE_S):
            return None  # its last probe's first token is yet to say
        sampled = self.tenants.get(tenant)
        if sampled is None:
            return PACE_RANGE[0]
        return min(max(sampled.at(load), PACE_RANGE[0]), PACE_RANGE[1])

    def probed(self, tenant: str, request_id: str, now_s: float) -> None:
        """Request ``request_id`` of ``tenant`` was admitted at its ``probe`` factor."""
        self.probes.pop(tenant, None)
        self.probes[tenant] = (now_s, request_id)
        while len(self.probes) > PACE_MAX_TENANTS:
            self.probes.popitem(last=False)

    def admitted(self, request_id: str, tenant: str, predicted_s: float, rest_s: float, load: int,
                 estimate_ms: float, own_s: float | None = None) -> None:
        """Request ``request_id`` was admitted at ``load`` requests in flight with
        ``predicted_s`` of prefill at the metered speed before its first token, ``own_s`` of it
        its own uncached tokens (within [0, ``predicted_s``]; None: all of it), and ``rest_s``
        besides (promotion, step wait)."""
        if request_id:
            own_s = predicted_s if own_s is None else min(max(own_s, 0.0), predicted_s)
            self.pending[request_id] = (tenant, predicted_s, rest_s, load, estimate_ms, own_s, False)

    def structured(self, request_id: str) -> None:
        """Admitted request ``request_id`` is structured: its first token waits for its grammar's
        compile as well, and it is a sample only with that wait reported (``finished``)."""
        entry = self.pending.get(request_id)
        if entry is not None:
            self.pending[request_id] = entry[:6] + (True,)

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def finished(self, request_id: str, ttft_ms: Any, now_s: float, grammar_wait_ms: Any = None) -> bool:
        """Request ``request_id`` ended with its first token ``ttft_ms`` after it reached the
        node: a sample of its tenant's pace when it is a number and the prediction was long
        enough (``PACE_MIN_PREDICTED_S``); a sample's pace is held within [0,
        ``PACE_RANGE[1]``]. Returns whether it was taken.

        A ``structured`` request's ``grammar_wait_ms`` (its node's word: from its arrival to its
        grammar compiled) is the part of ``ttft_ms`` that is its spec's, not the node's pace. Its
        grammar compiles while the queue ahead of it drains, so its pace is ``_grammar_paced``'s,
        not ``ttft_ms`` less the wait over the prediction: that counts the queue drained
        meanwhile as free, and one tenant's too fast samples would speed every tenant's
        estimates (the node's factor is the least pace). It is no sample unless its wait is a
        finite number within [0, ``ttft_ms``] (a first token before its grammar is impossible),
        nor when the wait held it past its queue and its own prefill was predicted under
        ``PACE_MIN_PREDICTED_S``. A wait reported for an unstructured request is ignored."""
        entry = self.pending.pop(request_id, None)
        if entry is None or not _finite(ttft_ms):
            return False
        tenant, predicted_s, rest_s, load, _, own_s, structured = entry
        if predicted_s < PACE_MIN_PREDICTED_S:
            return False
        took_s = max(0.0, ttft_ms / 1000.0 - rest_s)
        if structured:
            if not _finite(grammar_wait_ms) or not 0.0 <= grammar_wait_ms <= ttft_ms:
                return False
            paced = _grammar_paced(took_s, predicted_s - own_s, own_s, grammar_wait_ms / 1000.0)
            if paced is None:
                return False
        else:
            paced = took_s / predicted_s
        pace = min(max(0.0, paced), PACE_RANGE[1])
        sampled = self.tenants.pop(tenant, None) or _TenantPace([0.0] * 4, now_s)
        sampled.update(load, pace, self.alpha, now_s)
        self.tenants[tenant] = sampled  # the most recently sampled last
        while len(self.tenants) > PACE_MAX_TENANTS:
            self.tenants.popitem(last=False)
        return True


def _finite(value: Any) -> bool:
    """``value`` is an int or a float (not a bool) and finite."""
    return type(value) in (int, float) and math.isfinite(value)


def _grammar_paced(took_s: float, ahead_s: float, own_s: float, wait_s: float) -> float | None:
    """The pace ``p`` of a node whose structured request took ``took_s`` to its first token
    (less promotion and step wait), predicted at the meter's speed to wait ``ahead_s`` for the
    queue ahead of it and ``own_s`` for its own prefill, and whose grammar was compiled
    ``wait_s`` after its arrival: its prefill starts once the queue ahead is done and its
    grammar is, ``took_s = max(wait_s, p * ahead_s) + p * own_s`` (increasing in ``p``: one
    solution). None when the wait held it past its queue and ``own_s`` is under
    ``PACE_MIN_PREDICTED_S`` (too little of the node's work after it to tell its pace).

    E.g. ahead 2 s, own 0.1 s, a node 3 times slow: a 0.5 s wait gives ``took_s`` 6.3 s (the
    compile ran while the queue drained) and a 10 s wait 10.3 s; both are pace 3 (``took_s``
    less the wait over the prediction: 2.76 and 0.14)."""
    queued = took_s / (ahead_s + own_s)
    if queued * ahead_s >= wait_s:
        return queued
    if own_s < PACE_MIN_PREDICTED_S:
        return None
    return (took_s - wait_s) / own_s


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
