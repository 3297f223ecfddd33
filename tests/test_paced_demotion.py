"""Paced demotion in the tier copier (cache_node/tiers/device_copy.py), on the CPU.

A stand-in for CUDA runs the copier's own code: the copy stream is a FIFO of raw pitched
copies (``ctypes.memmove`` row by row, as ``cudaMemcpy2DAsync`` on host memory) and event
markers, landed only when the test says so. Regression (H200, 2026-12-04, ``bench.tiers
--device cuda``): a 1 GiB demotion enqueued whole made the next decode step wait for all of
it behind the copy engine (23 ms against 8.5 ms)."""

from __future__ import annotations

import contextlib
import ctypes
from collections import deque
from typing import Any

import torch

from cache_node.tiers.device_copy import DeviceCopier
from cache_node.tiers.manager import TierManager
from cache_node.tiers.memcpy2d import Copy2D


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.landed = stream, False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        while not self.landed:
            self.stream.land(1)


class FakeStream:
    """A CUDA stream's order: queued copies and event markers, landed in order."""

    cuda_stream = 0

    def __init__(self) -> None:
        self.queue: deque[Any] = deque()
        self.copies_landed = 0

    def enqueue_copy(self, c: Copy2D) -> None:
        self.queue.append(c)

    def record(self) -> FakeEvent:
        event = FakeEvent(self)
        self.queue.append(event)
        return event

    def land(self, n: int | None = None) -> None:
        """Carry out the next ``n`` queue entries (all with None)."""
        while self.queue and (n is None or n > 0):
            item = self.queue.popleft()
            if isinstance(item, FakeEvent):
                item.landed = True
            else:
                for r in range(item.height):
                    ctypes.memmove(item.dst + r * item.dpitch, item.src + r * item.spitch, item.width)
                self.copies_landed += 1
            n = None if n is None else n - 1

    def copies_queued(self) -> int:
        return sum(not isinstance(x, FakeEvent) for x in self.queue)

    def wait_stream(self, other: Any) -> None:
        pass

    def synchronize(self) -> None:
        self.land()


class FakeCompute:
    """The compute stream: the CPU computes at once, so waiting on an event means everything
    queued up to it has landed."""

    def __init__(self) -> None:
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)
        event.synchronize()


