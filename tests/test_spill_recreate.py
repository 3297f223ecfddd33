"""A spill node dead for good is created again by the global scheduler's spill watch
(``services.spill_recreate``), its directory's blocks found again; the watch's re-index of a
node back from the dead is bounded by the config and applied once, in order; the start grace
ends when the launcher's spill nodes serve (s38 faults 1-3).

Regressions: (1) nothing recreated a spill node past its restarts or killed with
``no_restart``: its shard of the spill tier was lost until ``kvstrata down`` / ``up``, and a
cache node's client kept the dead handle for good. (2) ``_index_spill_holder`` waited a
hard-coded 10 s, sent a new ``held_blocks`` each round after a timeout, and applied the list
after events the node pushed meanwhile (a stale index). (3) a spill node dead right after a
fresh start read "unknown" (``/health`` "ok") for the 120 s start grace. Real parts: SpillNode
and GlobalScheduler actors on the session's Ray cluster, the node's ``BlockReporter``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from services import spill_client
from services.block_reports import BlockReporter
from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerActor
from services.global_scheduler_recovery import RecoveryPeers
from services.metrics import GatewayMetrics
from services.node_monitor import scheduler_answer
from services.recovery_report import BadReport
from services.spill_client import RaySpillClient
from services.spill_node import SpillNode
from services.spill_recreate import RecreatePolicy, SpillRecipe, SpillRecreator
from tests.ray_actors import GatedSpillNode
from tests.test_http_metrics import samples
from tests.test_spill_status import NAMESPACE, POLL_S, _indexed
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks


def _recipe(tmp_path: Path, name: str, scheduler: str) -> SpillRecipe:
    """One node's recipe as the launcher makes it (placed anywhere: the test cluster)."""
    return SpillRecipe(((name, str(tmp_path / "spill" / "0")),), FMT, 0, DISK, NAMESPACE, scheduler)


def _scheduler(tmp_path: Path, name: str, peers: RecoveryPeers) -> Any:
    return GlobalSchedulerActor.options(name=f"sched-{name}"[-60:], namespace=NAMESPACE, num_cpus=0).remote(
        str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={name: 1 << 12}), peers=peers,
        spill_poll_s=POLL_S)


def _kill_by_name(*names: str) -> None:
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


