"""The full cache: every token's KV stays on the device tier (the quality reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register


@register
@dataclass
class FullCache(Policy):
    """Never evicts. A request naming it runs the engine's plain paged path (no per-sequence
    state), so it costs nothing; ``budget`` is ignored."""

    name = "full"
    compresses = False

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
