"""Attention backends: how one layer attends the non-policy sequences of a step.

A backend turns the step's sequences (``SeqStep``: host-side counts and block ids) into host
integer arrays (copied to the device once per step, with everything else the step needs, by
``ModelRunner``), builds its metadata from their device copies, and attends one layer:

- ``torch`` (the CPU default): each decode's context is gathered through its slots and
  attended with SDPA (``attention.decode_attention``); each prefill chunk is one SDPA call with
  a causal mask offset by its cached context. Idea: vLLM's paged attention (Kwon et al.,
  SOSP'23), on CPU with gather + SDPA.
- ``triton`` (the CUDA default): one varlen launch for all prefill chunks and decodes
  together, reading the pool in place through block tables (``cache_node.kernels``); under
  ``TRITON_INTERPRET=1`` it also runs on CPU tensors (tests).

Sequences under a KV policy (``seq.kv``) attend through the policy on every backend
(``attention.paged_attention_forward``). Backends are found by name (``get_backend``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from cache_node.kv_pool import block_slots

HostArrays = dict[str, np.ndarray]
DeviceArrays = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SeqStep:
    """One non-policy sequence's part of a step (host-side plain data).

    ``flat_start``: index of its first new token in the flattened batch; ``num_tokens``: new
    tokens (1 for a decode); ``context_len``: tokens it attends after the step (cached + new:
    the kernel's ``seq_len``); ``block_ids``: its block table (at least
    ``ceil(context_len / block_size)`` entries).
    """

    flat_start: int
    num_tokens: int
    context_len: int
    block_ids: list[int]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.context_len > 1


class AttentionBackend(ABC):
    """Attention for the non-policy sequences of a step (see the module docstring).

    ``plan`` runs on the host and may not touch the device; ``metadata`` builds device
    tensors from ``plan``'s arrays (already on the device) without host syncs; ``forward``
    attends one layer. ``forward`` returns ``(num_tokens, num_heads, head_dim)`` for the
    whole flattened batch; rows of policy-managed sequences are left for the caller.
    """

    name: ClassVar[str] = ""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    @abstractmethod
    def plan(self, steps: list[SeqStep], num_tokens: int) -> tuple[HostArrays, Any]:
        """Host arrays (int64, any shape) to copy to the device, and host-side facts kept
        for ``metadata`` (Python ints or tuples; never tensors)."""

    @abstractmethod
    def metadata(self, steps: list[SeqStep], dev: DeviceArrays, host: Any) -> Any:
        """The backend's per-step metadata from ``plan``'s arrays on the device (``dev``)."""

    @abstractmethod
    def forward(self, md: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scaling: float) -> torch.Tensor:
        """Attend one layer. ``q``: (num_tokens, num_heads, head_dim) after RoPE;
        ``k_cache``/``v_cache``: (num_slots, num_kv_heads, head_dim) with the step's new K/V
        written. Returns (num_tokens, num_heads, head_dim)."""


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str) -> type[AttentionBackend]:
    """The backend class called ``name``. Raises ValueError listing the known names."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


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
        out[i] = o.reshape(num_heads, head_dim)  # CUDA SDPA may return it non-contiguous
    return out


@dataclass
class TorchMetadata:
    """``decode_token_idx``: (num_decodes,) flat index of each decode's query; ``decode_slots``:
    (sum of the decodes' context lengths,) their context slots, concatenated; ``decode_offsets``
    (num_decodes + 1,) where each decode's slots start. ``prefills``: (flat start, num_tokens,
    context slots (context_len,), mask (num_tokens, context_len) bool or None = plain causal)."""

    decode_token_idx: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_offsets: tuple[int, ...]
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


