"""A flush acknowledged to its caller is never undone by a restart (session 32).

A flush takes every group file out of the index and unlinks it; a file whose unlink failed
(EIO, EROFS, EACCES, or no descriptor of the directory: EMFILE) stayed on the undeleted list,
which lived only in memory, and was deleted at a later sweep. A restart before that sweep
listed the directory, read the file's header and indexed it again: the KV an operator flushed
was served again. The same for a node killed in the middle of a flush's unlinks. A flush now
records its write sequence in ``spill_format.FLUSH_FILE`` (written atomically, fsync'd) before
it unlinks anything; a restart deletes every group file whose header's sequence is at most
that one, never indexes it. A flush that could neither record nor delete raises (it is not
acknowledged). The dropped holders' list (``TOMBSTONE_FILE``) does the same for a deleted
tenant's drop.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from cache_node.tiers import spill_format
from cache_node.tiers.spill_disk import FLUSH_FILE, SpillDeletionNotDurable
from cache_node.tiers.spill_disk_faults import READ_ATTEMPTS
from cache_node.tiers.spill_store import SpillStore
from services.metrics.spill import SpillMetrics
from services.spill_dirs import remove_retired_spill_dirs
from services.spill_node import SpillNode
from services.spill_sweep import DeletedTenantSweep
from tenants.model import own_namespace
from tests.test_spill_disk_faults import failing_unlinks, tokens, unblock_fifo, within
from tests.test_spill_pending_nofd import no_fd
from tests.test_spill_store import DISK, FMT, files_in, hashes_of, make_blocks


def store_at(root: Path, **options: int) -> SpillStore:
    """A spill store on ``root`` (RAM 0: every put goes to disk), as a (re)started node builds."""
    return SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK, **options)


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES, errno.EROFS])
def test_a_flush_whose_unlinks_failed_is_not_served_after_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     err: int) -> None:
    """The reviewer's case: the flush answered, its files' unlinks failed (kept on the in-memory
    undeleted list), and the node restarted before a sweep deleted them: the restart indexed
    and served all 4 flushed blocks. It deletes them now (tried again while they stay)."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    with monkeypatch.context() as m:
        failing_unlinks(m, err)
        assert store.flush() == 4
        assert store.contains(hashes_of(range(4))) == [None] * 4 and store.stats()["undeleted_bytes"] > 0
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = store_at(tmp_path)  # before any sweep retried the unlink; it still fails
        assert restarted.contains(hashes_of(range(4))) == [None] * 4
        assert restarted.get(hashes_of(range(4)), tokens(range(4))).hashes == []
    restarted.expire_quarantine()  # the volume is sound again: the next sweep deletes the files
    assert files_in(tmp_path) == [] and restarted.stats()["undeleted_bytes"] == 0


