"""A spill node's metrics: ``SpillStore.stats()`` read at scrape time (nothing counted twice).

Every sample has the label ``node`` (the spill node id). Blocks and capacity per tier
(``spill_ram``, ``spill_disk``) use the same names as the cache nodes' device and host tiers,
so one query shows every tier's occupancy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.metrics.requests import PREFIX

SPILL_READ_ERRORS = {"corrupt": "corrupt_reads", "io_error": "io_errors", "missing_file": "missing_files",
                     "token_mismatch": "token_mismatches"}

SPILL_DISK_EVENTS = {"disk_full_write": "disk_full_writes", "disk_full_evicted_file": "disk_full_evicted_files",
                     "unlink_error": "unlink_errors", "dir_recreated": "dir_recreated",
                     "tombstoned_file": "tombstoned_files", "flushed_file": "flushed_files"}
"""``spill_disk_events{kind}``: the disk tier's faults and what it did about them
(``cache_node.tiers.spill_disk``): a write that failed for a full volume (ENOSPC/EDQUOT, tried
once more after eviction), a file evicted to make room on a volume fuller than the budget says,
an unlink that failed (the file stays counted in ``spill_undeleted_bytes``, tried again), the
spill directory made again after it was deleted, a file of a dropped holder deleted at a restart
instead of indexed, a file written before an acknowledged flush (its ``flushed-seq.msgpack``
record) deleted at a restart instead of indexed."""


class SpillMetrics(Collector):
    """Registered in its own ``registry``.

    Args:
        node_id: the ``node`` label.
        stats: ``SpillStore.stats``.
        block_nbytes: bytes of one block in the store's format.
    """

    def __init__(self, node_id: str, stats: Callable[[], dict[str, int]], block_nbytes: int) -> None:
        self.node_id, self.stats, self.block_nbytes = node_id, stats, block_nbytes
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        s, nid = self.stats(), self.node_id
        blocks = GaugeMetricFamily(PREFIX + "kv_blocks", "KV blocks held, by tier.", labels=["node", "tier"])
        capacity = GaugeMetricFamily(PREFIX + "kv_capacity_blocks", "KV blocks a tier can hold.",
                                     labels=["node", "tier"])
        hits = CounterMetricFamily(PREFIX + "spill_hits", "Blocks read, by the tier that held them.",
                                   labels=["node", "tier"])
        for tier, budget in (("spill_ram", "ram_budget_bytes"), ("spill_disk", "disk_budget_bytes")):
            blocks.add_metric([nid, tier], s[f"blocks_{tier}"])
            capacity.add_metric([nid, tier], s[budget] // max(1, self.block_nbytes))
            hits.add_metric([nid, tier], s[f"hits_{tier}"])
        misses = CounterMetricFamily(PREFIX + "spill_misses", "Blocks asked for and not held.", labels=["node"])
        misses.add_metric([nid], s["misses"])
        errors = CounterMetricFamily(PREFIX + "spill_read_errors", "Spill reads lost, by kind (read as misses).",
                                     labels=["node", "kind"])
        for kind, key in SPILL_READ_ERRORS.items():
            errors.add_metric([nid, kind], s[key])
        corrupt = CounterMetricFamily(PREFIX + "spill_corrupt_blocks", "Blocks dropped alone for a failed "
                                      "checksum, their file's other blocks still served.", labels=["node"])
        corrupt.add_metric([nid], s["corrupt_blocks"])
        used = GaugeMetricFamily(PREFIX + "spill_bytes_used", "Bytes held, by tier.", labels=["node", "tier"])
        used.add_metric([nid, "spill_ram"], s["ram_bytes"])
        used.add_metric([nid, "spill_disk"], s["disk_bytes"])
        unserved = GaugeMetricFamily(PREFIX + "spill_unserved_bytes", "Bytes of spill files never served, "
                                     "by kind (counted in the disk budget).", labels=["node", "kind"])
        removed = CounterMetricFamily(PREFIX + "spill_removed_files", "Spill files never served that were "
                                      "deleted (disk budget, quarantine bounds and age, flush, a dropped "
                                      "namespace), by kind.", labels=["node", "kind"])
        for kind in ("unindexed", "quarantined"):
            unserved.add_metric([nid, kind], s[f"{kind}_bytes"])
            removed.add_metric([nid, kind], s[f"removed_{kind}_files"])
        events = CounterMetricFamily(PREFIX + "spill_disk_events", "Disk tier faults met and handled, by kind.",
                                     labels=["node", "kind"])
        for kind, key in SPILL_DISK_EVENTS.items():
            events.add_metric([nid, kind], s.get(key, 0))
        undeleted = GaugeMetricFamily(PREFIX + "spill_undeleted_bytes", "Bytes of spill files whose deletion "
                                      "failed (read-only volume, EIO), counted in the disk budget and tried "
                                      "again.", labels=["node"])
        undeleted.add_metric([nid], s.get("undeleted_bytes", 0))
        yield from (blocks, capacity, hits, misses, errors, corrupt, used, unserved, removed, events, undeleted)
