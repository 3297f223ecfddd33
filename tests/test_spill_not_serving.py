"""A spill node that does not serve yet fails its calls, pushes nothing until it serves, and
knows another deployment's or another host's store from its own previous process (review R3
of 96714bf/6708fea, s36: F1-F3).

Regressions: F1, while a node waited for its directory ``put`` answered 0 and ``get``/
``contains`` nothing, so the cache node's ``RaySpillClient`` counted no failure and logged
nothing (a dead node's ``ActorDiedError`` had counted ``put_failures`` with a warning). F2, a
node whose fixed ``/metrics`` port was still taken pushed its reset of every held block before
the bind, then closed its store on the bind's failure with no empty reset (the global
scheduler's index listed blocks the node answered as misses), and every retry reopened the
store and pushed them all again. F3, "previous process" was decided by the owner text
``<ray namespace>/<actor name>`` alone: another deployment on the same ``spill_dir`` (the
namespace defaults to "kvstrata"), or a store on another host over NFS, was waited for as the
node's own previous process.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked
from cache_node.tiers.spill_store import SpillStore
from services import spill_client, spill_node
from services.metrics import MetricsEndpoint
from services.spill_client import RaySpillClient
from services.spill_node import SpillNode, SpillNodeActor, create_spill_node
from tests.test_spill_lock_wait import holder_processes, wait_serving
from tests.test_spill_store import BLOCK, DISK, FMT, hashes_of, make_blocks

OTHER_HOST = """
import os, sys, time
from pathlib import Path
from cache_node.tiers.spill_lock import LOCK_FILE
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import DISK, FMT
store = SpillStore(Path(sys.argv[1]), FMT, ram_bytes=0, disk_bytes=DISK, lock_owner=sys.argv[2])
# what a holder on another host (the directory over NFS) writes: its pid and host, the same owner
fd = os.open(Path(sys.argv[1]) / LOCK_FILE, os.O_WRONLY)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()} some-other-host {sys.argv[2]}\\n".encode(), 0)
os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def other_host() -> Iterator[callable]:  # type: ignore[valid-type]
    """Starts a process whose store holds a directory under ``owner``, as a holder on another
    host names itself; killed at the end."""
    yield from holder_processes(OTHER_HOST)


def test_every_data_call_of_a_waiting_node_fails(tmp_path: Path) -> None:
    """F1 (the plain class): while another store holds the directory, put/get/contains/
    match_prefix/held_blocks raise ``SpillDirLocked`` naming why; once it serves they work."""
    root = tmp_path / "spill"
    other = SpillStore(root, FMT, 0, DISK, lock_owner="other-deployment/spill_node_0")
    node = SpillNode(root, FMT, 0, DISK, node_id="spill_node_0", lock_owner="ns/spill_node_0", lock_wait_s=0.1)
    try:
        calls = {
            "put": lambda: node.put(hashes_of([1]), make_blocks([1]), "tenant:a", [[1, 2, 3, 4]], {"a": 1.0}),
            "get": lambda: node.get(hashes_of([1])),
            "contains": lambda: node.contains(hashes_of([1])),
            "match_prefix": lambda: node.match_prefix(hashes_of([1])),
            "held_blocks": lambda: node.held_blocks(),
        }
        for name, call in calls.items():
            with pytest.raises(SpillDirLocked, match="does not serve yet.*in use by another spill store"):
                call()
                pytest.fail(f"{name} answered while the node does not serve")
        other.close()
        wait_serving(node)
        assert node.put(hashes_of([1]), make_blocks([1]), "tenant:a", [[1, 2, 3, 4]], {"a": 1.0}) == 1
        assert node.contains(hashes_of([1])) == ["spill_disk"] and node.match_prefix(hashes_of([1])) == 1
    finally:
        node.close()
        other.close()


