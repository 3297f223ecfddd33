"""Pitched (2D) block copies between the device pool and pinned host memory.

A run of ``n`` consecutive blocks in a layer-major pool view ``(L, 2, num_blocks, block_size,
H_kv, d)`` is ``2 * L`` equal rows of ``n * block_bytes_per_row`` bytes, one per (layer, K/V),
evenly spaced in both tensors. ``torch`` has no strided cross-device copy that stays on the
copy engine (a non-contiguous ``copy_`` to the host goes through a temporary), so the tier
copier used to issue ``2 * L`` ``cudaMemcpyAsync`` calls per run: a 1 GiB demotion of a
Llama-3.1-8B-shaped pool cost ~17 ms of host time in the step that enqueued it (H200,
2026-12-04, ``bench.tiers --device cuda --quick``: that step 26.3 ms against 8.8 ms). One
``cudaMemcpy2DAsync`` per run (CUDA Runtime API, "Memory Management") moves the same rows in
one call, so the host cost is per run, not per run and row.

The runtime call comes from ``cuda.bindings`` (NVIDIA's cuda-python, installed with CUDA
builds of torch) or CuPy, whichever imports; without either, or for a layout that is not evenly
pitched, ``plan_runs`` still gives the plan and the caller falls back to per-row copies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from cache_node.tiers.runs import runs

log = logging.getLogger(__name__)

MAX_PITCH_BYTES = (1 << 31) - 1
"""Pitches above this are refused by ``cudaMemcpy2DAsync`` on current GPUs
(``cudaDevAttrMaxPitch``); such a layout is copied row by row instead."""


class Copy2D(NamedTuple):
    """One pitched copy: ``height`` rows of ``width`` bytes; row ``r`` starts at
    ``dst + r * dpitch`` and ``src + r * spitch`` (addresses in bytes). It moves blocks
    ``src_block .. src_block + blocks - 1`` of the source view into ``dst_block ..``."""

    dst: int
    dpitch: int
    src: int
    spitch: int
    width: int
    height: int
    src_block: int = 0
    dst_block: int = 0
    blocks: int = 0


def _row_layout(t: torch.Tensor) -> tuple[int, int] | None:
    """(pitch between (layer, K/V) rows, bytes per block) of a pool view ``(L, R, B, ...)``
    (R = 2: K and V; 1: K or V alone) whose L * R rows are evenly spaced and whose blocks are
    contiguous; None otherwise (an empty view included)."""
    if t.dim() < 3 or t.numel() == 0:
        return None
    es = t.element_size()
    block = t[0, 0, 0]
    if not block.is_contiguous() or t.stride(2) != block.numel():
        return None
    if t.shape[1] == 1:  # one row per layer (review F3: a K-only view took the K->V stride)
        return t.stride(0) * es, t.stride(2) * es
    if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        return None  # (layer, K/V) rows not one even sequence
    return t.stride(1) * es, t.stride(2) * es


def plan_runs(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
              src_ids: Sequence[int], max_bytes: int | None = None) -> list[Copy2D] | None:
    """The pitched copies doing ``dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]]``, one per run
    of consecutive ids (``runs``), a run split so no copy moves more than ``max_bytes`` (but
    at least one block); None when either view is not evenly pitched.

    Args:
        dst, src: pool views ``(L, 2, blocks, block_size, H_kv, d)`` of the same dtype and
            shape apart from ``blocks``.
        dst_ids, src_ids: paired block indices.
        max_bytes: largest copy (bytes); None: whole runs. A copy engine serves one copy at a
            time: a step's small device->host copy (its sampled token ids) queued behind a
            1 GiB demotion waits for all of it (H200, 2026-12-04: that step took 21.5 ms
            against 8.1 ms with one copy per run).

    Raises:
        ValueError: the views' dtypes or per-block shapes differ, or the id lists' lengths do.
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError(f"{len(dst_ids)} destination ids but {len(src_ids)} source ids")
    if dst.dtype != src.dtype or dst.shape[:2] != src.shape[:2] or dst.shape[3:] != src.shape[3:]:
        raise ValueError(f"pool views differ: {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
    if not len(dst_ids):
        return []
    d_layout, s_layout = _row_layout(dst), _row_layout(src)
    if d_layout is None or s_layout is None:
        return None
    (dpitch, dblock), (spitch, sblock) = d_layout, s_layout
    if max(dpitch, spitch) > MAX_PITCH_BYTES:
        return None
    height = dst.shape[0] * dst.shape[1]
    d0, s0 = dst.data_ptr(), src.data_ptr()
    step = max(1, max_bytes // (height * sblock)) if max_bytes else None
    out = []
    for s, d, n in runs(src_ids, dst_ids):
        k = step or n
        for i in range(0, n, k):
            m = min(k, n - i)
            out.append(Copy2D(d0 + (d + i) * dblock, dpitch, s0 + (s + i) * sblock, spitch, m * sblock, height,
                              s + i, d + i, m))
    return out


Memcpy2DAsync = Callable[[Copy2D, int], None]
"""Enqueue one ``Copy2D`` on a CUDA stream (its raw handle); raises RuntimeError on a CUDA error."""


def _cuda_bindings() -> Memcpy2DAsync | None:
    try:
        from cuda.bindings import runtime as cudart  # type: ignore[import-not-found]
    except ImportError:
        return None
    kind, ok = cudart.cudaMemcpyKind.cudaMemcpyDefault, cudart.cudaError_t.cudaSuccess

    def copy(c: Copy2D, stream: int) -> None:
        (err,) = cudart.cudaMemcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, kind, stream)
        if err != ok:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {err}")
    return copy


def _cupy() -> Memcpy2DAsync | None:
    try:
        from cupy.cuda import runtime as cpr  # type: ignore[import-not-found]
    except ImportError:
        return None

    def copy(c: Copy2D, stream: int) -> None:
        try:
            cpr.memcpy2DAsync(c.dst, c.dpitch, c.src, c.spitch, c.width, c.height, cpr.memcpyDefault, stream)
        except cpr.CUDARuntimeError as exc:
            raise RuntimeError(f"cudaMemcpy2DAsync failed: {exc}") from exc
    return copy


def find_memcpy2d() -> tuple[str, Memcpy2DAsync] | None:
    """The first importable ``cudaMemcpy2DAsync`` binding, as ``(name, enqueue)``; None if none."""
    for name, make in (("cuda.bindings", _cuda_bindings), ("cupy", _cupy)):
        try:
            fn = make()
        except Exception as exc:  # noqa: BLE001 - a broken optional install: try the next one
            log.warning("tier copies: %s unusable (%s: %s)", name, type(exc).__name__, exc)
            fn = None
        if fn is not None:
            return name, fn
    return None


def emulate(copies: Sequence[Copy2D], dst: torch.Tensor, src: torch.Tensor) -> None:
    """Do ``copies`` with plain tensor copies over byte views of two CPU tensors: what the
    device does with them, for testing ``plan_runs`` on the CPU."""
    d_bytes = _bytes(dst)
    s_bytes = _bytes(src)
    d0, s0 = dst.data_ptr(), src.data_ptr()
    for c in copies:
        for r in range(c.height):
            do, so = c.dst - d0 + r * c.dpitch, c.src - s0 + r * c.spitch
            d_bytes[do : do + c.width].copy_(s_bytes[so : so + c.width])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the storage ``t`` starts at (t's own bytes onward)."""
    storage = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    start = t.data_ptr() - storage.data_ptr()
    return base[start:]
