"""Faults of the spill directory and the volume under it (review 30e): what a ``SpillStore``
finds there is untrusted and the volume may fail, yet no call hangs, no other tenant waits on
another's deletion, no data outside the directory is touched, and nothing deleted is served
again.

F1: a FIFO (or a link to one) named like a group file is never opened. F4: the directory
deleted while running is made again; swapped for a link, the link is never followed. F2: a
full volume below the budget makes room instead of dropping every new write. F3: a tenant's
drop or a flush unlinks outside the store's lock. F5: a file whose unlink failed stays counted
and is deleted later; a dropped tenant's file is never indexed again at a restart. F6: a restart
picks a block's newest copy by write sequence, not by mtime.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cache_node.tiers import spill_format, spill_unserved
from cache_node.tiers.spill_lock import LOCK_FILE, SpillDirLocked
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, make_blocks


def tokens(indices: range | list[int]) -> list[list[int]]:
    return [[i, i + 1, i + 2, i + 3] for i in indices]


def within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()`` run on a daemon thread; fails the test when it has not returned in ``seconds``
    (a hang leaves only a parked thread behind, not a stuck test run)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not return within {seconds} s (hung)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def unblock_fifo(path: Path) -> None:
    """Open the FIFO ``path`` for writing without blocking (a reader that hung on it returns)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader: nothing hangs
        return
    os.close(fd)


# F1 ------------------------------------------------------------------------------------------


def test_a_fifo_named_like_a_group_file_does_not_hang_a_restart(tmp_path: Path) -> None:
    """Review 30e F1: ``read_header`` opened a FIFO ``<x>.kvs`` with a plain ``open()``, which
    waits for a writer: a restarted spill node's constructor never returned. Neither a FIFO nor
    a link to one is opened now; the sound files are indexed, the FIFO left as it is (a flush
    too: it is not ours)."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    fifo = tmp_path / ("0" * 32 + spill_format.FILE_SUFFIX)
    os.mkfifo(fifo)
    outside = tmp_path.parent / f"{tmp_path.name}-fifo"
    os.mkfifo(outside)
    (tmp_path / ("1" * 32 + spill_format.FILE_SUFFIX)).symlink_to(outside)
    try:
        store.close()  # a restart: the old process is gone, its lock with it
        restarted = within(5, lambda: SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK))
        hits = within(5, lambda: restarted.get(hashes_of(range(4)), tokens(range(4))))
        assert hits.blocks.tobytes() == make_blocks(range(4)).tobytes()
        within(5, restarted.flush)
        assert stat.S_ISFIFO(fifo.lstat().st_mode) and stat.S_ISFIFO(outside.lstat().st_mode)
        assert files_in(tmp_path) == [fifo]  # the link went (the name only), the FIFO stays
    finally:
        unblock_fifo(fifo)
        unblock_fifo(outside)


def test_a_file_swapped_for_a_fifo_is_a_miss_and_other_tenants_go_on(tmp_path: Path) -> None:
    """Review 30e F1: a ``get`` of blocks whose file was swapped for a FIFO hung holding the
    store's lock, and every other tenant's put and get with it. Now it is a miss at once (the
    blocks dropped, the FIFO left in place), and another tenant's put goes through."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    (path,) = files_in(tmp_path)
    path.unlink()
    os.mkfifo(path)
    try:
        started = time.monotonic()
        hits = within(5, lambda: store.get(hashes_of(range(4)), tokens(range(4))))
        assert time.monotonic() - started < 1
        assert (hits.hashes, store.contains(hashes_of(range(4)))) == ([], [None] * 4)
        assert store.stats()["missing_files"] == 1
        assert within(5, lambda: store.put(hashes_of([9]), make_blocks([9]), "tenant:b", tokens([9]))) == 1
        assert stat.S_ISFIFO(path.lstat().st_mode)
    finally:
        unblock_fifo(path)


def test_no_read_of_the_format_opens_anything_but_a_regular_file(tmp_path: Path) -> None:
    """Every read path of ``spill_format`` refuses a FIFO, a link and a directory at once."""
    fifo = tmp_path / "f.kvs"
    os.mkfifo(fifo)
    (tmp_path / "l.kvs").symlink_to(fifo)
    (tmp_path / "d.kvs").mkdir()
    try:
        for path in (fifo, tmp_path / "l.kvs", tmp_path / "d.kvs"):
            with pytest.raises(FileNotFoundError, match="not a regular file"):
                within(5, lambda p=path: spill_format.read_header(p))
            with pytest.raises(FileNotFoundError, match="not a regular file"):
                within(5, lambda p=path: spill_format.read_blocks(p, FMT, hashes_of([0])))
            assert within(5, lambda p=path: spill_format.read_namespace(p)) is None
        assert spill_format.list_group_files(tmp_path) == []
    finally:
        unblock_fifo(fifo)


