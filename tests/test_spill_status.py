"""Spill node states where operators look: the global scheduler's ``stats``/``health``
(``services.spill_watch``), ``kvstrata status`` and the gateway's HTTP ``/health``.

Regression (s37): a spill node alive but not serving (its directory held by another store,
its ``/metrics`` port taken) or dead for good (a constructor that raised) was visible only in
its own log, its ``status()`` and its cache nodes' failure counters: ``kvstrata status`` listed
cache nodes alone and ``/health`` said "ok". Real parts: SpillNode actors, a directory held by
another process (``holder_processes``), the GlobalScheduler actor, the CLI's table, the
gateway's HTTP app.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console

from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked
from cache_node.tiers.spill_store import SpillStore
from cli.lifecycle import spill_table
from kvstrata.v1 import admin_pb2
from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerActor
from services.global_scheduler_recovery import RecoveryPeers
from services.metrics import GatewayMetrics
from services.node_monitor import scheduler_answer
from services.openai_api.app import OpenAIEdge, create_app
from services.spill_node import SpillNodeActor, create_spill_node
from services.spill_watch import SpillWatch, failed_state, state_of
from tests.ray_actors import CountingSpillNode
from tests.test_http_metrics import samples
from tests.test_spill_lock_wait import HOLDER, holder_processes
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks

NAMESPACE = "kvstrata-test"  # the session cluster's (tests.service_fixtures.start_cluster)
POLL_S = 0.2  # the scheduler's spill watch in these tests (SPILL_POLL_S is 5 s)


@pytest.fixture
def holder() -> Iterator[Any]:
    yield from holder_processes(HOLDER)


def _states(scheduler: Any, want: dict[str, str], within_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """The scheduler's ``stats()["spill_nodes"]`` once each node named in ``want`` is in the
    state ``want`` gives it, or at the deadline. Each is awaited, not only a first answer: a
    node under load may read "not answering" before its state (s37 review F4: flaky)."""
    deadline = time.monotonic() + within_s
    while True:
        states = ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"]
        if all(states[n]["state"] == w for n, w in want.items()) or time.monotonic() > deadline:
            return states
        time.sleep(0.1)


def _health_over_http(spill_down: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """``GET /health`` of the gateway's HTTP app, straight through ASGI, one healthy cache node."""
    edge = OpenAIEdge(servicer=None, model_id="m@0:f16", encode=list, num_healthy=lambda: 1,  # type: ignore[arg-type]
                      spill_down=lambda: spill_down)
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "path": "/health",
             "raw_path": b"/health", "query_string": b"", "scheme": "http", "headers": [],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "root_path": ""}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(create_app(edge)(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_status_and_health_name_a_waiting_and_a_dead_spill_node(
        tmp_path: Path, holder, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    other = holder(root / "1", "another-deployment/spill_node_1")
    (root / "2").mkdir(mode=0o777)
    os.chmod(root / "2", 0o777)  # writable by others: the node's constructor raises UnsafeDirectoryError
    names = [f"spill-status-{tmp_path.name}-{i}"[-60:] for i in range(3)]
    actors = [SpillNodeActor.options(name=name, namespace=NAMESPACE, max_restarts=-1, resources={}, num_cpus=0)
              .remote(str(root / str(i)), FMT, 0, DISK, node_id=name, lock_owner=f"{NAMESPACE}/{name}", lock_wait_s=0.1)
              for i, name in enumerate(names)]
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(
        str(tmp_path / "state"), {"n0": 1}, peers=RecoveryPeers(NAMESPACE, tuple(names)), spill_poll_s=POLL_S)
    try:
        states = _states(scheduler, dict(zip(names, ["serving", "waiting", "dead"], strict=True)))
        assert [states[n]["state"] for n in names] == ["serving", "waiting", "dead"], states
        held = states[names[1]]
        assert held["holder"] == f"pid {other.pid} on {socket.gethostname()} (another-deployment/spill_node_1)"
        assert held["previous_process"] is False and "in use by another spill store" in held["detail"]
        assert held["text"] == f"waiting for its directory: held by another store, {held['holder']}"
        assert states[names[2]]["detail"].startswith("its constructor raised "), states[names[2]]
        assert "writable" in states[names[2]]["detail"], states[names[2]]

        health = scheduler_answer(ray.get(scheduler.health.remote(), timeout=30))  # as a gateway reads it
        assert sorted(health["spill_down"]) == names[1:]
        assert health["spill_down"][names[1]] == held["text"]
        assert health["spill_down"][names[2]].startswith("dead: ")

        console = Console(record=True, width=300)
        console.print(spill_table(admin_pb2.StatsResponse(stats_json=json.dumps({"scheduler": {"spill_nodes": states}}))))
        lines = {line.split("│")[1].strip(): line.split("│")[2].strip()
                 for line in console.export_text().splitlines() if line.count("│") == 3}
        assert lines[names[0]] == "serving"
        assert lines[names[1]] == held["text"] and lines[names[2]].startswith("dead: ")

        assert _health_over_http(health["spill_down"]) == (
            200, {"status": "degraded", "healthy_nodes": 1, "spill_nodes_not_serving": names[1:]})
        assert _health_over_http({}) == (200, {"status": "ok", "healthy_nodes": 1})

        other.kill()  # the other store lets the directory go: the node serves, and says so
        other.wait(10)
        deadline = time.monotonic() + 60
        while ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"][names[1]]["state"] != "serving":
            assert time.monotonic() < deadline, ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"]
            time.sleep(0.2)
        assert sorted(ray.get(scheduler.health.remote(), timeout=30)["spill_down"]) == names[2:]
    finally:
        for actor in (*actors, scheduler):
            ray.kill(actor, no_restart=True)


def _indexed(scheduler: Any, want: int, within_s: float = 60.0, tier: str = "spill_ram") -> int:
    """The index's block count in ``tier`` once it is ``want`` (events and the watch are
    asynchronous), or at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        got = ray.get(scheduler.stats.remote(), timeout=30)["indexed_blocks_by_tier"][tier]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_a_dead_spill_nodes_blocks_leave_the_global_index(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Regression (s37): a spill node dead for good (here: killed past its restarts) kept its
    blocks in the global scheduler's index for good (admission counted their tokens as cached,
    routing steered by them; every get was a miss). The scheduler's spill watch sees it dead and
    drops them. Before: the index still listed its 3 blocks."""
    name = f"spill-dead-{tmp_path.name}"[-60:]
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(
        str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={name: 1 << 12}),
        peers=RecoveryPeers(NAMESPACE, (name,)), spill_poll_s=POLL_S)
    node = create_spill_node(name, tmp_path / "spill", FMT, 1 << 20, DISK, resources={}, namespace=NAMESPACE,
                             scheduler=scheduler, max_restarts=0)
    try:
        ray.get(node.ready.remote(), timeout=60)
        assert ray.get(node.put.remote(hashes_of([1, 2, 3]), make_blocks([1, 2, 3]), "tenant:a"), timeout=30) == 3
        assert _indexed(scheduler, 3) == 3
        assert _states(scheduler, {name: "serving"})[name]["state"] == "serving"
        ray.kill(node, no_restart=True)
        assert _indexed(scheduler, 0) == 0
        assert ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"][name]["state"] == "dead"
    finally:
        ray.kill(node, no_restart=True)
        ray.kill(scheduler, no_restart=True)


def test_a_spill_node_serving_again_has_its_blocks_indexed_again(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Regression (s37 review F6): once the watch marked a spill node dead (its blocks left the
    index), nothing put them back when a node of that name served again without a reset push
    of its own (here: one created with no scheduler to push to, over the same directory, whose
    disk tier it reopens). The watch asks it for ``held_blocks``, as a restarted scheduler's
    recovery does. Before: 0 blocks indexed 20 s after it served."""
    name = f"spill-back-{tmp_path.name}"[-60:]
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(
        str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={name: 1 << 12}),
        peers=RecoveryPeers(NAMESPACE, (name,)), spill_poll_s=POLL_S)
    node = create_spill_node(name, tmp_path / "spill", FMT, 0, DISK, resources={}, namespace=NAMESPACE,
                             scheduler=scheduler, max_restarts=0)  # RAM 0: every block on disk
    again = None
    try:
        ray.get(node.ready.remote(), timeout=60)
        assert ray.get(node.put.remote(hashes_of([1, 2, 3]), make_blocks([1, 2, 3]), "tenant:a"), timeout=30) == 3
        assert _indexed(scheduler, 3, tier="spill_disk") == 3
        ray.kill(node, no_restart=True)
        assert _states(scheduler, {name: "dead"})[name]["state"] == "dead"
        assert _indexed(scheduler, 0, tier="spill_disk") == 0
        again = create_spill_node(name, tmp_path / "spill", FMT, 0, DISK, resources={}, namespace=NAMESPACE,
                                  max_restarts=0)
        ray.get(again.ready.remote(), timeout=60)
        assert _states(scheduler, {name: "serving"})[name]["state"] == "serving"
        assert _indexed(scheduler, 3, within_s=20, tier="spill_disk") == 3
    finally:
        for actor in (node, again, scheduler):
            if actor is not None:
                ray.kill(actor, no_restart=True)


def test_the_gateways_metrics_export_the_spill_nodes_not_serving() -> None:
    """A spill node that does not serve exports no ``/metrics`` of its own: the gateway's say
    which do not (``NodeMonitor.spill_down``, here as the scheduler's health gave it), read at
    each scrape."""
    metrics = GatewayMetrics()
    down = {"spill_node_1": "waiting for its directory: held by another store, pid 7 on h (o)",
            "spill_node_2": "dead: its constructor raised ..."}
    metrics.watch_spill(lambda: down)
    seen = samples(metrics)
    assert seen[("kvstrata:spill_nodes_not_serving", ())] == 2
    assert {k: v for k, v in seen.items() if k[0] == "kvstrata:spill_node_not_serving"} == {
        ("kvstrata:spill_node_not_serving", (("spill_node", "spill_node_1"),)): 1,
        ("kvstrata:spill_node_not_serving", (("spill_node", "spill_node_2"),)): 1}
    down.clear()  # both serve again
    seen = samples(metrics)
    assert seen[("kvstrata:spill_nodes_not_serving", ())] == 0
    assert not [k for k in seen if k[0] == "kvstrata:spill_node_not_serving"]


def test_health_lists_the_spill_nodes_not_serving_by_name_only() -> None:
    """Regression (s37 review F1): the unauthenticated HTTP ``/health`` returned each spill
    node's reason verbatim: hosts, pids, the Ray namespace, spill_dir paths, exception text.
    It names the nodes; the reasons stay in ``kvstrata status`` (admin key). Before: the body
    held the reasons below."""
    down = {"spill_node_2": "dead: its constructor raised UnsafeDirectoryError: /srv/kv/spill/2 is writable",
            "spill_node_1": "waiting for its directory: held by another store, pid 4242 on gpu-host-7 "
                            "(prod-ns-3f9a/spill_node_1)"}
    status, body = _health_over_http(down)
    assert (status, body) == (200, {"status": "degraded", "healthy_nodes": 1,
                                    "spill_nodes_not_serving": ["spill_node_1", "spill_node_2"]})
    for secret in ("/srv", "4242", "gpu-host-7", "prod-ns", "Unsafe", "writable"):
        assert secret not in json.dumps(body)


def test_a_lock_files_control_characters_never_reach_the_terminal(tmp_path: Path, holder) -> None:  # type: ignore[no-untyped-def]
    """Regression (s37 review F2): a lock file's host and owner were read back raw (cleaned
    only when this code wrote them), and the spill table escaped rich markup only: ESC
    sequences from a lock file (or a node's answer, or Ray's error text) reached the terminal
    of ``kvstrata status``. Before: ``SpillDirLocked.host`` held "\\x1b]0;x\\x07"."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    other = holder(root, "o")
    (root / LOCK_FILE).write_bytes(f"{other.pid} h\x1b]0;x\x07ost \x1b[2Jown\x1bcer\n".encode())  # same inode
    with pytest.raises(SpillDirLocked) as caught:
        SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK, lock_owner="me")
    assert (caught.value.pid, caught.value.host, caught.value.owner) == (other.pid, "h_]0;x_ost", "_[2Jown_cer")

    states = {"a": state_of({"serving": False, "error": "held \x1b[2J", "holder_pid": 7,
                             "holder_host": "h\x1b]0;x\x07", "holder_owner": "o\x1b[31m"}),
              "b": failed_state(ValueError("Failed to look up actor \x1b]0;x\x07"))}
    assert states["a"]["holder"] == "pid 7 on h?]0;x? (o?[31m)" and states["a"]["detail"] == "held ?[2J"
    states["c"] = {"state": "dead", "text": "dead: \x1b[2J\x1b]0;x\x07 from an older scheduler"}
    console = Console(record=True, width=300)
    console.print(spill_table(admin_pb2.StatsResponse(stats_json=json.dumps(
        {"scheduler": {"spill_nodes": {n: st | ({} if "text" in st else {"text": ""}) for n, st in states.items()}}}))))
    shown = console.export_text()
    assert "\x1b" not in shown and "\x07" not in shown and "?[2J?]0;x? from an older scheduler" in shown


def test_a_restarted_scheduler_sees_a_spill_node_gone_before_it_at_once(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Regression (s37 review F3): a spill node dead before the scheduler's watch began (no
    live actor of its name) read "unknown: not asked yet" for the 120 s start grace also after
    Ray restarted the scheduler, whose spill nodes exist already: ``/health`` "ok", the gateway's
    metric 0. The grace holds on a first start only. Before: still unknown 30 s after the restart."""
    name = f"spill-gone-{tmp_path.name}"[-60:]  # never created: as one dead for good
    scheduler = GlobalSchedulerActor.options(num_cpus=0, max_restarts=1).remote(
        str(tmp_path / "state"), {"n0": 1}, peers=RecoveryPeers(NAMESPACE, (name,)), spill_poll_s=POLL_S)
    try:
        time.sleep(3 * POLL_S)  # a first start: the name may not be created yet (the launcher's order)
        assert ray.get(scheduler.health.remote(), timeout=60)["spill_down"] == {}
        ray.kill(scheduler, no_restart=False)
        deadline = time.monotonic() + 30
        while not (health := _health_after_restart(scheduler))["spill_down"]:
            assert time.monotonic() < deadline, (health, ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"])
            time.sleep(0.1)
        assert health["restarts"] == 1 and list(health["spill_down"]) == [name]
        assert health["spill_down"][name].startswith("dead: no live actor of that name")
    finally:
        ray.kill(scheduler, no_restart=True)


def _health_after_restart(scheduler: Any) -> dict[str, Any]:
    """The scheduler's ``health()``; an empty ``spill_down`` while Ray restarts it."""
    try:
        return ray.get(scheduler.health.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return {"spill_down": {}}


def test_a_hung_spill_node_gets_one_status_call_not_one_per_round(tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Regression (s37 review F5): each round of the watch sent a new ``status`` to a node that
    had not answered the last; on a hung node they piled up in its queue. The call that timed
    out is awaited again instead. Before: 5 calls queued behind a 2 s hang (poll 0.1 s,
    timeout 0.2 s); after: 1."""
    name = f"spill-hung-{tmp_path.name}"[-60:]
    node = ray.remote(CountingSpillNode).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
        str(tmp_path / "spill"), FMT, 0, DISK, node_id=name)
    watch = SpillWatch(NAMESPACE, [name], poll_s=0.1, timeout_s=0.2)

    async def watched_through_a_hang() -> tuple[str, int]:
        await node.ready.remote()
        watching = asyncio.create_task(watch.run())
        while watch.states[name]["state"] != "serving":
            await asyncio.sleep(0.05)
        hung = node.hang.remote(2.0)
        await asyncio.sleep(1.5)
        watching.cancel()
        state = watch.states[name]["state"]
        before = await hung
        return state, await node.calls.remote() - before  # the calls queued behind the hang

    try:
        assert asyncio.run(asyncio.wait_for(watched_through_a_hang(), 60)) == ("not answering", 1)
    finally:
        ray.kill(node, no_restart=True)
