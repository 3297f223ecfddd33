"""Tier fault matrix: every spill fault is a miss (recompute), never wrong KV or a counted hit."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cache_node.hashing import hash_prompt_blocks
from cache_node.tiers import spill_format
from cache_node.tiers.spill_format import BlockFormat, read_header
from cache_node.tiers.spill_store import SpillHits, SpillStore
from tests.test_tier_engine import BLOCK_BYTES, PARAMS, by_tier, prompt_of, run, tiered

P = prompt_of(200, 11)  # 12 reusable blocks


def disk_engine(tiny, root: Path, store_cls: type[SpillStore] = SpillStore):
    """(engine, store, cold output) with P's 12 blocks in spill disk files only."""
    probe = tiered(tiny)
    store = store_cls(root, BlockFormat(*probe.spill_block_spec()), 0, 1 << 30, max_blocks_per_file=4)
    eng = tiered(tiny, spill=store)
    cold = run(eng, P)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert store.stats()["blocks_spill_disk"] == 12 and len(files(root)) == 3
    return eng, store, cold


def files(root: Path) -> list[Path]:
    return sorted(root.glob("*.kvs"))


def file_of_block(eng, root: Path, index: int) -> Path:
    """The group file holding block ``index`` of P (files group 4 blocks each)."""
    hashes = hash_prompt_blocks(P, 16, ("default", eng.model_id, eng.kv_format))
    (path,) = [f for f in files(root) if hashes[index] in read_header(f).block_hashes]
    return path


def assert_recomputed(eng, cold, spill_disk_tokens: int) -> None:
    out = run(eng, P)
    assert out.output_token_ids == cold.output_token_ids
    assert out.num_cached_tokens_by_tier == by_tier(spill_disk=spill_disk_tokens)


def test_deleted_spill_file_is_a_miss(tiny, tmp_path) -> None:
    """Fault: one group file deleted; the blocks before it still hit, the rest recompute."""
    eng, _, cold = disk_engine(tiny, tmp_path)
    file_of_block(eng, tmp_path, 4).unlink()  # blocks 4..7
    assert_recomputed(eng, cold, 4 * 16)


def test_truncated_spill_file_is_a_miss(tiny, tmp_path) -> None:
    """Fault: the first group file cut short; nothing past it is contiguous, all recompute."""
    eng, store, cold = disk_engine(tiny, tmp_path)
    path = file_of_block(eng, tmp_path, 0)
    os.truncate(path, path.stat().st_size - 100)
    assert_recomputed(eng, cold, 0)
    assert store.stats()["corrupt_reads"] == 1


def test_flipped_bytes_in_spill_file_are_a_miss(tiny, tmp_path) -> None:
    """Fault: bit rot in the last file's payload (block 11, its last); that block's checksum
    turns it into a miss, and the output equals the cold run. Regression (review 26b F3): the
    whole file (blocks 8-11) was dropped; now blocks 8-10 still hit from it."""
    eng, store, cold = disk_engine(tiny, tmp_path)
    path = file_of_block(eng, tmp_path, 8)
    data = bytearray(path.read_bytes())
    data[-50:-40] = bytes(b ^ 0xFF for b in data[-50:-40])
    path.write_bytes(bytes(data))
    assert_recomputed(eng, cold, 11 * 16)
    stats = store.stats()
    assert (stats["corrupt_reads"], stats["corrupt_blocks"], stats["quarantined_files"]) == (1, 1, 0)


def test_transient_disk_error_recomputes_and_keeps_the_files(tiny, tmp_path, monkeypatch) -> None:
    """issue 18 fault 5: EIO on every spill file read: the request recomputes (output equals
    cold), no file is touched, and once the disk recovers the same blocks hit again."""
    eng, store, cold = disk_engine(tiny, tmp_path)
    before = {f.name: f.read_bytes() for f in files(tmp_path)}

    def failing_open(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(spill_format, "open", failing_open, raising=False)
    assert_recomputed(eng, cold, 0)
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in files(tmp_path)} == before
    stats = store.stats()
    assert (stats["io_errors"], stats["blocks_spill_disk"], stats["corrupt_reads"]) == (3, 12, 0)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert_recomputed(eng, cold, 12 * 16)


def test_spill_block_stored_with_other_tokens_is_not_served(tiny, tmp_path) -> None:
    """issue 18 fault 6: a spill hit checks tokens as the device and host tiers do: blocks
    held under P's exact hashes but put with other token ids (and garbage KV) are misses,
    counted, and the output equals the cold run."""
    probe = tiered(tiny)
    cold = run(probe, P)
    block_format = BlockFormat(*probe.spill_block_spec())
    store = SpillStore(tmp_path, block_format, 0, 1 << 30)
    hashes = hash_prompt_blocks(P, 16, ("default", probe.model_id, probe.kv_format))[:12]
    other = [[t + 1 for t in P[i * 16 : (i + 1) * 16]] for i in range(12)]
    store.put(hashes, np.full((12, *block_format.shape), 7, block_format.np_dtype), "default", other)
    assert store.stats()["blocks_spill_disk"] == 12
    out = run(tiered(tiny, spill=store), P)
    assert out.num_cached_tokens_by_tier == by_tier()
    assert out.output_token_ids == cold.output_token_ids
    stats = store.stats()
    assert (stats["token_mismatches"], stats["hits_spill_disk"]) == (12, 0)


