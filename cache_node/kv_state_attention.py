"""Attention of a step's queries over a sequence's policy-managed layout: the part of
``cache_node.kv_state.SequenceKV`` that ``attend`` (``cache_node.attention``) calls each layer.

``attend`` picks the path: a prompt step under a query-dependent policy goes span by span
(``cache_node.query_spans``); a decode query over a dense layout takes one fused
``scaled_dot_product_attention`` call (``attend_decode``); everything else the general path
(``attend_all``: logits over the valid slots with the causal mask and the support's log, plus
the policy's extra KV, one softmax). ``SequenceKVAttention`` is mixed into ``SequenceKV``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cache_node.query_spans import attend_spans

# ``SequenceKVAttention.pool_part``: K (H_kv, d, S), V (H_kv, S, d), bias (n, S) or None
PoolPart = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
# queries from which a span's pool products run per KV head (``attend_all``): a whole span
PER_HEAD_MIN_QUERIES = 16

if TYPE_CHECKING:
    from cache_node.attention_stats import AttentionStats
    from cache_node.policies.base import DenseExtraKV, ExtraKV, Policy


class SequenceKVAttention:
    """Attention methods of ``SequenceKV`` (which provides these attributes and is what
    ``attend`` hands to the policy: hence its ``type: ignore[arg-type]``)."""

    policy: Policy
    positions: torch.Tensor
    support: torch.Tensor
    stats: AttentionStats | None
    scaling: float
    dense: bool

    def attend(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               ctx_slots: torch.Tensor) -> torch.Tensor:
        """Attention of this step's queries over the layer's valid slots (+ extra KV).

        A decode query over a dense layout (``set_layout``'s ``dense``) whose probabilities no
        statistic needs, with no extra KV or extra KV that hands over plain K/V
        (``DenseExtraKV``), takes one fused call (``attend_decode``); everything else
        ``attend_all``.

        Args:
            q: (n, H, d) queries of the new tokens (the last n physical slots).
            k_cache, v_cache: (pool_slots, H_kv, d) the layer's pool.
            ctx_slots: (S,) pool slots of physical slots [0, S).

        Returns:
            (n, H, d).
        """
        n = q.shape[0]
        s = ctx_slots.shape[0]
        q_pos = self.positions[layer_idx, s - n : s]
        stats = self.stats
        cuts = self.policy.query_spans(self, n)  # type: ignore[arg-type]
        if cuts is not None:  # a prompt step under a query-dependent policy: span by span
            out, probs = attend_spans(self, layer_idx, q, q_pos, k_cache, v_cache, ctx_slots, cuts)  # type: ignore[arg-type]
            if stats is not None:
                stats.record(layer_idx, probs, q.float(), q_pos)
            return out
        self.policy.before_attend(self, layer_idx, q, q_pos)  # type: ignore[arg-type]
        extra = self.policy.extra_kv(self, layer_idx)  # type: ignore[arg-type]
        probs = None
        if (self.dense and n == 1 and (stats is None or not stats.needs.attention)
                and (extra is None or hasattr(extra, "dense_kv"))):
            out = self.attend_decode(q, k_cache, v_cache, ctx_slots, extra)  # type: ignore[arg-type]
        else:
            out, probs = self.attend_all(layer_idx, q, q_pos, k_cache, v_cache, ctx_slots, extra)
        if stats is not None:
            stats.record(layer_idx, probs, q.float(), q_pos)
        return out

    def attend_all(self, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, ctx_slots: torch.Tensor, extra: ExtraKV | None, causal: bool = False,
                   pool: PoolPart | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend``'s general path: logits over the pool's valid slots (causal mask, the
        support's log added) and ``extra``'s, one softmax, the outputs summed. Returns the
        output (n, H, d) and the pool part's probabilities (H_kv, g, n, S) float32.
        ``causal``: mask even a lone query over a dense layout (a span of a step's queries,
        not necessarily in the last slot: ``attend_spans``). ``pool``: the pool part already
        prepared for these queries (``pool_part``, sliced to their rows), so a step's spans
        gather the layer's K/V and build its mask once; the same arithmetic either way."""
        n, h, d = q.shape
        # a whole span (``attend_spans``, 16 queries): the per-head products below; a shorter
        # one (a prompt's first) keeps the broadcast products: with 1-2 rows per product the
        # CPU's BLAS takes another path, whose last bits differ
        per_head = pool is not None and n >= PER_HEAD_MIN_QUERIES
        if pool is None:
            pool = self.pool_part(layer_idx, q_pos, k_cache, v_cache, ctx_slots, q.dtype, causal)
        k, v, bias = pool
        h_kv, _, s = k.shape
        g = h // h_kv
        qh = q.view(n, h_kv, g, d).permute(1, 2, 0, 3)  # (H_kv, g, n, d)
        if per_head:  # a span: one (g n, d) @ (d, S) product per KV head, the same dot products
            # as broadcasting K over the g query heads without the g copies of K (and of V) that
            # materialises (at 8 KV heads of 4, d 128, S 4096: 7 ms instead of 46 on this CPU)
            logits = torch.bmm(qh.reshape(h_kv, g * n, d), k).view(h_kv, g, n, s) * self.scaling
        else:
            logits = qh @ k.unsqueeze(1) * self.scaling  # (H_kv, g, n, S)
        if bias is not None:
            logits = logits + bias
        if extra is not None:
            logits = torch.cat([logits, extra.logits(qh, self.scaling).to(q.dtype)], -1)
        probs = torch.softmax(logits, dim=-1)
        if per_head:
            out = torch.bmm(probs[..., :s].reshape(h_kv, g * n, s), v).view(h_kv, g, n, d)
        else:
            out = probs[..., :s] @ v.unsqueeze(1)  # (H_kv, g, n, d)
        if extra is not None:
            out = out + extra.output(probs[..., s:]).to(q.dtype)
        return out.permute(2, 0, 1, 3).reshape(n, h, d), probs[..., :s].float()

    def pool_part(self, layer_idx: int, q_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  ctx_slots: torch.Tensor, dtype: torch.dtype, causal: bool = False) -> PoolPart:
        """The pool part of ``attend_all`` for queries at ``q_pos`` (n,): the layer's K
        (H_kv, d, S) and V (H_kv, S, d) in ``dtype``, and the additive bias (n, S) (the
        support's log, -inf where the causal mask hides a slot; None for a lone query in the
        last slot of a dense layout, which sees every slot). Adding the bias is the same
        arithmetic as adding the log and then masking: a finite logit plus -inf is -inf."""
        s = ctx_slots.shape[0]
        k, v = k_cache[ctx_slots].to(dtype), v_cache[ctx_slots].to(dtype)
        bias = None
        if causal or not (self.dense and q_pos.shape[0] == 1):
            pos = self.positions[layer_idx, :s]
            allowed = (pos.view(1, -1) >= 0) & (pos.view(1, -1) <= q_pos.view(-1, 1))  # (n, S)
            log_support = self.support[layer_idx, :s].clamp(min=1e-6).log().to(dtype)
            bias = log_support.expand(q_pos.shape[0], s).masked_fill(~allowed, float("-inf"))
        return k.permute(1, 2, 0), v.permute(1, 0, 2), bias

    def attend_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      ctx_slots: torch.Tensor, extra: DenseExtraKV | None) -> torch.Tensor:
        """``attend`` for one query (1, H, d) over a dense layout (every slot valid, support 1,
        the query in the last slot: no mask on the pool part): the pool's K/V and the extra
        KV's (``DenseExtraKV.dense_kv``; its skipped slots masked) side by side in one
        ``scaled_dot_product_attention`` call, the ``g`` query heads of each KV head taken as
        its ``g`` queries (GQA). The same attention as ``attend_all`` up to float rounding, in a
        few ops instead of separate logits, softmax and outputs per part (on this CPU a step's
        attention is a few hundred small ops). Returns (1, H, d)."""
        _, h, d = q.shape
        s = ctx_slots.shape[0]
        k, v = k_cache[ctx_slots].to(q.dtype).transpose(0, 1), v_cache[ctx_slots].to(q.dtype).transpose(0, 1)
        h_kv = k.shape[0]
        mask = None
        if extra is not None:
            ek, ev, skip = extra.dense_kv(q.dtype)  # (H_kv, m, d), (H_kv, m)
            k, v = torch.cat([k, ek], 1), torch.cat([v, ev], 1)
            if skip is not None:  # additive, per KV head, broadcast over its query heads
                mask = q.new_zeros((1, h_kv, 1, k.shape[1]))
                mask[..., s:].masked_fill_(skip[None, :, None], float("-inf"))
        # 4-d (batch 1): CPU's fused (flash) kernel; 3-d inputs fall back to the unfused math path
        out = F.scaled_dot_product_attention(q.reshape(1, h_kv, h // h_kv, d), k.unsqueeze(0), v.unsqueeze(0),
                                             attn_mask=mask, scale=self.scaling)
        return out.reshape(1, h, d)
