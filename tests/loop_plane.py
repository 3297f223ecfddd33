"""A real CacheNode (the tiny Llama) and the GlobalScheduler's admission server on the real
data plane (CURVE keys), all on one event loop thread, without Ray: the base of the tests
that put gateways (``NodeStreams``, ``InferenceServicer``) in front of them."""

from __future__ import annotations

import asyncio
import inspect
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

from bench.chaos_stack import BLOCK_SIZE, POOL_BLOCKS, block_bytes, tiny_checkpoint
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.data_plane_auth import DataPlaneKeys
from services.global_scheduler_admission import GlobalSchedulerService


class LoopPlane:
    """Node "n0" (``max_num_seqs`` running slots, scheduling policy ``SCHEDULING_POLICY``) and
    the scheduler: ``node_address``, ``sched_address``, ``keys`` (for the gateways' identities);
    ``run`` a coroutine on the loop."""

    SCHEDULING_POLICY = "fcfs"

    def __init__(self, max_num_seqs: int, state_prefix: str) -> None:
        self.keys = DataPlaneKeys.generate()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE,
                            kv_pool_bytes=POOL_BLOCKS * block_bytes(), host_bytes=0, max_num_seqs=max_num_seqs)
        self.node = CacheNode("n0", config, num_threads=1, scheduler=self.SCHEDULING_POLICY,
                              security=self.keys.security("node"))
        self.scheduler = GlobalSchedulerService(tempfile.mkdtemp(prefix=state_prefix), {"n0": max_num_seqs},
                                                security=self.keys.security("scheduler"))
        self.node_address = self.run(self.node.open_data_plane())
        self.scheduler.attach_nodes({"n0": self.node_address})
        self.sched_address = self.run(self.scheduler.open_data_plane())

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def close_gateways(self) -> None:
        """On the loop, before the node and the scheduler close: what the subclass added."""

    def close(self) -> None:
        async def close() -> None:
            await self.close_gateways()
            self.scheduler.close_data_plane()
            self.node.close_data_plane()

        self.run(close())
        self.node.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.scheduler.store.close()


async def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on the loop, as the actor runs every method (awaited if it is a
    coroutine)."""
    result = fn(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def wait_for(predicate: Any, timeout_s: float = 10.0) -> float:
    """Seconds until ``predicate()`` held (fails the test after ``timeout_s``)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.01)
    return time.monotonic() - t0


class Actor:
    """``obj`` as a Ray actor handle: ``h.m.remote(...)`` runs the call on the loop whether or
    not it is awaited (the gateway's ``release`` is fire-and-forget), and cancelling what it
    returned (a caller's ``wait_for`` timing out, its task cancelled) leaves the call running
    (``asyncio.shield``), as Ray does with an actor task whose caller stops awaiting its ref.
    Regression (review r1 F2, session 37): the call was cancelled with its awaiter, so a
    Drain's cancellation stopped the node's drain itself and a no-op ``CacheNode.cancel_drain``
    passed tests/test_admin_drain_key.py."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.obj, name)
        return SimpleNamespace(remote=lambda *args, **kw: asyncio.shield(asyncio.ensure_future(call(fn, *args, **kw))))
