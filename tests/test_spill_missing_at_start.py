"""A cache node (re)started while one of its spill nodes has no live actor starts and serves.

Since b040d7b the global scheduler creates a spill node dead for good again
(``services.spill_recreate``), so a spill name with no live actor is a normal, passing state.
``CacheNodeActor.__init__`` looked every spill node up by name (``ray.get_actor``), whose
ValueError for a missing name failed the constructor: Ray does not restart an actor whose
constructor raised, so a cache node restarted meanwhile was dead for good. Now the missing node
is a dead one to its ``RaySpillClient`` (misses, dropped writes, a flush error naming it), looked
up again by name on use (``RELOOKUP_S``) until the scheduler has created it.

Real parts: a ``CacheNodeActor`` in this process (a tiny Llama checkpoint, its step thread and
the Ray spill client), a real ``SpillNode`` actor on the session's Ray cluster.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import ray

from cache_node.sampling_params import SamplingParams
from cache_node.tiers.spill_api import SpillFlushIncomplete
from cache_node.tiers.spill_format import BlockFormat
from services import spill_client
from services.actor_refs import ActorRef
from services.config import NodeConfig, ServiceConfig
from services.launcher import resolve_node_config, spill_block_spec
from services.node_request import NodeRequest
from services.spill_client import RaySpillClient
from services.spill_node import SpillNode
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks

NAMESPACE = "kvstrata-spill-missing"


def _kill_by_name(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass


def _create(name: str, root: Path, fmt: BlockFormat) -> Any:
    """A serving spill node of that name (keep its handle: Ray ends an actor none holds)."""
    handle = ray.remote(SpillNode).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
        str(root), fmt, 0, DISK, node_id=name)
    ray.get(handle.ready.remote(), timeout=60)
    return handle


def test_a_client_whose_node_is_missing_fails_every_call_as_a_dead_nodes_until_it_appears(
        tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Every call kind with no handle for the node: misses, dropped writes, a flush error that
    names it, counted per kind; no call raises. Once a node of that name serves, the client's
    next call (``RELOOKUP_S`` 0 here) finds it. Before: ``AttributeError: 'NoneType' object has
    no attribute 'put'`` (a None handle was never expected)."""
    name = f"missing-{tmp_path.name}"[-60:]
    monkeypatch.setattr(spill_client, "RELOOKUP_S", 3600.0)
    client = RaySpillClient([None], FMT.shape, str(FMT.np_dtype), names=[name], refs=[ActorRef(name, NAMESPACE)])
    try:
        assert client.put(hashes_of([1]), make_blocks([1]), "tenant:a") == 0
        assert client.get(hashes_of([1])).hashes == []
        assert client.contains(hashes_of([1])) == [None]
        assert client.drop_namespace("tenant:a") == 0
        assert client.take_events() == []
        with pytest.raises(SpillFlushIncomplete) as flush:
            client.flush()
        assert flush.value.unflushed == {name: f"failed: no live actor named {name}"}
        assert client.stats() == {f"{kind}_failures": 1 for kind in
                                  ("put", "get", "contains", "drop_namespace", "take_events", "flush")}
        created = _create(name, tmp_path / "spill", FMT)
        assert client.put(hashes_of([2]), make_blocks([2]), "tenant:a") == 0  # within RELOOKUP_S: not looked up
        monkeypatch.setattr(spill_client, "RELOOKUP_S", 0.0)
        assert client.put(hashes_of([2]), make_blocks([2]), "tenant:a") == 1
        assert client.contains(hashes_of([2])) == ["spill_disk"]
        assert ray.get(created.contains.remote(hashes_of([2])), timeout=30) == ["spill_disk"]
    finally:
        _kill_by_name(name)


def test_a_cache_node_started_while_its_spill_node_is_missing_serves(
        tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The launcher's arguments (an ``ActorRef`` per spill node), one of them naming no live
    actor: the node starts, serves a request, its demotions to that shard are dropped writes,
    and once the spill node exists its client's calls reach it. Before: ``ValueError: Failed to
    look up actor with name ...`` from the constructor."""
    from bench.chaos_stack import tiny_checkpoint
    from services.cache_node import CacheNodeActor

    name = f"missing-node-{tmp_path.name}"[-60:]
    config = resolve_node_config(NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20,
                                            host_bytes=1 << 20, device="cpu"), 0)
    spec = spill_block_spec(ServiceConfig(node=config))
    node = CacheNodeActor("n0", config, 1, spill_nodes=[ActorRef(name, NAMESPACE)], spill_spec=spec)
    try:
        request = NodeRequest(request_id="r1", tenant="t", cache_namespace="ns", token_ids=tuple(range(5, 85)),
                              sampling=SamplingParams(max_tokens=2, ignore_eos=True))

        async def serve() -> list[dict]:  # type: ignore[type-arg]
            return [event async for event in node.generate(request)]

        events = asyncio.run(serve())
        assert events[-1]["type"] == "finished"
        assert sum(len(event.get("token_ids", [])) for event in events) == 2
        tiers = node.engine.tiers
        with tiers.lock:
            assert tiers.demote_all(to_spill=True) > 0
        assert tiers.worker.wait_idle(30.0)
        client = tiers.spill
        assert client.stats()["put_failures"] >= 1 and tiers.counters["spill_put_blocks"] == 0
        with pytest.raises(SpillFlushIncomplete, match=f"no live actor named {name}"):
            client.flush()
        created = _create(name, tmp_path / "spill", BlockFormat(*spec))
        monkeypatch.setattr(spill_client, "RELOOKUP_S", 0.0)
        assert client.flush() == 0  # the node found by name answers
        assert client.nodes[0]._actor_id == created._actor_id
        assert client.stats()["flush_failures"] == 1
    finally:
        node.shutdown()
        _kill_by_name(name)
