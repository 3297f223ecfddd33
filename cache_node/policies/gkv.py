"""G-KV: a global score blending recent peak attention with decayed cumulative importance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.attention_stats import StatsNeeds
from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register


def _unit_max(x: torch.Tensor) -> torch.Tensor:
    return x / x.amax(-1, keepdim=True).clamp(min=1e-12)


@register
@dataclass
class GKV(Policy):
    """Score = ``lam * max recent attention + (1 - lam) * decayed cumulative attention``, each
    normalized to [0, 1] per KV head, summed over KV heads. The cumulative term decays by
    ``decay`` per unit of the token stream (once for the prompt, however it was chunked, then
    once per token: ``AttentionStats``), so a token that was pivotal long ago fades slowly
    instead of being evicted on a transient dip (the failure of recent-only scores).

    Keys a query attends (``Policy``): sinks (positions < ``sink_tokens``), the
    ``window_tokens`` most recent positions, and the highest global scores up to ``B`` per
    layer, as of the last compaction, plus the tokens computed since; all at positions ``<= p``.

    Source: "G-KV" (arXiv 2512.00504), §3 (global scoring that combines local/recent attention
    with historical importance), as described in docs/architecture.md, 'KV policies'.
    """

    name = "gkv"
    needs = StatsNeeds(attention=True, recent_steps=8)
    lam: float = 0.5
    decay: float = 0.95

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def score(self, view: LayerView) -> torch.Tensor:
        recent = _unit_max(view.recent_attention())
        cum = _unit_max(view.cumulative_attention())
        return (self.lam * recent + (1.0 - self.lam) * cum).sum(0)
