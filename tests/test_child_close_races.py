"""A cache node's shutdown (``close`` from its own thread) ends the grammar compiler and chat
renderer children promptly, whatever the thread using them is doing, and never signals a pid
once its child is reaped (s39's open items 1 and 2).

- A close while a grammar compile thread spawns its child (``CompilerProcess.start`` between
  the fork and ``proc`` being set: ``close`` finds no child to kill) kills that child at once.
  Regression: it ran on until it said ready (a child that never does: ``start_timeout_s``,
  120 s), the shutdown waiting ``STOP_TIMEOUT_S`` for the compile thread and returning with the
  child alive. (The chat renderer's got the same fix in 0eba26e: tests/test_node_render_child.)
- A close while the using thread reaps a child that ended (``_ended``'s wait) sends no signal
  by pid: that pid may already be another process's. Regression: ``Popen.kill`` from the
  closing thread checked ``poll()``, which answers None while another thread holds the
  ``Popen``'s wait lock, also from its ``waitpid``'s return (the pid free) to its
  ``returncode``: the SIGKILL went to the freed pid. Both children's ``close`` did so.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from cache_node import grammar_process
from cache_node.grammar_process import CompilerDied, CompilerProcess
from cache_node.structured_output import StructuredOutputSpec
from services.render_process import RenderFailed, RenderProcess
from tests.conftest import make_grammars

NEVER_READY = (sys.executable, "-c", "import time; time.sleep(60)")
"""A child that never says ready (a compiler still importing, as long as the test needs)."""

EXITS_AT_ONCE = (sys.executable, "-c", "import sys; sys.exit(3)")
"""A child that ends before it reads its ``init`` frame: its using thread reaps it in ``_ended``."""


@pytest.fixture(scope="module")
def tokenizer(grammar_tokenizer: Any) -> Any:
    return grammar_tokenizer


def test_a_close_during_a_compile_threads_spawn_kills_that_child_at_once(tokenizer: Any, monkeypatch) -> None:
    """``Grammars.close`` on another thread while compile thread 0 is between its child's
    fork and ``proc`` being set (held there until ``close`` has killed what it could): right
    after ``close`` returns, that child has ended, and ``close`` took well under its
    ``STOP_TIMEOUT_S`` (5 s) join of the thread."""
    g = make_grammars(tokenizer, workers=1, timeout_s=5.0)
    spawned: list[Any] = []
    took: list[float] = []

    def close_from_another_thread() -> None:
        t0 = time.monotonic()
        g.close()
        took.append(time.monotonic() - t0)

    closer = threading.Thread(target=close_from_another_thread, name="test-closer")

    def spawn_then_close(argv: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
        spawned.append(real_start_child(NEVER_READY, *args, **kwargs))
        closer.start()
        deadline = time.monotonic() + 10
        while not g._queue.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # (``stop`` kills each process's child right after closing the queue)
        return spawned[-1]

    real_start_child = grammar_process.start_child
    monkeypatch.setattr(grammar_process, "start_child", spawn_then_close)
    try:
        future = g.compile(StructuredOutputSpec("regex", "[ab]+"), "tenant-a")
        with pytest.raises(Exception, match="shutting down"):
            future.result(timeout=30)
        closer.join(30)
        assert not closer.is_alive() and len(spawned) == 1
        alive_after_close = spawned[0].poll() is None
        assert not alive_after_close, f"the child spawned during close() still runs after close() took {took[0]:.1f} s"
        assert took[0] < 2.0, took
    finally:
        for child in spawned:
            child.kill()
            child.wait(10)
        g.close()


def test_a_closed_compiler_process_starts_no_child() -> None:
    """``close`` before ``start`` (a process ``Grammars._process`` made after ``stop`` read the
    list): ``start`` refuses at once, as the node's shutdown, spawning nothing."""
    process = CompilerProcess("{}", 0, argv=NEVER_READY)
    process.close()
    t0 = time.monotonic()
    with pytest.raises(CompilerDied, match="shutting down") as refused:
        process.start()
    assert refused.value.signal == signal.SIGKILL  # (``run_compile``: the node's, not the spec's)
    assert process.num_starts == 0 and process.proc is None and time.monotonic() - t0 < 1.0


