"""A gateway's admissions to a global scheduler that takes nothing (its process hung: stopped,
deadlocked, a frozen VM; alive for Ray, so nothing restarts it) end at their deadline, at the
scheduler's failure, or at its restart, never later (review s34 B F1).

The gateway's ``DEALER`` to the scheduler queues ~1,000 messages (ZeroMQ's send high-water
mark) plus what the kernel's socket buffers take; past that a send waits. Before, that send was
awaited before the admission's deadline started: every admission past the ~1,000th waited in
it as long as the hang lasted (holding its call and its request body), ``scheduler_failed`` did
not end it, and ``reconnect_scheduler`` ended it with a bare CancelledError. Here the scheduler
is a real ``ROUTER`` that reads nothing (receive high-water mark 1), and the gateway side the
real ``NodeStreams``; 20,000-token prompts (~60 KB each) fill the kernel's buffers with a few
hundred of them, so 1,400 admissions are past everything the pipe takes.
"""

from __future__ import annotations

import asyncio
import time

import zmq

from cache_node.sampling_params import SamplingParams
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest
from services.ray_errors import SchedulerRestarting

PROMPT = tuple(range(1, 20_001))
ADMISSIONS = 1400


def _request(i: int) -> NodeRequest:
    return NodeRequest(request_id=f"r{i}", tenant="t", cache_namespace="ns", token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=1))


def _deaf_router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A ``ROUTER`` like the scheduler's that never reads: what a hung scheduler is to its peers."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 1)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


async def _ended(tasks: list[asyncio.Task], within_s: float) -> dict[str, int]:
    """How ``tasks`` ended (exception type names), asserting that all did within ``within_s``."""
    _, pending = await asyncio.wait(tasks, timeout=within_s)
    assert not pending, f"{len(pending)} of {len(tasks)} admissions still waiting after {within_s} s"
    kinds: dict[str, int] = {}
    for task in tasks:
        name = type(task.exception()).__name__ if task.exception() is not None else "admitted"
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def test_admissions_to_a_scheduler_that_takes_nothing_end_at_deadline_failure_or_restart() -> None:
    ctx = zmq.Context()
    router, address = _deaf_router(ctx)
    other, other_address = _deaf_router(ctx)

    async def go() -> None:
        streams = NodeStreams({}, {}, address, admit_timeout_s=1.0, security=None)
        await streams.start()
        try:
            began = time.monotonic()
            tasks = [asyncio.create_task(streams.admit(_request(i), [])) for i in range(ADMISSIONS)]
            # each waits admit_timeout_s at most, its send included (the loop's start-up lag aside)
            assert await _ended(tasks, within_s=6.0) == {"TimeoutError": ADMISSIONS}
            assert time.monotonic() - began < 8.0

            streams.admit_timeout_s = 60.0  # the pipe stays full: these wait in their send
            tasks = [asyncio.create_task(streams.admit(_request(i), [])) for i in range(200)]
            await asyncio.sleep(0.3)
            streams.scheduler_failed("the scheduler did not answer its health checks", restarting=True)
            assert await _ended(tasks, within_s=2.0) == {"SchedulerRestarting": 200}
            streams.scheduler_recovered()

            tasks = [asyncio.create_task(streams.admit(_request(i), [])) for i in range(200)]
            await asyncio.sleep(0.3)
            streams.reconnect_scheduler(other_address)  # restarted by Ray at a new address
            assert await _ended(tasks, within_s=2.0) == {"SchedulerRestarting": 200}
            assert all("retry" in str(t.exception()) for t in tasks)
            assert isinstance(tasks[0].exception(), SchedulerRestarting)
        finally:
            streams.shutdown()

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        router.close()
        other.close()
        ctx.term()