@register_backend
class TorchBackend(AttentionBackend):
    """Gather + SDPA per sequence (the CPU path)."""

    name = "torch"

    def plan(self, steps: list[SeqStep], num_tokens: int) -> tuple[HostArrays, Any]:
        decodes = [s for s in steps if s.is_decode]
        prefills = [s for s in steps if not s.is_decode]
        slots = lambda s: block_slots(s.block_ids, self.block_size, s.context_len)
        arrays = {
            "decode_idx": np.array([s.flat_start for s in decodes], dtype=np.int64),
            "decode_slots": np.concatenate([slots(s) for s in decodes] or [np.zeros(0, np.int64)]),
            "prefill_slots": np.concatenate([slots(s) for s in prefills] or [np.zeros(0, np.int64)]),
        }
        decode_offsets = tuple(np.cumsum([0] + [s.context_len for s in decodes]).tolist())
        prefill_offsets = tuple(np.cumsum([0] + [s.context_len for s in prefills]).tolist())
        return arrays, (decode_offsets, prefill_offsets)

    def metadata(self, steps: list[SeqStep], dev: DeviceArrays, host: Any) -> TorchMetadata:
        decode_offsets, prefill_offsets = host
        device = dev["prefill_slots"].device
        prefills = []
        for i, s in enumerate(s for s in steps if not s.is_decode):
            ctx = dev["prefill_slots"][prefill_offsets[i] : prefill_offsets[i + 1]]
            mask = None
            if s.context_len > s.num_tokens:  # cached context before the chunk
                q_pos = torch.arange(s.context_len - s.num_tokens, s.context_len, device=device)
                mask = torch.arange(s.context_len, device=device).unsqueeze(0) <= q_pos.unsqueeze(1)
            prefills.append((s.flat_start, s.num_tokens, ctx, mask))
        has_decodes = len(decode_offsets) > 1
        return TorchMetadata(
            dev["decode_idx"] if has_decodes else None, dev["decode_slots"] if has_decodes else None,
            decode_offsets, prefills,
        )

    def forward(self, md: TorchMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scaling: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if md.decode_token_idx is not None and md.decode_slots is not None:
            o = decode_attention(
                q.index_select(0, md.decode_token_idx), gather_slots(k_cache, md.decode_slots),
                gather_slots(v_cache, md.decode_slots), md.decode_offsets, scaling,
            )
            out.index_copy_(0, md.decode_token_idx, o)
        for start, n, ctx, mask in md.prefills:
            qp = q[start : start + n].transpose(0, 1).unsqueeze(0)
            kp = gather_slots(k_cache, ctx).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vp = gather_slots(v_cache, ctx).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True,
            )
            out[start : start + n] = o[0].transpose(0, 1)
        return out


@dataclass
class VarlenMetadata:
    """One varlen batch for the paged-attention kernel (``cache_node.kernels``).

    ``token_idx``: (num_varlen_tokens,) flat indices of the queries it covers, in sequence
    order; None when it covers the whole flattened batch in order. ``block_tables``:
    (num_seqs, max_blocks) int32, padded with 0; ``query_start_loc``: (num_seqs + 1,) int32;
    ``seq_lens``: (num_seqs,) int32, context lengths including the new tokens.
    """

    token_idx: torch.Tensor | None
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


def varlen_arrays(steps: list[SeqStep], block_size: int, width: int = 0) -> HostArrays:
    """Host (int64) ``block_tables`` (num_seqs, max(width, max blocks)) padded with 0,
    ``query_start_loc`` (num_seqs + 1,) and ``seq_lens`` (num_seqs,) for ``steps``."""
    need = [-(-s.context_len // block_size) for s in steps]
    tables = np.zeros((len(steps), max([width, *need])), dtype=np.int64)
    for row, (s, n) in enumerate(zip(steps, need)):
        tables[row, :n] = s.block_ids[:n]
    return {
        "block_tables": tables,
        "query_start_loc": np.cumsum([0] + [s.num_tokens for s in steps], dtype=np.int64),
        "seq_lens": np.array([s.context_len for s in steps], dtype=np.int64),
    }


def _paged_attention() -> Callable[..., torch.Tensor]:
    """``cache_node.kernels.paged_attention.paged_attention``, imported on first use (triton
    is needed only by this backend)."""
    from cache_node.kernels.paged_attention import paged_attention

    return paged_attention


@register_backend
class TritonBackend(AttentionBackend):
    """One varlen paged-attention launch per layer for every non-policy sequence."""

    name = "triton"
    kernel: ClassVar[Callable[..., torch.Tensor] | None] = None  # tests swap in the reference

    def plan(self, steps: list[SeqStep], num_tokens: int) -> tuple[HostArrays, Any]:
        arrays = varlen_arrays(steps, self.block_size)
        covered = sum(s.num_tokens for s in steps)
        in_order = covered == num_tokens  # no policy sequence in the batch: all tokens, in order
        if not in_order:
            arrays["token_idx"] = np.concatenate(
                [np.arange(s.flat_start, s.flat_start + s.num_tokens) for s in steps]
                or [np.zeros(0, np.int64)]
            ).astype(np.int64)
        return arrays, in_order

    def metadata(self, steps: list[SeqStep], dev: DeviceArrays, host: Any) -> VarlenMetadata:
        i32 = torch.int32
        return VarlenMetadata(
            None if host else dev["token_idx"], dev["block_tables"].to(i32),
            dev["query_start_loc"].to(i32), dev["seq_lens"].to(i32),
        )

    def forward(self, md: VarlenMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                scaling: float) -> torch.Tensor:
        kernel = type(self).kernel or _paged_attention()
        if md.token_idx is None:
            return kernel(q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                          scaling, self.block_size)
        out = torch.empty_like(q)
        if md.token_idx.shape[0]:
            o = kernel(q.index_select(0, md.token_idx), k_cache, v_cache, md.block_tables,
                       md.query_start_loc, md.seq_lens, scaling, self.block_size)
            out.index_copy_(0, md.token_idx, o)
        return out
