"""The spill-put backlog is bounded, fair among tenants, and a dropped write is only a miss.

Regression (security review, secrev20 S2): the transfer worker queued every host-tier victim
batch, with a copy of its KV, for a spill put and nothing bounded the queue; while a spill node
stalled (a disk stall, a restart: every put then waits out its timeout) a cache node's RAM grew
with every block any tenant evicted (6.4 MB after 80 tiny-model prompts, without end). The
queue is now bounded by ``TierConfig.spill_put_backlog_bytes`` and past it the tenant with the
most queued loses its oldest writes; and a put that timed out is cancelled on its spill node.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cache_node.hashing import hash_prompt_blocks
from cache_node.tiers.host import BlockMeta, Victims
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_backlog import SpillBacklog
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillHits, SpillStore
from tests.conftest import node_metric
from tests.test_tier_engine import BLOCK_BYTES, PARAMS, by_tier, prompt_of, run, tiered

A, B = "tenant:a", "tenant:b"


class Stalled(SpillStore):
    """A spill node whose puts wait for ``gate`` (a disk stall); ``entered`` once one waits."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.gate, self.entered = threading.Event(), threading.Event()

    def put(self, hashes, blocks, namespace, token_ids=None, weight=1.0):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(60)
        return super().put(hashes, blocks, namespace, token_ids, weight)


def stalled_engine(tiny, root: Path, bound_blocks: int, host_blocks: int = 16):
    probe = tiered(tiny)
    store = Stalled(root, BlockFormat(*probe.spill_block_spec()), 1 << 20, 1 << 30)
    eng = tiered(tiny, spill=store, pool_blocks=64, host_bytes=host_blocks * BLOCK_BYTES,
                 auto_prefetch=False, spill_put_backlog_bytes=bound_blocks * BLOCK_BYTES)
    return eng, store


def held_bytes(eng) -> int:
    """KV bytes the backlog's tensors really keep (queued batches and the one being written)."""
    backlog = eng.tiers.worker.backlog
    with eng.tiers.worker._cond:
        queued = sum(b.blocks.nbytes for b in backlog._batches.values())
        return queued + sum(backlog._in_flight.values()) * BLOCK_BYTES


def index_of(events) -> dict[str, set[bytes]]:
    """tier -> hashes that the stored/removed events (as the global block index reads them)
    say the tier holds."""
    held: dict[str, set[bytes]] = {}
    for event, block_hash, tier in events:
        (held.setdefault(tier, set()).add if event == "stored" else held.setdefault(tier, set()).discard)(block_hash)
    return held


def test_a_stalled_spill_node_keeps_the_backlog_within_its_bound(tiny, tmp_path) -> None:
    """secrev20 S2: 40 distinct prompts through a 16-slot host tier while every spill put
    stalls; the backlog stays at its 32-block bound (it grew ~10 blocks a prompt, unbounded),
    every evicted block is written or counted dropped, and after the stall every index entry
    is true and every prompt's output equals its cold run."""
    eng, store = stalled_engine(tiny, tmp_path, bound_blocks=32)
    prompts = [prompt_of(160, 1000 + i) for i in range(40)]
    cold = [out.output_token_ids for out in tiered(tiny).generate(prompts[:3], PARAMS)]
    for p in prompts:
        eng.generate([p], PARAMS)
        eng.demote_all()
        stats = eng.stats()
        assert stats["spill_put_backlog_bytes"] <= 32 * BLOCK_BYTES
        assert held_bytes(eng) == stats["spill_put_backlog_bytes"]
    stats = eng.stats()
    evicted = stats["demoted_blocks"] - stats["host_blocks"]  # host victims, all spillable
    assert evicted == 40 * 10 - 16
    assert stats["spill_put_backlog_blocks"] == 32 and held_bytes(eng) == 32 * BLOCK_BYTES
    assert stats["spill_put_dropped_blocks"] == evicted - 32
    assert node_metric(eng, "kvstrata:spill_put_dropped_blocks_total") == evicted - 32
    assert node_metric(eng, "kvstrata:spill_put_backlog_bytes") == 32 * BLOCK_BYTES
    store.gate.set()
    assert eng.wait_for_transfers()
    eng.check_integrity()
    stats = eng.stats()
    assert (stats["spill_put_blocks"], stats["spill_put_backlog_bytes"]) == (32, 0)
    assert store.stats()["blocks_spill_ram"] + store.stats()["blocks_spill_disk"] == 32
    index = index_of([tuple(e) for e in eng.take_tier_events()] + [tuple(e) for e in store.take_events()])
    spilled = index.get("spill_ram", set()) | index.get("spill_disk", set())
    assert len(spilled) == 32 and all(store.contains(list(spilled)))
    # the dropped blocks are claimed by no tier: a later miss (recompute), never a wrong hit
    everything = {h for p in prompts for h in hash_prompt_blocks(p, 16, ("default", eng.model_id, eng.kv_format))}
    claimed = set().union(*index.values())
    assert len(everything - claimed) == evicted - 32
    assert [run(eng, p).output_token_ids for p in prompts[:3]] == cold
    eng.check_integrity()


