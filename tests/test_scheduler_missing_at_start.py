"""A cache node (re)started while the global scheduler has no live actor starts and serves.

Regression (s39): ``CacheNodeActor.__init__`` looked the scheduler up by name
(``ray.get_actor``), whose ValueError for a missing name failed the constructor, and Ray does
not restart an actor whose constructor raised: a cache node restarted by Ray (``max_restarts``)
while the scheduler was dead for good (not created again yet) was dead for good too. Now the
name is looked up on use (``actor_refs.NamedPeer``): the node serves, says in ``stats`` that
the scheduler is unreachable, skips what it would tell it (block reports lost and resent in
full later, expired sessions logged), and once a scheduler of that name lives its calls reach
it again: its block index is whole after the next report (a ``reset`` of all it holds).

Real parts: a ``CacheNodeActor`` in this process (a tiny Llama checkpoint, its step thread and
block reporter), as ``test_spill_missing_at_start`` does, and a real ``GlobalSchedulerActor``
created under the name on the session's Ray cluster.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from cache_node.sampling_params import SamplingParams
from services import cache_node
from services.actor_refs import ActorRef
from services.config import NodeConfig
from services.global_scheduler_admission import GlobalSchedulerActor
from services.launcher import resolve_node_config
from services.node_request import NodeRequest

NAMESPACE = "kvstrata-scheduler-missing"


def _serve(node: Any, request_id: str, first_token: int) -> None:
    request = NodeRequest(request_id=request_id, tenant="t", cache_namespace="ns",
                          token_ids=tuple(range(first_token, first_token + 80)),
                          sampling=SamplingParams(max_tokens=2, ignore_eos=True))

    async def serve() -> list[dict]:  # type: ignore[type-arg]
        return [event async for event in node.generate(request)]

    events = asyncio.run(serve())
    assert events[-1]["type"] == "finished", events[-1]


def test_a_cache_node_started_while_the_scheduler_is_missing_serves_and_reports_once_it_is_back(
        tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The launcher's argument (the scheduler's ``ActorRef``) naming no live actor: the node
    starts, serves, its stats name the missing scheduler, its block report and expired
    sessions are skipped without an error; with a scheduler of that name created, the next
    request's report resends everything (the index holds exactly the node's blocks) and stats
    say it is reachable. Before: ``ValueError: Failed to look up actor with name ...`` from
    the constructor."""
    from bench.chaos_stack import tiny_checkpoint
    from services.cache_node import CacheNodeActor

    monkeypatch.setattr(cache_node, "SCHEDULER_RELOOKUP_S", 0.0, raising=False)  # (none before)
    name = f"scheduler-{tmp_path.name}"[-60:]
    config = resolve_node_config(NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20,
                                            host_bytes=1 << 20, device="cpu"), 0)
    node = CacheNodeActor("n0", config, 1, scheduler=ActorRef(name, NAMESPACE))
    scheduler = None
    try:
        _serve(node, "r1", 5)
        reporter = node._reporter
        assert reporter is not None and reporter.flush(30.0)
        assert reporter.counters["failed_calls"] >= 1 and reporter.counters["sent_calls"] == 0
        assert reporter.needs_resync
        assert f"no live actor named {name}" in node.stats()["scheduler_unreachable"]
        node.session_sink("n0", ["t/s-expired"])  # skipped (logged), not raised

        scheduler = GlobalSchedulerActor.options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
            str(tmp_path / "state"), {"n0": 1})
        assert ray.get(scheduler.stats.remote(), timeout=60)["indexed_blocks"] == 0
        deadline = time.monotonic() + 10  # (stats never wait for a look-up: a later call reads it)
        while node.stats()["scheduler_unreachable"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.stats()["scheduler_unreachable"] == ""
        _serve(node, "r2", 500)
        assert reporter.flush(30.0)
        assert reporter.counters["sent_calls"] >= 1 and not reporter.needs_resync
        held = collections.Counter(tier for _, tier in node.engine.tier_block_hashes())
        indexed = ray.get(scheduler.stats.remote(), timeout=30)["indexed_blocks_by_tier"]
        assert held and {t: n for t, n in indexed.items() if n} == dict(held), (indexed, held)
        node.session_sink("n0", ["t/s-expired"])  # (to the scheduler found again)
    finally:
        node.shutdown()
        if scheduler is not None:
            ray.kill(scheduler, no_restart=True)
