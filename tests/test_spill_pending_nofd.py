"""Review 31 F2: a deletion the spill store takes out of its books is never lost. A flush or a
tenant's drop whose directory descriptor could not be duplicated (EMFILE: out of descriptors)
deleted nothing, and the files it took out of the index were counted nowhere and never tried
again (``DiskTier._pending``'s comment said "the files stay counted"): a restart indexed them
again, so the flushed KV was served again, and a deleted tenant's files (its token ids) stayed.
Of the same kind: a flush whose listing failed deleted nothing, and a quarantine folder that
could not be opened (EMFILE) had a flush, the age limit or the folder's bounds forget its files
undeleted. Each such file is now counted as undeleted (against the budget) and deleted at a
later sweep or budget pass."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cache_node.tiers import spill_format, spill_unserved
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_disk_faults import tokens
from tests.test_spill_store import DISK, FMT, files_in, hashes_of, make_blocks
from tests.test_spill_unserved import corrupt_file_of


def no_fd(self: spill_format.SpillDir) -> int:
    raise OSError(errno.EMFILE, "Too many open files")


@contextmanager
def quarantine_unopenable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Opening the quarantine folder fails with EMFILE (out of descriptors) meanwhile."""
    real_open = os.open

    def emfile_open(path: object, *args: object, **kwargs: object) -> int:
        if path == spill_format.QUARANTINE_DIR:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(os, "open", emfile_open)
        yield


def test_a_flush_that_cannot_dup_its_dir_fd_is_not_undone_by_a_restart(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))
    on_disk = sum(p.stat().st_size for p in files_in(tmp_path))
    assert on_disk

    with monkeypatch.context() as m:
        m.setattr(spill_format.SpillDir, "dup", no_fd)
        assert store.flush() == 4
    assert store.stats()["undeleted_bytes"] == on_disk  # counted against the budget meanwhile
    store.expire_quarantine()  # a sweep: retries the deletions that failed
    assert not files_in(tmp_path) and store.stats()["undeleted_bytes"] == 0
    store.put(hashes_of([9]), make_blocks([9]), "tenant:a", tokens([9]))  # a budget pass
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(4))) == [None] * 4  # flushed: never served again


def test_a_drop_that_cannot_dup_its_dir_fd_leaves_no_file_of_the_deleted_tenant(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:bob", tokens(range(4)))
    bob_files = set(files_in(tmp_path))

    with monkeypatch.context() as m:
        m.setattr(spill_format.SpillDir, "dup", no_fd)
        assert store.drop_namespace("tenant:bob") == 4
    for _ in range(3):
        store.expire_quarantine()  # sweeps: retry the deletions that failed
    store.put(hashes_of([9]), make_blocks([9]), "tenant:ann", tokens([9]))  # a budget pass
    assert not bob_files & set(files_in(tmp_path)), "the deleted tenant's group files (its token ids) stay on disk"


def test_a_flush_whose_listing_fails_still_deletes_every_file_it_knows(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:a", tokens(range(4)))

    def unlistable(dir_fd: int, links: bool = False) -> list[spill_format.GroupName]:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(spill_format, "list_group_names", unlistable)
        assert store.flush() == 4
    assert not files_in(tmp_path)
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(4))) == [None] * 4


def test_a_flush_that_cannot_open_the_quarantine_deletes_its_files_at_the_next_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "spill"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    bad = corrupt_file_of(store, root, "tenant:secret", [0, 1])
    size = (root / spill_format.QUARANTINE_DIR / bad).stat().st_size
    with quarantine_unopenable(monkeypatch):
        store.flush()
    assert (store.stats()["undeleted_bytes"], store.stats()["quarantined_bytes"]) == (size, 0)
    store.expire_quarantine()
    assert os.listdir(root / spill_format.QUARANTINE_DIR) == []
    assert store.stats()["undeleted_bytes"] == 0


def test_a_quarantined_file_past_its_age_is_deleted_later_when_its_folder_cannot_be_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "spill"
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    bad = corrupt_file_of(store, root, "tenant:secret", [0, 1])
    moved = root / spill_format.QUARANTINE_DIR / bad
    later = moved.stat().st_mtime_ns + int(spill_unserved.QUARANTINE_MAX_AGE_S * 1e9) + 1
    with quarantine_unopenable(monkeypatch):
        assert store.expire_quarantine(later) == 0
    assert store.stats()["undeleted_bytes"] == moved.stat().st_size  # not forgotten
    store.expire_quarantine(later)
    assert not moved.exists()
