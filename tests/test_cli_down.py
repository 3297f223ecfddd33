"""`kvstrata down` after `kvstrata up --address auto` (issue 18 fault 9: it stopped nothing,
and the next `up` failed on the taken gateway port).

The real check: on a running Ray cluster (the user's, here the session cluster), detached
actors under kvstrata's names hold a TCP port as the gateway does; `kvstrata down` in a
subprocess, with the state `up --address auto` leaves, kills them and frees the port, and
the cluster itself stays up.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray
import yaml

from cli.lifecycle import _ray_target, _service_actor_names

ROOT = Path(__file__).resolve().parent.parent


@ray.remote(num_cpus=0)
class _PortHolder:
    """Stands in for the gateway: listens on a port until its process dies."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()

    def port(self) -> int:
        return self.sock.getsockname()[1]


@ray.remote(num_cpus=0)
class _Scheduler:
    """Stands in for the GlobalScheduler: notes that ``down`` asked it to store its usage."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def flush_durable(self) -> int:
        Path(self.marker).write_text("flushed")
        return 1


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_service_actor_names_pick_only_ours() -> None:
    """issue 18 fault 9: down kills kvstrata's actors in its namespace, nothing else."""
    named = [{"name": n, "namespace": ns} for n, ns in [
        ("gateway", "kv"), ("global_scheduler", "kv"), ("cache_node_0", "kv"), ("cache_node_12", "kv"),
        ("spill_node_1", "kv"), ("gateway", "other"), ("my_actor", "kv"), ("cache_node_x", "kv")]]
    assert _service_actor_names(named, "kv") == ["gateway", "global_scheduler", "cache_node_0",
                                                 "cache_node_12", "spill_node_1"]


def test_ray_target_resolves_auto_and_client_addresses(monkeypatch) -> None:
    """issue 18 fault 9: an `auto` or `ray://` address is handed to Ray, never judged unreachable."""
    assert _ray_target({"ray_address": "auto"}) == "auto"
    assert _ray_target({"ray_address": "ray://head:10001"}) == "ray://head:10001"
    assert _ray_target({"ray_address": "127.0.0.1:1"}) is None  # nothing listens on port 1
    assert _ray_target({}) is None


def test_down_after_up_on_an_existing_cluster_stops_our_actors_only(ray_cluster, tmp_path: Path) -> None:
    """issue 18 fault 9: down stops the services (port freed), not the user's cluster."""
    namespace = "kvstrata-down-test"
    gateway = _PortHolder.options(name="gateway", namespace=namespace, lifetime="detached").remote()
    node = _PortHolder.options(name="cache_node_0", namespace=namespace, lifetime="detached").remote()
    bystander = _PortHolder.options(name="gateway", namespace="someone-else", lifetime="detached").remote()
    scheduler = _Scheduler.options(name="global_scheduler", namespace=namespace, lifetime="detached").remote(
        str(tmp_path / "flushed"))
    port = ray.get(gateway.port.remote())
    ray.get(scheduler.__ray_ready__.remote())
    ray.get([node.port.remote(), bystander.port.remote()])
    assert _listening(port)
    (tmp_path / "gateway.json").write_text(json.dumps({
        "address": f"127.0.0.1:{port}", "ray_address": "auto", "started_ray": False,
        "ray_temp_dir": "", "namespace": namespace, "state_dir": str(tmp_path)}))
    (tmp_path / "prometheus_targets.json").write_text("[]")  # what up wrote: addresses now stale
    env = dict(os.environ, KVSTRATA_STATE_DIR=str(tmp_path), RAY_ADDRESS=ray_cluster.address)

    done = subprocess.run([sys.executable, "-m", "cli.main", "down"], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stdout + done.stderr
    deadline = time.monotonic() + 10
    while _listening(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _listening(port)
    names = {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}
    assert (namespace, "gateway") not in names and (namespace, "cache_node_0") not in names
    assert (namespace, "global_scheduler") not in names
    assert (tmp_path / "flushed").read_text() == "flushed"  # usage stored before the kill
    assert ("someone-else", "gateway") in names  # another namespace's actor is left alone
    assert all(n["Alive"] for n in ray.nodes())  # the user's cluster is still up
    assert not (tmp_path / "gateway.json").exists() and not (tmp_path / "prometheus_targets.json").exists()
    ray.kill(bystander)


def test_a_failed_up_on_an_existing_cluster_leaves_no_actor_behind(ray_cluster, tmp_path: Path) -> None:
    """Regression (review 23d, H): `up --address` whose cache nodes could not be placed left
    the detached scheduler (holding the tenant store) and the pending cache node behind, wrote
    no state for `down` ("nothing to stop"), and every later `up` failed on Ray's name
    collision. Now a failed `up` on a joined cluster kills what it placed."""
    namespace = "kvstrata-failed-up-test"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "namespace": namespace, "state_dir": str(tmp_path / "state"), "num_spill_nodes": 0,
        "cache_node_resource": "kvstrata_test_no_such_resource", "start_timeout_s": 3,
        "gateway_port": 0, "http_port": 0, "metrics_enabled": False}))
    env = dict(os.environ, KVSTRATA_STATE_DIR=str(tmp_path / "cli"), RAY_ADDRESS=ray_cluster.address)

    done = subprocess.run([sys.executable, "-m", "cli.main", "up", "--config", str(config), "--address",
                           ray_cluster.address], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)

    assert done.returncode == 1 and "kvstrata up failed" in done.stdout, done.stdout + done.stderr
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    assert left == [], left  # ['global_scheduler', 'cache_node_0'] before
    assert not (tmp_path / "cli" / "gateway.json").exists()


