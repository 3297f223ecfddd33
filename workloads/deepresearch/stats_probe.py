"""A :data:`StatsProbe` that samples the gateway's ``AdminService.Stats``.

Each sample is a flat dict of numbers summed over cache nodes, the time series
the report plots: device/host bytes, block occupancy of the device tier, queue
depth and open sessions.
"""

from __future__ import annotations

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
    return sample


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