# F4 ------------------------------------------------------------------------------------------


def test_a_spill_dir_deleted_while_running_is_made_again(tmp_path: Path) -> None:
    """Review 30e F4: the directory deleted while running (an operator's cleanup) failed every
    later write until a restart. The next write makes it again (mode 0700), counted; the blocks
    that went with it leave the index."""
    root = tmp_path / "spill"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    for path in [*files_in(root), root / LOCK_FILE]:
        path.unlink()
    root.rmdir()
    assert store.put(hashes_of([10]), make_blocks([10]), "tenant:a", tokens([10])) == 1
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert store.contains(hashes_of([0, 10])) == [None, "spill_disk"]
    assert store.get(hashes_of([10]), tokens([10])).blocks.tobytes() == make_blocks([10]).tobytes()
    stats = store.stats()
    assert (stats["dir_recreated"], stats["io_errors"], stats["files"]) == (1, 0, 1)
    with pytest.raises(SpillDirLocked):  # the directory made again is locked as the first was
        SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)


def test_a_spill_dir_swapped_for_a_link_is_never_followed(tmp_path: Path) -> None:
    """Review 30e F4: the directory swapped for a link had writes land in the link's target,
    and a flush deleted every ``*.kvs`` file there. The store keeps the directory it opened
    (renamed away: still used); one deleted and replaced by a link is refused (writes dropped,
    counted), and nothing in the target is written or deleted."""
    root, target = tmp_path / "spill", tmp_path / "elsewhere"
    target.mkdir()
    precious = target / ("precious" + spill_format.FILE_SUFFIX)
    precious.write_bytes(b"not a spill file")
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    root.rename(tmp_path / "moved")
    root.symlink_to(target)
    store.put(hashes_of([1]), make_blocks([1]), "tenant:a", tokens([1]))
    assert len(files_in(tmp_path / "moved")) == 2 and os.listdir(target) == [precious.name]
    assert store.get(hashes_of([0, 1]), tokens([0, 1])).blocks.tobytes() == make_blocks([0, 1]).tobytes()
    store.flush()
    assert files_in(tmp_path / "moved") == [] and precious.read_bytes() == b"not a spill file"

    other = SpillStore(tmp_path / "other", FMT, ram_bytes=0, disk_bytes=DISK)
    (tmp_path / "other" / LOCK_FILE).unlink()
    (tmp_path / "other").rmdir()
    (tmp_path / "other").symlink_to(target)
    assert other.put(hashes_of([2]), make_blocks([2]), "tenant:a", tokens([2])) == 0
    assert other.stats()["io_errors"] == 1 and os.listdir(target) == [precious.name]
    other.flush()
    assert precious.read_bytes() == b"not a spill file"


# F2 ------------------------------------------------------------------------------------------