def test_one_tenants_flood_drops_its_own_queued_writes_not_anothers(tiny, tmp_path) -> None:
    """secrev20 S2, fairness: while a spill put stalls, B queues one prompt's blocks, then A
    streams 10 prompts past the 32-block bound. A's oldest queued writes go (88 blocks); B's
    10 stay queued, are written once the node recovers, and B's rerun is served from spill."""
    eng, store = stalled_engine(tiny, tmp_path, bound_blocks=32)
    b_prompt = prompt_of(160, 7)
    eng.generate([prompt_of(160, 100)], PARAMS, cache_namespace=A)
    eng.demote_all(to_spill=True)
    assert store.entered.wait(10)  # A's first 10 blocks are being written (stalled)
    eng.generate([b_prompt], PARAMS, cache_namespace=B)
    eng.demote_all(to_spill=True)
    for k in range(10):
        eng.generate([prompt_of(160, 200 + k)], PARAMS, cache_namespace=A)
        eng.demote_all(to_spill=True)
    backlog = eng.tiers.worker.backlog
    assert backlog.queued_by_holder() == {A: 12, B: 10}
    assert backlog.num_blocks == 32 and eng.stats()["spill_put_dropped_blocks"] == 110 - 10 - 12
    store.gate.set()
    assert eng.wait_for_transfers()
    eng.check_integrity()
    assert eng.stats()["spill_put_blocks"] == 32
    b_hashes = hash_prompt_blocks(b_prompt, 16, (B, eng.model_id, eng.kv_format))
    assert all(store.contains(b_hashes))
    again = run(eng, b_prompt, cache_namespace=B, prefetch=True)
    assert again.num_cached_tokens_by_tier == by_tier(spill_ram=144)


def victims(*spec: tuple[str, int]) -> Victims:
    """One batch: ``n`` blocks of each ``(namespace, n)``, block ``i`` filled with ``i``."""
    metas = [BlockMeta(bytes([k, i]) + bytes(30), (i,), ns) for k, (ns, n) in enumerate(spec) for i in range(n)]
    blocks = torch.arange(len(metas), dtype=torch.float32).reshape(-1, 1).repeat(1, 4)
    return Victims(metas, blocks)


def test_backlog_drops_the_largest_holders_oldest_first_and_releases_their_kv() -> None:
    """Exact order: with 6 blocks allowed, A (4 queued, then 3 arriving) loses its 3 oldest
    queued blocks, B (2) loses none; the dropped rows' KV is no longer referenced."""
    backlog = SpillBacklog(6)
    assert backlog.add(victims((A, 4), (B, 2))) == 0
    assert backlog.add(victims((A + "#salt=x", 3))) == 3  # a salt is no extra share
    assert backlog.queued_by_holder() == {A: 4, B: 2}
    first = backlog.take()
    assert first is not None and [m.namespace for m in first.metas] == [A, B, B]
    assert first.blocks[:, 0].tolist() == [3.0, 4.0, 5.0]  # the batch kept a copy of 3 rows
    assert backlog.num_blocks == 6 and backlog.queued_by_holder() == {A: 3}
    # in flight counts toward the bound and its holders' holdings (A 1 + 3, B 2 + 2 arriving:
    # one each), and is never dropped
    assert backlog.add(victims((B, 2))) == 2
    assert backlog.queued_by_holder() == {A: 2, B: 1}
    backlog.done()
    assert backlog.num_blocks == 3 and backlog.clear() == 3 and backlog.take() is None


