"""``kvstrata tenant show``'s "KV blocks held now" agrees with ``kvstrata status``.

Regression (new-user report): ``Usage.blocks_held`` was a ledger gauge nothing ever set, so
``tenant show`` said 0 blocks held while ``status`` counted the tenant's idle session's blocks
("by sessions"). Now ``TenantServicer.GetUsage`` sums each healthy node's ``tenant_blocks``
(its requests' blocks and its idle sessions', counted as ``stats``' ``session_blocks`` counts
them), and ``tenant show`` prints both parts. A real plain ``CacheNode`` (SmolLM2, no Ray), a
real ``GlobalSchedulerService`` and ``Authenticator``.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from cache_node.sampling_params import SamplingParams
from cli.tenant import tenant_table
from kvstrata.v1 import tenant_pb2
from services.auth import Authenticator
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.gateway_admin import TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from services.node_request import NodeRequest
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor


class _Context:
    """A gRPC call's context carrying ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.key}"),)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:4242"

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"{code.name}: {details}")


class _DownNode:
    """A node whose every call fails when awaited, as a dead actor's does."""

    class tenant_blocks:  # a Ray method's shape: tenant_blocks.remote(...)
        @staticmethod
        async def remote(tenant: str) -> Any:
            raise RuntimeError("node down")


def test_tenant_show_counts_the_idle_sessions_blocks_status_counts(tmp_path: Path) -> None:
    """After one finished session turn, ``GetUsage`` (own key) reports the blocks the session
    holds on the node, equal to that node's ``session_blocks`` (what ``status`` shows "by
    sessions"), all of them by idle sessions; another tenant holds none; a failing node adds
    nothing; ``tenant show`` prints both parts. Before: ``blocks_held`` was 0."""
    node = CacheNode("n0", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)

    async def run() -> tuple[tenant_pb2.Usage, tenant_pb2.Usage, dict[str, Any]]:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        tenant, key = await scheduler.register_tenant(TenantSpec("ann"))
        _other, other_key = await scheduler.register_tenant(TenantSpec("bob"))
        request = NodeRequest(request_id=f"{tenant.tenant_id}/r1", tenant=tenant.tenant_id, cache_namespace="ns",
                              token_ids=tuple(range(100, 150)), session_id=f"{tenant.tenant_id}/s1",
                              sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        async for _ in node.generate(request):
            pass
        await asyncio.sleep(0.3)  # the step thread republishes its stats snapshot
        servicer = TenantServicer(LocalActor(scheduler), Authenticator(LocalActor(scheduler)),
                                  {"n0": LocalActor(node), "n1": _DownNode()}, node_timeout_s=5.0)
        own = await servicer.GetUsage(tenant_pb2.GetUsageRequest(name="ann"), _Context(key))
        bob = await servicer.GetUsage(tenant_pb2.GetUsageRequest(name="bob"), _Context(other_key))
        scheduler.store.close()
        return own.usage, bob.usage, node.stats()

    try:
        usage, other, stats = asyncio.run(run())
    finally:
        node.shutdown()
    assert stats["running"] == 0 and stats["session_blocks"] == 4  # 53 history tokens, 16 a block
    assert (usage.blocks_held, usage.session_blocks_held) == (4, 4)
    assert (other.blocks_held, other.session_blocks_held) == (0, 0)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(tenant_table(tenant_pb2.Tenant(spec=tenant_pb2.TenantSpec(name="ann")), usage))
    rows = {cells[1].strip(): cells[2].strip() for line in console.file.getvalue().splitlines()
            if len(cells := line.split("│")) == 4}
    assert rows["KV blocks held now, all nodes"] == "4 (0 by requests, 4 by idle sessions)"
