"""A health poll of the global scheduler that fails with an error is no silence (review 29o F7).

Before: ``NodeMonitor._scheduler_turn`` counted every exception but Ray's actor errors and a
malformed answer as an unanswered poll, so a scheduler whose ``health`` failed at once (a task
error: the method raised) or a poll refused on its way was held silent after ``silent_polls``
such polls, ``retry_s`` apart (~0.5 s with the defaults): "has not answered for 1 s", gRPC
health NOT_SERVING, and every call that needed the scheduler refused UNAVAILABLE, although it
had answered. Now only a poll with no answer within its deadline counts; Ray's word that the
process died or is restarting (``RayActorError``, ``ActorDiedError``) is handled as before.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray.exceptions

from services.node_monitor import SCHEDULER_SILENT, NodeMonitor
from services.ray_errors import SCHEDULER_DOWN, SCHEDULER_RESTARTING


def _task_error() -> BaseException:
    """What awaiting a call whose actor method raised gives in Ray: a ``RayTaskError`` that is
    also the method's own exception type."""
    cause = RuntimeError("health failed inside the scheduler")
    return ray.exceptions.RayTaskError("health", "Traceback: ...", cause).as_instanceof_cause()


class _Scheduler:
    """A scheduler handle whose ``health`` does what ``mode`` says: raise ``error`` at once when
    awaited, refuse at ``.remote()`` (raise there), or never answer."""

    def __init__(self, mode: str, error: BaseException | None = None) -> None:
        self.mode, self.error, self.polls = mode, error, 0
        self.health = SimpleNamespace(remote=self._remote)

    def _remote(self) -> Any:
        self.polls += 1
        if self.mode == "refused":
            raise ray.exceptions.PendingCallsLimitExceededError("too many pending calls to the actor")
        return self._answer()

    async def _answer(self) -> Any:
        if self.mode == "silent":
            await asyncio.Event().wait()
        assert self.error is not None
        raise self.error


async def _watch(scheduler: _Scheduler, seconds: float) -> tuple[NodeMonitor, list[tuple[str, bool]]]:
    failed: list[tuple[str, bool]] = []
    streams = SimpleNamespace(scheduler_failed=lambda reason, restarting: failed.append((reason, restarting)),
                              on_disconnect=None, on_scheduler_disconnect=None)
    monitor = NodeMonitor({}, {}, streams, scheduler, poll_s=0.05, timeout_s=0.1, retry_s=0.05)
    monitor.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        await monitor.aclose()
    return monitor, failed


@pytest.mark.parametrize("mode", ["task_error", "refused", "plain_error"])
def test_a_poll_that_fails_with_an_error_is_no_silence(mode: str) -> None:
    error = {"task_error": _task_error(), "plain_error": ValueError("a refused call"), "refused": None}[mode]
    scheduler = _Scheduler("refused" if mode == "refused" else "error", error)
    monitor, failed = asyncio.run(_watch(scheduler, 1.5))
    assert scheduler.polls >= 10  # asked again every retry_s: 2 of them held it silent before
    assert failed == [] and monitor.scheduler_failure == "" and monitor.scheduler_silence() == ""
    assert monitor.scheduler_error_answers == scheduler.polls


def test_a_poll_with_no_answer_still_counts_as_silence() -> None:
    start = time.monotonic()
    monitor, failed = asyncio.run(_watch(_Scheduler("silent"), 1.2))
    assert time.monotonic() - start < 5
    assert failed and failed[0][0].startswith(SCHEDULER_SILENT.split("{")[0]), failed
    assert getattr(monitor, "scheduler_error_answers", 0) == 0


@pytest.mark.parametrize(("error", "reason", "restarting"), [
    (ray.exceptions.ActorDiedError(), SCHEDULER_DOWN, False),
    (ray.exceptions.ActorUnavailableError("restarting", None), SCHEDULER_RESTARTING, True),
])
def test_rays_word_that_the_process_died_is_still_unreachable(error: BaseException, reason: str,
                                                              restarting: bool) -> None:
    """A dead actor is another state than a failing one: down for good (``ActorDiedError``) or
    restarting, the calls that need it refused, as before."""
    monitor, failed = asyncio.run(_watch(_Scheduler("error", error), 0.5))
    assert failed[0] == (reason, restarting), failed
    assert getattr(monitor, "scheduler_error_answers", 0) == 0 and monitor.scheduler_silence() == ""
