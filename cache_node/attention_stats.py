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
        attention: keep cumulative attention received per key and the max over each of the
            last ``recent_steps`` units of the token stream (H2O, G-KV, SpindleKV).
        recent_steps: T, the length of the recent-attention ring, in units: the prompt is one
            unit, each later token one (``AttentionStats.begin_step``).
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

    Every statistic is a function of the token stream, never of engine steps: a *unit* is the
    prompt (all its chunks) or one later token (``begin_step``).

    ``cum``: (L, H_kv, capacity) attention received, summed over queries and the query heads of
    each KV head group, decayed by ``decay`` once per unit (decay 1.0 = H2O's plain sum).
    ``recent``: (L, T, H_kv, capacity) per-unit max over the unit's queries (mean over a group's
    query heads), a ring over the last T units; ``recent_max()`` is the max over the ring.
    ``queries[l]``: (<= w, H, d) latest query vectors; ``query_pos[l]``: their absolute positions.
    """

    def __init__(self, needs: StatsNeeds, num_layers: int, num_kv_heads: int, decay: float = 1.0,
                 device: torch.device | str = "cpu") -> None:
        self.needs = needs
        self.decay = decay
        self.num_layers = num_layers
        self.capacity = 0
        self.step = -1  # the last unit opened (its ring slot: step % T)
        self.open_prompt: int | None = None  # prompt_end of the prompt whose unit is still open
        self.rows = (0, 0)  # (prompt, later) query rows of the current step, in that order
        self.cum = torch.zeros((num_layers, num_kv_heads, 0), device=device)
        self.recent = torch.zeros((num_layers, needs.recent_steps, num_kv_heads, 0), device=device)
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.query_pos: list[torch.Tensor | None] = [None] * num_layers

    def begin_step(self, num_slots: int, start: int, num_new: int, prompt_end: int) -> None:
        """Open an engine step over ``num_slots`` physical slots that computes the tokens at
        absolute positions [start, start + num_new) of a sequence whose prompt ends at
        ``prompt_end`` (the tokens before it are prompt, the rest decode or recomputed output).

        The prompt is one unit: its first chunk opens a ring slot (and applies one ``decay``),
        every later chunk of the same prompt writes that slot again (the max over all the
        prompt's queries). Each token at or past ``prompt_end`` opens a unit of its own. So a
        sequence's statistics do not depend on how its prompt was chunked, i.e. on the node's
        ``max_num_batched_tokens`` or on the other requests sharing its steps. A session turn's
        new prompt (a larger ``prompt_end``) opens a new unit.

        Regression (review 22a, F1): the ring advanced, and G-KV's cumulative scores decayed,
        once per engine step, a prefill chunk being a step; a SpindleKV prompt chunked 24 + 76
        (another tenant's prefill took the rest of the step) kept other entries and decoded
        other tokens than the same prompt prefilled in one step.
        """
        self._ensure(num_slots)
        n_prompt = min(max(prompt_end - start, 0), num_new)
        n_later = num_new - n_prompt
        opens_prompt = n_prompt > 0 and self.open_prompt != prompt_end
        if n_later:
            self.open_prompt = None
        elif n_prompt:
            self.open_prompt = prompt_end
        self.rows = (n_prompt, n_later)
        opened = int(opens_prompt) + n_later
        self.step += opened
        if self.needs.attention and opened:
            if self.decay != 1.0:
                self.cum.mul_(self.decay**opened)
            ring = self.needs.recent_steps
            for unit in range(self.step - min(opened, ring) + 1, self.step + 1):
                self.recent[:, unit % ring].zero_()

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

        Raises:
            ValueError: ``n`` is not the ``num_new`` of the step ``begin_step`` opened.
        """
        if self.needs.attention:
            assert probs is not None, "needs.attention: record takes the probabilities"
            n_prompt, n_later = self.rows
            if probs.shape[2] != n_prompt + n_later:
                raise ValueError(f"record: {probs.shape[2]} queries, the step opened {n_prompt + n_later}")
            s = probs.shape[-1]
            if self.decay != 1.0 and n_later and (n_prompt or n_later > 1):
                # a row's weight: one decay per unit opened after its own
                later = torch.arange(n_later - 1, -1, -1, device=probs.device, dtype=probs.dtype)
                ages = torch.cat([later.new_full((n_prompt,), float(n_later)), later])
                self.cum[layer_idx, :, :s] += torch.einsum("hgns,n->hs", probs, self.decay**ages)
            else:
                self.cum[layer_idx, :, :s] += probs.sum(dim=(1, 2))
            peak = probs.mean(1)  # (H_kv, n, S)
            ring = self.needs.recent_steps
            first = self.step - n_later  # the prompt's unit (when n_prompt): the one before the later rows
            if n_prompt:
                cur = self.recent[layer_idx, first % ring, :, :s]
                torch.maximum(cur, peak[:, :n_prompt].amax(1), out=cur)
            if n_later:
                k = min(n_later, ring)  # only the last T units stay in the ring
                units = torch.arange(self.step - k + 1, self.step + 1, device=probs.device) % ring
                self.recent[layer_idx, units, :, :s] = peak[:, -k:].transpose(0, 1)
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
