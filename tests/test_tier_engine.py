"""Tiered engine on the tiny Llama: exact restores from every tier, movement, sessions, events."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_format import BlockFormat, read_header
from cache_node.tiers.spill_store import SpillStore

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny Llama float32 block: (L=2, 2, 16, H_kv=2, d=16)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


MADE: weakref.WeakSet[LLMEngine] = weakref.WeakSet()
"""Every engine ``tiered`` made and not collected yet (``_closed`` closes this module's)."""


def tiered(lm: LoadedModel, spill: object = None, pool_blocks: int = 128, **tier: object) -> LLMEngine:
    cfg = EngineConfig(block_size=16, kv_pool_bytes=pool_blocks * BLOCK_BYTES,
                       max_num_batched_tokens=64, max_num_seqs=8)
    tc = TierConfig(**{"host_bytes": 64 * BLOCK_BYTES, **tier})  # type: ignore[arg-type]
    eng = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, tier_config=tc, spill=spill)  # type: ignore[arg-type]
    MADE.add(eng)
    return eng


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Each test's engines are closed after it: their transfer threads end and their tiers are
    freed (before, each engine with a spill tier left its ``kv-transfer`` thread waiting)."""
    before = set(MADE)
    yield
    for eng in set(MADE) - before:
        eng.close()


def store_for(eng: LLMEngine, root: Path, ram_blocks: int = 256) -> SpillStore:
    return SpillStore(root, BlockFormat(*eng.spill_block_spec()), ram_blocks * BLOCK_BYTES, 1 << 30)


def run(eng: LLMEngine, prompt: list[int], **kw: str):
    out = eng.generate([prompt], PARAMS, **kw)[0]
    eng.wait_for_transfers()
    eng.check_integrity()
    return out


def by_tier(**counts: int) -> dict[str, int]:
    return {"device": 0, "host": 0, "spill_ram": 0, "spill_disk": 0} | counts


def test_every_tier_restores_token_identical_output(tiny, tmp_path) -> None:
    """device -> host -> spill RAM -> spill disk -> back: greedy output equals the cold run."""
    eng = tiered(tiny)
    eng = tiered(tiny, spill=store_for(eng, tmp_path))
    store = eng.tiers.spill
    p = prompt_of(200)  # 12 full blocks are reusable (the last token is always recomputed)
    cold = run(eng, p)
    assert cold.num_cached_tokens_by_tier == by_tier()
    assert run(eng, p).num_cached_tokens_by_tier == by_tier(device=192)
    assert eng.demote_all() == 12 and eng.stats()["host_blocks"] == 12
    host = run(eng, p)
    assert host.num_cached_tokens_by_tier == by_tier(host=192)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert eng.stats()["host_blocks"] == 0 and store.stats()["blocks_spill_ram"] == 12
    ram = run(eng, p)
    assert ram.num_cached_tokens_by_tier == by_tier(spill_ram=192)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert store.demote_to_disk() == 12
    disk = run(eng, p)
    assert disk.num_cached_tokens_by_tier == by_tier(spill_disk=192)
    for out in (host, ram, disk):
        assert out.output_token_ids == cold.output_token_ids and out.num_cached_tokens == 192


def test_watermark_demotes_lru_cached_blocks_to_host(tiny) -> None:
    """Free un-cached blocks below 50% of 32 -> LRU cached blocks copied down up to 75%."""
    eng = tiered(tiny, pool_blocks=32, demote_low_watermark=0.0, demote_high_watermark=0.0)
    a, b = prompt_of(200, 1), prompt_of(200, 2)  # 207 tokens of KV each: 12 full blocks
    cold = run(eng, a)
    run(eng, b)
    stats = eng.stats()
    assert (stats["free_blocks"], stats["cached_blocks"], stats["host_blocks"]) == (8, 24, 0)
    eng.tiers.config = TierConfig(host_bytes=64 * BLOCK_BYTES, demote_low_watermark=0.5,
                                  demote_high_watermark=0.75)
    eng.take_tier_events()
    eng.step()
    stats = eng.stats()
    assert (stats["free_blocks"], stats["cached_blocks"], stats["host_blocks"]) == (24, 8, 16)
    events = eng.take_tier_events()
    moved = [e.block_hash for e in events if e.tier == "host"]
    assert [e.block_hash for e in events if e.tier == "device"] == moved and len(moved) == 16
    assert {(e.event, e.tier) for e in events} == {("removed", "device"), ("stored", "host")}
    again = run(eng, a)  # a was freed first, so all of it went down
    assert again.num_cached_tokens_by_tier == by_tier(host=192)
    assert again.output_token_ids == cold.output_token_ids


def test_allocation_copies_cached_blocks_down_before_dropping_them(tiny) -> None:
    """Watermark off: an allocation that reaches cached blocks demotes them (evict hook)."""
    eng = tiered(tiny, pool_blocks=16, demote_low_watermark=0.0, demote_high_watermark=0.0)
    a = prompt_of(150, 3)
    cold = run(eng, a)
    run(eng, prompt_of(200, 4))  # needs 13 blocks: evicts a's cached blocks to host
    again = run(eng, a)
    assert again.num_cached_tokens_by_tier["host"] > 0 and again.num_cached_tokens == 144
    assert again.output_token_ids == cold.output_token_ids


def test_host_eviction_pushes_batches_to_spill(tiny, tmp_path) -> None:
    calls: list[int] = []

    class Counting(SpillStore):
        def put(self, hashes, blocks, namespace, token_ids=None, weight=1.0):  # type: ignore[no-untyped-def]
            calls.append(len(hashes))
            return super().put(hashes, blocks, namespace, token_ids, weight)

    probe = tiered(tiny)
    store = Counting(tmp_path, BlockFormat(*probe.spill_block_spec()), 1 << 30, 1 << 30)
    eng = tiered(tiny, spill=store, host_bytes=4 * BLOCK_BYTES)
    for k in range(3):
        run(eng, prompt_of(200, 10 + k))
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert sum(calls) == 36 == store.stats()["blocks_spill_ram"]
    assert len(calls) <= 6  # batched: a handful of puts, not one per block


def test_idle_session_demotes_and_next_turn_promotes(tiny, tmp_path) -> None:
    eng = tiered(tiny)
    turn1 = prompt_of(100, 5)
    first = eng.generate([turn1], PARAMS, session_id="s1")[0]
    history = turn1 + list(first.output_token_ids)
    assert eng.stats()["used_blocks"] == 7  # 107 tokens of KV pinned by the session
    assert eng.demote_session("s1") == 6  # full blocks go to host; the partial one is freed
    stats = eng.stats()
    assert (stats["used_blocks"], stats["host_blocks"]) == (0, 6)
    turn2 = history + prompt_of(20, 6)
    second = eng.generate([turn2], PARAMS, session_id="s1")[0]
    assert second.num_cached_tokens_by_tier == by_tier(host=96)
    fresh = tiered(tiny)
    assert second.output_token_ids == fresh.generate([turn2], PARAMS)[0].output_token_ids
    assert eng.demote_session("unknown") == 0


def test_namespaces_never_hit_each_other_at_any_tier(tiny, tmp_path) -> None:
    probe = tiered(tiny)
    store = store_for(probe, tmp_path)
    eng = tiered(tiny, spill=store)
    p = prompt_of(120, 7)
    run(eng, p, cache_namespace="A")
    for move in ("device", "host", "spill_ram", "spill_disk"):
        if move == "host":
            eng.demote_all()
        elif move.startswith("spill"):
            eng.demote_all(to_spill=True)
            eng.wait_for_transfers()
            if move == "spill_disk":
                store.demote_to_disk()
        other = run(eng, p, cache_namespace="B")
        assert other.num_cached_tokens == 0, move
        eng.flush()
        run(eng, p, cache_namespace="A")
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    store.demote_to_disk()
    headers = [read_header(f) for f in tmp_path.glob("*.kvs")]
    assert headers and {h.namespace for h in headers} == {"A"}


def test_prefetch_overlaps_running_steps(tiny, tmp_path) -> None:
    """A request whose blocks are in spill waits in the queue while another one decodes."""

    class Slow(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            time.sleep(0.5)
            return super().get(hashes, token_ids)

    probe = tiered(tiny)
    store = Slow(tmp_path, BlockFormat(*probe.spill_block_spec()), 1 << 30, 1 << 30)
    eng = tiered(tiny, spill=store)
    p = prompt_of(200, 8)
    cold = run(eng, p)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    busy = eng.add_request(prompt_of(10, 9), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()  # busy is running; its own prefetch (nothing in spill) has landed
    waiting = eng.add_request(p, PARAMS)
    tokens_meanwhile, final = 0, None
    while final is None:
        for out in eng.step():
            if out.request_id == busy:
                tokens_meanwhile += len(out.new_token_ids) if final is None else 0
            if out.request_id == waiting and out.finished:
                final = out
    eng.abort_request(busy)
    assert tokens_meanwhile >= 5  # the busy request kept decoding during the 0.5 s transfer
    assert final.num_cached_tokens_by_tier == by_tier(spill_ram=192)
    assert final.output_token_ids == cold.output_token_ids


def test_tier_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="watermark"):
        TierConfig(demote_low_watermark=0.5, demote_high_watermark=0.1)
    with pytest.raises(ValueError, match="host_bytes"):
        TierConfig(host_bytes=-1)


def test_prefetch_hint_overrides_auto_prefetch(tiny, tmp_path) -> None:
    """The global index's hint (``add_request(prefetch=...)``): False skips the spill read
    (the request recomputes), True prefetches even with ``auto_prefetch`` off."""
    eng = tiered(tiny)
    store = store_for(eng, tmp_path)
    eng = tiered(tiny, spill=store)
    p = prompt_of(200, 13)
    cold = run(eng, p)

    def reads() -> int:
        stats = store.stats()
        return stats["hits_spill_ram"] + stats["misses"]

    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    before = reads()
    assert run(eng, p, prefetch=False).num_cached_tokens_by_tier == by_tier()
    assert reads() == before
    off = tiered(tiny, spill=store, auto_prefetch=False)
    hinted = run(off, p, prefetch=True)
    assert hinted.num_cached_tokens_by_tier == by_tier(spill_ram=192)
    assert hinted.output_token_ids == cold.output_token_ids
    assert run(off, prompt_of(200, 14)).num_cached_tokens_by_tier == by_tier()
    assert reads() == before + 12  # only the hinted request read the spill tier


def test_kvstrata_demotes_the_over_quota_tenants_blocks_first(tiny) -> None:
    """SLO issue, memory rule: borrowed device space is reclaimed first. ``guest`` (within its
    quota) released its blocks before ``hog`` (12 blocks over a quota of 0), so LRU alone would
    demote guest's; the kvstrata policy demotes all of hog's, then guest's LRU tail."""
    from cache_node.scheduling import TenantShare

    cfg = EngineConfig(block_size=16, kv_pool_bytes=32 * BLOCK_BYTES, max_num_batched_tokens=64,
                       max_num_seqs=8, scheduling_policy="kvstrata")
    tc = TierConfig(host_bytes=64 * BLOCK_BYTES, demote_low_watermark=0.0, demote_high_watermark=0.0)
    eng = LLMEngine(tiny.model, cfg, tiny.model_id, tiny.eos_token_ids, tier_config=tc)
    eng.scheduler.policy.set_tenant("guest", TenantShare("standard", kv_quota_blocks=24))
    eng.scheduler.policy.set_tenant("hog", TenantShare("standard", kv_quota_blocks=0))
    g, h = prompt_of(200, 1), prompt_of(200, 2)  # 12 full blocks each
    cold = {"guest": run(eng, g, tenant="guest"), "hog": run(eng, h, tenant="hog")}
    owner = {h: b.owner for h, b in eng.kv_manager.pool.cached.items()}
    lru = [b.block_hash for b in eng.kv_manager.pool.free_queue if b.block_hash is not None]
    assert [owner[h] for h in lru] == ["guest"] * 12 + ["hog"] * 12  # LRU would take guest's
    eng.tiers.config = TierConfig(host_bytes=64 * BLOCK_BYTES, demote_low_watermark=0.5,
                                  demote_high_watermark=0.75)
    eng.take_tier_events()
    eng.step()  # demotes 16 blocks
    moved = [e.block_hash for e in eng.take_tier_events() if e.tier == "host"]
    assert [owner[h] for h in moved] == ["hog"] * 12 + ["guest"] * 4
    assert moved[12:] == lru[:4]  # then guest's, in LRU order
    hog = run(eng, h, tenant="hog")
    assert hog.num_cached_tokens_by_tier == by_tier(host=192)
    assert hog.output_token_ids == cold["hog"].output_token_ids
    assert run(eng, g, tenant="guest").output_token_ids == cold["guest"].output_token_ids


