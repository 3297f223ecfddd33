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
  before it is overwritten), then copied to the device on the copy stream;
- **paced demotion**: a pitched demotion (``memcpy2d``) is split into pieces of at most
  ``max_copy_bytes`` and only ``max_inflight_bytes`` of them are enqueued at a time: the rest
  wait in ``pending`` and ``pump`` (called once per step, ``TierManager.maybe_demote``, and by
  an idle node, ``settle_transfers``) enqueues the next ones once the last lot has landed. A copy engine serves its queue in order, so a
  step's own small device->host copy (its sampled token ids) queued behind a whole 1 GiB
  demotion waited for all of it: on the H200 (2026-12-04) the step that enqueued one took
  23 ms against 8.5 ms, with whole runs or 256/64 MiB pieces alike, and 311 ms with 8 MiB
  pieces (a pitched copy costs ~35 us per row). A demotion's ``CopyTicket`` completes when its
  last piece has landed. Every other copy-stream use (a promotion or install, a host read or
  write, ``order_reuse``, a wait) first enqueues everything pending (``flush``), so the copy
  stream's order, and so every rule above, is what it would have been without pacing.

A copy of a run of ``n`` consecutive blocks is one ``cudaMemcpy2DAsync`` of ``2 * num_layers``
rows of ``n * block_bytes / (2 * num_layers)`` bytes (``memcpy2d``), or, without a binding for
it, that many contiguous ``cudaMemcpyAsync`` calls: the pool is layer-major, and ``copy_`` of a
non-contiguous slice across devices would go through a pageable temporary and block the host
(``aten/src/ATen/native/cuda/Copy.cu``).

On a CPU pool the same calls run synchronously (``block_copy``), with no streams or events.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from cache_node.block import KVBlock
from cache_node.tiers.block_copy import copy_stack_to_view, copy_view_to_view
from cache_node.tiers.memcpy2d import Copy2D, find_memcpy2d, plan_runs
from cache_node.tiers.runs import runs

log = logging.getLogger(__name__)

MAX_COPY_BYTES = 64 << 20
"""Default ``DeviceCopier.max_copy_bytes``: ~1.2 ms of a 55 GB/s host link, rows of >= 1 MiB
for a Llama-3.1-8B-shaped pool (pitched copies of small rows are slow: module docstring)."""

MAX_INFLIGHT_BYTES = 256 << 20
"""Default ``DeviceCopier.max_inflight_bytes``: ~4.7 ms of a 55 GB/s host link, less than an
8B model's decode step on an H200 (8.5 ms), so the lot has landed before the step reads back."""


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


