"""Calls for a cache node's step thread are answered or refused, never left waiting.

Regressions (s41 review of 73ff1b0):
- an admin call made after ``CacheNode.shutdown`` (``close_session``, ``flush_by_tier``,
  ``integrity_stats``, ``recovery_report``) never returned: ``_between_steps`` checked only
  ``failure`` and queued it for a step thread that had stopped;
- a queued call that raised a BaseException ended the step loop, and the calls run before it in
  the same batch (their answers held until the stats refresh) and those queued after it were
  never answered.
A real plain ``CacheNode`` (SmolLM2, no Ray).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from services.cache_node import CacheNode
from services.config import NodeConfig

ANSWER_BOUND_S = 2.0  # a refusal is immediate; the old code never answered


class StepKiller(BaseException):
    """Not an Exception: what a KeyboardInterrupt or SystemExit in a queued call is."""


def _node(**config: object) -> CacheNode:
    return CacheNode("n0", NodeConfig(kv_pool_bytes=8 << 20, host_bytes=0, **config), num_threads=1)


def test_calls_after_shutdown_are_refused_at_once() -> None:
    node = _node()
    node.shutdown()

    async def ask(call: object) -> str:
        with pytest.raises(RuntimeError) as refused:
            await asyncio.wait_for(call, ANSWER_BOUND_S)  # type: ignore[arg-type]
        return str(refused.value)

    async def run() -> list[str]:
        return [await ask(node.close_session(session_id="t/s1", tenant="t")),
                await ask(node.flush_by_tier(spill_timeout_s=1.0)),
                await ask(node.integrity_stats()),
                await ask(node.recovery_report())]

    start = time.monotonic()
    assert asyncio.run(run()) == ["cache node n0 is shut down; retry on another node"] * 4
    assert time.monotonic() - start < ANSWER_BOUND_S
    node.end_tenant("t")  # a data-plane command queued for the step thread: refused, does not raise
    assert not node._admin


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # StepKiller, on purpose
def test_a_call_raising_a_base_exception_strands_no_caller() -> None:
    """Batch: gate (holds the step thread until the rest are queued), a close of an unknown
    session (answered -1), a call raising StepKiller (RuntimeError naming it), an
    ``integrity_stats`` queued after it (refused as the step loop ends), then a close asked
    once it ended (refused at once); the node is unhealthy then, naming it. Before: the first close and
    ``integrity_stats`` timed out."""
    node = _node()
    started, release = threading.Event(), threading.Event()

    def kill() -> None:
        raise StepKiller("queued call")

    async def killer() -> None:
        await node._between_steps(kill)

    async def run() -> list[object]:
        gate = node._between_steps(lambda: started.set() or release.wait(5.0))
        assert await asyncio.to_thread(started.wait, ANSWER_BOUND_S)  # the step thread runs the gate
        calls = [asyncio.ensure_future(c) for c in (node.close_session(session_id="t/none", tenant="t"),
                                                      killer(), node.integrity_stats())]
        await asyncio.sleep(0)  # each task, in this order, has queued its call behind the gate
        assert len(node._admin) == 3
        release.set()
        await asyncio.wait_for(gate, ANSWER_BOUND_S)
        answers = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), ANSWER_BOUND_S)
        node._thread.join(ANSWER_BOUND_S)
        late = await asyncio.gather(asyncio.wait_for(node.close_session(session_id="t/s1", tenant="t"),
                                                     ANSWER_BOUND_S), return_exceptions=True)
        return [a if not isinstance(a, BaseException) else f"{type(a).__name__}: {a}" for a in answers + late]

    try:
        answers = asyncio.run(run())
        health = asyncio.run(node.health())
    finally:
        node.shutdown()
    failed = re.compile(r"RuntimeError: error id [0-9a-f]{12}: cache node n0: step loop failed: StepKiller: "
                        r"queued call")
    assert answers[:2] == [-1, "RuntimeError: cache node n0: the call ended its step loop: StepKiller: queued call"]
    assert all(failed.fullmatch(a) for a in answers[2:]), answers[2:]
    # Regression (s41 review r9): the loop ended so left ``failure`` empty and ``health`` healthy
    # (the gateways' monitors kept routing requests that never started).
    assert not health["healthy"] and "StepKiller" in health["failure"], health


def test_a_failed_node_refuses_calls_before_and_after_its_shutdown() -> None:
    """A step loop that failed (``inject_step_fault``) refuses with its ``failure``, and still
    does once the node is shut down (its failure loop has exited)."""
    node = _node(fault_injection=True)
    node.inject_step_fault()
    deadline = time.monotonic() + ANSWER_BOUND_S
    while not node.failure and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "injected step fault" in node.failure

    async def refusal() -> str:
        with pytest.raises(RuntimeError) as refused:
            await asyncio.wait_for(node.close_session(session_id="t/s1", tenant="t"), ANSWER_BOUND_S)
        return str(refused.value)

    before = asyncio.run(refusal())
    node.shutdown()
    assert before == asyncio.run(refusal()) == node.failure
