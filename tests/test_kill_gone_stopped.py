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
import threading
import time

import ray

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
