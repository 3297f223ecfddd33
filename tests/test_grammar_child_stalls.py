"""A grammar compiler process that stops reading, or is killed from outside, costs a request a
bounded wait and a retryable refusal (review 29a F1, F4); real compiler processes.

- F1: the request frame is written under the compile's own deadline (``CompilerProcess._write``:
  the CPU-time limit and ``WALL_LIMIT_FACTOR`` times it of wall time), as its reply is read; so
  is a new process's ``init`` frame, under ``start_timeout_s``. A stopped (or starved) child
  reads nothing of a frame larger than the pipe's buffer (64 KiB): the compile ends at the wall
  bound, refused as the node's load (RESOURCE_EXHAUSTED, retry hint), its process killed, and
  the compile thread serves the next compile.
  Regression: the write was a blocking ``stdin.write`` before any deadline; the compile thread
  (and with both stuck, every tenant's structured requests on the node) waited until SIGCONT.
- F4: a child killed by SIGKILL or SIGTERM mid-compile (an operator, the OOM killer) refuses the
  request UNAVAILABLE, not remembered: the same tenant's retry compiles. A death by another
  signal (SIGABRT, SIGSEGV: the memory cap, a crash on the spec) stays the spec's failure.
  Regression: every death was the spec's (INVALID_ARGUMENT, its tenant refused for 60 s).
- The node's metrics count the ready compiler processes by sandbox state.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import pytest

from cache_node.grammar_compile import GrammarUnavailable
from cache_node.grammar_process import WALL_LIMIT_FACTOR, CompilerDied, CompilerProcess, cpu_seconds
from cache_node.grammar_stats import SANDBOX_STATES
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars

TIMEOUT_S = 1.0
BOUND_S = TIMEOUT_S * WALL_LIMIT_FACTOR
SLACK_S = 5.0

BIG_REGEX = "(" + "a" * 65531 + ")|b"  # 65,535 bytes: a frame past the pipe's 64 KiB
BIG_CHOICE = json.dumps([f"{i}" + "\u00e9" * 120 for i in range(256)], ensure_ascii=False)  # ~190 KB as a grammar


@pytest.fixture(scope="module")
def tokenizer(grammar_tokenizer: Any) -> Any:
    return grammar_tokenizer


def _ready(g: Any, slot: int = 0) -> int:
    """Compile a trivial regex, wait until process ``slot`` is ready; its pid."""
    g.compile(StructuredOutputSpec("regex", "[ab]"), "warm").result(timeout=180)
    deadline = time.monotonic() + 180
    while not (g.processes[slot] is not None and g.processes[slot].ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = g.processes[slot].pid
    assert pid is not None
    return pid


LARGE_SPECS = (StructuredOutputSpec("regex", BIG_REGEX), StructuredOutputSpec("choice", BIG_CHOICE))
"""A 65,535-byte regex, and a choice of non-ASCII strings (its frame's bytes, not its characters,
fill the pipe)."""


def test_stopped_children_refuse_large_requests_as_the_nodes_load_within_the_wall_bound(tokenizer) -> None:
    """Each of ``LARGE_SPECS`` sent at once to its own stopped child (two compile threads): each
    is refused within the wall bound, each child killed, and each thread compiles the next spec
    on a fresh process. (One test: the two specs ran one after the other, each waiting the whole
    bound in a ``Grammars`` of its own.)"""
    g = make_grammars(tokenizer, timeout_s=TIMEOUT_S, workers=2)
    pids: list[int] = []
    try:
        pids = [_ready(g, 0), _ready(g, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        futures = [g.compile(spec, f"tenant{i}") for i, spec in enumerate(LARGE_SPECS)]
        for future in futures:
            with pytest.raises(GrammarUnavailable) as refused:
                future.result(timeout=BOUND_S + 30)  # (the old code: still waiting here)
            took = time.monotonic() - started
            assert refused.value.code == "RESOURCE_EXHAUSTED" and refused.value.retry_after_s > 0, refused.value
            assert "too busy" in str(refused.value)
            assert BOUND_S - 0.5 <= took <= BOUND_S + SLACK_S, took
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z"  # killed (reaped: gone)
        assert g.stats()["failed_specs"] == 0  # not remembered against the spec
        # both compile threads are free: each started a fresh process, and they compile the next specs
        assert {_ready(g, 0), _ready(g, 1)}.isdisjoint(pids)
        for future in [g.compile(StructuredOutputSpec("regex", "[x-z]+"), "tenantC"),
                       g.compile(StructuredOutputSpec("regex", "[u-w]+"), "tenantD")]:
            future.result(timeout=180)
    finally:
        for pid in pids:
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGCONT)
        g.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_child_that_never_reads_its_init_frame_fails_its_start_within_start_timeout_s() -> None:
    """The ``init`` frame (~1.6 MB of tokenizer info for a real model) is written within
    ``start_timeout_s`` too: a child that reads nothing fails its start at that bound."""
    process = CompilerProcess("x" * (2 << 20), 0, argv=(sys.executable, "-c", "import time; time.sleep(60)"),
                              start_timeout_s=0.5)  # (the frame fills the pipe whatever the child does)
    started = time.monotonic()
    try:
        with pytest.raises(CompilerDied, match="did not start within 0.5 s"):
            process.start()
        assert time.monotonic() - started < 0.5 + SLACK_S
        assert process.proc is None  # killed and reaped
    finally:
        process.kill()


SLOW_REGEX = "[a-z0-9]{1,%d}@[a-z]{1,300}"


def _compile_then_signal(g: Any, spec: StructuredOutputSpec, signum: int) -> BaseException | None:
    """Compile ``spec`` for tenantA on a ready process and send it ``signum`` once it has spent
    0.3 s of CPU time on it; what the future raised."""
    pid = _ready(g)
    cpu_start = cpu_seconds(pid)
    future = g.compile(spec, "tenantA")
    deadline = time.monotonic() + 60
    while (cpu_seconds(pid) or 0.0) - (cpu_start or 0.0) < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not future.done(), "the compile ended before the signal: make SLOW_REGEX slower"
    os.kill(pid, signum)
    return future.exception(timeout=60)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_child_killed_from_outside_mid_compile_is_the_nodes_failure_not_remembered(tokenizer, signum) -> None:
    g = make_grammars(tokenizer, timeout_s=60.0, workers=1)
    spec = StructuredOutputSpec("regex", SLOW_REGEX % 3000)
    try:
        exc = _compile_then_signal(g, spec, signum)
        assert isinstance(exc, GrammarUnavailable), repr(exc)
        assert exc.code == "UNAVAILABLE", exc.code
        assert f"killed by signal {int(signum)}" in str(exc)
        assert g.stats()["failed_specs"] == 0
        assert g.stats()["compiles"]["compiler_died"] == 1
        # the same tenant's retry compiles (not refused at once as a failed spec)
        assert g.compile(spec, "tenantA").result(timeout=180) is not None
    finally:
        g.close()


def test_a_child_crashing_mid_compile_stays_the_specs_failure(tokenizer) -> None:
    """SIGABRT (a crash, the memory cap's abort): INVALID_ARGUMENT, remembered for its tenant."""
    g = make_grammars(tokenizer, timeout_s=60.0, workers=1)
    spec = StructuredOutputSpec("regex", SLOW_REGEX % 3000)
    try:
        exc = _compile_then_signal(g, spec, signal.SIGABRT)
        assert isinstance(exc, ValueError) and not isinstance(exc, GrammarUnavailable), repr(exc)
        assert "failed on it" in str(exc)
        again = g.compile(spec, "tenantA")
        assert again.done() and "refused without compiling" in str(again.exception())
    finally:
        g.close()


def test_the_node_metrics_count_compiler_processes_by_sandbox_state(tokenizer) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from services.metrics.node import NodeMetrics

    g = make_grammars(tokenizer, workers=2)
    try:
        _ready(g, 0)
        _ready(g, 1)
        stats = g.stats()
        assert set(stats["compiler_sandbox"]) == set(SANDBOX_STATES)
        assert sum(stats["compiler_sandbox"].values()) == 2
        expected = {state: sum(p.sandbox_state == state for p in g.processes) for state in SANDBOX_STATES}
        assert stats["compiler_sandbox"] == expected

        class Families:  # NodeMetrics' grammar families alone (its other families need an engine's stats)
            def collect(self) -> Any:
                return NodeMetrics._grammar_families(metrics, stats)

        metrics = NodeMetrics.__new__(NodeMetrics)
        metrics.node_id = "n0"
        registry = CollectorRegistry()
        registry.register(Families())
        samples = {s.labels["sandbox"]: s.value
                   for f in text_string_to_metric_families(generate_latest(registry).decode())
                   for s in f.samples if s.name == "kvstrata:grammar_compiler_processes_by_sandbox"}
        assert samples == {state: float(n) for state, n in expected.items()}
    finally:
        g.close()
