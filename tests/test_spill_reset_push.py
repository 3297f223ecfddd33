"""A restarted spill node's reset push carries every block it holds (review 30m F1).

Since f98834a the constructor awaits its first sweep of deleted tenants before its reset push.
When that sweep drops blocks (a tenant deleted while the node was down), the sweep's own push
carried the rebuild's "stored" events first; the reset that followed went out empty, and the
scheduler (``GlobalScheduler.report_events``: a reset forgets the holder, then applies) forgot
every block the node held, which nothing ever reported again: routing and the TTFT estimates
treated them as uncached for every tenant. A reset push is now a snapshot of what is held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache_node.tiers.spill_store import SpillStore
from services.spill_node import SpillNode
from tenants.model import own_namespace
from tests.test_spill_store import FMT, hashes_of, make_blocks


def _tokens(ids: range) -> list[list[int]]:
    return [[i, i + 1, i + 2, i + 3] for i in ids]


def test_the_index_knows_every_block_after_a_restart_whose_first_sweep_dropped_some(tmp_path: Path) -> None:
    root = tmp_path / "0"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=10**9)
    store.put(hashes_of(range(3)), make_blocks(range(3)), own_namespace("bob"), _tokens(range(3)))
    store.put(hashes_of(range(10, 20)), make_blocks(range(10, 20)), own_namespace("ann"), _tokens(range(10, 20)))
    store.close()  # the node goes down (its lock with its process); bob is deleted meanwhile

    index: dict[bytes, str] = {}
    pushes: list[tuple[int, bool]] = []

    def sink(node_id: str, events: list[tuple[str, bytes, str]], reset: bool) -> None:
        pushes.append((len(events), reset))
        if reset:  # as GlobalScheduler.report_events: forget the holder, then apply
            index.clear()
        for event, block_hash, tier in events:
            if event == "stored":
                index[block_hash] = tier
            else:
                index.pop(block_hash, None)

    deleted: Any = lambda seq: [(1, "bob")] if seq == 0 else []
    node = SpillNode(root, FMT, ram_bytes=0, disk_bytes=10**9, node_id="spill_node_0", event_sink=sink,
                     deleted_tenants=deleted, sweep_interval_s=3600)
    try:
        assert node.contains(hashes_of(range(3))) == [None] * 3  # the sweep dropped bob's
        assert pushes[-1][1], pushes  # the constructor's reset came last
        held = hashes_of(range(10, 20))
        assert [node.contains(held)[i] is not None for i in range(10)] == [True] * 10
        assert all(h in index for h in held), pushes
        assert not any(h in index for h in hashes_of(range(3)))
    finally:
        node._sweep.stop()  # type: ignore[union-attr]