def test_a_prefetch_asks_for_a_long_prompt_in_batches(tiny, tmp_path) -> None:
    """Review 23a: a prefetch asked the spill node for all of a prompt's spilled blocks in one
    ``get`` (a 128k-token prompt of an 8B model: 16 GiB held at once on the spill node and
    here). With ``spill_get_batch_blocks`` 5 the 12 blocks come in gets of 5, 5 and 2, each
    installed before the next, and the output is the cold run's."""
    asked: list[int] = []

    class Counting(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            asked.append(len(hashes))
            return super().get(hashes, token_ids)

    probe = tiered(tiny)
    store = Counting(tmp_path, BlockFormat(*probe.spill_block_spec()), 1 << 30, 1 << 30)
    eng = tiered(tiny, spill=store, spill_get_batch_blocks=5)
    p = prompt_of(200, 3)
    cold = run(eng, p)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    asked.clear()
    again = run(eng, p)
    assert asked == [5, 5, 2]  # [12] before
    assert again.num_cached_tokens_by_tier == by_tier(spill_ram=192)
    assert again.output_token_ids == cold.output_token_ids


def test_drop_namespace_empties_every_tier_of_it(tiny, tmp_path) -> None:
    """Review 23d, E: a deleted tenant's cached KV stayed on every tier (its prompts' token ids
    in the spill files, across restarts). ``drop_namespace`` (the cache node's ``end_tenant``)
    drops the namespace's and its salted variants' blocks on device, host, spill RAM and spill
    disk, deleting its group files; another namespace's blocks stay and still hit."""
    probe = tiered(tiny)
    store = store_for(probe, tmp_path)
    eng = tiered(tiny, spill=store)
    gone = {"tenant:gone": prompt_of(70, 1), "tenant:gone#salt=s": prompt_of(70, 2)}
    kept = prompt_of(70, 3)  # 4 full blocks each
    for ns, p in [*gone.items(), ("tenant:kept", kept)]:
        run(eng, p, cache_namespace=ns)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert store.demote_to_disk() == 12  # 3 files: gone, gone#salt=s, kept
    on_host, on_ram, on_device = prompt_of(70, 4), prompt_of(70, 5), prompt_of(70, 6)
    run(eng, on_ram, cache_namespace="tenant:gone")
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    run(eng, on_host, cache_namespace="tenant:gone#salt=s")
    eng.demote_all()
    run(eng, on_device, cache_namespace="tenant:gone")
    assert eng.drop_namespace("tenant:gone") == {"prefixes": 0, "device": 4, "host": 4, "spill": 12}
    assert {read_header(f).namespace for f in tmp_path.glob("*.kvs")} == {"tenant:kept"}
    assert (store.stats()["blocks_spill_ram"], store.stats()["blocks_spill_disk"]) == (0, 4)
    assert eng.stats()["host_blocks"] == 0
    for ns, p in [*gone.items(), ("tenant:gone", on_ram), ("tenant:gone#salt=s", on_host),
                  ("tenant:gone", on_device)]:
        assert run(eng, p, cache_namespace=ns).num_cached_tokens == 0
    assert run(eng, kept, cache_namespace="tenant:kept").num_cached_tokens_by_tier == by_tier(spill_disk=64)


def test_a_landed_prefetch_tells_the_engines_waiter(tiny, tmp_path) -> None:
    """While the only request waits on its prefetch the step schedules nothing
    (``scheduled_nothing``, so a cache node waits instead of stepping again at once); the
    prefetch's end calls ``on_ready`` (the node's wake event), and the request then runs."""

    class Slow(SpillStore):
        def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            return super().get(hashes, token_ids)

    probe = tiered(tiny)
    eng = tiered(tiny, spill=Slow(tmp_path, BlockFormat(*probe.spill_block_spec()), 1 << 30, 1 << 30))
    p = prompt_of(200, 21)
    cold = run(eng, p)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    ready: list[float] = []
    eng.on_ready = lambda: ready.append(time.monotonic())
    rid = eng.add_request(p, PARAMS)
    assert eng.step() == [] and eng.scheduled_nothing and not ready
    deadline = time.monotonic() + 10
    while not ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready, "the prefetch landed without telling the engine's waiter"
    final = None
    while final is None:
        final = next((o for o in eng.step() if o.request_id == rid and o.finished), None)
        assert not eng.scheduled_nothing
    assert final.num_cached_tokens_by_tier == by_tier(spill_ram=192)
    assert final.output_token_ids == cold.output_token_ids
