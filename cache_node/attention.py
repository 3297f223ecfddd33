"""Paged attention through the KV pool, registered with transformers' attention interface.

Each decoder layer calls ``paged_attention_forward`` with its post-RoPE query/key/value for the
flattened batch. The function writes the new K/V into the pool through ``slot_mapping``, lets
the step's attention backend (``cache_node.attention_backends``: gather + SDPA on CPU, one
varlen Triton launch on CUDA) attend every plain sequence, and lets each policy-managed
sequence attend through its own layout (``SequenceKV.attend``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from cache_node.attention_backends import AttentionBackend, decode_attention, gather_slots
from cache_node.kv_pool import KVPool
from cache_node.outputs import SequenceFault

ATTN_IMPLEMENTATION = "kvstrata_paged"
__all__ = ["ATTN_IMPLEMENTATION", "AttentionMetadata", "ForwardContext", "PolicyChunk",
           "decode_attention", "forward_context", "gather_slots", "paged_attention_forward"]


@dataclass
class PolicyChunk:
    """A policy-managed sequence's tokens [start, start + num_tokens) of the flat batch.

    ``context_slots``: (context_len,) pool slots of every physical slot the chunk attends
    (cached + new), on the pool's device; ``kv``: the sequence's ``SequenceKV``, which attends
    itself (per-layer holes, merged entries, quantized extra KV, statistics).
    """

    start: int
    num_tokens: int
    context_slots: torch.Tensor
    kv: Any


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch, shared by every layer; tensors on the pool's
    device.

    ``slot_mapping``: (num_tokens,) int64 destination slot of every new token.
    ``backend``: the backend's metadata for the plain sequences (None when there are none).
    ``policy_chunks``: the policy-managed sequences.
    """

    slot_mapping: torch.Tensor
    backend: Any = None
    policy_chunks: list[PolicyChunk] = field(default_factory=list)


@dataclass
class ForwardContext:
    pool: KVPool
    metadata: AttentionMetadata
    backend: AttentionBackend


_FORWARD_CONTEXT: ForwardContext | None = None


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
        SequenceFault: a policy-managed sequence's ``attend`` raised (the cause is chained).
    """
    ctx = _FORWARD_CONTEXT
    if ctx is None:
        raise RuntimeError("paged attention called outside an engine forward_context")
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    md = ctx.metadata
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)  # (T, H, d)
    ctx.pool.write(layer_idx, md.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    k_cache, v_cache = ctx.pool.kv[layer_idx, 0], ctx.pool.kv[layer_idx, 1]
    if md.backend is not None:
        out = ctx.backend.forward(md.backend, q, k_cache, v_cache, scale)
    else:
        out = torch.empty_like(q)
    for chunk in md.policy_chunks:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        try:
            out[rows] = chunk.kv.attend(layer_idx, q[rows], k_cache, v_cache, chunk.context_slots)
        except Exception as exc:  # one sequence's policy fails that request alone
            raise SequenceFault(chunk.kv.seq.request_id) from exc
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