class FakeCudaCopier(DeviceCopier):
    """``DeviceCopier`` with its CUDA calls (``_on_device``, ``_record``, the stream context,
    the pinned check, the ``cudaMemcpy2DAsync`` binding) on the fakes above."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.copy_stream: Any = FakeStream()
        self.compute_stream: Any = FakeCompute()
        self._memcpy2d = lambda c, handle: self.copy_stream.enqueue_copy(c)
        self.copy_backend = "memcpy2d:fake"

    def _on_device(self, pool: torch.Tensor) -> bool:
        return True

    def _pinned_or_device(self, t: torch.Tensor) -> bool:
        return True

    def _on_copy_stream(self) -> Any:
        return contextlib.nullcontext()

    def _record(self) -> Any:
        return self.copy_stream.record()


def _setup(pieces_per_lot: int = 2) -> tuple[FakeCudaCopier, torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, 16, 4, 2, 3, generator=g)
    host = torch.zeros(2, 2, 8, 4, 2, 3)
    copier = FakeCudaCopier()
    piece = 2 * 2 * 2 * pool[0, 0, 0].numel() * pool.element_size()  # 2 blocks, all 4 rows
    copier.max_copy_bytes = piece
    copier.max_inflight_bytes = pieces_per_lot * piece
    return copier, pool, host, piece


def test_a_demotion_is_enqueued_a_lot_at_a_time_and_its_ticket_waits_for_the_last_piece() -> None:
    copier, pool, host, _ = _setup()
    ticket = copier.demote(host, list(range(8)), pool, list(range(4, 12)))  # 8 blocks: 4 pieces
    assert ticket is not None and copier.copy_stream.copies_queued() == 2 and len(copier.pending) == 2
    assert copier.pump() == 0  # the first lot has not landed: nothing more goes in behind it
    copier.copy_stream.land()
    assert not ticket.query()  # landed, but two pieces were never enqueued
    assert copier.pump() == 2 and not copier.pending
    assert not ticket.query()
    copier.copy_stream.land()
    assert ticket.query()
    assert torch.equal(host, pool[:, :, 4:12])


def test_a_promotion_of_pending_slots_enqueues_the_demotion_first() -> None:
    """The copy stream's order stays the calls' order: a promotion reading host slots that a
    pending piece fills must come after that piece (it read zeros without the flush)."""
    copier, pool, host, _ = _setup(pieces_per_lot=1)
    copier.demote(host, list(range(8)), pool, list(range(8)))
    assert len(copier.pending) == 3
    target = pool.clone()
    copier.promote(target, list(range(8, 16)), host, list(range(8)))
    assert not copier.pending
    copier.copy_stream.land()
    assert torch.equal(target[:, :, 8:16], pool[:, :, 0:8])


def test_host_barrier_and_waits_land_everything_pending() -> None:
    copier, pool, host, _ = _setup(pieces_per_lot=1)
    ticket = copier.demote(host, list(range(8)), pool, list(range(8, 16)))
    copier.hold(ticket, ["b"] * 8)  # type: ignore[list-item]
    assert copier.release_done() == []
    copier.host_barrier()
    assert not copier.pending and not copier.copy_stream.queue and torch.equal(host, pool[:, :, 8:16])
    assert len(copier.release_done()) == 8

    copier, pool, host, _ = _setup(pieces_per_lot=1)
    ticket = copier.demote(host, list(range(8)), pool, list(range(8)))
    copier.hold(ticket, ["b"] * 8)  # type: ignore[list-item]
    assert len(copier.release_done(wait=True)) == 8 and ticket.query() and not copier.pending
    assert torch.equal(host, pool[:, :, :8])


def test_order_reuse_enqueues_the_pieces_and_makes_the_steps_wait_for_the_last() -> None:
    """Blocks an allocation reuses at once: every piece is enqueued now and the compute
    stream waits on the event after the last one (not on a lot's)."""
    copier, pool, host, _ = _setup(pieces_per_lot=1)
    ticket = copier.demote(host, list(range(8)), pool, list(range(8)))
    copier.order_reuse(ticket)
    assert not copier.pending and ticket is not None
    assert copier.compute_stream.waited == [ticket.event]
    ticket.event.synchronize()
    assert torch.equal(host, pool[:, :, :8])


def test_later_demotions_queue_behind_earlier_ones() -> None:
    copier, pool, host, _ = _setup(pieces_per_lot=1)
    first = copier.demote(host, list(range(4)), pool, list(range(4)))
    second = copier.demote(host, list(range(4, 8)), pool, list(range(8, 12)))
    assert first is not None and second is not None
    for _ in range(6):
        copier.copy_stream.land()
        copier.pump()
        assert not second.query() or first.query()  # never the later one first
    assert first.query() and second.query()
    assert torch.equal(host[:, :, :4], pool[:, :, :4]) and torch.equal(host[:, :, 4:], pool[:, :, 8:12])


def test_unpaced_copier_enqueues_a_demotion_whole() -> None:
    copier, pool, host, _ = _setup()
    copier.max_inflight_bytes = None
    ticket = copier.demote(host, list(range(8)), pool, list(range(8)))
    assert not copier.pending and copier.copy_stream.copies_queued() == 4 and ticket is not None
    copier.copy_stream.land()
    assert ticket.query()


def test_watermark_demotion_pumps_the_copier_each_step() -> None:
    calls = []

    class Spy:
        def pump(self) -> None:
            calls.append("pump")

    mgr = TierManager.__new__(TierManager)
    mgr.enabled, mgr.copier = True, Spy()  # type: ignore[assignment]

    def stop() -> int:
        calls.append("release")
        raise StopIteration  # the rest of maybe_demote is not under test here

    mgr.release_held = stop  # type: ignore[method-assign]
    try:
        mgr.maybe_demote()
    except StopIteration:
        pass
    assert calls == ["pump", "release"]


def _paced_engine(lot_blocks: int | None) -> tuple[Any, FakeCudaCopier, int]:
    """A CPU engine (tiny Llama) whose tier copier is ``FakeCudaCopier``: watermark batches of
    8 blocks, lots of ``lot_blocks`` blocks (None: unpaced)."""
    from cache_node.config import EngineConfig
    from cache_node.engine import LLMEngine
    from cache_node.model_loader import tiny_llama
    from cache_node.tiers.manager import TierConfig

    lm = tiny_llama(0)
    mc = lm.model.config
    block = 16 * 2 * mc.num_hidden_layers * mc.num_key_value_heads * (mc.hidden_size // mc.num_attention_heads) * 4
    cfg = EngineConfig(block_size=16, kv_pool_bytes=64 * block, max_num_batched_tokens=256, max_num_seqs=2,
                       device="cpu", dtype="float32")
    tc = TierConfig(host_bytes=256 * block, demote_low_watermark=0.2, demote_high_watermark=0.3,
                    demote_batch_blocks=8)
    eng = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tc)
    copier = FakeCudaCopier()
    copier.max_copy_bytes = block
    copier.max_inflight_bytes = None if lot_blocks is None else lot_blocks * block
    eng.tiers.copier = eng.tiers.host.copier = copier
    return eng, copier, block


def test_paced_watermark_demotion_keeps_the_prefix_cache_and_returns_every_block() -> None:
    """Review F1: with lots smaller than a watermark batch, held blocks came back a lot per
    step while the watermark (not counting them as free) kept demoting: the device prefix
    cache kept 6 cached blocks instead of the unpaced 43, 52 of 64 blocks were held at peak,
    and 46 were still held (40 pieces pending) once the work stopped. Now watermark demotion
    waits for the pending batch, counts held blocks as free, and an idle engine
    (``settle_transfers``) enqueues what is pending."""
    import random

    from cache_node.sampling_params import SamplingParams

    results = {}
    for lot in (None, 2):
        eng, copier, _ = _paced_engine(lot)
        rng = random.Random(0)
        peak = 0
        for _ in range(16):
            eng.add_request([rng.randrange(1, 500) for _ in range(97)], SamplingParams(max_tokens=4, temperature=0.0))
            while eng.has_unfinished_requests():
                eng.step()
                copier.copy_stream.land()  # a fast copy engine: each lot lands within its step
                peak = max(peak, copier.num_held)
        pool = eng.kv_manager.pool
        while eng.settle_transfers():  # idle: the rest of a paced batch, a lot at a time
            copier.copy_stream.land()
        assert not copier.pending and copier.num_held == 0
        eng.check_integrity()
        results[lot] = (sum(1 for b in pool.free_queue if b.block_hash is not None), peak)
    (unpaced_cached, _), (paced_cached, paced_peak) = results[None], results[2]
    assert paced_peak <= 8  # at most one watermark batch held at a time
    assert paced_cached >= unpaced_cached - 8, results


def test_an_idle_engine_advances_a_paced_demotion_a_lot_at_a_time() -> None:
    """An idle node enqueued every pending piece at once (``flush``), so a request arriving
    just after waited behind the whole demotion on the copy engine (its sampled-token readback
    queues there); now each idle call enqueues one lot, after the last one landed, and says
    whether to come back."""
    eng, copier, block = _paced_engine(2)
    copier.max_copy_bytes = block
    # 12 one-block pieces from every other device block (no two adjacent: one piece each)
    copier.demote(eng.tiers.host.data, list(range(12)), eng.tiers.pool.blocks_view(), list(range(0, 24, 2)))
    assert copier.copy_stream.copies_queued() <= 2 and len(copier.pending) >= 10
    lots = 0
    while eng.settle_transfers():
        assert copier.copy_stream.copies_queued() <= 2  # one lot in flight at most
        copier.copy_stream.land()
        lots += 1
    assert not copier.pending and lots >= 5