class TinyVolume:
    """A volume of ``capacity`` bytes under ``root``: ``fstatvfs`` reports what is free (or,
    with ``lie``, plenty), and a write past it fails with ENOSPC as a full disk's does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, capacity: int, lie: bool) -> None:
        self.root, self.capacity, self.lie, self.enospc = root, capacity, lie, 0
        real_write = spill_format.write_group

        def write_group(path: Any, hashes: Any, blocks: Any, *args: Any, **kwargs: Any) -> int:
            if self.used() + len(hashes) * BLOCK + 512 > self.capacity:
                self.enospc += 1
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(path, hashes, blocks, *args, **kwargs)

        def fstatvfs(fd: int) -> Any:
            free = 10**12 if self.lie else max(0, self.capacity - self.used())
            return os.statvfs_result((4096, 1, 10**9, 0, free, 0, 0, 0, 0, 255))

        monkeypatch.setattr(spill_format, "write_group", write_group)
        monkeypatch.setattr(os, "fstatvfs", fstatvfs)

    def used(self) -> int:
        return sum(p.stat().st_size for p in files_in(self.root))


@pytest.mark.parametrize("lie", [False, True], ids=["free-space-known", "enospc-only"])
def test_a_full_volume_below_the_budget_keeps_the_newest_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lie: bool
) -> None:
    """Review 30e F2: a volume that filled before the budget (64x here) made every new write
    fail and drop its blocks while the oldest files stayed. Now room is made on the volume as
    for the budget (least recently used first): every put is stored, the newest blocks are
    held, and the files stay within the volume. A volume whose free space is not known in
    advance answers ENOSPC: the write makes room and is tried once more (counted)."""
    capacity = 20 * (BLOCK + 600)
    volume = TinyVolume(monkeypatch, tmp_path, capacity, lie)
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=64 * capacity, max_blocks_per_file=1)
    stored = [store.put(hashes_of([i]), make_blocks([i]), "tenant:a", tokens([i])) for i in range(60)]
    assert stored == [1] * 60
    assert store.contains(hashes_of([0, 59])) == [None, "spill_disk"]
    assert store.get(hashes_of(range(55, 60)), tokens(range(55, 60))).blocks.tobytes() == \
        make_blocks(range(55, 60)).tobytes()
    assert volume.used() <= capacity
    stats = store.stats()
    assert stats["io_errors"] == 0 and stats["disk_full_evicted_files"] > 0
    assert (stats["disk_full_writes"] > 0) == lie == (volume.enospc > 0)


# F3 ------------------------------------------------------------------------------------------


def slow_unlinks(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[str]:
    """Each unlink of a group file by the spill format takes ``seconds``; returns the names
    unlinked, in order."""
    real_unlink, done = os.unlink, []

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        if str(name).endswith(spill_format.FILE_SUFFIX):
            time.sleep(seconds)
            done.append(str(name))
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(spill_format.os, "unlink", unlink)
    return done


@pytest.mark.parametrize("how", ["drop", "flush"])
def test_a_big_drop_does_not_hold_other_tenants_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Review 30e F3: a tenant's drop (and a flush) unlinked every file under the store's one
    lock: another tenant's get of one RAM block waited 5.8 s behind 5,000 unlinks. The files
    leave the index under the lock and are unlinked after it: the get answers at once, sees none
    of the dropped blocks, and a block put again meanwhile is not deleted by the late unlink."""
    store = SpillStore(tmp_path, FMT, ram_bytes=BLOCK, disk_bytes=DISK, max_blocks_per_file=1,
                       demote_low_watermark=1.0)
    store.put(hashes_of(range(20)), make_blocks(range(20)), "tenant:a", tokens(range(20)))
    store.demote_to_disk()
    store.put(hashes_of([100]), make_blocks([100]), "tenant:b", tokens([100]))  # b's, in RAM
    assert store.stats()["files"] == 20
    unlinked = slow_unlinks(monkeypatch, 0.1)
    drop = threading.Thread(target=store.drop_namespace if how == "drop" else store.flush,
                            args=("tenant:a",) if how == "drop" else ())
    drop.start()
    while not unlinked:
        time.sleep(0.005)
    started = time.monotonic()
    if how == "drop":  # b's RAM block, while a's files are unlinked
        assert store.get(hashes_of([100]), tokens([100])).tiers == ["spill_ram"]
    assert store.contains(hashes_of(range(20))) == [None] * 20
    store.put(hashes_of([0]), make_blocks([0]), "tenant:c", tokens([0]))  # a dropped hash, put again
    store.demote_to_disk()
    assert store.get(hashes_of([0]), tokens([0])).tiers == ["spill_disk"]
    assert time.monotonic() - started < 1.0  # 20 unlinks of 0.1 s each are still under way
    drop.join(10)
    assert not drop.is_alive() and len(unlinked) >= 20
    assert store.get(hashes_of([0]), tokens([0])).blocks.tobytes() == make_blocks([0]).tobytes()
    kept = ["tenant:b", "tenant:c"] if how == "drop" else ["tenant:c"]
    assert sorted(spill_format.read_header(p).namespace for p in files_in(tmp_path)) == kept


# F5 ------------------------------------------------------------------------------------------


