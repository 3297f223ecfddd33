"""StreamingLLM: attention sinks plus a sliding window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register


@register
@dataclass
class StreamingLLM(Policy):
    """Keep the first ``sink_tokens`` and the most recent ``budget - sink_tokens`` tokens.

    Source: Xiao et al., "Efficient Streaming Language Models with Attention Sinks"
    (ICLR'24, arXiv 2309.17453), §3.2 (rolling KV cache with attention sinks).
    """

    name = "streaming"

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
