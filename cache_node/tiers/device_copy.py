"""Block copies between the device pool and pinned host memory, ordered by CUDA events.

On a CUDA pool every tier move runs on one copy stream of its own, so demotions and
promotions overlap the steps that run on the compute stream (the stream the engine was
built on). The ordering rules, as in vLLM's and LMCache's swap paths:

- **before a copy**: the copy stream waits on the compute stream (``wait_stream``), so a copy
  reads KV only after the steps already enqueued have written it, and overwrites a device
  block only after the steps already enqueued have stopped reading it;
- **promotion** (host -> device, spill rows -> device): an event is recorded after the copy
  and the compute stream waits on it, so no step reads a promoted block before it lands;
  the host thread never waits;
- **demotion** (device -> host): an event is recorded after the copy. Either the freed
  device blocks are *held* (``hold``: kept out of the free queue with one reference) until
  the event has completed (``release_done`` returns them), or, when an allocation reuses
  them at once (``BlockPool.evict_hook``), the compute stream waits on the event before any
  later step can overwrite them (``order_reuse``);
- **host reads on the CPU** (victims pushed to spill, a policy writing reserved slots):
  ``host_barrier`` waits for the copy stream first, since a pending demotion may still be
  writing the host tensor or a pending promotion reading a slot just released;
- **spill rows** are staged into a pinned buffer (reused; its last copy's event is waited on
  before it is overwritten), then copied to the device on the copy stream.

A copy of a run of ``n`` consecutive blocks is one ``cudaMemcpy2DAsync`` of ``2 * num_layers``
rows of ``n * block_bytes / (2 * num_layers)`` bytes (``memcpy2d``), or, without a binding for
it, that many contiguous ``cudaMemcpyAsync`` calls: the pool is layer-major, and ``copy_`` of a
non-contiguous slice across devices would go through a pageable temporary and block the host
(``aten/src/ATen/native/cuda/Copy.cu``).

On a CPU pool the same calls run synchronously (``block_copy``), with no streams or events.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cache_node.block import KVBlock
from cache_node.tiers.block_copy import copy_stack_to_view, copy_view_to_view
from cache_node.tiers.memcpy2d import find_memcpy2d, plan_runs
from cache_node.tiers.runs import runs

log = logging.getLogger(__name__)

MAX_COPY_BYTES = 32 << 20
"""Default ``DeviceCopier.max_copy_bytes``: ~0.6 ms of a 55 GB/s host link."""


def _copy_runs(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """``dst[:, :, dst_ids[i]] = src[:, :, src_ids[i]]`` as contiguous async chunk copies.

    ``dst``/``src``: pool views (L, 2, blocks, block_size, H_kv, d) on different devices, one
    of them pinned host memory.
    """
    L, two = dst.shape[:2]
    for s, d, n in runs(src_ids, dst_ids):
        for layer in range(L):
            for kv in range(two):
                dst[layer, kv, d : d + n].copy_(src[layer, kv, s : s + n], non_blocking=True)


class DeviceCopier:
    """Tier copies for one pool: async and event-ordered on CUDA, synchronous on the CPU.

    Args:
        device: the pool's device.

    Attributes:
        compute_stream: the stream steps run on (CUDA; the current stream of the thread that
            built the copier). Set it if the engine steps on another stream.
        copy_stream: the stream tier copies run on (CUDA), None on the CPU.
        copy_backend: how runs are copied on CUDA: ``"memcpy2d:<binding>"`` (one pitched copy
            per run) or ``"rows"`` (one copy per run and (layer, K/V) row); None on the CPU.
        copy_calls: copy calls enqueued on the copy stream so far (CUDA).
        max_copy_bytes: the largest single pitched copy (``memcpy2d.plan_runs``): a step's own
            small copies wait behind at most one such piece on the copy engine.
    """

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.compute_stream = torch.cuda.current_stream(device) if self.is_cuda else None
        self._held: list[tuple[torch.cuda.Event, list[KVBlock]]] = []
        self._staging: torch.Tensor | None = None
        self._staging_event: torch.cuda.Event | None = None
        self._last_event: torch.cuda.Event | None = None
        found = find_memcpy2d() if self.is_cuda else None
        self._memcpy2d = found[1] if found else None
        self.copy_backend = (f"memcpy2d:{found[0]}" if found else "rows") if self.is_cuda else None
        self.copy_calls = 0
        self.max_copy_bytes: int | None = MAX_COPY_BYTES

    # ---- copies --------------------------------------------------------------------------
    def demote(self, host: torch.Tensor, slots: Sequence[int], pool: torch.Tensor,
               block_ids: Sequence[int]) -> torch.cuda.Event | None:
        """Copy device blocks ``block_ids`` into host slots ``slots``; returns the copy's event
        (None on the CPU, where the copy is done on return). The device blocks must not be
        overwritten before the event completes: ``hold`` them or ``order_reuse``."""
        if self.copy_stream is None or not pool.is_cuda:
            copy_view_to_view(host, slots, pool, block_ids)
            return None
        return self._async(host, slots, pool, block_ids, wait_after=False)

    def promote(self, pool: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor,
                slots: Sequence[int]) -> None:
        """Copy host slots ``slots`` into device blocks ``block_ids``; every later step (on the
        compute stream) reads them only after the copy has landed."""
        if self.copy_stream is None or not pool.is_cuda:
            copy_view_to_view(pool, block_ids, host, slots)
            return
        self._async(pool, block_ids, host, slots, wait_after=True)

    def install(self, pool: torch.Tensor, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy CPU rows ``(n, L, 2, block_size, H_kv, d)`` into device blocks ``block_ids``
        through the pinned staging buffer; later steps read them only after they land."""
        if self.copy_stream is None or not pool.is_cuda:
            copy_stack_to_view(pool, block_ids, rows)
            return
        if rows.shape[0] != len(block_ids):
            raise ValueError(f"{rows.shape[0]} rows but {len(block_ids)} destination ids")
        if not block_ids:
            return
        staging = self._stage(rows)
        self._async(pool, block_ids, staging, range(len(block_ids)), wait_after=True)
        self._staging_event = self._last_event

    def _stage(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as a pinned pool view ``(L, 2, n, block_size, H_kv, d)`` (reused buffer)."""
        n = rows.shape[0]
        shape = (rows.shape[1], rows.shape[2], n, *rows.shape[3:])
        if self._staging_event is not None:
            self._staging_event.synchronize()  # its last copy must have read it
        buf = self._staging
        if buf is None or buf.dtype != rows.dtype or buf.shape[:2] != shape[:2] or buf.shape[2] < n \
                or buf.shape[3:] != shape[3:]:
            buf = torch.empty(shape, dtype=rows.dtype, pin_memory=True)
            self._staging = buf
        view = buf[:, :, :n]
        view.copy_(rows.permute(1, 2, 0, 3, 4, 5))
        return view

    def _async(self, dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
               src_ids: Sequence[int], wait_after: bool) -> torch.cuda.Event:
        assert self.copy_stream is not None and self.compute_stream is not None
        self.copy_stream.wait_stream(self.compute_stream)
        with torch.cuda.stream(self.copy_stream):
            if not self._copy_pitched(dst, dst_ids, src, src_ids):
                _copy_runs(dst, dst_ids, src, src_ids)
                self.copy_calls += len(runs(src_ids, dst_ids)) * dst.shape[0] * dst.shape[1]
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if wait_after:
            self.compute_stream.wait_event(event)
        self._last_event = event
        return event

    def _copy_pitched(self, dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                      src_ids: Sequence[int]) -> bool:
        """One ``cudaMemcpy2DAsync`` per run on the copy stream; False (nothing enqueued, or
        a failed call: the caller copies row by row, which rewrites every row) when there is
        no binding, a view is not evenly pitched or not pinned, or the call fails (then the
        binding is not tried again)."""
        if self._memcpy2d is None or not all(t.is_cuda or t.is_pinned() for t in (dst, src)):
            return False
        plan = plan_runs(dst, dst_ids, src, src_ids, self.max_copy_bytes)
        if plan is None:
            return False
        assert self.copy_stream is not None
        handle = self.copy_stream.cuda_stream
        try:
            for c in plan:
                self._memcpy2d(c, handle)
        except RuntimeError as exc:
            log.warning("tier copies: pitched copies failed (%s); copying row by row from now on", exc)
            self._memcpy2d, self.copy_backend = None, "rows"
            return False
        self.copy_calls += len(plan)
        return True

    # ---- ordering ------------------------------------------------------------------------
    def hold(self, event: torch.cuda.Event | None, blocks: list[KVBlock]) -> bool:
        """Keep ``blocks`` (already taken out of the free queue by the caller) until ``event``
        completes; False (nothing held) when there is no event (CPU)."""
        if event is None or not blocks:
            return False
        self._held.append((event, blocks))
        return True

    def release_done(self, wait: bool = False) -> list[KVBlock]:
        """Held blocks whose demotion copy has finished (all of them, waiting, with ``wait``)."""
        out: list[KVBlock] = []
        keep = []
        for event, blocks in self._held:
            if wait:
                event.synchronize()
            if wait or event.query():
                out.extend(blocks)
            else:
                keep.append((event, blocks))
        self._held = keep
        return out

    @property
    def num_held(self) -> int:
        return sum(len(b) for _, b in self._held)

    def order_reuse(self, event: torch.cuda.Event | None) -> None:
        """Make later steps wait for ``event`` (demoted blocks an allocation reuses at once)."""
        if event is not None and self.compute_stream is not None:
            self.compute_stream.wait_event(event)

    def host_barrier(self) -> None:
        """Wait for every tier copy in flight (before the CPU reads or writes host slots)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
