"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register


@register
@dataclass
class StreamingLLM(Policy):
    """Keep the first ``sink_tokens`` and the most recent ``B - sink_tokens`` tokens.

    Keys a query attends: once the prompt is computed and a layer holds more than ``B +
    evict_every`` entries (``B = budget_tokens(num_prompt_tokens)``, at least ``sink_tokens +
    window_tokens + 1``), the layer is cut to positions ``0 .. sink_tokens - 1`` and the
    ``B - sink_tokens`` most recent positions; a query at position ``p`` attends those and
    every token computed since the cut, all ``<= p`` (``window_tokens`` adds nothing here:
    the most recent tokens are kept anyway).

    Source: Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
    (ICLR'24, arXiv 2309.17453), §3.2 (rolling KV cache with attention sinks).
    """

    name = "streaming"

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
