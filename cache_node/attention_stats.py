"""Attention statistics a scoring policy asks for, collected only for sequences that need them.

Indexed by the sequence's *physical* slot index (position in its block table), so compaction
re-indexes them with the same kept indices it applies to the KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StatsNeeds:
    """What a policy reads.

    Attributes:
        window_queries: keep the last ``window_queries`` query vectors per layer (SnapKV's
            observation window; 0 = none).
        attention: keep cumulative attention received per key and the per-step max over the
            last ``recent_steps`` engine steps (H2O, G-KV, SpindleKV).
        recent_steps: T, the length of the recent-attention ring.
    """

    window_queries: int = 0
    attention: bool = False
    recent_steps: int = 8

    def union(self, other: StatsNeeds) -> StatsNeeds:
        return StatsNeeds(
            max(self.window_queries, other.window_queries),
            self.attention or other.attention,
            max(self.recent_steps, other.recent_steps),
        )

    @property
    def any(self) -> bool:
        return self.window_queries > 0 or self.attention


class AttentionStats:
    """Per-sequence, per-layer statistics.

    ``cum``: (L, H_kv, capacity) attention received, summed over queries and the query heads of
    each KV head group, decayed by ``decay`` once per step (decay 1.0 = H2O's plain sum).
    ``recent``: (L, T, H_kv, capacity) per-step max over the step's queries (mean over a group's
    query heads); ``recent_max()`` is the max over the ring.
    ``queries[l]``: (<= w, H, d) latest query vectors; ``query_pos[l]``: their absolute positions.
    """

    def __init__(self, needs: StatsNeeds, num_layers: int, num_kv_heads: int, decay: float = 1.0,
                 device: torch.device | str = "cpu") -> None:
        self.needs = needs
        self.decay = decay
        self.num_layers = num_layers
        self.capacity = 0
        self.step = -1
        self.cum = torch.zeros((num_layers, num_kv_heads, 0), device=device)
        self.recent = torch.zeros((num_layers, needs.recent_steps, num_kv_heads, 0), device=device)
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.query_pos: list[torch.Tensor | None] = [None] * num_layers

    def begin_step(self, num_slots: int) -> None:
        """Open a new engine step over ``num_slots`` physical slots."""
        self._ensure(num_slots)
        self.step += 1
        if self.needs.attention:
            if self.decay != 1.0:
                self.cum.mul_(self.decay)
            self.recent[:, self.step % self.needs.recent_steps].zero_()

    def _ensure(self, n: int) -> None:
        if n <= self.capacity:
            return
        grow = max(n, 2 * self.capacity) - self.capacity
        self.cum = torch.cat([self.cum, self.cum.new_zeros((*self.cum.shape[:2], grow))], -1)
        self.recent = torch.cat([self.recent, self.recent.new_zeros((*self.recent.shape[:3], grow))], -1)
        self.capacity += grow

    def record(self, layer_idx: int, probs: torch.Tensor | None, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        """Add one layer's attention of this step.

        Args:
            probs: (H_kv, group, n, S) attention probabilities over the first S physical slots
                (None is accepted only when ``needs.attention`` is off: nothing reads them).
            q: (n, H, d) the step's queries; q_pos: (n,) their absolute positions.
        """
        if self.needs.attention:
            assert probs is not None, "needs.attention: record takes the probabilities"
            s = probs.shape[-1]
            self.cum[layer_idx, :, :s] += probs.sum(dim=(1, 2))
            slot = self.step % self.needs.recent_steps
            self.recent[layer_idx, slot, :, :s] = probs.mean(1).amax(1)
        w = self.needs.window_queries
        if w:
            prev, prev_pos = self.queries[layer_idx], self.query_pos[layer_idx]
            if prev is not None:
                q, q_pos = torch.cat([prev, q]), torch.cat([prev_pos, q_pos])
            self.queries[layer_idx], self.query_pos[layer_idx] = q[-w:].clone(), q_pos[-w:].clone()

    def recent_max(self, layer_idx: int, n: int) -> torch.Tensor:
        """(H_kv, n) max attention received over the last T steps."""
        return self.recent[layer_idx, :, :, :n].amax(0)

    def compact(self, keep: list[torch.Tensor]) -> None:
        """Keep, per layer, the slots ``keep[l]`` (moved to the front); the rest is zeroed."""
        cum = torch.zeros_like(self.cum)
        recent = torch.zeros_like(self.recent)
        for layer, idx in enumerate(keep):
            cum[layer, :, : len(idx)] = self.cum[layer][:, idx]
            recent[layer, :, :, : len(idx)] = self.recent[layer][:, :, idx]
        self.cum, self.recent = cum, recent

    def clone(self) -> AttentionStats:
        out = AttentionStats.__new__(AttentionStats)
        out.__dict__.update(self.__dict__)
        out.cum, out.recent = self.cum.clone(), self.recent.clone()
        out.queries, out.query_pos = list(self.queries), list(self.query_pos)
        return out
