"""The gateway's admin reads take a cache node's answer as untrusted: ``GetUsage`` sums only
``tenant_blocks`` answers of non-negative int counts, and ``Stats`` reports a node whose
``stats`` answer is malformed (not its own node id, a value its ``NodeStats`` or JSON cannot
hold) as unhealthy, "sent a malformed answer", and the other nodes as they answered.

Regression (s38): ``GetUsage`` summed ``int(...)`` of each answer's counts, so a node's
negative count took blocks off the others' (or failed the call, the sum below 0), and a count
``int`` refuses (``inf``, ``"x"``) failed a tenant's own call UNKNOWN; one node's ``stats``
answer that ``NodeStats`` refused failed the whole ``Stats`` call UNKNOWN (``kvstrata status``
showed nothing), and a node could answer in another node's name; a flush count past
``FlushResponse``'s ``uint32`` failed the Flush UNKNOWN.

A real ``GlobalSchedulerService`` (its store on disk) and ``Authenticator``; the nodes are
stand-ins, since what is tested is answers no real node sends.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc

from kvstrata.v1 import admin_pb2, tenant_pb2
from services.auth import Authenticator
from services.gateway_admin import AdminServicer, TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from tenants.model import TenantSpec
from tests.gateway_harness import LocalActor
from tests.grpc_context import GrpcContext, Refused


class _Answers:
    """A cache node's handle whose ``tenant_blocks``, ``stats`` and ``flush_by_tier`` answer
    ``blocks``, ``stats`` and ``flushed``."""

    def __init__(self, blocks: Any = None, stats: Any = None, flushed: Any = None) -> None:
        self.answers = {"blocks": blocks, "stats": stats, "flushed": flushed}
        self.tenant_blocks, self.stats = LocalActor(self).answer_blocks, LocalActor(self).answer_stats
        self.flush_by_tier = LocalActor(self).answer_flush

    def answer_blocks(self, tenant: str) -> Any:  # the node's tenant_blocks signature
        return self.answers["blocks"]

    def answer_stats(self) -> Any:
        return self.answers["stats"]

    def answer_flush(self, spill_timeout_s: float | None = None) -> Any:  # flush_by_tier's
        return self.answers["flushed"]


LIES = ({"requests": -1000, "idle_sessions": 0}, {"requests": float("inf")}, {"requests": "7"},
        {"idle_sessions": 10 ** 5000}, {"requests": True}, ["requests", 5])


def test_get_usage_sums_only_well_formed_node_answers(tmp_path: Path) -> None:
    """One node holds 3 + 2 blocks of the tenant; each other answers one lie: the usage is 5
    blocks, 2 by idle sessions. Before: each lie failed the tenant's own call UNKNOWN (the
    first: "blocks_held must be a non-negative integer, got -995"; ``int(inf)``'s
    OverflowError), but ``"7"`` and ``True``, which counted 12 and 6."""

    async def run() -> list[tuple[int, int]]:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        try:
            _tenant, key = await scheduler.register_tenant(TenantSpec("ann"))
            usages = []
            for lie in LIES:
                nodes = {"n0": _Answers(blocks={"requests": 3, "idle_sessions": 2}), "n1": _Answers(blocks=lie)}
                servicer = TenantServicer(LocalActor(scheduler), Authenticator(LocalActor(scheduler)), nodes,
                                          node_timeout_s=5.0)
                usage = (await servicer.GetUsage(tenant_pb2.GetUsageRequest(name="ann"), GrpcContext(key))).usage
                usages.append((usage.blocks_held, usage.session_blocks_held))
            return usages
        finally:
            scheduler.store.close()

    assert asyncio.run(run()) == [(5, 2)] * len(LIES)


GOOD = {"node_id": "n0", "healthy": True, "num_blocks": 64, "free_blocks": 60, "used_blocks": 4, "block_size": 16}
BAD_STATS = ({"node_id": "n1", "num_blocks": "64"}, {"node_id": "n1", "free_blocks": 2 ** 70},
             {"node_id": "n1", "running": 1.5}, {"node_id": "n1", "extra": b"\x00"}, {"node_id": "n0"},
             {"num_blocks": 1})


def test_stats_names_a_node_whose_answer_is_malformed_and_reports_the_others(tmp_path: Path) -> None:
    """Node n0 answers well, n1 one malformed answer per call: every call answers, n0 as it
    said, n1 unhealthy with "sent a malformed answer" (in ``stats_json``) and no count of its
    answer. Before: the call failed (TypeError / ValueError from ``NodeStats``, ``KeyError``
    for no node id, TypeError from ``json.dumps`` of bytes), or n1 was listed as a second n0."""

    async def run() -> list[admin_pb2.StatsResponse]:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1})
        admin_key = scheduler.store.ensure_admin_key()
        try:
            answers = []
            for bad in BAD_STATS:
                nodes = {"n0": _Answers(stats=GOOD), "n1": _Answers(stats=bad)}
                servicer = AdminServicer(LocalActor(scheduler), Authenticator(LocalActor(scheduler)), nodes,
                                         node_timeout_s=5.0)
                answers.append(await servicer.Stats(admin_pb2.StatsRequest(), GrpcContext(admin_key)))
            return answers
        finally:
            scheduler.store.close()

    for bad, resp in zip(BAD_STATS, asyncio.run(run()), strict=True):
        assert [(n.node_id, n.num_blocks, n.free_blocks, n.used_blocks) for n in resp.nodes] == [
            ("n0", 64, 60, 4), ("n1", 0, 0, 0)], bad
        nodes = json.loads(resp.stats_json)["nodes"]
        assert nodes[0] == GOOD, bad
        assert nodes[1] == {"node_id": "n1", "healthy": False, "failure": "sent a malformed answer"}, bad


def test_flush_names_a_node_whose_count_is_past_the_replys_field(tmp_path: Path) -> None:
    """A node's flush answer counting 2**32 blocks of a tier (past ``FlushResponse``'s
    ``uint32``) is a malformed answer: the flush ends UNAVAILABLE naming that node, with the
    other node's 5 blocks. Before: ``FlushResponse`` raised ValueError (the call UNKNOWN)."""

    async def run() -> Refused:
        scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1, "n1": 1})
        admin_key = scheduler.store.ensure_admin_key()
        nodes = {"n0": _Answers(flushed={"device": 5}), "n1": _Answers(flushed={"device": 1 << 32})}
        servicer = AdminServicer(LocalActor(scheduler), Authenticator(LocalActor(scheduler)), nodes,
                                 node_timeout_s=5.0)
        try:
            await servicer.Flush(admin_pb2.FlushRequest(), GrpcContext(admin_key))
        except Refused as refused:
            return refused
        finally:
            scheduler.store.close()
        raise AssertionError("the flush answered OK")

    refused = asyncio.run(run())
    assert refused.code == grpc.StatusCode.UNAVAILABLE
    assert "cache node n1 (sent a malformed answer) did not flush" in refused.message
    assert "the nodes that answered freed 5 KV blocks (device 5," in refused.message
