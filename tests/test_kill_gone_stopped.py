"""``kill_gone`` returns once the killed actor's process has exited, not when Ray lists it DEAD.

Ray lists an actor DEAD (``ray.get_actor`` raises) as soon as ``ray.kill`` returns; a process
that is stopped (``SIGSTOP``: a debugger, a paused container, a host under memory pressure) runs
on once continued, until it reads the kill, and Ray force-kills one still stopped only about 5 s
later. ``kvstrata down`` and the launcher kill the global scheduler with ``kill_gone`` before
the spill nodes because its spill watch creates a dead spill node again
(``services.spill_recreate``): a scheduler process still running then outlives that order.
Real Ray actor processes, stopped and continued with real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
import ray

import services.actor_refs
from bench.chaos_stack import actor_pid
from services.actor_refs import kill_gone
from tests.ray_actors import NameHolder

NAMESPACE = "kvstrata-kill-gone-stopped"
CONTINUE_AFTER_S = 1.0
"""How long the actor's process stays stopped before it is continued (it then reads the kill)."""


def _state(pid: int) -> str:
    """The process's state letter (``T`` stopped, ``Z`` exited, not reaped yet), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _stopped_actor(name: str) -> int:
    holder = NameHolder.options(name=name, namespace=NAMESPACE, lifetime="detached").remote()
    assert ray.get(holder.ping.remote(), timeout=60) == "other"
    pid = actor_pid(holder)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return pid


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_kill_gone_waits_for_a_stopped_actors_process_to_exit(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Regression (s41): kill_gone returned at once, the actor DEAD in Ray's tables, while its
    stopped process was still there (state T) and would run on once continued."""
    pid = _stopped_actor("stopped-then-continued")
    timer = threading.Timer(CONTINUE_AFTER_S, _continue, (pid,))
    timer.start()
    try:
        started = time.monotonic()
        gone = kill_gone("stopped-then-continued", NAMESPACE, 30.0)
        state, waited_s = _state(pid), time.monotonic() - started
        assert state in ("Z", "gone"), f"kill_gone returned after {waited_s:.2f} s, its process in state {state}"
        assert waited_s >= CONTINUE_AFTER_S - 0.1  # the timer started just before the clock
        assert gone is True
    finally:
        timer.cancel()
        _continue(pid)


def test_kill_gone_says_when_the_process_outlived_its_wait(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """A process still stopped at the timeout: False (the caller knows the order did not hold)."""
    pid = _stopped_actor("stopped-past-the-wait")
    try:
        gone = kill_gone("stopped-past-the-wait", NAMESPACE, 0.5)
        assert _state(pid) == "T"
        assert gone is False
    finally:
        _continue(pid)


def test_kill_gone_of_no_actor_is_done(ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """Nothing of that name: nothing to wait for (True at once)."""
    assert kill_gone("nobody-has-this-name", NAMESPACE, 5.0) is True


class _ActorTableNaming:
    """The GCS accessor, its actor table naming process ``pid`` for every actor (what a
    ``kvstrata down`` run in another PID namespace than the actor's, at the same address, reads:
    the pid of the actor's namespace, some other process in its own)."""

    def __init__(self, accessor: Any, pid: int) -> None:
        self._accessor, self._pid = accessor, pid

    def get_actor_info(self, actor_id: Any) -> bytes | None:
        from ray.core.generated import gcs_pb2

        raw = self._accessor.get_actor_info(actor_id)
        if raw is None:
            return None
        info = gcs_pb2.ActorTableData.FromString(raw)
        info.pid = self._pid
        return info.SerializeToString()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accessor, name)


def test_kill_gone_waits_for_no_process_the_actor_table_names_that_is_no_ray_worker(
        ray_cluster, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Regression (s41 review): the pid the actor table gives is of the actor's PID namespace;
    where it names another live process here (no Ray worker: another namespace at the same
    address), kill_gone waited for it to its timeout and said False, the actor long gone."""
    holder = NameHolder.options(name="foreign-pid", namespace=NAMESPACE, lifetime="detached").remote()
    assert ray.get(holder.ping.remote(), timeout=60) == "other"
    other = subprocess.Popen(["sleep", "60"])
    real = services.actor_refs._gcs
    monkeypatch.setattr(services.actor_refs, "_gcs", lambda: _ActorTableNaming(real(), other.pid))
    try:
        started = time.monotonic()
        gone = kill_gone("foreign-pid", NAMESPACE, 5.0)
        waited_s = time.monotonic() - started
        assert gone is True and waited_s < 4.0, (gone, waited_s)
        assert other.poll() is None  # the other process runs on: it was no reason to wait
    finally:
        other.kill()
        other.wait()
