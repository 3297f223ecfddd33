"""``cli.processes.stop_processes`` on real child processes: it stops the processes whose
command line matches and their descendants, SIGKILLs those that ignore SIGTERM, signals the
``last`` ones after the others have exited, and leaves every other process alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from cli.processes import stop_processes


def _spawn(script: str, marker: str) -> subprocess.Popen:
    """``sh -c script marker`` in a new process group (the marker is its ``$0``, so it is in
    the shell's command line only, not its children's)."""
    return subprocess.Popen(["sh", "-c", script, marker], start_new_session=True)


def _child(proc: subprocess.Popen) -> psutil.Process:
    deadline = time.monotonic() + 10
    while not (children := psutil.Process(proc.pid).children()):
        assert time.monotonic() < deadline, "the shell started no child"
        time.sleep(0.01)
    return children[0]


def _gone(proc: psutil.Process, wait_s: float = 5.0) -> bool:
    """True once ``proc`` has exited (SIGKILL is delivered asynchronously: wait a little)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _matching(marker: str):
    return lambda cmdline: any(marker in part for part in cmdline)


def _cleanup(*procs: subprocess.Popen) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_stop_processes_stops_matches_and_descendants_only() -> None:
    marker = f"kvstrata-test-{uuid.uuid4().hex}"
    target = _spawn("sleep 600 & wait", marker)
    bystander = _spawn("sleep 600 & wait", f"kvstrata-test-{uuid.uuid4().hex}")
    try:
        shell, child = psutil.Process(target.pid), _child(target)
        bystander_child = _child(bystander)
        start = time.monotonic()

        stopped = stop_processes(_matching(marker), timeout_s=30.0)

        assert stopped == 2  # the shell and its sleep (whose command line lacks the marker)
        assert time.monotonic() - start < 10  # SIGTERM sufficed; no wait for the timeout
        assert _gone(shell) and _gone(child)
        assert bystander.poll() is None and bystander_child.is_running()
    finally:
        _cleanup(target, bystander)


def test_stop_processes_kills_what_ignores_sigterm() -> None:
    marker = f"kvstrata-test-{uuid.uuid4().hex}"
    stubborn = _spawn("trap '' TERM; sleep 600 & wait", marker)  # the sleep inherits the ignore
    try:
        shell, child = psutil.Process(stubborn.pid), _child(stubborn)
        start = time.monotonic()

        assert stop_processes(_matching(marker), timeout_s=1.0) == 2

        assert time.monotonic() - start >= 1.0  # SIGTERM was ignored; SIGKILL after the timeout
        assert _gone(shell) and _gone(child)
    finally:
        _cleanup(stubborn)


def test_stop_processes_without_matches_stops_nothing() -> None:
    assert stop_processes(lambda cmdline: False, timeout_s=0.1) == 0


LAST = """
import os, signal, sys, time
first, out = int(sys.argv[2]), sys.argv[3]

def on_term(*_):
    try:
        with open(f"/proc/{first}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        state = "gone"
    with open(out, "w") as f:
        f.write("first gone" if state in ("gone", "Z", "X") else f"first still running ({state})")
    sys.exit(0)

signal.signal(signal.SIGTERM, on_term)
open(out + ".ready", "w").close()
while True:
    time.sleep(1)
"""


def test_stop_processes_signals_the_last_ones_once_the_others_have_exited(tmp_path) -> None:
    """``last`` (Ray's GCS for ``kvstrata down``): its processes get SIGTERM only after every
    other match has exited; here the first one takes 0.3 s to exit on SIGTERM."""
    marker = f"kvstrata-test-{uuid.uuid4().hex}"
    first = _spawn("trap 'sleep 0.3; exit 0' TERM; sleep 600 & wait", f"{marker}-first")
    out = tmp_path / "seen"
    last = subprocess.Popen([sys.executable, "-c", LAST, f"{marker}-last", str(first.pid), str(out)],
                            start_new_session=True)
    try:
        _child(first)
        deadline = time.monotonic() + 30
        while not (tmp_path / "seen.ready").exists():
            assert time.monotonic() < deadline and last.poll() is None, "the last process did not start"
            time.sleep(0.01)
        start = time.monotonic()

        stopped = stop_processes(_matching(marker), timeout_s=30.0,
                                 last=lambda cmdline: any(part.endswith("-last") for part in cmdline))

        assert stopped == 3  # the first shell, its sleep, the last process
        assert time.monotonic() - start < 10  # each exited on SIGTERM
        assert out.read_text() == "first gone"  # "first still running (S)" if signalled together
        assert last.wait(timeout=10) == 0
    finally:
        _cleanup(first, last)


def test_another_users_process_naming_the_same_paths_is_left_alone() -> None:
    """Review s34 B F5: every user's process whose command line matched was taken, so one of
    another user naming the cluster's temp dir made ``terminate`` raise ``AccessDenied`` (for a
    non-root caller), ``down`` failing before it signalled the cluster. Only this user's
    processes are stopped now. Needs root to start a process as another user (skipped else)."""
    if os.getuid() != 0:
        pytest.skip("starting a process as another user needs root")
    marker = f"kvstrata-test-{uuid.uuid4().hex}"
    mine = _spawn("sleep 600 & wait", marker)
    other = subprocess.Popen(["sh", "-c", "sleep 600 & wait", marker], start_new_session=True,
                             user=65534, group=65534)
    try:
        mine_shell, mine_child, other_shell = psutil.Process(mine.pid), _child(mine), psutil.Process(other.pid)
        assert other_shell.uids().real == 65534

        assert stop_processes(_matching(marker), timeout_s=10.0) == 2  # mine and its sleep

        assert _gone(mine_shell) and _gone(mine_child)
        assert other.poll() is None and other_shell.is_running()
    finally:
        _cleanup(mine, other)


def test_down_stops_options_naming_the_temp_dir_not_a_reader_of_its_logs(tmp_path) -> None:
    """``kvstrata down``'s match (``cli.lifecycle._stop_local_ray``): a process with an option
    naming a path under the cluster's temp dir (``--session-dir=...``, as each Ray process has)
    is the cluster's; one given such a path as a plain argument (``tail -f .../raylet.out``, an
    editor on a log) is the user's own and left running (review s34 B F5: it was stopped too),
    as is one naming a sibling directory that shares the prefix."""
    from cli.lifecycle import _stop_local_ray

    temp_dir = str(tmp_path / "kvstrata-ray-x")
    ray_like = _spawn("sleep 600 & wait", f"--session-dir={temp_dir}/session_1")
    reader = _spawn("sleep 600 & wait", f"{temp_dir}/session_1/logs/raylet.out")
    sibling = _spawn("sleep 600 & wait", f"--temp-dir={temp_dir}-other")
    try:
        ray_shell, ray_child = psutil.Process(ray_like.pid), _child(ray_like)
        reader_child, sibling_child = _child(reader), _child(sibling)

        assert _stop_local_ray(temp_dir) == 2  # the option-bearing shell and its sleep

        assert _gone(ray_shell) and _gone(ray_child)
        assert reader.poll() is None and reader_child.is_running()
        assert sibling.poll() is None and sibling_child.is_running()
    finally:
        _cleanup(ray_like, reader, sibling)
