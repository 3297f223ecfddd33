"""Tiers on CUDA (issue 17, Build 4): the copier's ordering rules and the moves, bit for bit.

The CPU tests check what holds without a device: the copier copies synchronously there, and
the hold bookkeeping (demoted blocks kept out of the free queue until their copy's event
completes) keeps the pool consistent. CUDA events cannot exist without CUDA, so the
bookkeeping test drives it with ``PendingCopy``, an object with the two methods of
``torch.cuda.Event`` the copier calls. The ``gpu`` tests run the real streams and events.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from cache_node.tiers.block_copy import view_to_stack
from cache_node.tiers.device_copy import DeviceCopier
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_api import from_numpy
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore


class PendingCopy:
    """Stands in for a ``torch.cuda.Event`` (``query``/``synchronize``) on a CPU-only machine."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def engine_on(lm: LoadedModel, device: str, pool_blocks: int, host_blocks: int,
              spill_root: Path | None = None, max_num_seqs: int = 8) -> LLMEngine:
    mc = lm.model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    elem = torch.empty((), dtype=next(lm.model.parameters()).dtype).element_size()
    block = 16 * 2 * mc.num_hidden_layers * mc.num_key_value_heads * head_dim * elem
    cfg = EngineConfig(block_size=16, kv_pool_bytes=pool_blocks * block, max_num_batched_tokens=512,
                       max_num_seqs=max_num_seqs, device=device,
                       dtype=str(next(lm.model.parameters()).dtype).removeprefix("torch."))
    tc = TierConfig(host_bytes=host_blocks * block)
    if spill_root is None:
        return LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tc)
    probe = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids)
    store = SpillStore(spill_root, BlockFormat(*probe.spill_block_spec()), 256 * block, 1 << 30)
    del probe
    return LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tc, spill=store)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def block_ids_of(eng: LLMEngine, prompt: list[int]) -> tuple[Sequence, list[int]]:
    """The request-shaped ``Sequence`` of ``prompt`` and the device block ids of its full blocks."""
    keys = (eng.config.cache_namespace_default, eng.model_id, eng.kv_format)
    seq = Sequence("probe", prompt, SamplingParams(), extra_keys=keys)
    n = (len(prompt) - 1) // 16
    hashes = eng.tiers.kv.block_hashes(seq, n)
    blocks = [eng.kv_manager.pool.lookup(h, prompt[i * 16:(i + 1) * 16]) for i, h in enumerate(hashes)]
    assert all(b is not None for b in blocks), "prompt blocks are not all cached on the device"
    return seq, [b.block_id for b in blocks]  # type: ignore[union-attr]


# ---- CPU ------------------------------------------------------------------------------------
def test_cpu_copier_copies_synchronously_and_holds_nothing() -> None:
    copier = DeviceCopier(torch.device("cpu"))
    pool = torch.arange(2 * 2 * 6 * 4, dtype=torch.float32).view(2, 2, 6, 4, 1, 1)
    host = torch.zeros(2, 2, 4, 4, 1, 1)
    assert copier.demote(host, [0, 1, 3], pool, [4, 5, 1]) is None
    assert torch.equal(host[:, :, [0, 1, 3]], pool[:, :, [4, 5, 1]])
    dst = torch.zeros_like(pool)
    copier.promote(dst, [2, 3], host, [0, 1])
    assert torch.equal(dst[:, :, [2, 3]], pool[:, :, [4, 5]])
    rows = view_to_stack(pool, [0, 2])
    copier.install(dst, [0, 5], rows)
    assert torch.equal(dst[:, :, [0, 5]], pool[:, :, [0, 2]])
    assert copier.hold(None, []) is False and copier.release_done() == [] and copier.num_held == 0
    copier.host_barrier()  # no stream: a no-op


def test_held_demoted_blocks_stay_out_of_the_free_queue_until_their_copy_lands(tiny) -> None:
    """A freed device block must not be reused before its demotion copy finished: while the copy
    is pending the blocks are referenced (not allocatable), the pool stays consistent, and once
    the event completes they return to the free-queue head with no hash."""
    eng = engine_on(tiny, "cpu", pool_blocks=64, host_blocks=32)
    p = prompt_of(100)
    eng.generate([p], SamplingParams(max_tokens=2, ignore_eos=True))
    _, ids = block_ids_of(eng, p)
    pool, tiers = eng.kv_manager.pool, eng.tiers
    blocks = [pool.blocks[i] for i in ids]
    free_before = pool.num_free_blocks()
    copy = PendingCopy()
    with eng._lock:
        tiers._uncache_and_hold(blocks, copy)  # type: ignore[arg-type]
        assert tiers.copier.num_held == len(blocks) == eng.stats()["held_demoted_blocks"]
        assert pool.num_free_blocks() == free_before - len(blocks)
        assert all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
        pool.check_integrity()
        assert tiers.release_held() == 0  # copy still pending
        copy.done = True
        assert tiers.release_held() == len(blocks)
    assert pool.num_free_blocks() == free_before and tiers.copier.num_held == 0
    assert set(pool.free_queue.block_ids()[: len(blocks)]) == set(ids)  # reused first
    eng.check_integrity()