def failing_unlinks(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """Every unlink of a group file by the spill format fails with ``err`` (a read-only volume)."""
    real_unlink = os.unlink

    def unlink(name: Any, *args: Any, **kwargs: Any) -> None:
        if str(name).endswith(spill_format.FILE_SUFFIX):
            raise OSError(err, os.strerror(err), str(name))
        real_unlink(name, *args, **kwargs)

    monkeypatch.setattr(spill_format.os, "unlink", unlink)


def test_a_failed_unlink_is_kept_counted_and_a_dropped_tenant_never_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 30e F5: an unlink that failed (EROFS, EIO) forgot the file: it left the budget for
    good, and after a restart the deleted tenant's blocks were indexed and served again. Now it
    stays counted (``undeleted_bytes``) and is deleted at the next sweep once the volume allows;
    a restart before that deletes the dropped tenant's files instead of indexing them, and
    refuses its late puts."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(3)), make_blocks(range(3)), "tenant:a", tokens(range(3)))
    store.put(hashes_of([7]), make_blocks([7]), "tenant:b", tokens([7]))
    failing_unlinks(monkeypatch, errno.EIO)
    assert store.drop_namespace("tenant:a") == 3
    stats = store.stats()
    assert stats.get("undeleted_bytes", 0) > 0
    assert (stats["unlink_errors"], stats["files"], len(files_in(tmp_path))) == (1, 1, 2)
    assert store.contains(hashes_of(range(3))) == [None] * 3

    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)  # the unlink still fails
    assert restarted.contains(hashes_of([0, 1, 2, 7])) == [None, None, None, "spill_disk"]
    assert restarted.get(hashes_of(range(3)), tokens(range(3))).hashes == []
    assert restarted.put(hashes_of([3]), make_blocks([3]), "tenant:a#salt=x", tokens([3])) == 0
    assert restarted.stats()["tombstoned_files"] == 1 and restarted.stats()["undeleted_bytes"] > 0

    monkeypatch.undo()  # the volume is writable again: the next sweep deletes it
    restarted.expire_quarantine()
    assert len(files_in(tmp_path)) == 1 and restarted.stats()["undeleted_bytes"] == 0


# F6 ------------------------------------------------------------------------------------------


def test_a_restart_picks_a_blocks_newest_copy_by_write_sequence_not_mtime(tmp_path: Path) -> None:
    """Review 30e F6: a restart indexed each block from the file of the latest mtime. A block
    that failed its checksum and was written again while the clock was behind (a step back)
    came back from its old corrupt copy, and the good copy was deleted. The write sequence in
    the header decides now."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of([0, 1]), make_blocks([0, 1]), "tenant:a", tokens([0, 1]))
    (old,) = files_in(tmp_path)
    data = bytearray(old.read_bytes())
    data[-BLOCK - 1] ^= 1  # block 0's payload
    old.write_bytes(bytes(data))
    assert store.get(hashes_of([0]), tokens([0])).hashes == []  # dropped as corrupt, 1 still served
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    (new,) = set(files_in(tmp_path)) - {old}
    back = old.stat().st_mtime_ns - 3600 * 10**9
    os.utime(new, ns=(back, back))  # written "an hour earlier": the clock stepped back
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert new.exists()
    hits = restarted.get(hashes_of([0, 1]), tokens([0, 1]))
    assert hits.blocks.tobytes() == make_blocks([0, 1]).tobytes()
    assert restarted.stats()["corrupt_blocks"] == 0
    assert spill_format.read_header(new).seq > spill_format.read_header(old).seq


def test_a_clock_step_back_does_not_keep_a_quarantined_file_past_its_age(tmp_path: Path) -> None:
    """Review 30e F6: a quarantined file's age counted from its mtime; after a clock step back it
    lay in the future and was kept past ``QUARANTINE_MAX_AGE_S``. Its age now counts from when
    the step was noticed at the latest."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    (path,) = files_in(tmp_path)
    path.write_bytes(b"KVSP" + b"\0" * 40)
    assert store.get(hashes_of([0])).hashes == [] and store.stats()["quarantined_files"] == 1
    moved = tmp_path / spill_format.QUARANTINE_DIR / path.name
    limit = int(spill_unserved.QUARANTINE_MAX_AGE_S * 1e9)
    stepped_back = moved.stat().st_mtime_ns - 10 * limit  # the clock now reads 10 days earlier
    assert store.expire_quarantine(stepped_back) == 0
    assert store.expire_quarantine(stepped_back + limit + 1) == 1
    assert not moved.exists()