def test_the_cache_nodes_client_counts_a_waiting_node_as_failed(
        tmp_path: Path, ray_cluster, caplog: pytest.LogCaptureFixture,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    """F1 (over Ray): the cache node's ``RaySpillClient`` counts every call to a node that does
    not serve as failed, as it does a dead node's (old: put 0, no failure counted), and logs it
    once per ``FAIL_LOG_EVERY_S`` per kind, saying how many it did not log (review s36 R4 F3:
    a WARNING for every batch, for as long as the node did not serve)."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    other = SpillStore(root / "0", FMT, 0, DISK, lock_owner="other-deployment/spill_node_0")
    actor = SpillNodeActor.options(max_restarts=0, resources={}, num_cpus=0).remote(
        str(root / "0"), FMT, 0, DISK, node_id="spill-not-serving", lock_owner="test/spill-not-serving",
        lock_wait_s=0.1)
    try:
        assert ray.get(actor.status.remote(), timeout=60)["serving"] is False
        client = RaySpillClient([actor], FMT.shape, str(FMT.np_dtype), get_timeout_s=30, put_timeout_s=30)
        with caplog.at_level("WARNING", logger="services.spill_client"):
            assert client.put(hashes_of([1, 2]), make_blocks([1, 2]), "tenant:a", [[1, 2, 3, 4]] * 2,
                              {"a": 1.0}) == 0
            assert client.get(hashes_of([1, 2])).hashes == []
            assert client.contains(hashes_of([1, 2])) == [None, None]
            for _ in range(4):
                assert client.get(hashes_of([1, 2])).hashes == []
        assert client.stats() == {"put_failures": 1, "get_failures": 5, "contains_failures": 1}
        assert sum("SpillDirLocked" in r.getMessage() for r in caplog.records) == 3
        caplog.clear()
        monkeypatch.setattr(spill_client, "FAIL_LOG_EVERY_S", 0.0)  # the next one is due
        with caplog.at_level("WARNING", logger="services.spill_client"):
            assert client.get(hashes_of([1, 2])).hashes == []
        assert client.stats()["get_failures"] == 6
        [said] = [r.getMessage() for r in caplog.records]
        assert "SpillDirLocked" in said and "4 more get failures" in said, said
    finally:
        ray.kill(actor, no_restart=True)
        other.close()


def test_a_held_metrics_port_keeps_the_store_and_pushes_one_reset_once_it_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F2: a restarted node whose fixed ``/metrics`` port is still taken pushes nothing to the
    block index while it retries the bind (old: a reset of all 20 blocks per try, the store then
    closed, with no empty reset after), keeps one store open, and pushes one reset of every
    block once the port is free and it serves."""
    monkeypatch.setattr(spill_node, "LOCK_RETRY_MAX_S", 0.2)
    root = tmp_path / "spill"
    before = SpillStore(root, FMT, 0, DISK)
    before.put(hashes_of(range(20)), make_blocks(range(20)), "tenant:a", [[i, 1, 2, 3] for i in range(20)])
    before.close()
    pushes: list[tuple[bool, int]] = []
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    node = SpillNode(root, FMT, 64 * BLOCK, DISK, node_id="n0",
                     event_sink=lambda node_id, events, reset: pushes.append((reset, len(events))),
                     metrics=MetricsEndpoint("127.0.0.1", taken.getsockname()[1]), retry_start=True)
    try:
        store = node._store
        time.sleep(1.5)  # several tries
        assert node.status()["serving"] is False and node.status()["tries"] >= 3
        assert pushes == []
        assert node._store is store is not None  # never reopened (its disk index rebuilt, swept again)
        with pytest.raises(SpillDirLocked, match="could not start serving"):
            node.contains(hashes_of([0]))
        taken.close()
        wait_serving(node)
        assert pushes == [(True, 20)] and node._store is store
        assert node.contains(hashes_of([0])) == ["spill_disk"]
    finally:
        taken.close()
        node.close()


def test_a_first_start_whose_port_is_taken_lets_its_directory_go(tmp_path: Path) -> None:
    """A first start (no retry) whose ``/metrics`` port is taken raises, its directory free at
    once for the next store."""
    root = tmp_path / "spill"
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError):
            SpillNode(root, FMT, 0, DISK, metrics=MetricsEndpoint("127.0.0.1", taken.getsockname()[1]),
                      retry_start=False)
    finally:
        taken.close()
    SpillStore(root, FMT, 0, DISK, lock_wait_s=0.0).close()


def test_a_holder_on_another_host_is_not_the_previous_process(tmp_path: Path, other_host) -> None:  # type: ignore[no-untyped-def]
    """F3: a store holding the directory from another host, under the very owner this node
    writes, is another store (an error, ``previous_process`` False), never waited for as this
    node's own previous process."""
    root = tmp_path / "spill"
    holder = other_host(root, "kvstrata/spill_node_0")
    assert (root / LOCK_FILE).read_text().split()[:2] == [str(holder.pid), "some-other-host"]
    node = SpillNode(root, FMT, 0, DISK, node_id="spill_node_0", lock_owner="kvstrata/spill_node_0",
                     lock_wait_s=0.1)
    try:
        status = node.status()
        assert status["serving"] is False and status["holder_host"] == "some-other-host"
        assert status["previous_process"] is False
    finally:
        node.close()


def test_another_deployments_node_of_the_same_name_is_not_the_previous_process(
        tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """F3: two deployments of one Ray namespace whose state directories differ share a
    ``spill_dir``: the second's node (``create_spill_node`` with its ``deployment_id``, as the
    launcher starts it) names the first's store as another store, not its previous process;
    its own restart (same deployment) is its previous process."""
    from services.spill_node import deployment_id

    first, second = tmp_path / "state-a", tmp_path / "state-b"
    assert deployment_id(first) != deployment_id(second) == deployment_id(tmp_path / "x" / ".." / "state-b")
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    namespace = ray.get_runtime_context().namespace
    name = f"spill-deploy-{os.getpid()}"
    held = SpillStore(root / "0", FMT, 0, DISK, lock_owner=f"{namespace}/{name}@{deployment_id(first)}")
    actor = create_spill_node(name, root / "0", FMT, 0, DISK, resources={}, max_restarts=0,
                              deployment=deployment_id(second), lock_wait_s=0.1)
    try:
        status = ray.get(actor.status.remote(), timeout=60)
        assert status["serving"] is False and status["previous_process"] is False
        assert status["holder_owner"] == f"{namespace}/{name}@{deployment_id(first)}"
        held.close()
        deadline = time.monotonic() + 20
        while not ray.get(actor.status.remote(), timeout=30)["serving"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        owner = (root / "0" / LOCK_FILE).read_text().split()[2]
        assert owner == f"{namespace}/{name}@{deployment_id(second)}"
        assert ray.get(actor.get.remote(hashes_of([1])), timeout=30).hashes == []
        assert isinstance(ray.get(actor.held_blocks.remote(), timeout=30), list)
    finally:
        ray.kill(actor, no_restart=True)
        held.close()