def test_wait_for_transfers_and_flush_release_held_blocks(tiny) -> None:
    eng = engine_on(tiny, "cpu", pool_blocks=64, host_blocks=32)
    eng.generate([prompt_of(80)], SamplingParams(max_tokens=2, ignore_eos=True))
    pool = eng.kv_manager.pool
    for release in (eng.wait_for_transfers, eng.flush):
        blocks = [b for b in pool.free_queue][:3]
        with eng._lock:
            eng.tiers._uncache_and_hold(blocks, PendingCopy())  # type: ignore[arg-type]
        release()
        assert eng.tiers.copier.num_held == 0 and pool.num_free_blocks() == pool.num_blocks
    eng.check_integrity()


# ---- CUDA -----------------------------------------------------------------------------------
def _cuda_model(dtype: torch.dtype = torch.float32) -> LoadedModel:
    from cache_node.model_shapes import random_model

    return random_model("smollm2-135m", dtype, "cuda", seed=0)


@pytest.mark.gpu
def test_device_host_spill_device_round_trips_are_bit_exact(tmp_path: Path) -> None:
    eng = engine_on(_cuda_model(torch.bfloat16), "cuda", pool_blocks=256, host_blocks=64, spill_root=tmp_path)
    p = prompt_of(300)
    eng.generate([p], SamplingParams(max_tokens=1))
    seq, ids = block_ids_of(eng, p)
    snap = eng.pool.read_blocks(ids).clone()
    assert eng.demote_all() == len(ids) and eng.wait_for_transfers()
    slots = [eng.tiers.host.entries[h].slot for h in eng.tiers.kv.block_hashes(seq, len(ids))]
    assert torch.equal(view_to_stack(eng.tiers.host.data, slots), snap.cpu())  # device -> host
    eng.pool.kv.zero_()
    with eng._lock:
        assert len(eng.tiers.promote(seq, [])) == len(ids)
    _, ids = block_ids_of(eng, p)
    assert torch.equal(eng.pool.read_blocks(ids), snap)  # host -> device
    eng.demote_all(to_spill=True)
    assert eng.wait_for_transfers()
    eng.pool.kv.zero_()
    start, hashes = eng.tiers.spill_candidates(seq)
    hits = eng.tiers.spill.get(hashes)  # type: ignore[union-attr]
    assert start == 0 and len(hits.hashes) == len(ids)
    assert torch.equal(from_numpy(hits.blocks, eng.pool.kv.dtype), snap.cpu())  # device -> spill
    with eng._lock:
        assert eng.tiers.install(seq, start, from_numpy(hits.blocks, eng.pool.kv.dtype), hits.tiers) == len(ids)
    _, ids = block_ids_of(eng, p)
    assert torch.equal(eng.pool.read_blocks(ids), snap)  # spill -> device
    eng.check_integrity()