class _SignalLog:
    """Every signal sent by pid (``os.kill``) to the child after it was reaped; the reap of
    ``child_pid`` is held in its window (``waitpid`` returned, ``Popen.returncode`` not yet
    set: ``Popen._handle_exitstatus``, on every path that reaps) until ``go`` is set."""

    def __init__(self, monkeypatch) -> None:
        self.child_pid = -1
        self.reaped = threading.Event()
        self.go = threading.Event()
        self.kills_after_reap: list[int] = []
        real_handle, real_kill = subprocess.Popen._handle_exitstatus, os.kill

        def handle_exitstatus(popen: subprocess.Popen[bytes], *args: Any, **kwargs: Any) -> None:
            if popen.pid == self.child_pid and not self.reaped.is_set():
                self.reaped.set()
                self.go.wait(10)
            real_handle(popen, *args, **kwargs)

        def kill(pid: int, sig: int) -> None:
            if self.reaped.is_set() and pid == self.child_pid:
                self.kills_after_reap.append(sig)
            real_kill(pid, sig)

        monkeypatch.setattr(subprocess.Popen, "_handle_exitstatus", handle_exitstatus)
        monkeypatch.setattr(os, "kill", kill)


def _close_while_reaped(log: _SignalLog, start: Any, close: Any) -> list[BaseException]:
    """Run ``start`` (a start whose child ends at once) on a thread; once its ``_ended`` has
    reaped the child (held in that window), ``close`` on another thread; then let the reap
    finish. Returns what ``start`` raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            start()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            raised.append(exc)

    user = threading.Thread(target=run, name="test-user")
    user.start()
    assert log.reaped.wait(30), "the child was never reaped"
    closer = threading.Thread(target=close, name="test-closer")
    closer.start()
    closer.join(0.5)  # (the old code signalled here; the new one waits for the reap's end)
    log.go.set()
    closer.join(10)
    user.join(10)
    assert not closer.is_alive() and not user.is_alive()
    return raised


@pytest.fixture(params=["pidfd", "by pid"])
def signalled(request: pytest.FixtureRequest, monkeypatch) -> str:
    """How ``Child.kill`` signals: through a pidfd where the platform has one, else (a kernel
    before 5.3, a seccomp filter: patched here) by pid under the ``Child``'s lock. Regression
    (diff review s40 r2): on a host with pidfds the tests below took only the pidfd's way, and
    a fallback that signalled a reaped pid (``poll`` not under the lock) passed them."""
    if request.param == "by pid":
        monkeypatch.setattr(grammar_process, "_pidfd_open", lambda pid: None)
    elif not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open here")
    return request.param


def test_a_grammar_compiler_close_never_signals_a_reaped_pid(signalled: str, monkeypatch) -> None:
    process = CompilerProcess("{}", 0, argv=EXITS_AT_ONCE, start_timeout_s=30)
    log = _SignalLog(monkeypatch)
    real_start_child = grammar_process.start_child

    def spawn(*args: Any, **kwargs: Any) -> Any:
        child = real_start_child(*args, **kwargs)
        log.child_pid = child.pid
        return child

    monkeypatch.setattr(grammar_process, "start_child", spawn)
    raised = _close_while_reaped(log, process.start, process.close)
    assert len(raised) == 1 and isinstance(raised[0], CompilerDied), raised
    assert log.kills_after_reap == [], f"close() sent {log.kills_after_reap} to pid {log.child_pid} after its reap"
    assert process.proc is None


def test_a_render_child_close_never_signals_a_reaped_pid(signalled: str, tokenizer: Any, monkeypatch) -> None:
    from services import render_process

    process = RenderProcess(tokenizer, argv=EXITS_AT_ONCE, start_timeout_s=30)
    log = _SignalLog(monkeypatch)
    real_start_child = render_process.start_child

    def spawn(*args: Any, **kwargs: Any) -> Any:
        child = real_start_child(*args, **kwargs)
        log.child_pid = child.pid
        return child

    monkeypatch.setattr(render_process, "start_child", spawn)
    raised = _close_while_reaped(log, process.start, process.close)
    assert len(raised) == 1 and isinstance(raised[0], RenderFailed), raised
    assert log.kills_after_reap == [], f"close() sent {log.kills_after_reap} to pid {log.child_pid} after its reap"
    assert process.proc is None


def test_a_child_dropped_unreaped_leaves_no_descriptor_open(tmp_path) -> None:
    """A ``Child`` killed and waited for but never reaped (``reap`` closes its pipes and pidfd),
    then dropped: its pidfd is closed with it (a finalizer), as ``Popen`` closes its pipes.
    Regression (a7a7181): the pidfd stayed open for the node process's life."""
    from cache_node.grammar_process import child_env, start_child

    def open_fds() -> int:  # pidfds only: other threads of a suite worker (zmq, gRPC, Ray) open and
        # close descriptors meanwhile (the s40 final CI counted one fewer than before the test)
        return _fd_targets().count("anon_inode:[pidfd]")

    _wait_for_stderr_threads()  # (an earlier test's child's: each closes its pipe as it ends)
    before = open_fds()
    child = start_child(NEVER_READY, str(tmp_path), child_env(os.environ), "test")
    child.kill()
    assert child.wait(10) == -signal.SIGKILL
    del child
    gc.collect()
    deadline = time.monotonic() + 5  # (its stderr thread closes the stderr pipe as it ends)
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds() == before, f"{open_fds() - before} pidfd(s) left open: {_fd_targets()}"