def test_write_sequence_rises_across_restarts_and_clock_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write's sequence is past every one found at a restart, even with the clock behind."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=1)
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    monkeypatch.setattr(time, "time_ns", lambda: 1)  # the clock stepped back to 1970
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=1)
    restarted.put(hashes_of([1, 2]), make_blocks([1, 2]), "tenant:a", tokens([1, 2]))
    seqs = {spill_format.read_header(p).block_hashes[0]: spill_format.read_header(p).seq for p in files_in(tmp_path)}
    assert seqs[hashes_of([0])[0]] < seqs[hashes_of([1])[0]] < seqs[hashes_of([2])[0]]
    assert np.array_equal(restarted.get(hashes_of([0])).blocks, make_blocks([0]))


def test_a_restarted_node_serves_nothing_of_a_tenant_deleted_before_its_first_sweep(tmp_path: Path) -> None:
    """Review 30e F5: a deleted tenant's files that could not be deleted (and whose drop the
    store could not record: a read-only volume) were indexed again at a restart and served until
    the node's first sweep of deleted tenants got its answer. The node now waits for that first
    sweep (bounded) before it serves."""
    from services.spill_node import SpillNode
    from tenants.model import own_namespace

    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(3)), make_blocks(range(3)), own_namespace("bob"), tokens(range(3)))
    store.put(hashes_of([5]), make_blocks([5]), own_namespace("ann"), tokens([5]))

    def deleted_after(seq: int) -> list[tuple[int, str]]:
        time.sleep(0.3)  # a scheduler that takes a moment to answer
        return [(1, "bob")] if seq == 0 else []

    store.close()  # a restart: the old process is gone, its lock with it
    node = SpillNode(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK, deleted_tenants=deleted_after,
                     sweep_interval_s=3600)
    try:
        assert node.contains(hashes_of([0, 1, 2, 5])) == [None, None, None, "spill_disk"]
        assert node.get(hashes_of(range(3)), tokens(range(3))).hashes == []
    finally:
        assert node._sweep is not None
        node._sweep.stop()


def test_a_cache_node_counts_only_the_blocks_its_spill_put_stored(tiny, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Review 30e F2: a cache node counted every block it sent in ``spill_put_blocks``
    (``kv_spilled_blocks_total``) whatever the put answered, so blocks whose disk write failed
    counted as spilled. It counts what the put says it stored now."""
    from cache_node.tiers.spill_format import BlockFormat
    from tests.test_tier_engine import prompt_of, run, tiered

    def failing_write(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    probe = tiered(tiny)
    store = SpillStore(tmp_path, BlockFormat(*probe.spill_block_spec()), 0, 1 << 30)  # RAM 0: to disk
    eng = tiered(tiny, spill=store, pool_blocks=64)
    monkeypatch.setattr(spill_format, "write_group", failing_write)
    run(eng, prompt_of(160, 3))
    eng.demote_all(to_spill=True)
    assert eng.wait_for_transfers()
    assert store.stats()["io_errors"] > 0 and store.stats()["blocks_spill_disk"] == 0
    assert eng.stats()["spill_put_blocks"] == 0
    monkeypatch.undo()
    run(eng, prompt_of(160, 500))
    eng.demote_all(to_spill=True)
    assert eng.wait_for_transfers()
    assert eng.stats()["spill_put_blocks"] == store.stats()["blocks_spill_disk"] > 0


def test_a_retired_spill_dir_with_a_tombstone_file_is_still_deleted(tmp_path: Path) -> None:
    """The store's list of dropped holders is a file a spill node writes: a retired node's
    directory holding one is deleted as before (``services.spill_dirs``), not left as foreign."""
    from services.spill_dirs import remove_retired_spill_dirs

    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    store = SpillStore(root / "1", FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    store.drop_namespace("tenant:b")
    assert (root / "1" / spill_format.TOMBSTONE_FILE).is_file()
    store.close()  # its process ended (a live store's directory is kept: spill_lock)
    assert remove_retired_spill_dirs(root, 1) == ["1"]
    assert os.listdir(root) == []


def test_a_fifo_or_link_named_metrics_port_does_not_hang_a_spill_node(tmp_path: Path) -> None:
    """F1's kind in the spill node itself: it read its previous metrics port from
    ``<dir>/metrics_port`` with ``read_text`` and wrote it with ``write_text``, so a FIFO there
    hung its constructor, and a link there had its target overwritten. The port file is read
    as a regular file only and written by a rename over the name."""
    from services.metrics import MetricsEndpoint
    from services.spill_dirs import METRICS_PORT_FILE
    from services.spill_node import SpillNode

    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    os.mkfifo(root / METRICS_PORT_FILE)
    try:
        node = within(5, lambda: SpillNode(root, FMT, 0, DISK, node_id="s0", metrics=MetricsEndpoint("127.0.0.1", 0)))
        assert node.metrics_server is not None
        node.metrics_server.close()
        assert (root / METRICS_PORT_FILE).read_text() == f"{node.metrics_server.port}\n"
    finally:
        unblock_fifo(root / METRICS_PORT_FILE)
    target = tmp_path / "precious"
    target.write_text("keep")
    (root / METRICS_PORT_FILE).unlink()
    (root / METRICS_PORT_FILE).symlink_to(target)
    node.close()  # a restart: the old process is gone, its lock with it
    node = within(5, lambda: SpillNode(root, FMT, 0, DISK, node_id="s0", metrics=MetricsEndpoint("127.0.0.1", 0)))
    assert node.metrics_server is not None
    node.metrics_server.close()
    assert target.read_text() == "keep" and not (root / METRICS_PORT_FILE).is_symlink()


def test_the_disk_tiers_faults_are_exported_as_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 30: the disk tier's new fault counters (review 30e F2/F4/F5) were in
    ``SpillStore.stats()`` only; a spill node's /metrics now has ``spill_disk_events_total{kind}``
    and ``spill_undeleted_bytes``, so an operator sees a read-only or full volume."""
    from services.metrics.spill import SPILL_DISK_EVENTS, SpillMetrics

    store = SpillStore(tmp_path / "spill", FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(3)), make_blocks(range(3)), "tenant:a", tokens(range(3)))
    failing_unlinks(monkeypatch, errno.EIO)
    store.drop_namespace("tenant:a")
    metrics = SpillMetrics("spill_node_0", store.stats, BLOCK).registry
    node = {"node": "spill_node_0"}
    assert metrics.get_sample_value("kvstrata:spill_undeleted_bytes", node) == store.stats()["undeleted_bytes"] > 0
    for kind in SPILL_DISK_EVENTS:
        expected = 1 if kind == "unlink_error" else 0
        assert metrics.get_sample_value("kvstrata:spill_disk_events_total", {**node, "kind": kind}) == expected, kind


