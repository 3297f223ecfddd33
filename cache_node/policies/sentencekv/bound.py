"""SentenceKV's recall bound: per-sentence key bounds made at demotion and, per decode step,
an upper bound on the softmax mass of the tokens a query does not attend.

Key bounds (Quest, Tang et al. 2024, §3): for each demoted sentence, layer and KV head, the
channel-wise min ``lo`` and max ``hi`` of its keys. For every key ``k`` of the sentence and
any query ``q``, ``q . k <= sum_c max(q_c lo_c, q_c hi_c)``, so
``ub_s = scaling * sum_c max(q_c lo_c, q_c hi_c)`` bounds every logit of the sentence's tokens.

Missed-mass bound, per step, layer and query head: with ``A`` the attended tokens' softmax
numerators (``sum exp(logit - m)`` over sinks, window, new tokens, recall region) and
``U = sum_{s not attended} n_s exp(ub_s - m)``, the true missed mass ``M / (A + M)`` (``M``
the unattended tokens' numerators, ``M <= U``) is at most ``U / (A + U)``, since
``x / (A + x)`` grows with ``x``. ``A`` is taken as a lower bound: the region attends int8/int4
codes, so each region logit is lowered by ``||q|| * err_s`` (Cauchy-Schwarz), ``err_s`` the
largest ``||k - dequant(code(k))||`` among the sentence's tokens, measured at demotion.
Float rounding is covered by a relative slack (``SLACK``) on both sides.
"""

from __future__ import annotations

import math

import torch

from cache_node.policies.quant import quantize
from cache_node.policies.sentencekv.sketch import KeySketch, LayeredSketch

SLACK = 1e-4
"""Relative slack (of ``sum |q_c| max(|lo_c|, |hi_c|)``) added to every bound, covering the
float32 rounding of the logits it is compared with (their relative error is ~1e-6)."""

LOG_SLACK = 1e-4
"""Added to every log upper mass and taken from ``log A``: the float32 rounding of a sum of
``exp`` over up to a few thousand terms (relative error <= terms * 6e-8), which the relative
``SLACK`` does not cover when the logits are near 0."""


