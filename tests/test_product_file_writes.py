"""Every file the product writes for a reader to find later is written atomically and durably:
to a temp file in its directory, fsynced, renamed over its name, the directory fsynced after
(``kvstrata.durable_files.write_file_atomic``). A crash (power loss) at any point leaves the old file or
the new one whole, never an empty or cut-short one.

Regression (s39): Prometheus's targets file (``services.metrics.targets``) was renamed into
place unsynced, and the workload's report folder (calls.jsonl, timeseries.jsonl, report.json,
report.md, run.json, trace.jsonl, the plots, comparison.json) was written in place, so a crash
could leave a targets file a (re)started Prometheus scraped nothing from, or a report folder
whose files were cut short."""

from __future__ import annotations

import os
import resource
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from services.metrics.targets import TARGETS_FILE, write_targets
from tests.test_report import RECORDS, TENANTS, TIMESERIES
from workloads.deepresearch.compare import append_comparison
from workloads.deepresearch.report import write_report


def _write_targets(root: Path) -> None:
    write_targets({"gateway": "127.0.0.1:9100", "cache_node_0": "127.0.0.1:9101"}, root / TARGETS_FILE, "kvs")


def _write_report_folder(root: Path) -> None:
    trace = [{"call_id": "c0", "messages": [{"role": "user", "content": "é"}]}]
    run_dir, first = write_report(RECORDS, TIMESERIES, TENANTS, root=root, trace=trace, scheduler="kvstrata")
    other_dir, second = write_report(RECORDS, TIMESERIES, TENANTS, root=root / "cmp", scheduler="fcfs")
    append_comparison(run_dir, first, second, other_dir)


WRITERS: dict[str, Callable[[Path], None]] = {"targets": _write_targets, "report_folder": _write_report_folder}


class _Syscalls:
    """``os.fsync`` and ``os.replace`` as they happen (the real calls run): ("fsync", path of the
    fd) and ("replace", src, dst)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(src: str | Path, dst: str | Path, **kw: object) -> None:
            self.events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
            real_replace(src, dst, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_file_written_is_fsynced_renamed_into_place_and_its_directory_fsynced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """For each regular file the writer leaves: its last ``os.replace`` onto it moved a file
    fsynced before, and its directory was fsynced after; no temp file is left."""
    calls = _Syscalls(monkeypatch)
    WRITERS[writer](tmp_path)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink())
    assert files, "the writer wrote nothing"
    assert _unsafe(calls, files) == []
    assert not [p.name for p in files if p.name.startswith(".") or p.suffix == ".tmp"]


def test_the_cached_model_identity_is_fsynced_renamed_into_place_and_its_directory_fsynced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model_identity`` caches its digest beside the checkpoint (``IDENTITY_FILE``), durably;
    nothing else is left there. Regression (s40): it was written to a ``.tmp<pid>`` file and
    renamed into place unsynced (its own temp+replace, not ``write_file_atomic``)."""
    from cache_node.model_files import IDENTITY_FILE, model_identity

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llama"}')
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 64)
    calls = _Syscalls(monkeypatch)
    identity = model_identity(checkpoint)
    assert identity.startswith("ckpt@")
    assert _unsafe(calls, [checkpoint / IDENTITY_FILE]) == []
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted([IDENTITY_FILE, "config.json", "model.safetensors"])
    assert model_identity(checkpoint) == identity


def _unsafe(calls: _Syscalls, files: list[Path]) -> list[str]:
    """The ``files`` not written atomically and durably, each with what was missing."""
    unsafe = []
    for path in files:
        final = str(path.resolve())
        at = max((i for i, e in enumerate(calls.events) if e[0] == "replace" and e[2] == final), default=None)
        if at is None:
            unsafe.append(f"{path.name}: written in place")
            continue
        if ("fsync", calls.events[at][1]) not in calls.events[:at]:
            unsafe.append(f"{path.name}: renamed into place unsynced")
        if ("fsync", str(path.parent.resolve())) not in calls.events[at + 1:]:
            unsafe.append(f"{path.name}: its directory not fsynced after the rename")
    return unsafe


def test_targets_file_is_world_readable_and_replaced_whole(tmp_path: Path) -> None:
    """Prometheus (maybe another user) reads it: 0644 whatever the umask; a second ``up`` replaces
    it (a new inode) rather than rewriting it in place."""
    old = os.umask(0o077)
    try:
        _write_targets(tmp_path)
        inode = (tmp_path / TARGETS_FILE).stat().st_ino
        _write_targets(tmp_path)
    finally:
        os.umask(old)
    st = (tmp_path / TARGETS_FILE).stat()
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [TARGETS_FILE]


def test_a_write_the_disk_refuses_leaves_the_old_file_whole(tmp_path: Path) -> None:
    """A file system that refuses bytes past a size (RLIMIT_FSIZE: EFBIG, as a full disk's
    ENOSPC) mid-write: the targets file a scraper reads is the old one, whole, and no temp
    file is left."""
    _write_targets(tmp_path)
    before = (tmp_path / TARGETS_FILE).read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # Python ignores SIGXFSZ: write raises
    try:
        with pytest.raises(OSError):
            write_targets({f"cache_node_{i}": f"127.0.0.1:{9200 + i}" for i in range(8)}, tmp_path / TARGETS_FILE,
                          "kvs")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (tmp_path / TARGETS_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [TARGETS_FILE]