def _wait_for_stderr_threads(timeout_s: float = 5.0) -> None:
    """Until no child's stderr thread (``grammar_process._forward_stderr``) runs: each closes a
    pipe when it ends, which counted against this test's descriptors as it ran."""
    deadline = time.monotonic() + timeout_s
    while any("-stderr-" in t.name for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)


def _fd_targets() -> list[str]:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own)
            pass
    return sorted(targets)


READY_THEN_EXITS = (sys.executable, "-c", """
import os, sys, time
from cache_node.grammar_worker import frame, read_frame_blocking
read_frame_blocking(sys.stdin.buffer, 1 << 30)  # its init frame
sys.stdout.buffer.write(frame(["ready", "none"]))
sys.stdout.buffer.flush()
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
os._exit(0)
""")
"""A compiler child that says ready, then ends (unasked, as one past its memory cap does) once
the file named by its first argument exists."""


def test_a_compile_never_reads_the_cpu_time_of_its_childs_pid_once_another_thread_reaped_it(
        tmp_path, monkeypatch) -> None:
    """A compile's CPU-time reads (``/proc/<pid>/stat``) are of its child alone: its child ends
    as the compile reads it, another thread (``Grammars.stats``: ``CompilerProcess.pid``) polls
    it meanwhile, and the read still finds the child not reaped (its pid its own), the reap
    waiting for the read's end. Regression (diff review s40 r2): the read was by pid and
    unguarded, so the other thread's reap ran first and the compile read a free pid (with the
    pid reused, another process's CPU time taken as its compile's: past the limit, the spec
    refused as too slow). The compile then fails as its child's end (``CompilerDied``)."""
    go = tmp_path / "exit-now"
    process = CompilerProcess("{}", 0, argv=(*READY_THEN_EXITS, str(go)), start_timeout_s=60)
    reads: list[tuple[int, bool]] = []  # (pid read, its child reaped then)
    real_cpu_seconds = grammar_process.cpu_seconds

    def cpu_seconds(pid: int) -> float | None:
        child = process.proc
        if child is not None and pid == child.pid and not reads:  # the compile's first read
            go.touch()
            deadline = time.monotonic() + 30
            while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                assert time.monotonic() < deadline, "the child did not end"
                time.sleep(0.01)
            stats = threading.Thread(target=lambda: process.pid, name="test-stats")  # (it reaps the ended child)
            stats.start()
            stats.join(1.0)  # (the old code: reaped here; the new one waits for this read's end)
            reads.append((pid, child.returncode is not None))
        elif child is not None and pid == child.pid:
            reads.append((pid, child.returncode is not None))
        return real_cpu_seconds(pid)

    try:
        process.start()
        monkeypatch.setattr(grammar_process, "cpu_seconds", cpu_seconds)
        with pytest.raises(CompilerDied, match="ended"):
            process.compile("regex", "[ab]+", 5.0)
    finally:
        process.kill()
    assert reads, "the compile read no CPU time of its child"
    reaped_reads = [pid for pid, reaped in reads if reaped]
    assert not reaped_reads, f"the compile read /proc/{reaped_reads[0]}/stat after that pid's child was reaped"
    assert process.proc is None