def test_spill_reader_that_raises_is_a_miss(tiny, tmp_path) -> None:
    """Fault: the client's get raises (I/O error, dead node); the node keeps serving."""

    class Raising(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            raise OSError("disk on fire")

    eng, _, cold = disk_engine(tiny, tmp_path, Raising)
    assert_recomputed(eng, cold, 0)
    assert eng.stats()["spill_get_errors"] == 2  # the cold run's prefetch and the resend's


def test_spill_reply_of_wrong_dtype_is_a_miss(tiny, tmp_path) -> None:
    """Fault: a reply whose rows are not the asked format is not trusted as KV."""

    class Wrong(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            hits = super().get(hashes, token_ids)
            return SpillHits(hits.hashes, hits.blocks.astype(np.float64), hits.tiers)

    eng, _, cold = disk_engine(tiny, tmp_path, Wrong)
    assert_recomputed(eng, cold, 0)


@pytest.mark.parametrize("fault", ["tier", "hash", "fields"])
def test_spill_reply_of_unknown_tier_or_wrong_types_is_a_miss(tiny, tmp_path, fault) -> None:
    """Fault: a reply with the asked hashes, shape and dtype but a tier name the engine does
    not know (regression: a KeyError in the step's per-tier accounting killed the node's step
    loop), hashes that are not bytes, or fields that are not sequences: a miss, counted."""

    class Wrong(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            hits = super().get(hashes, token_ids)
            if fault == "tier":
                return SpillHits(hits.hashes, hits.blocks, ["bogus"] * len(hits.hashes))
            if fault == "hash":
                return SpillHits([h.hex() for h in hits.hashes], hits.blocks, hits.tiers)
            return SpillHits(7, hits.blocks, None)  # type: ignore[arg-type]

    eng, _, cold = disk_engine(tiny, tmp_path, Wrong)
    assert_recomputed(eng, cold, 0)
    assert eng.stats()["spill_bad_replies"] >= (fault != "hash")  # hex strings answer no asked hash


def test_spill_get_slower_than_prefetch_wait_recomputes(tiny, tmp_path) -> None:
    """Fault: a hung transfer; the request stops waiting after prefetch_wait_s and recomputes."""
    release = threading.Event()

    class Hung(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super().get(hashes, token_ids)

    probe = tiered(tiny)
    store = Hung(tmp_path, BlockFormat(*probe.spill_block_spec()), 0, 1 << 30)
    eng = tiered(tiny, spill=store, prefetch_wait_s=0.2)
    t0 = time.monotonic()
    out = eng.generate([P], PARAMS)[0]
    assert time.monotonic() - t0 < 5 and out.num_cached_tokens == 0
    release.set()
    eng.wait_for_transfers()
    eng.check_integrity()


def test_cancel_during_prefetch_releases_everything(tiny, tmp_path) -> None:
    """Fault: abort while blocks are in flight, x200; integrity holds, free blocks at baseline."""

    class Slowish(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            time.sleep(0.001)
            return super().get(hashes, token_ids)

    eng, _, cold = disk_engine(tiny, tmp_path, Slowish)
    baseline = eng.stats()["free_blocks"] + eng.stats()["cached_blocks"]
    for i in range(200):
        rid = eng.add_request(P, PARAMS)
        if i % 2:
            eng.step()
        eng.abort_request(rid)
        eng.step()
    eng.wait_for_transfers()
    eng.check_integrity()
    stats = eng.stats()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] + stats["cached_blocks"] == baseline
    assert run(eng, P).output_token_ids == cold.output_token_ids


def test_identical_prompts_while_first_is_being_written_equal_cold(tiny, tmp_path) -> None:
    """Fault: two identical long prompts 0-50 ms apart while the first's KV is still being
    written to spill; both must equal the cold output."""
    gate = threading.Event()

    class SlowPut(SpillStore):
        def put(self, hashes, blocks, namespace, token_ids=None, weight=1.0):  # type: ignore[no-untyped-def]
            gate.wait(5)
            return super().put(hashes, blocks, namespace, token_ids, weight)

    probe = tiered(tiny)
    store = SlowPut(tmp_path, BlockFormat(*probe.spill_block_spec()), 1 << 20, 1 << 30)
    long_p = prompt_of(400, 12)
    eng = tiered(tiny, spill=store, host_bytes=0)
    cold = tiered(tiny).generate([long_p], PARAMS)[0]
    for gap_s in (0.0, 0.02, 0.05):
        gate.clear()
        first = eng.add_request(long_p, PARAMS)
        t0, second, outs = time.monotonic(), None, {}
        while len(outs) < 2:
            if second is None and time.monotonic() - t0 >= gap_s:
                second = eng.add_request(long_p, PARAMS)
            outs.update({o.request_id: o for o in eng.step() if o.finished})
            if second is not None and len(outs) == 1:
                eng.demote_all(to_spill=True)  # first's blocks head to a spill put that waits
        gate.set()
        eng.wait_for_transfers()
        assert outs[first].output_token_ids == outs[second].output_token_ids == cold.output_token_ids
        eng.check_integrity()


def test_restarted_spill_store_serves_disk_hits_without_rewriting(tiny, tmp_path) -> None:
    """Fault: the spill node restarts (RAM lost); disk hits survive, files are not rewritten."""
    eng, store, cold = disk_engine(tiny, tmp_path)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in files(tmp_path)}
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, store.block_format, 0, 1 << 30, max_blocks_per_file=4)
    eng.tiers.spill = eng.tiers.worker.spill = restarted  # type: ignore[union-attr]
    assert_recomputed(eng, cold, 192)
    eng.demote_all(to_spill=True)  # the same blocks go down again: a touch, not a write
    eng.wait_for_transfers()
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in files(tmp_path)}
    assert after == before


def test_flush_then_resend_has_no_cached_tokens_in_any_tier(tiny, tmp_path) -> None:
    """Fault: stale KV after Flush; every tier must be empty and the resend fully cold."""
    probe = tiered(tiny)
    store = SpillStore(tmp_path, BlockFormat(*probe.spill_block_spec()), 8 * BLOCK_BYTES, 1 << 30)
    eng = tiered(tiny, spill=store, host_bytes=4 * BLOCK_BYTES)
    for k in range(3):  # spread blocks over device, host, spill RAM and disk
        run(eng, prompt_of(200, 20 + k))
        eng.demote_all()
    eng.demote_all(to_spill=True)
    run(eng, prompt_of(200, 20))
    assert eng.flush() > 0
    eng.wait_for_transfers()
    stats, spill = eng.stats(), store.stats()
    assert (stats["cached_blocks"], stats["host_blocks"]) == (0, 0)
    assert (spill["blocks_spill_ram"], spill["blocks_spill_disk"], spill["files"]) == (0, 0, 0)
    for k in range(3):
        out = run(eng, prompt_of(200, 20 + k))
        assert out.num_cached_tokens_by_tier == by_tier()
        eng.flush()


def test_the_ray_spill_client_refuses_replies_it_would_broadcast_or_cast(monkeypatch) -> None:
    """Regression (security review): ``RaySpillClient.get`` copied each spill node's rows into
    an array of the pool's shape and dtype, so numpy broadcast a (n, 1) reply and cast a
    float64 one into KV that the engine's own check then accepted as hits. A reply that is
    not exactly (n, *block_shape) of the pool's dtype, or answers hashes not asked, is a miss."""
    import numpy as np

    import services.spill_client as sc
    from cache_node.tiers.spill_store import SpillHits

    class Ref:
        def __init__(self, value) -> None:  # type: ignore[no-untyped-def]
            self.value = value

    class FakeRay:  # ray.wait / ray.get over plain values
        @staticmethod
        def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
            return list(refs), []

        @staticmethod
        def get(ref):  # type: ignore[no-untyped-def]
            return ref.value

    class Node:
        def __init__(self, blocks, extra=b"") -> None:  # type: ignore[no-untyped-def]
            self.blocks, self.extra = blocks, extra
            self.get = self

        def remote(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            hashes = list(hashes) + ([self.extra] if self.extra else [])
            return Ref(SpillHits(hashes, self.blocks(len(hashes)), ["spill_ram"] * len(hashes)))

    monkeypatch.setattr(sc, "ray", FakeRay)
    shape, asked = (2, 2, 16, 3, 64), [bytes([i]) * 32 for i in range(3)]
    good = lambda n: np.ones((n, *shape), np.int16)
    for blocks, extra, hits in ((good, b"", 3), (lambda n: np.full((n, 1), 7, np.int16), b"", 0),
                                (lambda n: np.full((n, *shape), 1e9, np.float64), b"", 0),
                                (good, b"\x09" * 32, 0)):
        client = sc.RaySpillClient([Node(blocks, extra)], shape, "int16")
        reply = client.get(asked, [[1] * 16] * 3)
        assert len(reply.hashes) == hits and reply.blocks.shape == (hits, *shape)
        assert client.stats().get("get_failures", 0) == (0 if hits else 1)
