"""Triton paged attention: prefill chunks and decodes of many sequences in one launch.

``paged_attention`` reads one layer of the KV pool in place through the block tables; this
module checks inputs, picks the kernel and its tile sizes, and launches the programs of
``cache_node/kernels/paged_attention_triton.py``.

- **Unified varlen kernel** (any mix of prefill chunks and decodes): the grid is (query tiles,
  KV heads, KV splits). A program takes ``BLOCK_Q`` consecutive queries of one sequence and, as
  rows of its tiles, every query head that shares the KV head (``BLOCK_Q * group`` rows), so
  K/V read once serve the whole GQA group. It walks the context in tiles of ``BLOCK_N``
  positions, mapping position -> block table entry -> slot, with the online softmax of
  FlashAttention-2 (Dao 2023, §3.1, Algorithm 1) in fp32 and exp2. The grid is sized from
  shapes alone, ``num_tokens // BLOCK_Q + num_seqs`` (an upper bound on the tiles), and a
  program finds its sequence by binary search over ``query_start_loc``, the scheme of vLLM's
  Triton unified attention; no host sync, so a step can be captured in a CUDA graph.
- **Split-KV** (few query tiles over long contexts: decodes of a few sequences, or a short
  prefill chunk after a long cached prefix, as on a prefix-cache hit): each tile's causal
  context is cut into ``num_kv_splits`` ranges attended in parallel, each writing its
  normalized partial output and log-sum-exp; a second kernel merges them (Flash-Decoding, Dao,
  Haziza, Massa and Sizov, 2023, as SGLang's ``decode_attention.py``; here for query tiles too,
  so a 50-token chunk after 2k cached tokens fills the GPU instead of ~32 of its SMs).

Paging follows PagedAttention (Kwon et al., SOSP'23). On CPU tensors the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which the tests use.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch
import triton  # type: ignore[import-untyped]

from cache_node.kernels.paged_attention_triton import (
    _merge_splits_kernel,
    _unified_attention_kernel,
)
from cache_node.kernels.reference import check_paged_attention_inputs

LOG2_E = 1.4426950408889634
SPLIT_MIN_CONTEXT = 1024  # tokens of block-table capacity before split-KV pays off
SPLIT_MIN_TOKENS = 256  # fewest context tokens per split
MAX_KV_SPLITS = 16


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_scalar_index() -> None:
    """Let Triton's interpreter use a loaded scalar as a ``range`` bound under numpy >= 2.4.

    Triton 3.6's interpreter holds a scalar as a 1-element array and converts it with
    ``int(array)``, which numpy 2.4 rejects ("only 0-dimensional arrays can be converted");
    triton-lang/triton#9171, fixed upstream by squeezing. Applied only when interpreting.
    """
    from triton.runtime import interpreter  # type: ignore[import-untyped]

    original = interpreter._patch_lang_tensor
    if getattr(original, "squeezes_scalars", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


INTERPRETED = _interpreting()  # triton.jit read TRITON_INTERPRET when it wrapped the kernels
if INTERPRETED:
    _patch_interpreter_scalar_index()


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200's count, so the interpreter exercises the GPU's choices
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_kv_splits(num_tiles: int, num_kv_heads: int, max_context: int,
                         num_sms: int) -> int:
    """How many context ranges each (query tile, KV head) program's context is cut into.

    ``num_tiles``: the batch's query tiles (at least one per sequence; a decode batch has one
    per sequence). 1 (no split) when the programs already fill the GPU's SMs or the block tables
    hold fewer than ``SPLIT_MIN_CONTEXT`` tokens; else enough ranges to give every SM about two
    programs, each of at least ``SPLIT_MIN_TOKENS`` tokens of capacity, at most
    ``MAX_KV_SPLITS``. Uses shapes only (``max_context`` = block-table width * block_size), so
    it needs no host sync and a CUDA graph captures the same choice it replays.
    """
    programs = num_tiles * num_kv_heads
    if programs >= num_sms or max_context < SPLIT_MIN_CONTEXT:
        return 1
    wanted = math.ceil(2 * num_sms / programs)
    return max(1, min(MAX_KV_SPLITS, wanted, max_context // SPLIT_MIN_TOKENS))


def num_query_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """A lower bound on a batch's non-empty query tiles, from shapes: every sequence has one,
    and ``block_q`` queries fill at most one."""
    return max(num_seqs, math.ceil(num_tokens / block_q))


def _common_config(head_dim: int, block_size: int, dtype: torch.dtype) -> dict[str, Any]:
    # KV tiles of 64 positions for 16-bit head_dim <= 64, else 32: no register spills on sm_90
    # (tests/compile_kernels.py checks it).
    wide = head_dim <= 64 and dtype != torch.float32
    return {
        "BLOCK_N": 64 if wide else 32, "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        # fp32 inputs use exact fp32 products, not TF32, so fp32 runs match torch to ~1e-6.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "UPCAST_DOT": INTERPRETED and dtype == torch.bfloat16,
    }


def unified_config(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                   head_dim: int, block_size: int, dtype: torch.dtype,
                   num_splits: int = 1) -> dict[str, Any]:
    """Compile-time parameters of ``_unified_attention_kernel`` for a batch's shapes.

    Rows per program ``BLOCK_Q * GROUP_PAD`` = 16 when the batch is mostly decodes (<= 4
    queries per sequence on average), else 64; KV tiles of ``BLOCK_N`` positions;
    ``NUM_SPLITS`` context ranges per program (1: no split).
    """
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = max(16 if num_tokens <= 4 * num_seqs else 64, group_pad)
    return {
        "GROUP": num_heads // num_kv_heads, "GROUP_PAD": group_pad,
        "BLOCK_Q": block_m // group_pad, "NUM_SPLITS": num_splits,
        **_common_config(head_dim, block_size, dtype),
    }


def launch_options(config: dict[str, Any]) -> dict[str, int]:
    """Warps and pipeline stages for a config: 8 warps for tiles of >= 64 rows (4 spill fp32)."""
    rows = int(config["BLOCK_Q"] * config["GROUP_PAD"])
    return {"num_warps": 8 if rows >= 64 else 4, "num_stages": 2}


def _launch_unified(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, qk_scale: float,
                    block_size: int, num_kv_splits: int | None) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[1]
    config = unified_config(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                            q.dtype)
    splits = num_kv_splits or choose_num_kv_splits(
        num_query_tiles(num_tokens, num_seqs, config["BLOCK_Q"]), num_kv_heads,
        block_tables.shape[1] * block_size, _num_sms(q.device))
    config["NUM_SPLITS"] = splits
    if splits == 1:
        partial = lse = out  # not read or written with one split
    else:
        partial = torch.empty(num_tokens, num_heads, splits, config["HEAD_DIM_PAD"],
                              dtype=torch.float32, device=q.device)
        lse = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
    grid = (num_tokens // config["BLOCK_Q"] + num_seqs, num_kv_heads, splits)  # >= the tiles
    _unified_attention_kernel[grid](
        out, partial, lse, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        qk_scale, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), **config, **launch_options(config),
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial, lse, out.stride(0), out.stride(1), NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=config["HEAD_DIM_PAD"], num_warps=4,
        )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_size: int,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over a paged KV cache, on the GPU (Triton).

    Args:
        q: (num_tokens, num_heads, head_dim) queries of num_seqs sequences, concatenated.
        k_cache, v_cache: (num_slots, num_kv_heads, head_dim), one layer of the pool (e.g.
            ``KVPool.kv[layer, 0]``); slot = block_id * block_size + offset; the new tokens'
            K/V are already written (``KVPool.write``). Last dim contiguous; other strides free.
        block_tables: (num_seqs, max_blocks) int32; entries past a sequence's length are
            never read.
        query_start_loc: (num_seqs + 1,) int32, strictly increasing from 0 to num_tokens
            (every sequence has >= 1 query).
        seq_lens: (num_seqs,) int32 context length per sequence, new tokens included.
        scale: softmax scale (usually head_dim ** -0.5).
        block_size: tokens per block.
        num_kv_splits: context ranges per (query tile, KV head) program, merged afterwards
            (split-KV); None chooses by ``choose_num_kv_splits``, 1 does not split.

    Returns:
        (num_tokens, num_heads, head_dim), q's dtype. Query i of sequence s sits at position
        ``seq_lens[s] - q_len_s + i`` and attends to positions <= its own; query head h reads
        KV head ``h // (num_heads // num_kv_heads)``. Accumulates in fp32 (fp32/fp16/bf16 in).
        Never synchronizes with the host; the length values are trusted (see the reference,
        ``paged_attention_reference``, which checks them).

    Raises:
        ValueError: malformed shapes/dtypes/devices (``check_paged_attention_inputs``), a last
            dim that is not contiguous, num_kv_splits < 1, or CPU tensors without
            ``TRITON_INTERPRET=1``.
    """
    check_paged_attention_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 block_size)
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"paged_attention runs on CUDA tensors (or on CPU under "
                         f"TRITON_INTERPRET=1 set before triton is imported); got {q.device}")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1; got {num_kv_splits}")
    block_tables, query_start_loc, seq_lens = (t.contiguous() for t in
                                               (block_tables, query_start_loc, seq_lens))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    qk_scale = float(scale) * LOG2_E
    if seq_lens.shape[0] == 0 or q.shape[0] == 0:
        return out
    _launch_unified(out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, qk_scale,
                    block_size, num_kv_splits)
    return out
