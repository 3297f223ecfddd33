"""Paged attention through the KV pool, registered with transformers' attention interface.

Each decoder layer calls ``paged_attention_forward`` with its post-RoPE query/key/value for the
flattened batch. The function writes the new K/V into the pool through ``slot_mapping`` and
attends over every sequence's blocks: the decodes' contexts are gathered once, unpadded, and
each decode is one mask-free SDPA call with its query-head group as query rows; prefill chunks
one SDPA call each with a causal mask offset by the cached context (GQA through SDPA's
``enable_gqa``). Idea: vLLM's paged attention (Kwon et al., SOSP'23), on CPU with gather + SDPA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from cache_node.kv_pool import KVPool

ATTN_IMPLEMENTATION = "kvstrata_paged"


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk: tokens [start, start + num_tokens) of the flat batch.

    ``context_slots``: (context_len,) slots of every token the chunk attends to (cached + new).
    ``mask``: (num_tokens, context_len) bool, True where attention is allowed; None = plain causal.
    ``kv``: the sequence's policy-managed layout (``SequenceKV``); when set, it attends itself
    (per-layer holes, merged entries, quantized extra KV, statistics) and ``mask`` is unused.
    """

    start: int
    num_tokens: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None
    kv: Any = None


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch for one layer (shared by layers by default).

    ``slot_mapping``: (num_tokens,) destination slot of every new token.
    ``decode_token_idx``: (num_decodes,) flat index of each decode's query token.
    ``decode_slots``: (sum of the decodes' context lengths,) context slots of every decode,
        concatenated in decode order (no padding).
    ``decode_offsets``: (num_decodes + 1,) where each decode's slots start in ``decode_slots``
        (``decode_offsets[-1] == len(decode_slots)``).
    """

    slot_mapping: torch.Tensor
    decode_token_idx: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_offsets: tuple[int, ...] = ()
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class ForwardContext:
    pool: KVPool
    metadata: AttentionMetadata


_FORWARD_CONTEXT: ForwardContext | None = None


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of ``cache`` (num_slots, num_kv_heads, head_dim) at ``slots`` (any shape).

    Returns ``(*slots.shape, num_kv_heads, head_dim)``, the same values as ``cache[slots]``:
    ``index_select`` over the flattened slots copies whole rows and is several times faster on
    CPU than advanced indexing.
    """
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: tuple[int, ...], scaling: float | None
) -> torch.Tensor:
    """One query token per sequence over that sequence's whole context, without padding.

    Args:
        q: (num_seqs, num_heads, head_dim), each sequence's newest token.
        k, v: (sum of context lengths, num_kv_heads, head_dim), contexts concatenated in
            sequence order; sequence ``i`` owns rows ``offsets[i]:offsets[i + 1]``.

    Returns:
        (num_seqs, num_heads, head_dim).

    GQA: the query heads sharing a KV head (transformers' ``repeat_kv`` order: head
    ``h`` reads KV head ``h // group``) become that KV head's query rows, so each KV head is read
    once and no mask is needed (a decode attends to every context token).
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.view(num_seqs, 1, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k, v = k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)  # (H_kv, S, d)
    out = torch.empty_like(q)
    for i in range(num_seqs):
        rows = slice(offsets[i], offsets[i + 1])
        o = F.scaled_dot_product_attention(
            qg[i], k[:, rows].unsqueeze(0), v[:, rows].unsqueeze(0), scale=scaling
        )
        out[i] = o.view(num_heads, head_dim)
    return out


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make ``ctx`` visible to the attention function for one model forward."""
    global _FORWARD_CONTEXT
    previous, _FORWARD_CONTEXT = _FORWARD_CONTEXT, ctx
    try:
        yield
    finally:
        _FORWARD_CONTEXT = previous


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function.

    Args:
        query: (1, num_heads, num_tokens, head_dim), after RoPE.
        key, value: (1, num_kv_heads, num_tokens, head_dim), after RoPE.

    Returns:
        ((1, num_tokens, num_heads, head_dim), None).

    Raises:
        RuntimeError: called outside ``forward_context`` (the model was run without the engine).
    """
    ctx = _FORWARD_CONTEXT
    if ctx is None:
        raise RuntimeError("paged attention called outside an engine forward_context")
    layer_idx = module.layer_idx
    md = ctx.metadata
    q = query[0].transpose(0, 1)  # (T, H, d)
    ctx.pool.write(layer_idx, md.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = ctx.pool.kv[layer_idx, 0], ctx.pool.kv[layer_idx, 1]
    out = torch.empty_like(q)
    if md.decode_token_idx is not None and md.decode_slots is not None:
        o = decode_attention(
            q.index_select(0, md.decode_token_idx), gather_slots(k_cache, md.decode_slots),
            gather_slots(v_cache, md.decode_slots), md.decode_offsets, scaling,
        )
        out.index_copy_(0, md.decode_token_idx, o)
    for chunk in md.prefills:
        if chunk.kv is not None:
            rows = slice(chunk.start, chunk.start + chunk.num_tokens)
            out[rows] = chunk.kv.attend(layer_idx, q[rows], k_cache, v_cache, chunk.context_slots)
            continue
        qp = q[chunk.start : chunk.start + chunk.num_tokens].transpose(0, 1).unsqueeze(0)
        kp = gather_slots(k_cache, chunk.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        vp = gather_slots(v_cache, chunk.context_slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scaling,
            enable_gqa=True,
        )
        out[chunk.start : chunk.start + chunk.num_tokens] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
