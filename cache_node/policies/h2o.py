"""H2O: heavy hitters (largest cumulative attention received) plus recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.attention_stats import StatsNeeds
from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register


@register
@dataclass
class H2O(Policy):
    """Score = attention received, summed over all queries so far and all query heads.

    Keys a query attends (``Policy``): sinks (positions < ``sink_tokens``), the
    ``window_tokens`` most recent positions, and the heaviest hitters up to ``B`` per layer,
    as of the last compaction, plus the tokens computed since; all at positions ``<= p``.

    Source: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
    Large Language Models" (NeurIPS'23, arXiv 2306.14048), §3.2 and Algorithm 1 (greedy
    eviction by accumulated attention; the recent window is kept).
    """

    name = "h2o"
    needs = StatsNeeds(attention=True)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.cumulative_attention().sum(0)