class CopyTicket:
    """A demotion's copy on CUDA: done when every piece is enqueued (``pieces_left`` 0,
    ``event`` recorded after the last) and that event has completed."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event
        self.pieces_left = 0

    def query(self) -> bool:
        """The copy has landed (False while pieces are still pending)."""
        return self.pieces_left == 0 and self.event is not None and self.event.query()

    def synchronize(self) -> None:
        """Wait for the copy (its pieces must all be enqueued: ``DeviceCopier.flush``)."""
        if self.pieces_left or self.event is None:
            raise RuntimeError("a demotion copy still has pieces pending: flush the copier first")
        self.event.synchronize()


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
        max_copy_bytes: the largest single pitched copy (``memcpy2d.plan_runs``).
        max_inflight_bytes: the most demotion bytes enqueued at a time (paced demotion, module
            docstring); None: a demotion is enqueued whole.
        pending: demotion pieces not enqueued yet, oldest first, each with its ticket and its
            destination and source views.
    """

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.compute_stream = torch.cuda.current_stream(device) if self.is_cuda else None
        self._held: list[tuple[CopyTicket, list[KVBlock]]] = []
        self._staging: torch.Tensor | None = None
        self._staging_event: torch.cuda.Event | None = None
        self._last_event: torch.cuda.Event | None = None
        found = find_memcpy2d() if self.is_cuda else None
        self._memcpy2d = found[1] if found else None
        self.copy_backend = (f"memcpy2d:{found[0]}" if found else "rows") if self.is_cuda else None
        self.copy_calls = 0
        self.max_copy_bytes: int | None = MAX_COPY_BYTES
        self.max_inflight_bytes: int | None = MAX_INFLIGHT_BYTES
        self.pending: deque[tuple[Copy2D, CopyTicket, torch.Tensor, torch.Tensor]] = deque()
        self._inflight: torch.cuda.Event | None = None  # recorded after the last paced lot

    # ---- copies --------------------------------------------------------------------------
    def demote(self, host: torch.Tensor, slots: Sequence[int], pool: torch.Tensor,
               block_ids: Sequence[int]) -> CopyTicket | None:
        """Copy device blocks ``block_ids`` into host slots ``slots``; returns the copy's
        ticket (None on the CPU, where the copy is done on return). On CUDA a pitched copy is
        paced (module docstring). The device blocks must not be overwritten before the ticket
        completes: ``hold`` them or ``order_reuse``."""
        if not self._on_device(pool):
            copy_view_to_view(host, slots, pool, block_ids)
            return None
        plan = self._pitched_plan(host, slots, pool, block_ids)
        if plan is None:
            return CopyTicket(self._async(host, slots, pool, block_ids, wait_after=False))
        ticket = CopyTicket()
        ticket.pieces_left = len(plan)
        self.pending.extend((c, ticket, host, pool) for c in plan)
        if not plan:
            ticket.event = self._record()
        if self.max_inflight_bytes is None:
            self.flush()  # unpaced: enqueued whole, now
        else:
            self.pump()
        return ticket

    def pump(self) -> int:
        """Enqueue the next pending demotion pieces, up to ``max_inflight_bytes`` (one piece at
        least), once the lot enqueued last has landed. Returns pieces enqueued."""
        if not self.pending or (self._inflight is not None and not self._inflight.query()):
            return 0
        return self._enqueue_pending(self.max_inflight_bytes)

    def flush(self) -> None:
        """Enqueue every pending demotion piece now (before any other copy-stream use)."""
        if self.pending:
            self._enqueue_pending(None)

    def _enqueue_pending(self, budget: int | None) -> int:
        assert self.copy_stream is not None and self.compute_stream is not None
        n = sent = 0
        self.copy_stream.wait_stream(self.compute_stream)
        with self._on_copy_stream():
            while self.pending:
                copy, ticket, dst, src = self.pending[0]
                size = copy.width * copy.height
                if n and budget is not None and sent + size > budget:
                    break
                self.pending.popleft()
                if not self._memcpy2d_or_fail(copy):  # the same blocks, row by row
                    ids = range(copy.blocks)
                    _copy_runs(dst, [copy.dst_block + i for i in ids], src, [copy.src_block + i for i in ids])
                    self.copy_calls += copy.height
                sent, n = sent + size, n + 1
                ticket.pieces_left -= 1
                if ticket.pieces_left == 0:
                    ticket.event = self._record()
            self._inflight = self._record()
        return n

    # ---- the CUDA calls (one place, so a test can stand in for them on the CPU) ----------
    def _on_device(self, pool: torch.Tensor) -> bool:
        return self.copy_stream is not None and pool.is_cuda

    def _pinned_or_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda or t.is_pinned()

    def _on_copy_stream(self) -> Any:
        return torch.cuda.stream(self.copy_stream)

    def _record(self) -> torch.cuda.Event:
        """A new event recorded on the copy stream now."""
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def promote(self, pool: torch.Tensor, block_ids: Sequence[int], host: torch.Tensor,
                slots: Sequence[int]) -> None:
        """Copy host slots ``slots`` into device blocks ``block_ids``; every later step (on the
        compute stream) reads them only after the copy has landed."""
        if not self._on_device(pool):
            copy_view_to_view(pool, block_ids, host, slots)
            return
        self._async(pool, block_ids, host, slots, wait_after=True)

    def install(self, pool: torch.Tensor, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy CPU rows ``(n, L, 2, block_size, H_kv, d)`` into device blocks ``block_ids``
        through the pinned staging buffer; later steps read them only after they land."""
        if not self._on_device(pool):
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
        self.flush()  # the copy stream's order is the calls' order: pending demotions first
        self.copy_stream.wait_stream(self.compute_stream)
        with self._on_copy_stream():
            if not self._copy_pitched(dst, dst_ids, src, src_ids):
                _copy_runs(dst, dst_ids, src, src_ids)
                self.copy_calls += len(runs(src_ids, dst_ids)) * dst.shape[0] * dst.shape[1]
            event = self._record()
        if wait_after:
            self.compute_stream.wait_event(event)
        self._last_event = event
        return event

    def _pitched_plan(self, dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                      src_ids: Sequence[int]) -> list[Copy2D] | None:
        """The pitched pieces of a copy; None when there is no binding or a view is not
        evenly pitched or not pinned (the copy then goes row by row)."""
        if self._memcpy2d is None or not all(self._pinned_or_device(t) for t in (dst, src)):
            return None
        return plan_runs(dst, dst_ids, src, src_ids, self.max_copy_bytes)

    def _memcpy2d_or_fail(self, copy: Copy2D) -> bool:
        """Enqueue one pitched piece on the copy stream (current); False when the binding
        failed (then it is not tried again: ``copy_backend`` becomes "rows")."""
        if self._memcpy2d is not None:
            assert self.copy_stream is not None
            try:
                self._memcpy2d(copy, self.copy_stream.cuda_stream)
                self.copy_calls += 1
                return True
            except RuntimeError as exc:
                log.warning("tier copies: pitched copies failed (%s); copying row by row from now on", exc)
                self._memcpy2d, self.copy_backend = None, "rows"
        return False

    def _copy_pitched(self, dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor,
                      src_ids: Sequence[int]) -> bool:
        """One ``cudaMemcpy2DAsync`` per piece on the copy stream (current); False (nothing
        enqueued, or a failed call: the caller copies row by row, which rewrites every row)
        when there is no plan or the binding fails."""
        plan = self._pitched_plan(dst, dst_ids, src, src_ids)
        if plan is None:
            return False
        return all(self._memcpy2d_or_fail(c) for c in plan)

    # ---- ordering ------------------------------------------------------------------------
    def hold(self, ticket: CopyTicket | None, blocks: list[KVBlock]) -> bool:
        """Keep ``blocks`` (already taken out of the free queue by the caller) until ``ticket``
        completes; False (nothing held) when there is no ticket (CPU)."""
        if ticket is None or not blocks:
            return False
        self._held.append((ticket, blocks))
        return True

    def release_done(self, wait: bool = False) -> list[KVBlock]:
        """Held blocks whose demotion copy has finished (all of them, waiting, with ``wait``)."""
        if wait:
            self.flush()
        out: list[KVBlock] = []
        keep = []
        for ticket, blocks in self._held:
            if wait:
                ticket.synchronize()
            if wait or ticket.query():
                out.extend(blocks)
            else:
                keep.append((ticket, blocks))
        self._held = keep
        return out

    @property
    def num_held(self) -> int:
        return sum(len(b) for _, b in self._held)

    def order_reuse(self, ticket: CopyTicket | None) -> None:
        """Make later steps wait for ``ticket``'s copy (demoted blocks an allocation reuses at
        once): its pending pieces are enqueued now."""
        if ticket is not None and self.compute_stream is not None:
            self.flush()
            assert ticket.event is not None
            self.compute_stream.wait_event(ticket.event)

    def host_barrier(self) -> None:
        """Wait for every tier copy, pending ones included (before the CPU reads or writes
        host slots)."""
        if self.copy_stream is not None:
            self.flush()
            self.copy_stream.synchronize()
