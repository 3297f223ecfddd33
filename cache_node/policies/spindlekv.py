"""SpindleKV: deep layers evict by recent peak attention; shallow layers merge near-duplicates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.attention_stats import StatsNeeds
from cache_node.policies.base import LayerPlan, LayerView, Policy
from cache_node.policies.registry import register


@register
@dataclass
class SpindleKV(Policy):
    """Deep layers (index >= ``shallow_fraction * L``) keep the entries with the highest max
    attention over the last T units of the token stream (the prompt is one unit, its max over
    all its queries however it was chunked; each later token one: ``AttentionStats``).
    Shallow layers, whose attention is flat and evicts badly, keep the same top entries but
    *merge* each evicted entry whose key has cosine similarity
    > ``merge_threshold`` with a kept key into it (support-weighted mean of K and V; the entry's
    support count becomes a log-count bias in attention), so the entry acts as a codebook
    vector standing for several tokens; dissimilar entries are dropped.

    Keys a query attends (``Policy``): sinks (positions < ``sink_tokens``), the
    ``window_tokens`` most recent positions, and the highest recent peaks up to ``B`` per
    layer, as of the last compaction, plus the tokens computed since; all at positions ``<= p``.
    In shallow layers a kept entry may stand for several merged tokens (its support), at the
    kept entry's position.

    Source: "SpindleKV: A Novel KV Cache Reduction Method Balancing Both Shallow and Deep
    Layers" (arXiv 2507.06517), §3.2 (attention-based eviction in deep layers) and §3.3
    (codebook-based replacement of similar tokens in shallow layers).
    """

    name = "spindlekv"
    needs = StatsNeeds(attention=True, recent_steps=8)
    shallow_fraction: float = 0.34
    merge_threshold: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.shallow_fraction <= 1:
            raise ValueError(f"shallow_fraction must be a fraction of the layers in [0, 1], got {self.shallow_fraction}")
        if not -1 <= self.merge_threshold <= 1:
            raise ValueError(f"merge_threshold must be a cosine similarity in [-1, 1], got {self.merge_threshold}")

    def score(self, view: LayerView) -> torch.Tensor:
        return view.recent_attention().sum(0)

    def plan(self, view: LayerView, budget: int) -> LayerPlan:
        base = super().plan(view, budget)
        n = view.positions.shape[0]
        if view.layer_idx >= self.shallow_fraction * view.num_layers or len(base.keep) == n:
            return base
        dropped = torch.ones(n, dtype=torch.bool, device=view.positions.device)
        dropped[base.keep] = False
        src = dropped.nonzero().squeeze(1)
        keys = torch.nn.functional.normalize(view.keys.flatten(1), dim=-1)
        sim = keys[src] @ keys[base.keep].T  # (k, m)
        best, dst = sim.max(1)
        merge = best > self.merge_threshold
        return LayerPlan(base.keep, src[merge], dst[merge])