def test_an_arriving_holders_refused_blocks_are_its_chain_tails() -> None:
    """A holder over the others with nothing queued to give up is refused its arriving
    blocks, first rows first (a chain's tail leaves the host tier first): heads stay."""
    backlog = SpillBacklog(4)
    assert backlog.add(victims((B, 2))) == 0
    assert backlog.add(victims((A, 5))) == 3
    batch_b = backlog.take()
    assert batch_b is not None and [m.namespace for m in batch_b.metas] == [B, B]
    backlog.done()
    batch_a = backlog.take()
    assert batch_a is not None and [m.token_ids for m in batch_a.metas] == [(3,), (4,)]


def test_backlog_bound_of_zero_blocks_drops_every_write_and_blocks_without_a_spill_hash() -> None:
    backlog = SpillBacklog(0)
    assert backlog.add(victims((A, 3))) == 3 and backlog.num_blocks == 0
    short = Victims([BlockMeta(b"x" * 8, (1,), A)], torch.zeros(1, 4))
    assert SpillBacklog(4).add(short) == 0  # never written (not a spill hash), never queued
    with pytest.raises(ValueError, match="max_blocks"):
        SpillBacklog(-1)


def test_the_backlog_bound_is_a_validated_setting() -> None:
    from pydantic import ValidationError

    from services.config import NodeConfig

    assert TierConfig().spill_put_backlog_bytes == NodeConfig().spill_put_backlog_bytes == 64 << 20
    with pytest.raises(ValueError, match="spill_put_backlog_bytes"):
        TierConfig(spill_put_backlog_bytes=0)
    with pytest.raises(ValidationError, match="spill_put_backlog_bytes"):
        NodeConfig(spill_put_backlog_bytes=0)


def test_the_node_config_bound_reaches_the_engine() -> None:
    from bench.chaos_stack import tiny_checkpoint
    from services.cache_node import CacheNode
    from services.config import NodeConfig

    config = NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=1 << 20, host_bytes=0,
                        spill_put_backlog_bytes=12345)
    node = CacheNode("n0", config, num_threads=1)
    try:
        assert node.engine.tiers.config.spill_put_backlog_bytes == 12345
    finally:
        node.shutdown()


def test_the_ray_spill_client_sends_no_put_behind_one_that_timed_out(monkeypatch) -> None:
    """secrev20 S2, related: a put that timed out stayed queued on the stalled spill node with
    its blocks pinned in the object store, and every later put (one per timeout) added another
    behind it. Now a node whose last put timed out and still runs gets no new put (a dropped
    write, ``put_skipped``) until that put ends; gets are unaffected."""
    import services.spill_client as sc

    sent: list[tuple[str, int]] = []
    running: set[tuple[str, int]] = set()  # refs of calls not finished

    class FakeRay:
        @staticmethod
        def wait(refs, num_returns, timeout):  # type: ignore[no-untyped-def]
            return [r for r in refs if r not in running], [r for r in refs if r in running]

        @staticmethod
        def get(ref):  # type: ignore[no-untyped-def]
            # a put stores its 3 blocks; a get finds none
            return 3 if ref[0] == "put" else SpillHits([], np.empty((0, *shape), np.float32), [])

    class Method:
        def __init__(self, name: str) -> None:
            self.name = name

        def remote(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            ref = (self.name, len(sent))
            sent.append(ref)
            if stalled:
                running.add(ref)
            return ref

    class Node:
        put, get = Method("put"), Method("get")

    monkeypatch.setattr(sc, "ray", FakeRay)
    shape = (2, 2, 16, 2, 16)
    client = sc.RaySpillClient([Node()], shape, "float32", put_timeout_s=0.01)
    hashes, rows = [bytes([i]) * 32 for i in range(3)], np.zeros((3, *shape), np.float32)
    stalled = True
    assert client.put(hashes, rows, A) == 0 and sent == [("put", 0)]  # timed out
    assert client.put(hashes, rows, A) == 0 and client.put(hashes, rows, A) == 0
    assert sent == [("put", 0)]  # nothing more sent, nothing more pinned
    assert len(client.get(hashes).hashes) == 0 and sent == [("put", 0), ("get", 1)]
    assert client.stats() == {"put_failures": 1, "put_skipped": 2, "get_failures": 1}
    stalled = False
    running.clear()  # the late put ended
    assert client.put(hashes, rows, A) == 3 and sent[-1] == ("put", 2)
