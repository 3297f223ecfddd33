"""The admin key survives a crash at any point of its creation (issue 18 fault 7).

Each crash state is made for real in a state dir: the tenant database holds an admin-key
hash, and the key file is missing, empty or half-written (what a process killed between the
commit and the end of the write left behind before the fix). The next start, through the
launcher's ``_admin_key`` and a real GlobalScheduler actor, must yield a key the scheduler
accepts and that is in the file.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray

from services.config import ServiceConfig
from services.global_scheduler_admission import GlobalSchedulerActor
from services.launcher import _admin_key, admin_key_path
from tenants.keys import KEY_PATTERN, read_key_file, write_key_file
from tenants.store import TenantStore


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):  # type: ignore[no-untyped-def]
    yield


def _start(state_dir: Path) -> tuple[str, object]:
    """One start of the services' admin-key step on ``state_dir`` (a fresh scheduler actor)."""
    config = ServiceConfig(state_dir=str(state_dir))
    scheduler = GlobalSchedulerActor.options(num_cpus=0).remote(str(state_dir), {"n0": 1})
    return _admin_key(config, scheduler), scheduler


def _crashed_after_commit(state_dir: Path, file_text: str | None) -> str:
    """The state a start killed after committing the hash left: returns the lost key."""
    store = TenantStore(state_dir / "tenants.sqlite")
    lost = store.ensure_admin_key()
    store.close()
    assert lost is not None
    if file_text is not None:
        (state_dir / "admin_key").write_text(file_text)
    return lost


@pytest.mark.parametrize(
    "file_text",
    [None, "", "kvs_0123456789ab_half-writ"],
    ids=["no-file", "empty-file", "half-written-file"],
)
def test_start_after_crash_between_commit_and_key_file_recovers(tmp_path: Path, file_text) -> None:
    """issue 18 fault 7: a hash committed with no usable key file locked the admin out."""
    lost = _crashed_after_commit(tmp_path, file_text)

    key, scheduler = _start(tmp_path)

    assert KEY_PATTERN.fullmatch(key)
    assert key != lost
    assert ray.get(scheduler.verify_admin_key.remote(key)) is True
    assert ray.get(scheduler.verify_admin_key.remote(lost)) is False
    assert read_key_file(admin_key_path(ServiceConfig(state_dir=str(tmp_path)))) == key
    assert stat.S_IMODE((tmp_path / "admin_key").stat().st_mode) == 0o600
    ray.kill(scheduler)


def test_restart_keeps_a_working_admin_key(tmp_path: Path) -> None:
    """issue 18 fault 7: a clean restart reads the same key back (no rotation)."""
    first, scheduler = _start(tmp_path)
    ray.kill(scheduler)

    again, scheduler = _start(tmp_path)

    assert again == first
    assert ray.get(scheduler.verify_admin_key.remote(first)) is True
    ray.kill(scheduler)


def test_key_file_written_but_hash_not_committed_is_replaced(tmp_path: Path) -> None:
    """issue 18 fault 7: killed after the file is written, before the commit (the new order)."""
    orphan = "kvs_0123456789ab_" + "A" * 43
    write_key_file(tmp_path / "admin_key", orphan)

    key, scheduler = _start(tmp_path)

    assert key != orphan
    assert ray.get(scheduler.verify_admin_key.remote(key)) is True
    assert read_key_file(tmp_path / "admin_key") == key
    ray.kill(scheduler)


def test_write_key_file_killed_mid_write_keeps_the_old_file(tmp_path: Path) -> None:
    """issue 18 fault 7: SIGKILL while the new key is written leaves the old file whole."""
    path = tmp_path / "admin_key"
    old = "kvs_0123456789ab_" + "A" * 43
    write_key_file(path, old)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, sys, time
            from tenants import keys
            real_replace = os.replace
            def stall(src, dst):
                print("ready", flush=True)
                time.sleep(60)
            os.replace = stall  # (kvstrata.durable_files, which keys writes through, calls it)
            keys.write_key_file({str(path)!r}, "kvs_ba9876543210_" + "B" * 43)
        """)],
        stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent, text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"

    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)

    assert read_key_file(path) == old
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "admin_key")
    assert len(leftovers) == 1 and leftovers[0].startswith(".admin_key.")  # the temp file
    write_key_file(path, "kvs_ba9876543210_" + "C" * 43)  # the next write still works
    assert read_key_file(path) == "kvs_ba9876543210_" + "C" * 43


def test_read_key_file_refuses_garbled_files(tmp_path: Path) -> None:
    """issue 18 fault 7: an empty or garbled key file reads as no key, never as a key."""
    path = tmp_path / "admin_key"
    assert read_key_file(path) is None
    for text in ("", "\n", "kvs_0123456789ab_half", "\x00" * 80):
        path.write_text(text)
        assert read_key_file(path) is None