@pytest.mark.gpu
def test_copy_stream_events_order_promotion_before_reads_and_demotion_before_reuse() -> None:
    """With the copy stream held busy (a spin kernel), a step-stream read of promoted blocks
    still sees their bytes, and a step-stream overwrite of demoted blocks never reaches the
    host copy: the compute stream waits on the copies' events."""
    copier = DeviceCopier(torch.device("cuda"))
    pool = torch.randn(4, 2, 64, 16, 2, 8, device="cuda")
    host = torch.zeros(4, 2, 64, 16, 2, 8, pin_memory=True)
    src = pool[:, :, 10:30].clone()
    assert copier.copy_stream is not None
    with torch.cuda.stream(copier.copy_stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of copy-stream work queued first
    event = copier.demote(host, list(range(20)), pool, list(range(10, 30)))
    copier.order_reuse(event)
    pool[:, :, 10:30].fill_(7.0)  # the reuse, on the compute stream
    torch.cuda.synchronize()
    assert torch.equal(host[:, :, :20], src.cpu())
    with torch.cuda.stream(copier.copy_stream):
        torch.cuda._sleep(200_000_000)
    copier.promote(pool, list(range(40, 60)), host, list(range(20)))
    read = pool[:, :, 40:60].clone()  # a step reading the promoted blocks
    torch.cuda.synchronize()
    assert torch.equal(read, src)
    rows = view_to_stack(host, [0, 1, 2])
    with torch.cuda.stream(copier.copy_stream):
        torch.cuda._sleep(200_000_000)
    copier.install(pool, [61, 62, 63], rows)
    assert torch.equal(pool[:, :, 61:64].clone().cpu(), src[:, :, :3].cpu())


@pytest.mark.gpu
def test_pitched_copies_equal_row_copies_on_scattered_blocks() -> None:
    """One ``cudaMemcpy2DAsync`` per run (memcpy2d) moves the same bytes as ``2 * L`` copies
    per run, both ways, for scattered and reversed ids in a bf16 pool; and it is the backend
    in use where cuda.bindings or CuPy is installed (both are on the acceptance GPU)."""
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(6, 2, 96, 16, 2, 8, generator=g).to(torch.bfloat16).cuda()
    src_ids = [5, 6, 7, 40, 39, 38, 90, 12, 13, 70]
    slots = [0, 1, 2, 3, 4, 5, 10, 11, 12, 30]
    hosts = []
    for pitched in (True, False):
        copier = DeviceCopier(torch.device("cuda"))
        if not pitched:
            copier._memcpy2d = None
        host = torch.zeros(6, 2, 32, 16, 2, 8, dtype=torch.bfloat16, pin_memory=True)
        copier.demote(host, slots, pool, src_ids)
        back = torch.zeros_like(pool)
        copier.promote(back, src_ids, host, slots)
        torch.cuda.synchronize()
        assert torch.equal(back[:, :, src_ids], pool[:, :, src_ids])
        hosts.append(host)
        if pitched:
            assert copier.copy_backend in ("memcpy2d:cuda.bindings", "memcpy2d:cupy"), copier.copy_backend
            assert copier.copy_calls == 2 * 7  # 7 runs each way, one call each
    assert torch.equal(hosts[0], hosts[1])


@pytest.mark.gpu
def test_held_blocks_wait_for_a_busy_copy_stream() -> None:
    eng = engine_on(_cuda_model(), "cuda", pool_blocks=128, host_blocks=64)
    eng.generate([prompt_of(400)], SamplingParams(max_tokens=1))
    with torch.cuda.stream(eng.tiers.copier.copy_stream):
        torch.cuda._sleep(200_000_000)
    n = eng.demote_all()
    assert n > 0 and eng.tiers.copier.num_held == n  # not reusable while the copy is queued
    assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks - n
    eng.wait_for_transfers()
    assert eng.tiers.copier.num_held == 0
    assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks
    eng.check_integrity()


@pytest.mark.gpu
def test_soak_300_requests_on_cuda_ends_with_every_block_free(tmp_path: Path) -> None:
    """300 requests over shared prefixes through a small pool with host and spill tiers: blocks
    are demoted, promoted, preempted and reused; at the end every block is free and the pool's
    bookkeeping is clean."""
    eng = engine_on(_cuda_model(), "cuda", pool_blocks=160, host_blocks=96, spill_root=tmp_path,
                    max_num_seqs=16)
    rng = random.Random(0)
    prefixes = [prompt_of(rng.randint(32, 200), offset=k * 37) for k in range(12)]
    done = 0
    for wave in range(10):
        ids = []
        for _ in range(30):
            p = rng.choice(prefixes) + [rng.randint(1, 499) for _ in range(rng.randint(1, 120))]
            ids.append(eng.add_request(p, SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)))
        while eng.has_unfinished_requests():
            done += sum(1 for o in eng.step() if o.finished)
        if wave % 3 == 2:
            eng.demote_all(to_spill=wave % 2 == 0)
        eng.check_integrity()
    assert done == 300
    assert eng.wait_for_transfers()
    pool = eng.kv_manager.pool
    assert pool.num_free_blocks() == pool.num_blocks and eng.tiers.copier.num_held == 0
    stats = eng.stats()
    assert stats["demoted_blocks"] > 0 and stats["promoted_host_blocks"] > 0
    eng.check_integrity()


def test_promotion_pairs_ascending_slots_with_ascending_block_ids(tiny) -> None:
    """Regression: promoted blocks came from the free queue in whatever order it held them
    (often descending ids), so consecutive host slots met non-consecutive device ids and every
    block became its own copy (2 * num_layers tiny copies each on CUDA). They are now paired
    in order, and a restored prefix comes back as one run."""
    from cache_node.tiers.runs import runs

    eng = engine_on(tiny, "cpu", pool_blocks=64, host_blocks=32)
    p = prompt_of(200)
    eng.generate([p], SamplingParams(max_tokens=1))
    seq, _ = block_ids_of(eng, p)
    eng.demote_all()
    eng.wait_for_transfers()
    hashes = eng.tiers.kv.block_hashes(seq, (len(p) - 1) // 16)
    slots = [eng.tiers.host.entries[h].slot for h in hashes]
    pool = eng.kv_manager.pool
    with eng._lock:
        taken = pool.allocate(pool.num_free_blocks())
        assert taken is not None
        pool.free(sorted(taken, key=lambda b: -b.block_id))  # free queue: descending ids
        restored = [b.block_id for b in eng.tiers.promote(seq, [])]
    assert len(runs(slots, restored)) == len(runs(slots, sorted(restored)))
    assert sorted(zip(slots, restored)) == list(zip(sorted(slots), sorted(restored)))
    eng.check_integrity()