def test_a_deleted_spill_root_and_its_node_dir_are_made_again(tmp_path: Path) -> None:
    """Review 30m F3: with the whole spill root deleted (``rm -rf <state_dir>/spill``), the node
    directory was made again without its parent: every later write failed until a restart."""
    import shutil

    top = tmp_path / "spill"
    store = SpillStore(top / "0", FMT, ram_bytes=0, disk_bytes=DISK)
    assert store.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2))) == 2
    shutil.rmtree(top)
    assert store.put(hashes_of([10]), make_blocks([10]), "tenant:a", tokens([10])) == 1
    assert stat.S_IMODE((top / "0").stat().st_mode) == stat.S_IMODE(top.stat().st_mode) == 0o700
    assert store.get(hashes_of([10]), tokens([10])).blocks.tobytes() == make_blocks([10]).tobytes()
    assert (store.stats()["dir_recreated"], store.stats()["io_errors"]) == (1, 0)


def test_a_header_claiming_a_write_sequence_past_the_bound_is_corrupt(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 30m F2: a group file whose header held seq 2**63 - 1 was taken as the largest write
    sequence at a restart, and every later write failed (ValueError out of put) for good, spill-RAM
    blocks of other tenants dropped with it. Such a header is now corrupt (quarantined), and the
    node writes on."""
    root = tmp_path / "0"
    root.mkdir(mode=0o700)
    with monkeypatch.context() as m:  # the writer refuses it (review 31 F1): crafted past its bound
        m.setattr(spill_format, "MAX_SEQ", 2**63 - 1)
        spill_format.write_group(root / "aa.kvs", hashes_of([100]), make_blocks([100]), "tenant:x", FMT,
                                 seq=2**63 - 1)
    store = SpillStore(root, FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK)
    assert store.contains(hashes_of([100])) == [None]
    assert store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:bob", tokens(range(4))) == 4
    assert store.put(hashes_of(range(20, 24)), make_blocks(range(20, 24)), "tenant:alice", tokens(range(20, 24))) == 4
    assert None not in store.contains(hashes_of([*range(4), *range(20, 24)]))
    assert store.stats()["io_errors"] == 0