def test_a_killed_spill_node_is_created_again_and_serves_its_disk_blocks(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Fault 1: a spill node killed with ``no_restart`` (dead for good) is created again by the
    watch on its directory: it serves the 3 blocks it had on disk (checksummed reads), they are
    back in the global index, and ``kvstrata status`` says it was recreated once. Before: it
    stayed ``dead`` with 0 blocks indexed."""
    name = f"spill-again-{tmp_path.name}"[-60:]
    recipe = _recipe(tmp_path, name, f"sched-{name}"[-60:])
    scheduler = _scheduler(tmp_path, name, RecoveryPeers(NAMESPACE, (name,), spill_recipe=recipe,
                                                         spill_recreate=RecreatePolicy(3, 3600.0, 0.0)))
    node = recipe.create(name)
    try:
        ray.get(node.ready.remote(), timeout=60)
        assert ray.get(node.put.remote(hashes_of([1, 2, 3]), make_blocks([1, 2, 3]), "tenant:a"), timeout=30) == 3
        assert _indexed(scheduler, 3, tier="spill_disk") == 3
        ray.kill(node, no_restart=True)
        deadline = time.monotonic() + 60
        while (states := ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"])[name]["state"] != "serving" \
                or not states[name].get("recreations"):
            assert time.monotonic() < deadline, states
            time.sleep(0.1)
        assert states[name]["recreations"] == 1, states
        assert states[name]["text"] == "serving; recreated 1 times"
        again = ray.get_actor(name, namespace=NAMESPACE)
        assert again._actor_id != node._actor_id
        hits = ray.get(again.get.remote(hashes_of([1, 2, 3])), timeout=30)
        assert hits.hashes == hashes_of([1, 2, 3]) and (hits.blocks == make_blocks([1, 2, 3])).all()
        assert _indexed(scheduler, 3, tier="spill_disk") == 3
        health = scheduler_answer(ray.get(scheduler.health.remote(), timeout=30))  # as a gateway reads it
        assert health["spill_recreations"] == {name: 1} and health["spill_down"] == {}
    finally:
        ray.kill(scheduler, no_restart=True)  # first: it recreates no more
        _kill_by_name(name)


def test_recreations_are_capped_per_window(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Fault 1, bounded: a node whose constructor raises every time (its directory writable by
    others) is created again at most ``max_per_window`` (2) times, then stays ``dead``, saying
    so and when the next try is. Before: never recreated."""
    name = f"spill-capped-{tmp_path.name}"[-60:]
    recipe = _recipe(tmp_path, name, f"sched-{name}"[-60:])
    (tmp_path / "spill" / "0").mkdir(parents=True)
    os.chmod(tmp_path / "spill" / "0", 0o777)  # the constructor raises UnsafeDirectoryError
    scheduler = _scheduler(tmp_path, name, RecoveryPeers(NAMESPACE, (name,), spill_recipe=recipe,
                                                         spill_recreate=RecreatePolicy(2, 3600.0, 0.0)))
    first = recipe.create(name)  # (held: Ray ends a named actor no handle is left to)
    ray.get(scheduler.attach_nodes.remote({}), timeout=60)  # as the launcher: the start grace ends
    try:
        deadline = time.monotonic() + 60
        while (state := ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"][name]).get("recreations", 0) < 2 \
                or state["state"] != "dead":
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        time.sleep(10 * POLL_S)  # rounds past the cap
        state = ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"][name]
        assert state["state"] == "dead" and state["recreations"] == 2, state
        assert state["next_recreation_s"] > 3500 and "recreated 2 times, next try in" in state["text"], state
        assert ray.get(scheduler.health.remote(), timeout=30)["spill_down"][name].startswith("dead: its constructor")
    finally:
        ray.kill(scheduler, no_restart=True)
        _kill_by_name(name)
        del first


def test_the_gateways_metrics_count_the_recreations() -> None:
    """Each spill node's recreations, as the scheduler's health answer gave them to the
    gateway's ``NodeMonitor``, are the counter ``spill_node_recreations_total{spill_node}``;
    a malformed count in that answer is refused (``BadReport``)."""
    metrics = GatewayMetrics()
    counts = {"spill_node_1": 2}
    metrics.watch_spill(dict, lambda: counts)
    seen = samples(metrics)
    assert {k: v for k, v in seen.items() if k[0].startswith("kvstrata:spill_node_recreations")} == {
        ("kvstrata:spill_node_recreations_total", (("spill_node", "spill_node_1"),)): 2}
    sound = {"pid": 1, "restarts": 0, "data_address": "", "down": {}}
    assert scheduler_answer(sound)["spill_recreations"] == {}  # a scheduler of the version before
    for bad in ({"spill_node_1": -1}, {"spill_node_1": "2"}, {"spill_node_1": True}, ["spill_node_1"]):
        with pytest.raises(BadReport, match="spill_recreations"):
            scheduler_answer(sound | {"spill_recreations": bad})


def test_the_recreation_policy_backs_off_and_caps() -> None:
    """``SpillRecreator``'s schedule: first try ``backoff_s`` after the node was seen dead, then
    twice as long after each, at most ``max_per_window`` within ``window_s``; serving ends the
    dead spell."""
    now = [100.0]
    made: list[str] = []

    class Recipe:  # records instead of creating an actor
        def create(self, name: str) -> None:
            made.append(name)

    recreator = SpillRecreator(Recipe(), RecreatePolicy(2, 1000.0, 5.0), clock=lambda: now[0])  # type: ignore[arg-type]
    assert recreator.next_at("s0") is None and not recreator.due("s0")
    recreator.seen("s0", "dead")
    assert recreator.next_at("s0") == 105.0 and not recreator.due("s0")
    now[0] = 105.0
    assert recreator.due("s0")
    recreator.recreate("s0", "dead: test")
    assert recreator.next_at("s0") == 115.0  # 10 s after it
    now[0] = 115.0
    recreator.recreate("s0", "dead: test")
    assert recreator.next_at("s0") == 1105.0 and not recreator.due("s0")  # capped: the first leaves the window
    assert recreator.info("s0") == {"recreations": 2, "next_recreation_s": 990.0}
    recreator.seen("s0", "serving")
    assert recreator.next_at("s0") is None and made == ["s0", "s0"]
    never = SpillRecreator(Recipe(), RecreatePolicy(0, 1.0, 0.0))  # type: ignore[arg-type]
    never.seen("s0", "dead")
    assert never.next_at("s0") is None and not never.due("s0")
    with pytest.raises(ValueError, match="window_s"):
        RecreatePolicy(1, 0.0, 1.0)


def test_a_cache_nodes_client_finds_the_recreated_node_by_name(tmp_path: Path, ray_cluster,  # type: ignore[no-untyped-def]
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault 1: a cache node's ``RaySpillClient`` looks a node dead for good up again by name,
    so a recreated node gets its puts. Before: the handle resolved at the cache node's start
    was kept for good (every put failed)."""
    from services.actor_refs import ActorRef

    monkeypatch.setattr(spill_client, "RELOOKUP_S", 0.0)
    name, root = f"spill-client-{tmp_path.name}"[-60:], str(tmp_path / "spill")
    first = ray.remote(SpillNode).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
        root, FMT, 0, DISK, node_id=name)
    try:
        ray.get(first.ready.remote(), timeout=60)
        client = RaySpillClient([first], FMT.shape, str(FMT.np_dtype), refs=[ActorRef(name, NAMESPACE)])
        assert client.put(hashes_of([1]), make_blocks([1]), "tenant:a") == 1
        ray.kill(first, no_restart=True)
        deadline = time.monotonic() + 30
        while client.put(hashes_of([2]), make_blocks([2]), "tenant:a") != 0:  # until Ray says it died
            assert time.monotonic() < deadline
        again = ray.remote(SpillNode).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
            root, FMT, 0, DISK, node_id=name)
        ray.get(again.ready.remote(), timeout=60)
        assert client.put(hashes_of([3]), make_blocks([3]), "tenant:a") == 1
        assert client.contains(hashes_of([1, 3])) == ["spill_disk", "spill_disk"]  # block 1 from its disk
    finally:
        _kill_by_name(name)


def test_the_reindex_waits_the_configured_bound_asks_once_and_keeps_newer_events(
        tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Fault 2: ``_index_spill_holder`` gives up after ``report_timeout_s`` (0.3 s here); the
    next rounds await that same call (1 call for 4 rounds, not one per round); and a block
    stored after the node's report was taken, before its answer reached the scheduler, stays
    indexed: the report goes through the node's ordered event push (a reset before that store's
    event). Before: it waited the hard-coded 10 s (no timeout here: the first round failed), each
    round sent a new ``held_blocks``, and the list, applied last as a reset, lost block 4."""
    name = f"spill-reindex-{tmp_path.name}"[-60:]
    scheduler = _scheduler(tmp_path, name, RecoveryPeers(NAMESPACE, (), report_timeout_s=0.3))
    node = ray.remote(GatedSpillNode).options(num_cpus=0, max_concurrency=2).remote(
        str(tmp_path / "spill"), FMT, 0, DISK, node_id=name, event_sink=BlockReporter(scheduler))
    try:
        ray.get([node.ready.remote(), scheduler.stats.remote()], timeout=60)  # both started
        assert ray.get(node.put.remote(hashes_of([1, 2, 3]), make_blocks([1, 2, 3]), "tenant:a"), timeout=30) == 3
        assert _indexed(scheduler, 3, tier="spill_disk") == 3
        ray.get(node.release.remote(), timeout=30)  # a first, answered call: the scheduler's way to the node
        ray.get(scheduler._index_spill_holder.remote(name, node), timeout=60)  # is open (5-7 s on a loaded host)
        ray.get([node.hold.remote(), scheduler._forget_spill_holder.remote(name)], timeout=30)  # seen dead
        assert _indexed(scheduler, 0, tier="spill_disk") == 0
        for _ in range(3):  # three rounds of the watch
            start = time.monotonic()
            with pytest.raises(ray.exceptions.RayTaskError, match="TimeoutError"):
                ray.get(scheduler._index_spill_holder.remote(name, node), timeout=8)
            assert time.monotonic() - start < 3
        assert ray.get(node.state.remote(), timeout=30) == (2, True)  # its report is taken
        assert ray.get(node.put.remote(hashes_of([4]), make_blocks([4]), "tenant:a"), timeout=30) == 1
        assert _indexed(scheduler, 4, within_s=5, tier="spill_disk") in (1, 4)  # its event applied
        ray.get(node.release.remote(), timeout=30)
        ray.get(scheduler._index_spill_holder.remote(name, node), timeout=30)  # the 4th round: the late answer
        assert _indexed(scheduler, 4, within_s=5, tier="spill_disk") == 4
        time.sleep(0.5)  # nothing later undoes it
        assert _indexed(scheduler, 4, within_s=0, tier="spill_disk") == 4
        assert ray.get(node.state.remote(), timeout=30)[0] == 2
    finally:
        ray.get(node.release.remote(), timeout=30)
        for actor in (node, scheduler):
            ray.kill(actor, no_restart=True)


def test_the_start_grace_ends_once_the_launcher_attaches(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Fault 3: on a first start a spill node name with no actor is ``unknown`` (the launcher
    creates the spill nodes after the scheduler) only until the launcher's ``attach_nodes``
    (its spill nodes serve by then); from then on it is ``dead`` at once. Before: "unknown"
    (``/health`` "ok") for 120 s."""
    name = f"spill-grace-{tmp_path.name}"[-60:]  # never created: as one dead right after the start
    scheduler = _scheduler(tmp_path, name, RecoveryPeers(NAMESPACE, (name,)))
    try:
        time.sleep(3 * POLL_S)
        assert ray.get(scheduler.health.remote(), timeout=60)["spill_down"] == {}  # not created yet
        ray.get(scheduler.attach_nodes.remote({}), timeout=30)
        deadline = time.monotonic() + 5
        while not (down := ray.get(scheduler.health.remote(), timeout=30)["spill_down"]):
            assert time.monotonic() < deadline, ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"]
            time.sleep(0.1)
        assert list(down) == [name] and down[name].startswith("dead: no live actor of that name")
    finally:
        ray.kill(scheduler, no_restart=True)