def test_a_flush_that_could_not_dup_its_dir_fd_is_not_served_after_a_restart(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 31 F2's case (no descriptor for the unlinks: EMFILE) with the restart coming
    before the sweep that deletes the files (``test_spill_pending_nofd`` restarts after it)."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    with monkeypatch.context() as m:
        m.setattr(spill_format.SpillDir, "dup", no_fd)
        assert store.flush() == 4
    assert len(files_in(tmp_path)) == 1  # nothing deleted yet: the sweep would retry it
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = store_at(tmp_path)
    assert restarted.contains(hashes_of(range(4))) == [None] * 4
    assert files_in(tmp_path) == []  # the restart deleted it
    metrics = SpillMetrics("spill_node_0", restarted.stats, FMT.block_nbytes).registry  # and /metrics says so
    assert metrics.get_sample_value("kvstrata:spill_disk_events_total",
                                    {"node": "spill_node_0", "kind": "flushed_file"}) == 1


def read_only_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spill directory's small records (``FLUSH_FILE``, ``TOMBSTONE_FILE``) cannot be written
    (a read-only volume), with ``failing_unlinks`` for its group files."""
    def refused(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(spill_format, "write_small_file", refused)


def test_a_flush_that_can_neither_delete_nor_record_is_not_acknowledged(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a read-only volume nothing can make the flush survive a restart: it raises instead of
    answering (a cache node's admin flush then fails naming the node); the blocks are out of
    the store meanwhile, and flushing again once the volume allows it is acknowledged for good."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EROFS)
        read_only_record(m)
        with pytest.raises(SpillDeletionNotDurable, match="could not be deleted"):
            store.flush()
        assert store.contains(hashes_of(range(4))) == [None] * 4
        assert store.stats()["undeleted_bytes"] > 0
    with monkeypatch.context() as m:  # the record can be written again, the unlink still fails
        failing_unlinks(m, errno.EIO)
        assert store.flush() == 0
        store.close()  # a restart: the old process is gone, its lock with it
        assert store_at(tmp_path).contains(hashes_of(range(4))) == [None] * 4


def test_a_flush_that_deleted_everything_needs_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record that cannot be written is no fault when every file went; a flush that deleted
    every file lets its record go (one that left files behind keeps it), and writes after a
    flush are served after a restart."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2)))
    with monkeypatch.context() as m:
        read_only_record(m)
        assert store.flush() == 2
    assert files_in(tmp_path) == [] and not (tmp_path / FLUSH_FILE).exists()

    store.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2)))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EIO)
        store.flush()
    assert (tmp_path / FLUSH_FILE).is_file()
    store.put(hashes_of([5]), make_blocks([5]), "tenant:a", tokens([5]))  # after the flush: kept
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = store_at(tmp_path)
    assert restarted.contains(hashes_of([0, 1, 5])) == [None, None, "spill_disk"]
    assert restarted.stats()["flushed_files"] == 1
    assert restarted.flush() == 1  # every file deleted: the record goes
    assert files_in(tmp_path) == [] and not (tmp_path / FLUSH_FILE).exists()


def test_writes_after_a_flush_survive_restarts_with_the_clock_stepped_back(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The record is a write sequence, and a restart continues past it: a clock stepped back to
    1970 after the restart does not make the next writes count as flushed."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2)))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EIO)
        store.flush()
    monkeypatch.setattr(time, "time_ns", lambda: 1)
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = store_at(tmp_path)
    restarted.put(hashes_of([7]), make_blocks([7]), "tenant:a", tokens([7]))
    restarted.close()  # a restart: the old process is gone, its lock with it
    again = store_at(tmp_path)
    assert again.contains(hashes_of([0, 1, 7])) == [None, None, "spill_disk"]
    assert again.get(hashes_of([7]), tokens([7])).blocks.tobytes() == make_blocks([7]).tobytes()


@pytest.mark.parametrize("record", [
    b"\xff\x00garbage", b"\x80", msgpack.packb({"seq": -1}), msgpack.packb({"seq": spill_format.MAX_SEQ + 1}),
    msgpack.packb({"seq": "1"}), msgpack.packb([1]), msgpack.packb({"seq": 1, "pad": "x" * 200}), b"",
    "fifo", "dir",
], ids=["garbage", "empty-map", "negative", "past-bound", "text", "list", "oversized", "empty", "fifo", "dir"])
def test_an_unreadable_flush_record_serves_nothing_that_might_be_flushed(tmp_path: Path,
                                                                         record: bytes | str) -> None:
    """The record's bytes are untrusted: a malformed, oversized or unreadable one (or a FIFO,
    never waited on) does not stop the node, and since what it covered is unknown, every group
    file found is deleted, none served. It is written again (when its name allows), so writes
    after that restart are served after the next one."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2)))
    path = tmp_path / FLUSH_FILE
    if record == "fifo":
        os.mkfifo(path)
    elif record == "dir":
        path.mkdir()
    else:
        assert isinstance(record, bytes)
        path.write_bytes(record)
    try:
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = within(5, lambda: store_at(tmp_path))
    finally:
        if record == "fifo" and path.exists() and not path.is_file():
            unblock_fifo(path)
    assert restarted.contains(hashes_of(range(2))) == [None, None] and files_in(tmp_path) == []
    assert restarted.stats()["io_errors"] >= 1 and restarted.stats()["flushed_files"] == 1
    restarted.put(hashes_of([7]), make_blocks([7]), "tenant:a", tokens([7]))
    restarted.close()  # a restart: the old process is gone, its lock with it
    again = store_at(tmp_path)
    assert again.contains(hashes_of([7])) == [None if record == "dir" else "spill_disk"]