def _outward_half(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lo``/``hi`` as float16, rounded down/up so the stored interval still holds the keys."""
    lo16, hi16 = lo.half(), hi.half()
    lo16 = torch.where(lo16.float() > lo, torch.nextafter(lo16, torch.full_like(lo16, -math.inf)), lo16)
    hi16 = torch.where(hi16.float() < hi, torch.nextafter(hi16, torch.full_like(hi16, math.inf)), hi16)
    return lo16, hi16


def quant_error(keys: torch.Tensor, bits: int, group_size: int,
                key_affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(L, H_kv) the largest ``||k - dequant(code(k))||_2`` over the tokens of ``keys``
    (L, n, H_kv, d) under the region's quantizer (``quant.quantize``; 0 for ``bits`` 0); with
    ``key_affine`` = (shift, scale), each (L, H_kv, d), the codes are of ``(k - shift) / scale``
    and dequantize as ``shift + scale * deq`` (``SentenceCodes.key_scale``)."""
    if not bits:
        return keys.new_zeros(keys.shape[0], keys.shape[2], dtype=torch.float32)
    k = keys.float()
    if key_affine is not None:
        shift, s = (t.float().to(keys.device)[:, None] for t in key_affine)
        k = (k - shift) / s
    codes, scale, zero = quantize(k, bits, group_size)
    deq = (codes.float().unflatten(-1, (-1, group_size)) * scale.float().unsqueeze(-1)
           + zero.float().unsqueeze(-1)).flatten(-2)
    if key_affine is not None:
        deq = shift + s * deq
    return (keys.float() - deq).norm(dim=-1).amax(1)


class KeyBounds:
    """Per-sentence key bounds of every demoted sentence (stored or dropped).

    ``lo``/``hi``: (S, L, H_kv, d) float16, rounded outward; ``err``: (S, L, H_kv) float32, the
    region codes' largest key error (``quant_error``) plus ``SLACK`` of the largest key norm;
    ``lengths``: (S,) tokens per sentence; ``sid``: (S,) the sentence's id in the store
    (``HostSentenceStore``), -1 when the host tier was full and it was dropped (never
    recallable, always missed). Rows are on ``device``. ``slot_err[layer]``: the recall
    region's per-slot ``err`` (H_kv, R) and the ``region_version`` it was made for (a cache).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None
        self.err: torch.Tensor | None = None
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)
        self.sid = torch.zeros(0, dtype=torch.long, device=self.device)
        self.slot_err: dict[int, tuple[int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.sid)

    def append(self, keys: torch.Tensor, sid: int, region_bits: int, region_group: int,
               key_affine: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Add one sentence: ``keys`` (L, n, H_kv, d); ``sid`` its store id or -1 (dropped);
        ``key_affine``: the region codes' per-channel key (shift, scale) (``SentenceCodes``), if any."""
        k = keys.float()
        lo, hi = _outward_half(k.amin(1), k.amax(1))
        err = quant_error(k, region_bits, region_group, key_affine) + SLACK * k.norm(dim=-1).amax(1)
        parts = [t.unsqueeze(0).to(self.device) for t in (lo, hi, err)]
        if self.lo is not None and self.hi is not None and self.err is not None:
            parts = [torch.cat([old, new]) for old, new in zip((self.lo, self.hi, self.err), parts)]
        self.lo, self.hi, self.err = parts
        self.lengths = torch.cat([self.lengths, torch.tensor([keys.shape[1]], device=self.device)])
        self.sid = torch.cat([self.sid, torch.tensor([sid], device=self.device)])

    def fork(self) -> KeyBounds:
        """A copy sharing the (never mutated in place) tensors."""
        out = KeyBounds(self.device)
        out.lo, out.hi, out.err, out.lengths, out.sid = self.lo, self.hi, self.err, self.lengths, self.sid
        return out

    @property
    def nbytes(self) -> int:
        parts = (self.lo, self.hi, self.err, self.lengths, self.sid)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def upper(self, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
        """(n, H, S) ``ub_s`` of every row for the queries ``q`` (n, H, d), query head ``h``
        reading KV head ``h // (H / H_kv)``, computed where the bounds are (``device``)."""
        assert self.lo is not None and self.hi is not None
        return logit_upper_bounds(q.to(self.device), self.lo[:, layer].float(), self.hi[:, layer].float(), scaling)

    def log_upper(self, layer: int, q: torch.Tensor, scaling: float,
                  sketch: KeySketch | LayeredSketch | None) -> torch.Tensor:
        """(n, H, S) an upper bound on each row's log mass: ``ub_s + log n_s``, or for a stored
        sentence the smaller of that and ``sketch_log_mass_bound`` when there is a sketch."""
        out = self.upper(layer, q, scaling) + self.lengths.float().log() + LOG_SLACK
        if sketch is None:
            return out
        part, local = sketch.part(layer)
        if part.codes is None or part.rank:
            return out  # a low-rank sketch's error has no per-channel bound: the key bounds alone
        rows = (self.sid >= 0).nonzero().squeeze(1)
        tight = sketch_log_mass_bound(part, local, q, scaling, len(rows)).to(out.device)
        out[..., rows] = torch.minimum(out[..., rows], tight)
        return out


def logit_upper_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scaling: float) -> torch.Tensor:
    """(n, H, S) ``scaling * sum_c max(q_c lo_c, q_c hi_c)`` (+ ``SLACK``): an upper bound on
    ``scaling * q . k`` for every key ``k`` with ``lo <= k <= hi`` channel-wise.

    ``q``: (n, H, d); ``lo``/``hi``: (S, H_kv, d) float; H a multiple of H_kv (GQA: query head
    ``h`` reads KV head ``h // (H / H_kv)``)."""
    n, h, d = q.shape
    h_kv = lo.shape[1]
    qg = q.float().view(n, h_kv, h // h_kv, d)
    ub = torch.einsum("nhgd,shd->nhgs", qg.clamp(min=0), hi) + torch.einsum("nhgd,shd->nhgs", qg.clamp(max=0), lo)
    mag = torch.einsum("nhgd,shd->nhgs", qg.abs(), torch.maximum(lo.abs(), hi.abs()))
    return ((ub + SLACK * mag) * scaling).reshape(n, h, -1)


def sketch_log_mass_bound(sketch: KeySketch, layer: int, q: torch.Tensor, scaling: float,
                          num_sentences: int) -> torch.Tensor:
    """(n, H, S) an upper bound on ``log sum_t exp(scaling * q . k_t)`` over each sentence's
    tokens, from the key sketch's codes: each token's logit on its codes (``q . k^``, as
    ``KeySketch.log_mass``) plus ``scaling * sum_G e_G ||q_G||_1``, ``e_G`` the largest
    ``|k - k^|`` the quantizer (``quant.quantize``: float16 scale ``s`` and zero ``z``) can leave
    in a channel of group ``G``: ``s / 2`` inside the code range, and at a clamped end the
    float16 rounding of ``z`` and ``s``, at most ``2^-10 ((2^b - 1) s + |z|)``; plus ``SLACK``
    of ``|z| + (2^b - 1) s`` for float32 rounding. ``q``: (n, H, d)."""
    assert sketch.scale is not None and sketch.zero is not None
    n, h, _ = q.shape
    scale, zero = sketch.scale[layer].float(), sketch.zero[layer].float()  # (N, H_kv, G)
    top = 2**sketch.bits - 1
    e = scale * (0.5 + 2**-10 * top) + 2**-10 * zero.abs() + SLACK * (zero.abs() + top * scale)
    h_kv = scale.shape[1]
    q1 = q.float().abs().view(n, h_kv, h // h_kv, -1, sketch.group_size).sum(-1)  # (n, H_kv, g, G)
    err = torch.einsum("nhgG,NhG->nhgN", q1.to(e.device), e) * scaling
    logits = sketch_logits(sketch, layer, q.to(e.device), scaling) + err
    of = sketch.sentence_of.to(e.device)
    peak = logits.new_full((*logits.shape[:3], num_sentences), -math.inf)  # per sentence: no underflow
    peak.scatter_reduce_(-1, of.expand_as(logits), logits, "amax")
    mass = torch.zeros_like(peak).index_add_(-1, of, (logits - peak[..., of]).exp())
    return (mass.log() + peak + LOG_SLACK).flatten(1, 2)


def sketch_logits(sketch: KeySketch, layer: int, q: torch.Tensor, scaling: float) -> torch.Tensor:
    """(n, H_kv, g, N) ``scaling * q . k^`` on the sketch's codes (``KeySketch.log_mass``'s
    logits, before its per-sentence sum)."""
    return sketch.logits(layer, q, scaling)  # shared with the recall's scores of the same step


def missed_mass_bound(log_attended: torch.Tensor, log_upper: torch.Tensor, missed: torch.Tensor) -> torch.Tensor:
    """(n, H) ``U / (A + U)``: an upper bound on the softmax mass the attended set misses.

    ``log_attended``: (n, H) ``log A`` (a lower bound on the attended tokens' mass, in the
    logits' units); ``log_upper``: (n, H, S) an upper bound on the log mass of each row's
    tokens (``ub_s + log n_s``, or ``sketch_log_mass_bound``); ``missed``: (H_kv, S) bool, the
    rows a KV head does not attend. Computed in log space: ``sigmoid(log U - log A)``, ``log A``
    lowered by ``LOG_SLACK`` for its float32 sum (0 when nothing is missed)."""
    n, h, s = log_upper.shape
    h_kv = missed.shape[0]
    log_u = log_upper.double().view(n, h_kv, h // h_kv, s)
    log_u = log_u.masked_fill(~missed.view(1, h_kv, 1, s), -math.inf).logsumexp(-1).view(n, h)
    return torch.sigmoid(log_u - (log_attended.double() - LOG_SLACK)).float()


def overflow_rows(log_attended: torch.Tensor, log_upper: torch.Tensor, missed: torch.Tensor,
                  recallable: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """Per KV head, the fewest recallable missed rows, in decreasing upper mass (the largest
    over the head's query heads and the step's queries), whose recall brings
    ``missed_mass_bound`` below ``eps`` for every query head of the group, ``A`` kept at
    ``log_attended`` (recalled rows only add mass, so the bound after recall is lower still).
    All recallable missed rows when that is not enough (dropped rows stay missed).

    Shapes as in ``missed_mass_bound``; ``recallable``: (S,) bool. Returns H_kv (k,) int64."""
    n, h, s = log_upper.shape
    h_kv = missed.shape[0]
    log_u = log_upper.double().view(n, h_kv, h // h_kv, s)
    log_a = log_attended.double().view(n, h_kv, h // h_kv) - LOG_SLACK
    target = log_a + math.log(eps / (1 - eps))  # U < eps / (1 - eps) * A  <=>  U / (A + U) < eps
    out = []
    for head in range(h_kv):
        cand = (missed[head] & recallable).nonzero().squeeze(1)
        fixed = log_u[:, head][..., missed[head] & ~recallable].logsumexp(-1)  # (n, g)
        c = log_u[:, head][..., cand]  # (n, g, k)
        order = c.amax(dim=(0, 1)).argsort(descending=True)
        c = c[..., order]
        # rest[..., j]: log U with the first j candidates recalled (j = 0 .. k)
        tail = c.flip(-1).logcumsumexp(-1).flip(-1)
        rest = torch.cat([tail, torch.full_like(tail[..., :1], -math.inf)], -1)
        rest = torch.logaddexp(rest, fixed.unsqueeze(-1))
        ok = (rest < target[:, head].unsqueeze(-1)).all(0).all(0)  # (k + 1,)
        j = int(ok.nonzero()[0]) if ok.any() else len(cand)
        out.append(cand[order[:j]])
    return out


class RecallBoundStats:
    """One request's recall bound over its decode steps.

    A step's value is the largest ``missed_mass_bound`` over its layers, query heads and
    queries; ``as_dict`` reports the max and mean of those over the steps, and, in
    exact-recall mode (once an overflow was recorded), the overflow's peak tokens and bytes, the peak device bytes
    (``SequenceKV.device_bytes`` plus the overflow) and the time spent recalling into it.
    ``last[layer]``: (n, H) the latest step's bound per query and query head (a KV head's is
    the max over its query heads).
    """

    def __init__(self) -> None:
        self.steps, self.sum_step_max, self.max = 0, 0.0, 0.0
        self.step_pos, self.step_max = -1, 0.0
        self.overflow_tokens_peak = self.overflow_bytes_peak = self.device_bytes_peak = 0
        self.overflow_s, self.exact = 0.0, False
        self.last: dict[int, torch.Tensor] = {}

    def record(self, pos: int, layer: int, bound: torch.Tensor) -> None:
        """Add layer ``layer``'s bound (n, H) at the step whose last query is at ``pos``."""
        if pos != self.step_pos:
            self._close_step()
            self.step_pos, self.step_max = pos, 0.0
        self.step_max = max(self.step_max, float(bound.max()))
        self.last[layer] = bound

    def kv_head_bounds(self, layer: int, num_kv_heads: int) -> torch.Tensor:
        """(n, H_kv) the latest step's bound in ``layer`` per KV head: the max over its query
        heads (query head ``h`` reads KV head ``h // (H / H_kv)``)."""
        b = self.last[layer]
        return b.view(b.shape[0], num_kv_heads, -1).amax(-1)

    def record_overflow(self, tokens: int, nbytes: int, device_bytes: int, seconds: float) -> None:
        self.exact = True
        self.overflow_tokens_peak = max(self.overflow_tokens_peak, tokens)
        self.overflow_bytes_peak = max(self.overflow_bytes_peak, nbytes)
        self.device_bytes_peak = max(self.device_bytes_peak, device_bytes + nbytes)
        self.overflow_s += seconds

    def _close_step(self) -> None:
        if self.step_pos >= 0:
            self.steps += 1
            self.sum_step_max += self.step_max
            self.max = max(self.max, self.step_max)
            self.step_pos = -1

    def as_dict(self) -> dict[str, float]:
        """``recall_bound_max``/``_mean``/``_steps`` and the overflow figures (the step in
        progress counted)."""
        steps = self.steps + (self.step_pos >= 0)
        total = self.sum_step_max + (self.step_max if self.step_pos >= 0 else 0.0)
        top = max(self.max, self.step_max if self.step_pos >= 0 else 0.0)
        out = {"recall_bound_max": top, "recall_bound_mean": total / steps if steps else 0.0,
               "recall_bound_steps": float(steps)}
        if self.exact:
            out |= {"recall_overflow_tokens_peak": float(self.overflow_tokens_peak),
                    "recall_overflow_bytes_peak": float(self.overflow_bytes_peak),
                    "device_bytes_peak": float(self.device_bytes_peak),
                    "recall_overflow_ms": self.overflow_s * 1000.0}
        return out

    def fork(self) -> RecallBoundStats:
        """A fresh record: a forked sequence's steps are its own."""
        return RecallBoundStats()