def test_a_failed_up_on_an_existing_cluster_leaves_another_deployment_alone(ray_cluster, tmp_path: Path) -> None:
    """Regression (review s37 r4 F1): `up --address` into a namespace where another deployment
    (one this CLI's gateway.json does not know) serves failed on Ray's name check for
    `global_scheduler`, then killed every actor named like ours in the namespace, that
    deployment's, and asked its scheduler to flush first. Now only what it created is killed."""
    namespace = "kvstrata-failed-up-bystander-test"
    scheduler = _Scheduler.options(name="global_scheduler", namespace=namespace, lifetime="detached").remote(
        str(tmp_path / "flushed"))
    node = _PortHolder.options(name="cache_node_0", namespace=namespace, lifetime="detached").remote()
    ray.get([scheduler.__ray_ready__.remote(), node.port.remote()])
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "namespace": namespace, "state_dir": str(tmp_path / "state"), "num_spill_nodes": 0,
        "start_timeout_s": 3, "gateway_port": 0, "http_port": 0, "metrics_enabled": False}))
    env = dict(os.environ, KVSTRATA_STATE_DIR=str(tmp_path / "cli"), RAY_ADDRESS=ray_cluster.address)

    done = subprocess.run([sys.executable, "-m", "cli.main", "up", "--config", str(config), "--address",
                           ray_cluster.address], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)

    try:
        assert done.returncode == 1 and "global_scheduler" in done.stdout, done.stdout + done.stderr
        assert ray.get(node.port.remote(), timeout=30) > 0  # ActorDiedError before
        assert ray.get(scheduler.__ray_ready__.remote(), timeout=30)  # alive
        assert not (tmp_path / "flushed").exists()  # flushed by the failed up before
        assert not (tmp_path / "cli" / "gateway.json").exists()
    finally:
        for actor in (scheduler, node):
            ray.kill(actor)


def test_down_kills_a_spill_node_the_scheduler_created_again_meanwhile(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """A spill node dead for good is created again by the scheduler's spill watch
    (``services.spill_recreate``; detached, as ``up``'s nodes). One it creates while ``down``
    runs (here: during ``flush_durable``, after ``down`` listed the actors) is killed too: the
    scheduler goes first, then the actors are listed again. Regression (s38 review): ``down``
    killed only the names it listed before, so that node outlived it, holding its directory's
    lock and its name (the next ``up`` on that cluster failed)."""
    from cli.lifecycle import _kill_services
    from tests.ray_actors import RecreatingScheduler

    namespace = "kvstrata-down-recreated"
    scheduler = RecreatingScheduler.options(name="global_scheduler", namespace=namespace,
                                            lifetime="detached").remote(namespace, "spill_node_0")
    ray.get(scheduler.__ray_ready__.remote(), timeout=60)
    try:
        _kill_services(namespace, "")
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}
        assert names == set()
    finally:
        for name in ("global_scheduler", "spill_node_0"):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(name, namespace=namespace))
