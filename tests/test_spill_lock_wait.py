"""A spill node whose directory another process holds waits for it instead of dying for good
(``services.spill_node``; s36 fault 1).

Regression: ``SpillNode``'s constructor raised ``SpillDirLocked`` after ``LOCK_WAIT_S`` (15 s)
when another process held its spill directory, and Ray's ``max_restarts`` does not cover a
constructor's failure: a restart that raced its old worker's exit, or a node started beside
another deployment's store on the same ``spill_dir``, left the deployment without that spill
node for good (every later call ``ActorDiedError``), with one log line to tell. Now the node
lives: it waits for its own previous process (the lock file names the same owner), says that
another store holds the directory (``ready`` raises ``SpillDirLocked`` naming it, ``status``,
an error in its log), refuses every data call meanwhile (``SpillDirLocked``), and opens the directory once it is free.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked
from services.spill_node import SpillNode, SpillNodeActor, await_serving
from tests.test_spill_disk_faults import tokens
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks

HOLDER = """
import sys, time
from pathlib import Path
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks
store = SpillStore(Path(sys.argv[1]), FMT, ram_bytes=0, disk_bytes=DISK, lock_owner=sys.argv[2])
store.put(hashes_of([50]), make_blocks([50]), "tenant:other", [[50, 51, 52, 53]])
print("ready", flush=True)
time.sleep(600)
"""


def holder_processes(script: str) -> Iterator[callable]:  # type: ignore[valid-type]
    """Yields ``start(root, owner)``: a process running ``script`` (``HOLDER`` or one like it),
    whose store holds ``root`` under ``owner`` once it printed "ready"; all killed at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(root: Path, owner: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", script, str(root), owner], cwd=Path(__file__).parents[1],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def holder() -> Iterator[callable]:  # type: ignore[valid-type]
    """Starts another process whose store holds a directory under ``owner``; killed at the end."""
    yield from holder_processes(HOLDER)


def wait_serving(node: SpillNode, within_s: float = 15.0) -> float:
    start = time.monotonic()
    while not node.status()["serving"]:
        assert time.monotonic() - start < within_s, node.status()
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_node_outlives_its_previous_process_and_serves_once_it_exits(tmp_path: Path, holder) -> None:  # type: ignore[no-untyped-def]
    """Ray restarted the node while its old worker (same owner in the lock file) still held the
    directory, past the constructor's wait: the node lives, says it waits for its previous
    process, serves nothing, and serves the directory's blocks once that process is gone."""
    root = tmp_path / "spill"
    old = holder(root, "ns/spill_node_0")
    node = SpillNode(root, FMT, 0, DISK, node_id="spill_node_0", lock_owner="ns/spill_node_0", lock_wait_s=0.2)
    try:
        status = node.status()
        assert status["serving"] is False and status["previous_process"] is True and status["holder_pid"] == old.pid
        assert node.stats()["serving"] == 0
        with pytest.raises(SpillDirLocked, match="cannot look up blocks"):
            node.contains(hashes_of([50]))  # a failed call, not a miss (review R3 F1)
        with pytest.raises(SpillDirLocked, match=rf"pid {old.pid} on .*ns/spill_node_0"):
            node.ready()
        old.send_signal(signal.SIGKILL)
        old.wait(10)
        wait_serving(node)
        assert node.ready() is True and node.contains(hashes_of([50])) == ["spill_disk"]
        assert (root / LOCK_FILE).read_text().split()[2] == "ns/spill_node_0"
    finally:
        node.close()


def test_another_store_on_the_directory_is_named_and_the_node_opens_it_once_free(
        tmp_path: Path, holder, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """Another deployment's store holds the directory: the node's start is refused clearly
    (``ready`` names the holder; an error in its log; ``status``), its data calls raise
    ``SpillDirLocked`` and a flush fails rather than touch the directory; it is never dead: once the other
    store is stopped the node opens the directory."""
    root = tmp_path / "spill"
    other = holder(root, "other-deployment/spill_node_0")
    with caplog.at_level(logging.ERROR, logger="services.spill_node"):
        node = SpillNode(root, FMT, 0, DISK, node_id="spill_node_0", lock_owner="ns/spill_node_0", lock_wait_s=0.2)
    try:
        assert any(r.levelno == logging.ERROR and f"pid {other.pid}" in r.getMessage() for r in caplog.records)
        status = node.status()
        assert status["serving"] is False and status["previous_process"] is False
        assert status["holder_owner"] == "other-deployment/spill_node_0"
        with pytest.raises(SpillDirLocked, match=rf"in use by another spill store \(pid {other.pid} on .*other-deployment"):
            node.ready()
        with pytest.raises(SpillDirLocked, match="cannot put"):  # a failed call (review R3 F1)
            node.put(hashes_of([1]), make_blocks([1]), "tenant:a", tokens([1]))
        with pytest.raises(SpillDirLocked, match="cannot get"):
            node.get(hashes_of([50]))
        with pytest.raises(SpillDirLocked, match="cannot list its blocks"):
            node.held_blocks()
        with pytest.raises(SpillDirLocked):
            node.flush()
        assert len(list(root.glob("*.kvs"))) == 1  # the other store's file stays
        time.sleep(1.0)
        assert node.status()["tries"] >= 2  # it keeps trying
        other.kill()
        other.wait(10)
        wait_serving(node)
        assert node.contains(hashes_of([50])) == ["spill_disk"]
        assert node.put(hashes_of([1]), make_blocks([1]), "tenant:a", tokens([1])) == 1
    finally:
        node.close()


def test_a_closed_waiting_node_stops_waiting(tmp_path: Path, holder) -> None:  # type: ignore[no-untyped-def]
    """A node closed while it waits never opens the directory afterwards."""
    root = tmp_path / "spill"
    other = holder(root, "x/y")
    node = SpillNode(root, FMT, 0, DISK, node_id="n", lock_wait_s=0)
    node.close()
    other.kill()
    other.wait(10)
    time.sleep(1.5)
    assert node.status()["serving"] is False
    SpillNode(root, FMT, 0, DISK, lock_wait_s=0).close()  # the directory is free


@pytest.fixture
def local_ray(ray_cluster) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """The session's Ray cluster (one per test session)."""
    yield


def test_the_ray_actor_stays_alive_while_another_process_holds_its_directory(
        tmp_path: Path, holder, local_ray) -> None:  # type: ignore[no-untyped-def]
    """The Ray actor itself: its construction past the lock wait does not kill it (old: the
    constructor's raise made every call ActorDiedError for good, max_restarts notwithstanding);
    it answers ``status`` and serves once the holder is gone."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    old = holder(root / "0", "kvstrata-test/spill-lock-wait")
    actor = SpillNodeActor.options(max_restarts=-1, resources={}, num_cpus=0).remote(
        str(root / "0"), FMT, 0, DISK, node_id="spill-lock-wait", lock_owner="kvstrata-test/spill-lock-wait",
        lock_wait_s=0.2)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="previous|in use by another spill store"):
            ray.get(actor.ready.remote(), timeout=60)
        assert ray.get(actor.status.remote(), timeout=30)["previous_process"] is True
        old.kill()
        old.wait(10)
        deadline = time.monotonic() + 20
        while not ray.get(actor.status.remote(), timeout=30)["serving"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert ray.get(actor.ready.remote(), timeout=30) is True
        assert ray.get(actor.contains.remote(hashes_of([50])), timeout=30) == ["spill_disk"]
    finally:
        ray.kill(actor, no_restart=True)


def test_a_start_waits_for_the_previous_process_and_fails_clearly_for_another_store(
        tmp_path: Path, holder, local_ray) -> None:  # type: ignore[no-untyped-def]
    """``await_serving`` (the launcher's wait for its spill nodes): a node whose previous
    process still holds its directory is waited for until that process exits; one whose
    directory another deployment's store holds fails the start at once, naming the holder."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    old = holder(root / "0", "kvstrata-test/spill-await-0")
    other = holder(root / "1", "another-deployment/spill_node_1")
    actors = [SpillNodeActor.options(max_restarts=-1, resources={}, num_cpus=0).remote(
        str(root / str(i)), FMT, 0, DISK, node_id=f"spill-await-{i}", lock_owner=f"kvstrata-test/spill-await-{i}",
        lock_wait_s=0.2) for i in range(2)]
    try:
        threading.Timer(2.0, old.kill).start()
        start = time.monotonic()
        await_serving(actors[:1], timeout_s=60, poll_s=0.1)
        assert 1.5 < time.monotonic() - start < 30
        assert ray.get(actors[0].contains.remote(hashes_of([50])), timeout=30) == ["spill_disk"]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"in use by another spill store \(pid {other.pid} on "
                                               r".*another-deployment/spill_node_1.*Stop that store"):
            await_serving(actors[1:], timeout_s=60, poll_s=0.1)
        assert time.monotonic() - start < 20
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def test_a_restarted_node_whose_metrics_port_is_still_taken_serves_once_it_is_free(tmp_path: Path) -> None:
    """The same race for ``/metrics`` on a fixed port: a restarted node (``retry_start``; Ray's
    restart sets it) whose old process still holds the port lives, says why it does not serve,
    and serves once the port is free; a first start still fails at once."""
    import socket

    from services.metrics import MetricsEndpoint

    root = tmp_path / "spill"
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    endpoint = MetricsEndpoint("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(OSError):
        SpillNode(root, FMT, 0, DISK, metrics=endpoint)
    node = SpillNode(root, FMT, 0, DISK, metrics=endpoint, retry_start=True)
    try:
        status = node.status()
        assert status["serving"] is False and "could not start serving" in status["error"]
        with pytest.raises(SpillDirLocked, match="could not start serving"):
            node.ready()
        taken.close()
        wait_serving(node)
        assert node.metrics_address() == f"127.0.0.1:{endpoint.port}"
    finally:
        taken.close()
        node.close()


@pytest.mark.parametrize(("held_by", "mine", "previous"), [
    # the version before de8b111 wrote '<ns>/<name>', without '@<deployment>'
    ("kvstrata/spill_node_0", "kvstrata/spill_node_0@0123456789abcdef", True),
    # an owner the lock file cleans (whitespace) and cuts (MAX_OWNER_CHARS) is still its own
    ("ns x/" + "n" * 300 + "@0123456789abcdef", "ns x/" + "n" * 300 + "@0123456789abcdef", True),
    ("ns x/" + "n" * 300, "ns x/" + "n" * 300 + "@0123456789abcdef", True),
    # 200 four-byte characters: more than the 512 bytes the holder's line was read from
    ("ns/" + "\U0001f642" * 250, "ns/" + "\U0001f642" * 250 + "@0123456789abcdef", True),
    # another deployment, another node, another namespace: another store
    ("kvstrata/spill_node_0@fedcba9876543210", "kvstrata/spill_node_0@0123456789abcdef", False),
    ("kvstrata/spill_node_1", "kvstrata/spill_node_0@0123456789abcdef", False),
    ("other/spill_node_0", "kvstrata/spill_node_0@0123456789abcdef", False),
])
def test_an_upgraded_or_long_owner_knows_its_previous_process(
        tmp_path: Path, held_by: str, mine: str, previous: bool) -> None:
    """Regression (review s36 R4 F1): the holder of the version before de8b111 ('<ns>/<name>')
    was taken for another store on the first restart after the upgrade, and an owner the lock
    file cleans or cuts never matched itself."""
    from cache_node.tiers.spill_store import SpillStore

    root = tmp_path / "0"
    root.mkdir(mode=0o700)
    old = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK, lock_owner=held_by)
    try:
        node = SpillNode(str(root), FMT, 0, DISK, node_id="spill_node_0", lock_owner=mine, lock_wait_s=0.1)
        try:
            status = node.status()
            assert status["serving"] is False and status["previous_process"] is previous, status
        finally:
            node.close()
    finally:
        old.close()
