"""SpillNode actor on a real local Ray: batched put/get and restart from disk."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from cache_node.tiers.spill_store import SpillEvent
from services.spill_client import RaySpillClient
from services.spill_node import create_spill_node
from tests.test_spill_store import BLOCK, DISK, FMT, hashes_of, make_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster) -> Iterator[None]:
    """The session's Ray cluster (one per test session: ray.init costs ~5 s and ~620 MiB)."""
    yield


def test_put_get_through_actor_is_byte_exact(tmp_path: Path) -> None:
    node = create_spill_node("spill-exact", tmp_path, FMT, ram_bytes=16 * BLOCK, disk_bytes=DISK)
    assert ray.get(node.put.remote(hashes_of(range(128)), make_blocks(range(128)), "ns")) == 128
    hits = ray.get(node.get.remote(hashes_of(range(130))))
    assert hits.hashes == hashes_of(range(128))
    assert hits.blocks.tobytes() == make_blocks(range(128)).tobytes()
    assert hits.tiers.count("spill_ram") == ray.get(node.stats.remote())["blocks_spill_ram"]
    assert ray.get(node.match_prefix.remote(hashes_of([0, 1, 999]))) == 2
    assert ray.get(node.contains.remote(hashes_of([999]))) == [None]
    assert ray.get(node.flush.remote()) == 128
    ray.kill(node, no_restart=True)


def test_restarted_actor_serves_disk_hits(tmp_path: Path) -> None:
    """Fault: an actor crash loses its memory; the restart must rebuild the index from disk."""
    node = create_spill_node("spill-restart", tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    ray.get(node.put.remote(hashes_of(range(128)), make_blocks(range(128)), "ns"))
    ray.get(node.take_events.remote())
    ray.kill(node, no_restart=False)
    deadline = time.monotonic() + 120
    events: list = []
    while not events and time.monotonic() < deadline:  # the kill is asynchronous: wait for the
        events = ray.get(node.take_events.remote(), timeout=120)  # restarted actor's rebuild
        time.sleep(0.2)
    hits = ray.get(node.get.remote(hashes_of(range(128))), timeout=120)
    assert hits.tiers == ["spill_disk"] * 128
    assert hits.blocks.tobytes() == make_blocks(range(128)).tobytes()
    stats = ray.get(node.stats.remote())
    assert (stats["hits_spill_disk"], stats["blocks_spill_disk"]) == (128, 128)
    assert sorted(events) == sorted(  # the rebuild announces what it holds
        SpillEvent("stored", h, "spill_disk") for h in hashes_of(range(128))
    )
    ray.kill(node, no_restart=True)


def test_a_put_carries_its_tenants_weight_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    """The weight of a put's namespace crosses the actor boundary (``RaySpillClient`` ->
    ``SpillNode``) as untrusted input: a positive finite number is its holder's weight in the
    node's fair shares; NaN, infinity, zero, a negative or a non-number is refused with
    ValueError naming ``weight`` and nothing is stored (the client counts a failed put)."""
    node = create_spill_node("spill-weight", tmp_path, FMT, ram_bytes=16 * BLOCK, disk_bytes=DISK,
                             demote_low_watermark=1.0)
    client = RaySpillClient([node], FMT.shape, FMT.dtype)
    for k, bad in enumerate((float("nan"), float("inf"), 0.0, -1.0, "3")):
        assert client.put(hashes_of([k]), make_blocks([k]), "tenant:a", None, bad) == 0  # type: ignore[arg-type]
        with pytest.raises(ray.exceptions.RayTaskError, match=r"weight must be a positive finite number"):
            ray.get(node.put.remote(hashes_of([k]), make_blocks([k]), "tenant:a", None, bad))
    assert client.stats() == {"put_failures": 5}
    assert ray.get(node.stats.remote())["blocks_spill_ram"] == 0
    # weight 3 for a, 1 for b: a 16-block RAM tier ends 12:4 (its room made per weight)
    for k in range(8):
        assert client.put(hashes_of(range(100 + 4 * k, 104 + 4 * k)), make_blocks(range(4)), "tenant:a", None, 3.0) == 4
        assert client.put(hashes_of(range(200 + 4 * k, 204 + 4 * k)), make_blocks(range(4)), "tenant:b", None, 1.0) == 4
    tiers = client.contains(hashes_of(range(100, 132)) + hashes_of(range(200, 232)))
    assert (tiers[:32].count("spill_ram"), tiers[32:].count("spill_ram")) == (12, 4)
    ray.kill(node, no_restart=True)


def _settled_spill_units(timeout_s: float = 15.0) -> float:
    """Available ``spill_node`` units once they stop changing for a second."""
    deadline = time.monotonic() + timeout_s
    last = ray.available_resources().get("spill_node", 0)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = ray.available_resources().get("spill_node", 0)
        if now == last:
            return now
        last = now
    return last


def test_node_is_placed_by_the_spill_node_resource(tmp_path: Path) -> None:
    before = _settled_spill_units()  # killed actors of earlier tests release theirs lazily
    node = create_spill_node("spill-placed", tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK)
    assert ray.get(node.ready.remote(), timeout=60) is True
    deadline = time.monotonic() + 10
    while ray.available_resources().get("spill_node", 0) != before - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("spill_node", 0) == before - 1  # it holds one unit
    ray.kill(node, no_restart=True)