@pytest.mark.parametrize("record", [
    b"\xff\x00garbage", msgpack.packb([b"x" * 31]), msgpack.packb({"a": 1}), b"\0" * (70000 * 34), "fifo",
], ids=["garbage", "short-digest", "map", "oversized", "fifo"])
def test_an_unreadable_list_of_dropped_holders_serves_nothing_that_might_be_dropped(
        tmp_path: Path, record: bytes | str) -> None:
    """The dropped holders' list is read back the same way: a malformed one was ignored, so a
    restart indexed and served again every file of the holders it had named (deleted tenants'
    that could not be deleted). Their files are unknown now, so none found is served: a flush
    in effect, recorded; both records are written again, so the next restart reads them."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(2)), make_blocks(range(2)), own_namespace("bob"), tokens(range(2)))
    path = tmp_path / spill_format.TOMBSTONE_FILE
    if record == "fifo":
        os.mkfifo(path)
    else:
        assert isinstance(record, bytes)
        path.write_bytes(record)
    try:
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = within(5, lambda: store_at(tmp_path))
    finally:
        if record == "fifo" and path.exists() and not path.is_file():
            unblock_fifo(path)
    assert restarted.contains(hashes_of(range(2))) == [None, None] and files_in(tmp_path) == []
    assert restarted.stats()["io_errors"] >= 1
    assert msgpack.unpackb(path.read_bytes()) == [] and (tmp_path / FLUSH_FILE).is_file()
    restarted.put(hashes_of([7]), make_blocks([7]), own_namespace("ann"), tokens([7]))
    restarted.close()  # a restart: the old process is gone, its lock with it
    assert store_at(tmp_path).contains(hashes_of([7])) == ["spill_disk"]


def test_a_node_killed_among_its_flushs_unlinks_serves_none_of_them_after_a_restart(tmp_path: Path) -> None:
    """A spill node killed (SIGKILL) while its flush unlinks one file after another: the files
    left were indexed again by the restarted node. The record came first, so none is served."""
    root = tmp_path / "spill"
    child = subprocess.Popen([sys.executable, "-c", _FLUSHING_CHILD, str(root)], cwd=Path(__file__).parents[1],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "flushing"
        deadline = time.monotonic() + 30
        while len(files_in(root)) == 20 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait(10)
    left = len(files_in(root))
    assert 0 < left < 20, left
    restarted = store_at(root, max_blocks_per_file=1)
    assert restarted.contains(hashes_of(range(20))) == [None] * 20
    assert restarted.stats()["flushed_files"] == left and files_in(root) == []


_FLUSHING_CHILD = """
import sys
import pytest
from pathlib import Path
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_disk_faults import slow_unlinks, tokens
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks
store = SpillStore(Path(sys.argv[1]), FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=1)
store.put(hashes_of(range(20)), make_blocks(range(20)), "tenant:a", tokens(range(20)))
slow_unlinks(pytest.MonkeyPatch(), 0.5)
print("flushing", flush=True)
store.flush()
print("flushed", flush=True)
"""


def test_a_drop_that_can_neither_delete_nor_record_is_swept_again(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The same kind for a deleted tenant: its drop on a read-only volume (files not deleted,
    list of dropped holders not written) was acknowledged, so the sweep moved past the deletion
    and a restart indexed and served the tenant's blocks again. The drop raises now: the sweep
    keeps its cursor and drops the tenant again at its next pass, which records it once the
    volume allows, and a restart then deletes the files it could not."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(3)), make_blocks(range(3)), own_namespace("bob"), tokens(range(3)))
    store.put(hashes_of([5]), make_blocks([5]), own_namespace("ann"), tokens([5]))
    pushes: list[int] = []
    sweep = DeletedTenantSweep(store, lambda seq: [(1, "bob")] if seq == 0 else [], lambda: pushes.append(1))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EROFS)
        read_only_record(m)
        with pytest.raises(SpillDeletionNotDurable):
            sweep.sweep()
        assert sweep.cursor == 0 and store.contains(hashes_of(range(3))) == [None] * 3
        assert pushes == [1]  # the blocks' "removed" events go out all the same
    with monkeypatch.context() as m:  # the list can be written again; the unlink still fails
        failing_unlinks(m, errno.EIO)
        sweep.sweep()
        assert sweep.cursor == 1
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = store_at(tmp_path)
        assert restarted.contains(hashes_of([0, 1, 2, 5])) == [None, None, None, "spill_disk"]
    restarted.expire_quarantine()
    assert len(files_in(tmp_path)) == 1


def test_a_spill_node_whose_flush_is_not_durable_fails_it_and_reports_its_blocks_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the spill node (the Ray actor's body): the flush raises, so the cache node's
    admin flush names the node (``SpillFlushIncomplete``), and the blocks' "removed" events still
    reach the scheduler's block index."""
    reports: list[tuple[str, list[tuple[str, bytes, str]], bool]] = []
    node = SpillNode(tmp_path / "spill", FMT, 0, DISK, node_id="s0",
                     event_sink=lambda node_id, events, reset: reports.append((node_id, events, reset)))
    node.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2)))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EROFS)
        read_only_record(m)
        with pytest.raises(SpillDeletionNotDurable):
            node.flush()
    node_id, events, reset = reports[-1]
    assert (node_id, sorted(events), reset) == ("s0", sorted(("removed", h, "spill_disk") for h in hashes_of(range(2))),
                                                False)


