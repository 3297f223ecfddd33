"""Admin Flush with a spill node that does not answer (SIGSTOP of a real SpillNode actor).

Before: the cache node's flush waited the spill client's own timeout (30 s by default) for the
spill node's answer and then counted it as 0 blocks dropped, so Flush answered OK ("flushed")
while the spill node still held the KV; with the client's timeout at or past the gateway's
(30 s both) the gateway instead timed the cache node out and named it, never the spill node.
Now the cache node's whole flush ends before the gateway's wait on it
(``gateway_admin.spill_timeout_s``) and names each spill node that did not confirm the flush
(``spill_unflushed``); Flush fails UNAVAILABLE naming them (``kvstrata admin flush`` prints the
line and exits 1), as for a cache node that does not answer (e87d3fe). Once the spill node
answers again, the flush goes through.

A real CacheNode (in process: its step thread, transfer worker and the Ray spill client), a
real SpillNode actor on the session's Ray cluster, and the gateway's ``AdminServicer``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray

from cache_node.sampling_params import SamplingParams
from cache_node.tiers.prefetch import TransferWorker
from cache_node.tiers.spill_format import BlockFormat
from kvstrata.v1 import admin_pb2
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.gateway_admin import AdminServicer
from services.node_request import NodeRequest
from services.spill_client import RaySpillClient
from tests.ray_actors import PidSpillNode
from tests.test_admin_flush_partial import _Aborted, _Auth, _Context, _Scheduler

pytestmark = pytest.mark.slow

NODE_TIMEOUT_S = 3.0  # the gateway's wait on a cache node (30 s in production); its flush waits 2.4 s
SPILL_NAME = "flush-silent-spill"


class _Remote:
    """A method of the in-process node as the gateway calls an actor's: ``.remote(...)``."""

    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)


class _NodeHandle:
    def __init__(self, node: CacheNode) -> None:
        self.flush_by_tier = _Remote(node.flush_by_tier)


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster) -> Iterator[None]:
    yield


@pytest.fixture(scope="module")
def node() -> Iterator[CacheNode]:
    n = CacheNode("n0", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=1 << 20), num_threads=1)
    yield n
    n.shutdown()


@pytest.fixture(scope="module")
def spill(node: CacheNode, tmp_path_factory) -> Iterator[tuple[Any, int]]:
    """One SpillNode actor for every case (an actor start took 2-5 s of each): each case leaves
    it answering again (SIGCONT) and flushed empty (the case's last check)."""
    handle = ray.remote(PidSpillNode).options(name=SPILL_NAME, resources={}, max_restarts=0, num_cpus=0).remote(
        str(tmp_path_factory.mktemp("flush-silent") / "spill"), BlockFormat(*node.engine.spill_block_spec()),
        1 << 24, 1 << 26)
    pid = ray.get(handle.pid.remote(), timeout=60)
    try:
        yield handle, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(handle, no_restart=True)


def _attach(node: CacheNode, handle: Any, put_timeout_s: float) -> None:
    """The node's spill tier is ``handle``, through the Ray client (as ``CacheNodeActor``'s)."""
    tiers = node.engine.tiers
    tiers.spill = client = RaySpillClient([handle], tiers.block_shape, tiers.spill_np_dtype.name,
                                          put_timeout_s=put_timeout_s, names=[SPILL_NAME])
    tiers.worker = TransferWorker(tiers, client, tiers.config.spill_put_backlog_bytes // tiers.host.block_nbytes)


def _request(rid: str, first: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=tuple(range(first, first + 80)),
                       sampling=SamplingParams(max_tokens=2, ignore_eos=True))


async def _spill_some(node: CacheNode, rid: str, first: int, wait: bool = True) -> None:
    async for _ in node.generate(_request(rid, first)):
        pass
    tiers = node.engine.tiers
    with tiers.lock:
        tiers.demote_all(to_spill=True)
    if wait:
        assert await asyncio.to_thread(tiers.worker.wait_idle, 30.0)


async def _flush(servicer: AdminServicer) -> tuple[Any, _Context, float]:
    context, start = _Context(), time.monotonic()
    try:
        reply = await servicer.Flush(admin_pb2.FlushRequest(), context)
    except _Aborted:
        reply = None
    return reply, context, time.monotonic() - start


@pytest.mark.parametrize("case", ["client_timeout_below_the_gateways", "client_timeout_30_s", "put_in_flight"])
def test_a_flush_a_spill_node_did_not_answer_is_unavailable_naming_it(node: CacheNode, spill, case: str) -> None:
    handle, pid = spill
    _attach(node, handle, put_timeout_s=2.0 if case == "client_timeout_below_the_gateways" else 30.0)
    servicer = AdminServicer(_Scheduler(), _Auth(), {"n0": _NodeHandle(node)},  # type: ignore[arg-type]
                             node_timeout_s=NODE_TIMEOUT_S)

    async def run() -> None:
        await _spill_some(node, f"{case}-a", 100)
        held = ray.get(handle.stats.remote(), timeout=30)["blocks_spill_ram"]
        assert held > 0
        os.kill(pid, signal.SIGSTOP)  # alive, answers nothing
        try:
            if case == "put_in_flight":  # the transfer thread's put to it waits its 30 s meanwhile
                await _spill_some(node, f"{case}-b", 1000, wait=False)
                await asyncio.sleep(0.5)
            reply, context, took = await _flush(servicer)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reply is None, f"answered OK while {SPILL_NAME} was stopped: {reply}"
        assert context.code == grpc.StatusCode.UNAVAILABLE
        assert context.details.startswith(f"flush incomplete: spill node {SPILL_NAME} ("), context.details
        assert "did not flush, so the KV blocks it stores may still be there" in context.details
        assert "asked by cache node n0" in context.details and "\n" not in context.details
        assert "cache node n0 did not answer" not in context.details  # the node answered, naming the spill node
        assert took < NODE_TIMEOUT_S + 1.0, took
        # answering again: the flush goes through and the spill node holds nothing
        if case == "put_in_flight":
            assert await asyncio.to_thread(node.engine.tiers.worker.wait_idle, 60.0)
        reply, context, _ = await _flush(servicer)
        assert context.code is None and reply is not None, context.details
        assert ray.get(handle.stats.remote(), timeout=30)["blocks_spill_ram"] == 0

    asyncio.run(run())
