"""One spill store per directory (review s35 D S2; ``cache_node.tiers.spill_lock``).

Before: nothing locked a spill directory. A second store on it (a ``spill_dir`` shared by two
deployments, or an old spill process still alive when its replacement started) deleted the
first's group files at its flush and its temp files at its start, and each rewrote the dropped
holders' list with only its own entries (a deleted tenant's undeletable file could then be
served after a restart). Now the second opener is refused, naming the directory and the holder's
pid; a restart after the holder's process ended (however it ended) opens at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from cache_node.tiers import spill_format
from cache_node.tiers.spill_store import SpillStore
from services.spill_dirs import remove_retired_spill_dirs
from services.spill_node import SpillNode
from tests.test_spill_disk_faults import tokens
from tests.test_spill_store import DISK, FMT, files_in, hashes_of, make_blocks

HOLDER = """
import sys, time
from pathlib import Path
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks
store = SpillStore(Path(sys.argv[1]), FMT, ram_bytes=0, disk_bytes=DISK)
store.put(hashes_of([50]), make_blocks([50]), "tenant:other", [[50, 51, 52, 53]])
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
"""


def holder_process(root: Path, hold_s: float) -> subprocess.Popen[str]:
    """Another process whose store holds ``root`` for ``hold_s`` (then it exits), started."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(hold_s)], cwd=Path(__file__).parents[1],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_store_on_a_directory_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    """The reviewer's case in one process: the second store's flush deleted the first's file
    (its get then missed) and its drop rewrote the dropped holders' list without the first's
    entry. Now the second store is refused; the first's file and list stay whole."""
    root = tmp_path / "spill"
    first = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    first.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    first.put(hashes_of([9]), make_blocks([9]), "tenant:gone", tokens([9]))
    first.drop_namespaces(["tenant:gone"])
    tombstones = (root / spill_format.TOMBSTONE_FILE).read_bytes()
    with pytest.raises(OSError, match=rf"spill directory {root} is in use by another spill store \(pid {os.getpid()}"):
        second = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
        second.flush()  # (what the old code went on to do)
        second.drop_namespaces(["tenant:other"])
    assert len(files_in(root)) == 1
    assert first.get(hashes_of(range(4)), tokens(range(4))).blocks.tobytes() == make_blocks(range(4)).tobytes()
    assert (root / spill_format.TOMBSTONE_FILE).read_bytes() == tombstones
    assert len(msgpack.unpackb(tombstones)) == 1

    first.close()  # released: a store opens it now, indexing what the first left
    again = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert again.contains(hashes_of([0, 3, 9])) == ["spill_disk", "spill_disk", None]
    first.close()  # idempotent, and the new store's lock is its own
    with pytest.raises(OSError, match="in use by another spill store"):
        SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)


def test_another_process_holding_the_directory_is_named_and_a_restart_after_its_death_opens(tmp_path: Path) -> None:
    """Across processes: refused while the other process's store lives (its pid named), and
    opened at once after that process was killed (SIGKILL: no close ran; the kernel dropped its
    lock, as for a spill node Ray restarts after a crash), serving what it had written."""
    from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked

    root = tmp_path / "spill"
    proc = holder_process(root, 60)
    try:
        with pytest.raises(SpillDirLocked, match=rf"{root} is in use by another spill store \(pid {proc.pid} on "):
            SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
        assert len(files_in(root)) == 1  # the refused opener deleted nothing
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    restarted = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of([50])) == ["spill_disk"]
    assert (root / LOCK_FILE).read_text().split()[0] == str(os.getpid())
    restarted.close()


def test_a_spill_node_waits_a_bounded_time_for_an_old_process_then_says_so(tmp_path: Path) -> None:
    """A spill node started while an old process still holds its directory waits for it
    (``lock_wait_s``): it starts once that process ends within the wait; when it does not, the
    constructor still returns (s36: it raised, and Ray never restarts a failed constructor) and
    ``ready`` fails naming the directory and pid while the node keeps trying
    (``tests/test_spill_lock_wait.py``)."""
    from cache_node.tiers.spill_lock import SpillDirLocked

    root = tmp_path / "spill"
    proc = holder_process(root, 0.5)  # the old worker ends 0.5 s from now
    start = time.monotonic()
    node = SpillNode(root, FMT, 0, DISK, lock_wait_s=20)
    assert time.monotonic() - start < 15 and node.contains(hashes_of([50])) == ["spill_disk"]
    proc.wait(10)
    node.close()

    proc = holder_process(root, 60)
    try:
        start = time.monotonic()
        node = SpillNode(root, FMT, 0, DISK, lock_wait_s=0.3)
        assert 0.3 <= time.monotonic() - start < 5
        with pytest.raises(SpillDirLocked, match=rf"{root} is in use by another spill store \(pid {proc.pid} on "):
            node.ready()
        node.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def test_a_retired_directory_a_live_store_holds_is_kept(tmp_path: Path) -> None:
    """``remove_retired_spill_dirs`` never empties a directory a store still runs on (an old
    deployment's node with a higher index, still alive); it deletes it once that store closed."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    store = SpillStore(root / "1", FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    assert remove_retired_spill_dirs(root, 1) == [] and len(files_in(root / "1")) == 1
    assert store.contains(hashes_of([0])) == ["spill_disk"]
    store.close()
    assert remove_retired_spill_dirs(root, 1) == ["1"] and os.listdir(root) == []


def test_a_store_whose_start_fails_releases_the_directory(tmp_path: Path) -> None:
    """A spill node whose constructor fails after its store opened (its metrics port taken)
    lets the directory go at once, not when the collector finds the store: its retry opens."""
    import socket

    from services.metrics import MetricsEndpoint

    root = tmp_path / "spill"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            SpillNode(root, FMT, 0, DISK, metrics=MetricsEndpoint("127.0.0.1", taken.getsockname()[1]))
    SpillNode(root, FMT, 0, DISK, lock_wait_s=0).close()
