"""A :data:`StatsProbe` that samples the gateway's ``AdminService.Stats``.

Each sample is a flat dict of numbers summed over cache nodes, the time series
the report plots: device/host bytes, block counts and capacities of the device and
host tiers, the spill tier's blocks (RAM and disk, from the global block index),
queue depth and open sessions.
"""

from __future__ import annotations

import json

import grpc

from kvstrata.v1 import admin_pb2, admin_pb2_grpc
from workloads.deepresearch.client import StatsProbe

NODE_COUNTERS = (
    "num_blocks",
    "free_blocks",
    "cached_blocks",
    "used_blocks",
    "device_bytes_used",
    "host_bytes_used",
    "running",
    "waiting",
)


def stats_sample(response: admin_pb2.StatsResponse) -> dict[str, float]:
    """Flatten a ``StatsResponse``: node counters summed, plus occupancy fractions.

    ``device_used_fraction`` and ``device_cached_fraction`` are used and cached
    blocks over all device-tier blocks (0 when there are none).
    """
    sample = {name: float(sum(getattr(n, name) for n in response.nodes)) for name in NODE_COUNTERS}
    total = sample["num_blocks"]
    sample["device_used_fraction"] = sample["used_blocks"] / total if total else 0.0
    sample["device_cached_fraction"] = sample["cached_blocks"] / total if total else 0.0
    sample["queued"] = float(response.queued)
    sample["sessions"] = float(response.sessions)
    sample.update(_tier_blocks(response.stats_json))
    return sample


def _tier_blocks(stats_json: str) -> dict[str, float]:
    """``host_blocks`` / ``host_capacity_blocks`` summed over the cache nodes that answered,
    and ``spill_ram_blocks`` / ``spill_disk_blocks`` (block copies in the index), from
    ``StatsResponse.stats_json``; keys it lacks are left out (an older gateway)."""
    try:
        stats = json.loads(stats_json) if stats_json else {}
    except json.JSONDecodeError:
        return {}
    out: dict[str, float] = {}
    nodes = [n for n in stats.get("nodes", []) if "host_slots" in n]
    if nodes:
        out["host_blocks"] = float(sum(n.get("host_blocks", 0) for n in nodes))
        out["host_capacity_blocks"] = float(sum(n["host_slots"] for n in nodes))
    per_tier = stats.get("scheduler", {}).get("indexed_blocks_by_tier", {})
    for tier in ("spill_ram", "spill_disk"):
        if tier in per_tier:
            out[f"{tier}_blocks"] = float(per_tier[tier])
    return out


def grpc_stats_probe(
    channel: grpc.aio.Channel, admin_key: str, timeout_s: float = 5.0
) -> StatsProbe:
    """A probe calling ``AdminService.Stats`` on ``channel`` with the admin key.

    The probe raises on RPC failure; the runner records the failure and keeps going.
    """
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    metadata = (("authorization", f"Bearer {admin_key}"),)

    async def probe() -> dict[str, float]:
        response = await stub.Stats(admin_pb2.StatsRequest(), metadata=metadata, timeout=timeout_s)
        return stats_sample(response)

    return probe


async def gateway_scheduler(channel: grpc.aio.Channel, admin_key: str, timeout_s: float = 30.0) -> str:
    """The scheduling policy the gateway's nodes run (``stats_json``'s ``scheduler.scheduler``).

    Raises:
        grpc.RpcError: the Stats call failed.
        KeyError / json.JSONDecodeError: the answer does not name one.
    """
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    response = await stub.Stats(admin_pb2.StatsRequest(), metadata=(("authorization", f"Bearer {admin_key}"),),
                                timeout=timeout_s)
    return str(json.loads(response.stats_json)["scheduler"]["scheduler"])
