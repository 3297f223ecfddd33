"""One layer's recall bound in a decode step (``bound.py`` has the math): the attended mass
``A`` as a lower bound, the rows each KV head misses, and the exact-recall mode's overflow.

Called by ``SentenceKV.before_attend`` after the budgeted recall, before the layer attends.
``A`` is recomputed here from the pool's keys (sinks, window, new tokens), the recall region
(on its codes, each logit lowered by the codes' key error) and the overflow (raw K/V): one
more ``q . k`` over the attended tokens per layer and step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from cache_node.compaction import sequence_slots
from cache_node.policies.sentencekv.bound import (
    SLACK,
    KeyBounds,
    RecallBoundStats,
    missed_mass_bound,
    overflow_rows,
)
from cache_node.policies.sentencekv.overflow import ExtraKVPart, OverflowKV

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV
    from cache_node.policies.sentencekv.store import HostSentenceStore


def _split_heads(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(n, H, d) -> (H_kv, g, n, d) float32, as ``SequenceKV.attend`` groups query heads."""
    n, h, d = q.shape
    return q.float().view(n, h_kv, h // h_kv, d).permute(1, 2, 0, 3)


def pool_logits(state: SequenceKV, layer: int, qh: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """(H_kv, g, n, S) lower bounds on the logits of the pool's tokens each query attends
    (-inf where it attends none): ``scaling * q . k`` minus ``SLACK * scaling * |q| |k|``."""
    slots = sequence_slots(state.seq, state.pool.block_size, state.frontier, state.pool.kv.device)
    k = state.pool.kv[layer, 0, slots].float().to(qh.device)  # (S, H_kv, d)
    pos = state.positions[layer].to(qh.device)
    logits = qh @ k.permute(1, 2, 0).unsqueeze(1)
    slack = SLACK * qh.norm(dim=-1, keepdim=True) * k.norm(dim=-1).T.unsqueeze(1).unsqueeze(1)
    allowed = (pos.view(1, -1) >= 0) & (pos.view(1, -1) <= q_pos.to(qh.device).view(-1, 1))  # (n, S)
    return ((logits - slack) * state.scaling).masked_fill(~allowed, float("-inf"))


def region_logits(state: SequenceKV, store: HostSentenceStore, bounds: KeyBounds, layer: int,
                  region: ExtraKVPart, qh: torch.Tensor) -> torch.Tensor:
    """(H_kv, g, n, R) lower bounds on the exact logits of the recall region's tokens: the
    region's own logits (on its codes) minus ``scaling * |q| * err`` of each slot's sentence,
    found from the slot's position (``HostSentenceStore.slot_sentences``: slots are in no
    sentence order). Cached per layer until its region changes (``region_version``)."""
    logits = region.logits(qh, state.scaling).float()
    version = store.region_version.get(layer)
    cached = bounds.slot_err.get(layer)
    if version is not None and cached is not None and cached[0] == version and cached[1].shape[-1] == logits.shape[-1]:
        err = cached[1]
    else:
        assert bounds.err is not None
        sids = store.slot_sentences(layer).to(bounds.device)  # (H_kv, R)
        filled = sids >= 0
        sid_rows = (bounds.sid >= 0).nonzero().squeeze(1)  # row of each stored sentence id
        heads = torch.arange(sids.shape[0], device=sids.device)[:, None].expand_as(sids)
        err = bounds.err[sid_rows[sids.clamp(min=0)], layer, heads].masked_fill(~filled, 0)
        err = err.to(logits.device)
        if version is not None:
            bounds.slot_err[layer] = (version, err)
    return logits - state.scaling * qh.norm(dim=-1, keepdim=True) * err[:, None, None, :]


def _log_mass(*parts: torch.Tensor) -> torch.Tensor:
    """(n, H) log of the summed numerators of ``parts`` (H_kv, g, n, *)."""
    out = torch.cat(parts, -1).logsumexp(-1)  # (H_kv, g, n)
    return out.permute(2, 0, 1).flatten(1)


def step_bound(state: SequenceKV, store: HostSentenceStore, bounds: KeyBounds, stats: RecallBoundStats,
               layer: int, q: torch.Tensor, q_pos: torch.Tensor, region: ExtraKVPart | None,
               eps: float) -> OverflowKV | None:
    """Record layer ``layer``'s missed-mass bound (n, H) for the queries ``q`` (n, H, d) at
    ``q_pos`` (n,) in ``stats``; with ``eps`` > 0 first recall into an overflow (returned, to
    attend beside the region) the sentences that bring it below ``eps``."""
    h_kv = state.pool.num_kv_heads
    qh = _split_heads(q, h_kv)
    sid_rows = (bounds.sid >= 0).nonzero().squeeze(1)  # row of each stored sentence id
    resident = store.resident.get(layer) or ((),) * h_kv
    rows = [sid_rows[list(sids)] for sids in resident]
    missed = torch.ones(h_kv, len(bounds), dtype=torch.bool, device=bounds.device)
    for head, r in enumerate(rows):
        missed[head, r] = False
    parts = [pool_logits(state, layer, qh, q_pos)]
    if region is not None:
        parts.append(region_logits(state, store, bounds, layer, region, qh))
    ub = bounds.log_upper(layer, q, state.scaling, store.sketch)
    log_a = _log_mass(*parts).to(ub.device)
    over = None
    if eps > 0:
        t0 = time.perf_counter()
        extra = overflow_rows(log_a, ub, missed, bounds.sid >= 0, eps)
        sids = [sorted(bounds.sid[r].tolist()) for r in extra]  # ids ascend with position
        over = OverflowKV(store, layer, sids, state.pool.head_dim, state.pool.kv.dtype, state.pool.kv.device)
        for head, r in enumerate(extra):
            missed[head, r] = False
        if over.num_tokens:
            k = over.k.float()  # (H_kv, O, d)
            slack = SLACK * qh.norm(dim=-1, keepdim=True) * k.norm(dim=-1)[:, None, None, :]
            parts.append(over.logits(qh, state.scaling).float() - slack * state.scaling)
            log_a = _log_mass(*parts).to(ub.device)
        stats.record_overflow(over.num_tokens, over.nbytes, state.device_bytes(), time.perf_counter() - t0)
    stats.record(int(q_pos[-1]), layer, missed_mass_bound(log_a, ub, missed))
    return over
