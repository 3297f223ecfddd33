"""RaySpillClient on a real local Ray: sharded round trip, and the spill node killed mid-read."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from cache_node.tiers.spill_format import BlockFormat
from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerActor
from services.spill_client import RaySpillClient
from services.spill_node import create_spill_node
from tests.ray_actors import SlowSpillNode, StalledPutNode
from tests.test_tier_engine import PARAMS, by_tier, prompt_of, run, tiered

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster) -> Iterator[None]:
    """The session's Ray cluster (one per test session: ray.init costs ~5 s and ~620 MiB)."""
    yield


def spill_blocks_indexed(scheduler, want: int, timeout_s: float = 30.0) -> dict[str, int]:
    """The scheduler's per-tier block counts once its spill RAM count is ``want`` (events
    arrive asynchronously), or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        tiers = ray.get(scheduler.stats.remote())["indexed_blocks_by_tier"]
        if tiers["spill_ram"] == want or time.monotonic() > deadline:
            return tiers
        time.sleep(0.05)


def test_engine_round_trip_through_two_sharded_spill_nodes(tiny, tmp_path) -> None:
    probe = tiered(tiny)
    spec = probe.spill_block_spec()
    fmt = BlockFormat(*spec)
    shards = IndexHolders(spill_blocks=dict.fromkeys(("tier-shard-0", "tier-shard-1"), 1 << 12))
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(str(tmp_path / "state"), {"n0": 4}, holders=shards)
    nodes = [create_spill_node(f"tier-shard-{i}", tmp_path / str(i), fmt, 1 << 24, 1 << 26,
                               scheduler=scheduler)
             for i in range(2)]
    ray.get([n.ready.remote() for n in nodes])
    try:
        client = RaySpillClient(nodes, spec.shape, spec.dtype)
        eng = tiered(tiny, spill=client)
        p = prompt_of(300, 31)
        cold = run(eng, p)
        eng.demote_all(to_spill=True)
        assert eng.wait_for_transfers()
        per_node = [ray.get(n.stats.remote())["blocks_spill_ram"] for n in nodes]
        assert sum(per_node) == 19 and min(per_node) > 0  # both shards hold part of the KV
        assert spill_blocks_indexed(scheduler, 19) == by_tier(spill_ram=19)  # pushed by the nodes
        again = run(eng, p)
        assert again.num_cached_tokens_by_tier == by_tier(spill_ram=288)
        assert again.output_token_ids == cold.output_token_ids
        eng.flush()
        assert spill_blocks_indexed(scheduler, 0) == by_tier()
    finally:
        for n in [*nodes, scheduler]:
            ray.kill(n, no_restart=True)


def test_spill_node_killed_mid_read_is_a_miss(tiny, tmp_path) -> None:
    """Fault: the spill node actor dies while a prefetch read is in flight; the request
    recomputes with the cold output and the engine keeps serving."""
    probe = tiered(tiny)
    spec = probe.spill_block_spec()
    node = ray.remote(SlowSpillNode).options(name="tier-slow", resources={"spill_node": 1},
                                             max_restarts=0, num_cpus=0).remote(
        str(tmp_path), BlockFormat(*spec), 1 << 24, 1 << 26)
    ray.get(node.ready.remote())
    client = RaySpillClient([node], spec.shape, spec.dtype, get_timeout_s=10)
    eng = tiered(tiny, spill=client)
    p = prompt_of(300, 32)
    cold = eng.generate([p], PARAMS)[0]  # its prefetch reads an empty node for 2 s first
    eng.wait_for_transfers()
    eng.demote_all(to_spill=True)
    assert eng.wait_for_transfers()
    threading.Timer(0.5, lambda: ray.kill(node, no_restart=True)).start()
    t0 = time.monotonic()
    out = eng.generate([p], PARAMS)[0]
    assert time.monotonic() - t0 < 8
    assert out.output_token_ids == cold.output_token_ids
    assert out.num_cached_tokens_by_tier == by_tier()
    assert client.stats()["get_failures"] == 1
    eng.check_integrity()


def test_a_stalled_spill_node_gets_no_put_behind_one_that_timed_out(tiny, tmp_path) -> None:
    """secrev20 S2, related: each put that timed out stayed queued on the stalled spill node,
    its blocks pinned in the object store, one more per timeout. Now the client sends that node
    nothing until the late put ends (a dropped write, ``put_skipped``), then writes again."""
    import numpy as np

    spec = tiered(tiny).spill_block_spec()
    node = ray.remote(StalledPutNode).options(resources={"spill_node": 1}, max_restarts=0, num_cpus=0).remote(
        str(tmp_path), BlockFormat(*spec), 1 << 24, 1 << 26)
    ray.get(node.ready.remote())
    client = RaySpillClient([node], spec.shape, spec.dtype, put_timeout_s=0.5)
    rows = np.zeros((2, *spec.shape), np.dtype(spec.dtype))
    assert client.put([b"\x01" * 32, b"\x02" * 32], rows, "ns") == 0  # timed out, still running
    assert client.put([b"\x03" * 32, b"\x04" * 32], rows, "ns") == 0  # not sent
    assert client.stats() == {"put_failures": 1, "put_skipped": 1}
    deadline = time.monotonic() + 10
    while client.put([b"\x05" * 32], rows[:1], "ns") == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(node.num_puts.remote()) == 2  # the late put and the last one; no other
    assert ray.get(node.contains.remote([b"\x01" * 32, b"\x03" * 32, b"\x05" * 32])) == [
        "spill_ram", None, "spill_ram"]
    ray.kill(node)