def test_a_retired_spill_dir_with_a_flush_record_is_still_deleted(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The flush record is a file a spill node writes: a retired node's directory holding one
    is deleted as before (``services.spill_dirs``), not left as foreign."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    store = store_at(root / "1")
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    with monkeypatch.context() as m:
        failing_unlinks(m, errno.EIO)
        store.flush()
    assert (root / "1" / FLUSH_FILE).is_file()
    assert remove_retired_spill_dirs(root, 1) == []  # its store runs still: kept (spill_lock)
    store.close()  # its process ended
    assert remove_retired_spill_dirs(root, 1) == ["1"]
    assert os.listdir(root) == []


def failing_first_reads(monkeypatch: pytest.MonkeyPatch, name: str, err: int, times: int) -> list[str]:
    """Make the first ``times`` opens of the spill record ``name`` fail with ``err``; returns
    the log of those failures."""
    real = spill_format.open_regular
    failed: list[str] = []

    def open_regular(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
        if os.fspath(path) == name and len(failed) < times:
            failed.append(name)
            raise OSError(err, os.strerror(err))
        return real(path, dir_fd)
    monkeypatch.setattr(spill_format, "open_regular", open_regular)
    return failed


@pytest.mark.parametrize("name", [spill_format.TOMBSTONE_FILE, FLUSH_FILE])
def test_a_transient_read_error_of_a_record_at_startup_keeps_the_spill_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Regression (review s32): one EIO while a restart read the dropped holders' list (or the
    flush record) counted the list as unknown, and every group file of the directory was
    deleted: a whole spill tier lost to one transient error. The read is tried again now
    (``READ_ATTEMPTS``); only an error that persists deletes, as an unreadable record must."""
    store = store_at(tmp_path)
    store.put(hashes_of(range(2)), make_blocks(range(2)), own_namespace("bob"), tokens(range(2)))
    store.put(hashes_of([5]), make_blocks([5]), own_namespace("ann"), tokens([5]))
    with monkeypatch.context() as m:  # files left behind: the flush record stays
        failing_unlinks(m, errno.EIO)
        store.flush()
    store.put(hashes_of([6]), make_blocks([6]), own_namespace("ann"), tokens([6]))
    store.put(hashes_of([2]), make_blocks([2]), own_namespace("bob"), tokens([2]))
    store.drop_namespace(own_namespace("bob"))  # bob's holder on the dropped holders' list
    store.put(hashes_of([3]), make_blocks([3]), own_namespace("cy"), tokens([3]))
    assert (tmp_path / name).is_file() and (tmp_path / spill_format.TOMBSTONE_FILE).is_file()
    with monkeypatch.context() as m:
        failed = failing_first_reads(m, name, errno.EIO, times=READ_ATTEMPTS - 1)
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = store_at(tmp_path)
    assert failed == [name] * (READ_ATTEMPTS - 1)
    assert restarted.contains(hashes_of([0, 1, 5, 2, 3, 6])) == [None] * 4 + ["spill_disk"] * 2
    assert restarted.stats()["io_errors"] == 0 and restarted.stats()["io_retries"] == READ_ATTEMPTS - 1
    with monkeypatch.context() as m:  # an error that persists: nothing that might be covered is served
        failing_first_reads(m, name, errno.EIO, times=READ_ATTEMPTS)
        restarted.close()  # a restart: the old process is gone, its lock with it
        again = store_at(tmp_path)
    assert again.contains(hashes_of([3, 6])) == [None] * 2 and again.stats()["io_errors"] >= 1
