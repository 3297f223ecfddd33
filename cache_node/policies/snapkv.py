"""SnapKV: keep what the last prompt tokens (the observation window) attend to, pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cache_node.attention_stats import StatsNeeds
from cache_node.policies.base import LayerView, Policy
from cache_node.policies.registry import register

MAX_KERNEL_SIZE = 1023
"""Widest pooling window a spec may ask for (the paper pools over 5-7 tokens). Regression: a
request's ``snapkv-kernel_size_2147483647`` padded every layer's votes by a billion entries,
holding its node's step loop 100 s (every tenant on the node waited)."""


@register
@dataclass
class SnapKV(Policy):
    """Score = observation-window attention summed over the window, max-pooled along the
    sequence (``kernel_size``) so kept tokens come with their neighbours; summed over KV heads.

    Source: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation"
    (NeurIPS'24, arXiv 2404.14469), §4.2 Algorithm 1 (window 32, pooling kernel 7).

    Keys a query attends (``Policy``): sinks (positions < ``sink_tokens``), the
    ``window_tokens`` most recent positions, and the entries the last 32 recorded queries (the
    observation window, ``needs.window_queries``) voted for most, up to ``B`` per layer, as of
    the last compaction, plus the tokens computed since; all at positions ``<= p``.

    Raises:
        ValueError: ``kernel_size`` not an odd number in [1, ``MAX_KERNEL_SIZE``] (an even kernel would shift the
            pooled scores by one position).
    """

    name = "snapkv"
    needs = StatsNeeds(window_queries=32)
    window_tokens: int = 32
    kernel_size: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.kernel_size <= MAX_KERNEL_SIZE or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd number in [1, {MAX_KERNEL_SIZE}], got {self.kernel_size}")

    def score(self, view: LayerView) -> torch.Tensor:
        votes = view.window_attention().sum(1)  # (H_kv, n)
        pooled = F.max_pool1d(votes.unsqueeze(0), self.kernel_size, 1, self.kernel_size // 2)
        return pooled[0].sum(0)
