"""What a cache node tells the global scheduler reaches it, even when the scheduler died after
the node found it or had no live actor at the time.

Regression (s40): ``CacheNodeActor`` told the scheduler of its expired sessions (and its
``/metrics`` port) with fire-and-forget calls through a handle looked up every
``SCHEDULER_RELOOKUP_S``: a call to a scheduler that had died since it was found went to the
dead actor and was lost unseen, and while no actor had the name it was skipped (logged). A route
the scheduler held for such a session (one a restarted scheduler rebuilt from the node's report)
stayed until ``session_ttl_s``, the session's next turn sent to a node that no longer held it.
Now the calls go through ``peer_outbox.PeerOutbox``: sent until a scheduler of the name answers.

Real parts: a ``CacheNodeActor`` in this process (a tiny Llama checkpoint, its step thread), as
``test_scheduler_missing_at_start`` does, and real ``GlobalSchedulerActor``s created, killed
and created again under the name (the last one restarted by Ray) on the session's Ray cluster. The route a restarted
scheduler's recovery rebuilds is made with the call recovery makes (``route_unconfirmed``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from cache_node.sampling_params import SamplingParams
from services import cache_node
from services.actor_refs import ActorRef
from services.config import NodeConfig
from services.global_scheduler_admission import GlobalSchedulerActor
from services.launcher import resolve_node_config
from services.node_request import NodeRequest

NAMESPACE = "kvstrata-scheduler-tells"


def _node(name: str) -> Any:
    from bench.chaos_stack import tiny_checkpoint
    from services.cache_node import CacheNodeActor

    config = resolve_node_config(NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20,
                                            host_bytes=1 << 20, device="cpu"), 0)
    return CacheNodeActor("n0", config, 1, scheduler=ActorRef(name, NAMESPACE))


def _create(name: str, state: Path, max_restarts: int = 0) -> Any:
    """A ``GlobalSchedulerActor`` under ``name``, not waited for: its name is taken at once (a
    look-up finds it), while its process starts (the caller's own work overlaps that start)."""
    return GlobalSchedulerActor.options(name=name, namespace=NAMESPACE, num_cpus=0,
                                        max_restarts=max_restarts).remote(str(state), {"n0": 1})


def _serving(scheduler: Any) -> Any:
    ray.get(scheduler.stats.remote(), timeout=60)
    return scheduler


def _scheduler(name: str, state: Path, max_restarts: int = 0) -> Any:
    return _serving(_create(name, state, max_restarts))


def _quick_retries(node: Any) -> None:
    """The node's outbox retries a failed tell 0.05 s later, not ``peer_outbox.RETRY_S`` (1 s):
    the test waits for the retry that reaches the new scheduler. (A node with no outbox, the
    code before it, is left as it is: the test's asserts then show what it lost.)"""
    tells = getattr(node, "_tells", None)
    if tells is not None:
        tells.retry_s = 0.05


def _routes(scheduler: Any) -> int:
    return int(ray.get(scheduler.stats.remote(), timeout=30)["sessions"])


def _wait_routes(scheduler: Any, expected: int, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (routes := _routes(scheduler)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return routes


def _kill(scheduler: Any, name: str) -> None:
    ray.kill(scheduler, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} still listed alive 30 s after ray.kill")


def _kill_to_restart(scheduler: Any) -> None:
    """Kill ``scheduler``'s process with a restart to come, and wait until that process is gone
    (``ray.kill`` returns before it is: a call made at once could still be answered by the
    process that dies, and whatever it applied die with it)."""
    pid = ray.get(scheduler.health.remote(), timeout=30)["pid"]
    ray.kill(scheduler, no_restart=False)
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid):
        assert time.monotonic() < deadline, f"the scheduler's process {pid} still runs 30 s after ray.kill"
        time.sleep(0.05)


def test_an_expiry_told_to_a_scheduler_that_died_after_it_was_found_reaches_its_successor(
        tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The node found scheduler A (its constructor looks it up); A is killed for good and B
    created under the name, holding a route to the node for session ``t/s-expired`` (as a
    restarted scheduler's recovery rebuilds it); the node expires that session: B drops the
    route. Before: the call went to dead A (the next look-up was ``SCHEDULER_RELOOKUP_S``
    away, 60 s here) and B kept the route (1 session routed after 15 s).

    Then the node's ``PeerOutbox`` against B (one scheduler start fewer than a test of its
    own): a call B raises on (``sessions_ended`` with an int for its list) is dropped at once,
    not sent for ever; B killed with a restart to come (Ray restarts it, its memory new), a
    ``record_metrics_port`` told as it goes down is applied by the restarted actor, whether Ray
    queued the call for it or failed it (sent again)."""
    monkeypatch.setattr(cache_node, "SCHEDULER_RELOOKUP_S", 60.0)
    name = f"sched-dead-{tmp_path.name}"[-60:]
    first = _create(name, tmp_path / "a")
    node = _node(name)  # (its model loads while the scheduler's process starts)
    second = None
    try:
        _serving(first)
        _quick_retries(node)
        assert node.stats()["scheduler_unreachable"] == ""
        _kill(first, name)
        second = _scheduler(name, tmp_path / "b", max_restarts=1)
        ray.get(second.route_unconfirmed.remote("t", "t/s-expired", "n0"), timeout=30)
        assert _routes(second) == 1
        node.session_sink("n0", ["t/s-expired"])
        assert _wait_routes(second, 0) == 0
        tells = node._tells
        assert tells.flush(10.0) and tells.counters["failed_calls"] >= 1

        tells.tell("sessions_ended", {"node_id": "n0", "session_ids": 5})  # (B raises: not a list)
        assert tells.flush(10.0) and tells.counters["refused_calls"] == 1
        _kill_to_restart(second)
        tells.tell("record_metrics_port", {"node_id": "n0", "port": 9100})
        assert tells.flush(60.0), tells.counters
        assert ray.get(second.metrics_port_of.remote("n0"), timeout=30) == 9100
        from ray._private import state  # (no public API reads an actor's restart count)

        assert state.actors(second._actor_id.hex())["NumRestarts"] == 1
    finally:
        node.shutdown()
        if second is not None:
            ray.kill(second, no_restart=True)


def test_an_expiry_while_no_scheduler_lives_is_told_once_one_is_back_less_sessions_held_again(
        tmp_path: Path, ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """No live scheduler of the name: the node expires ``t/s-expired`` and ``t/s-held``, then a
    turn opens ``t/s-held`` on it anew. A scheduler created under the name with routes to the
    node for both (as its recovery rebuilds them) drops ``t/s-expired``'s and keeps
    ``t/s-held``'s, the new session's. Before: both expiries were skipped (logged) and both
    routes stayed (2 routed after 15 s)."""
    monkeypatch.setattr(cache_node, "SCHEDULER_RELOOKUP_S", 0.0)
    name = f"sched-back-{tmp_path.name}"[-60:]
    node = _node(name)
    scheduler = None
    try:
        assert node._scheduler.handle() is None
        # the expiries go out once the routes are made (the scheduler's recovery rebuilds its
        # routes before it serves: a call found no route before them)
        routed = threading.Event()
        not_held = getattr(node, "_not_held", None)
        monkeypatch.setattr(node, "_not_held", lambda args: routed.wait(30) and not_held(args), raising=False)
        node.session_sink("n0", ["t/s-expired", "t/s-held"])
        request = NodeRequest(request_id="r1", tenant="t", cache_namespace="ns", session_id="t/s-held",
                              token_ids=tuple(range(5, 40)), sampling=SamplingParams(max_tokens=2, ignore_eos=True))

        async def serve() -> list[dict]:  # type: ignore[type-arg]
            return [event async for event in node.generate(request)]

        scheduler = _create(name, tmp_path / "state")  # (its process starts while the turn runs)
        assert asyncio.run(serve())[-1]["type"] == "finished"
        assert "t/s-held" in node.engine.sessions.sessions
        _serving(scheduler)
        for sid in ("t/s-expired", "t/s-held"):
            ray.get(scheduler.route_unconfirmed.remote("t", sid, "n0"), timeout=30)
        routed.set()
        assert _wait_routes(scheduler, 1) == 1
        assert node._tells.flush(10.0)
        time.sleep(0.5)  # (a late second call would drop the kept route: none comes)
        assert _routes(scheduler) == 1
    finally:
        node.shutdown()
        if scheduler is not None:
            ray.kill(scheduler, no_restart=True)

