"""Dropping a deleted tenant's namespace across sharded SpillNode actors (``RaySpillClient``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cache_node.tiers.spill_format import read_header
from services.spill_client import RaySpillClient
from services.spill_node import create_spill_node
from tests.test_spill_store import BLOCK, DISK, FMT, hashes_of, make_blocks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster) -> Iterator[None]:
    """The session's Ray cluster (one per test session)."""
    yield


def test_drop_namespace_reaches_every_spill_node(tmp_path: Path) -> None:
    """Review 23d, E: no call dropped a deleted tenant's blocks on the spill nodes. The
    client's ``drop_namespace`` asks every node (a block's node follows its hash): the
    namespace's RAM blocks and group files go on each, another namespace's stay."""
    nodes = [create_spill_node(f"spill-drop-{i}", tmp_path / str(i), FMT, ram_bytes=8 * BLOCK, disk_bytes=DISK)
             for i in range(2)]
    try:
        ray.get([n.ready.remote() for n in nodes])
        client = RaySpillClient(nodes, FMT.shape, FMT.dtype)
        client.put(hashes_of(range(32)), make_blocks(range(32)), "tenant:gone")
        client.put(hashes_of(range(32, 40)), make_blocks(range(32, 40)), "tenant:kept")
        client.put(hashes_of(range(40, 44)), make_blocks(range(40, 44)), "tenant:gone#salt=s")
        before = {read_header(f).namespace for f in tmp_path.glob("*/*.kvs")}
        assert "tenant:gone" in before  # past the RAM budgets: on disk too
        assert client.drop_namespace("tenant:gone") == 36
        tiers = client.contains(hashes_of(range(44)))
        assert tiers[:32] + tiers[40:] == [None] * 36 and None not in tiers[32:40]
        assert {read_header(f).namespace for f in tmp_path.glob("*/*.kvs")} <= {"tenant:kept"}
        assert sum(ray.get(n.stats.remote())["blocks_spill_ram"] for n in nodes) == tiers.count("spill_ram")
    finally:
        for node in nodes:
            ray.kill(node, no_restart=True)
