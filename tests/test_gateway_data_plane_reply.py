"""A gateway's start checks the scheduler's ``open_data_plane`` reply (an untrusted answer).

Regression (s39): ``Gateway.start`` connected its admission stream to whatever the scheduler's
``open_data_plane`` answered. ``None`` or a number failed deep in the start (ZeroMQ's
``connect``: TypeError), a string of no address failed there with ``ZMQError: Invalid
argument``, and bytes, ``tcp://:5``, port 0, port 70000 or a 300-digit port made a gateway
that served, every admission of it sent to a socket that never answers. Now each start fails at once with ``MalformedReply`` naming the
method and the reply, before anything is bound (the port stays free for a retry), and a true
reply still starts the gateway.

The real ``Gateway`` in-process without Ray, as in ``test_gateway_silent_peers``: the
scheduler is a real ``GlobalSchedulerService`` behind ``LocalActor``, its one method lying.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_stack import tiny_checkpoint
from services import gateway_server
from services.global_scheduler_admission import GlobalSchedulerService
from services.scheduler_replies import MalformedReply
from tests.gateway_harness import LocalActor
from tests.test_gateway_restart_start import FakeNode, free_port, grpc_serving, is_free

pytestmark = pytest.mark.timeout(60)

LIES = (None, 5, b"tcp://127.0.0.1:5", "garbage", "tcp://127.0.0.1", "tcp://:5", "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000", "tcp://h:" + "9" * 300)


class LyingDataPlane:
    """A real scheduler whose ``open_data_plane`` opens its socket and answers ``lie`` instead."""

    def __init__(self, scheduler: GlobalSchedulerService, lie: Any) -> None:
        self.scheduler, self.lie = scheduler, lie

    async def open_data_plane(self) -> Any:
        await self.scheduler.open_data_plane()
        return self.lie

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


async def _start(tmp_path: Path, lie: Any, port: int) -> BaseException | None:
    """One start against a scheduler answering ``lie``; its exception (None: it served)."""
    sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    handle = LocalActor(LyingDataPlane(sched, lie)) if lie is not True else LocalActor(sched)
    gw = gateway_server.Gateway(handle, {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()))
    try:
        await asyncio.wait_for(gw.start("127.0.0.1", port), 20)
        assert await grpc_serving(port)
        return None
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        return exc
    finally:
        await gw.stop(0)
        sched.close_data_plane()
        sched.store.close()


def test_a_malformed_open_data_plane_reply_fails_the_start_naming_it(tmp_path: Path) -> None:
    """Each lie: the start raises ``MalformedReply`` naming ``open_data_plane`` and the reply,
    and leaves the gRPC port free; the true reply serves. Before: a TypeError / ZMQError from
    deep in the start, or a gateway that served on a garbage address (None raised)."""

    async def go() -> list[tuple[Any, str]]:
        outcomes = []
        for lie in (*LIES, True):
            port = free_port()
            exc = await _start(tmp_path, lie, port)
            outcomes.append((lie, "served" if exc is None else f"{type(exc).__name__}: {exc}"))
            assert is_free(port), (lie, "the failed start left its port bound")
        return outcomes

    outcomes = asyncio.run(go())
    for lie, outcome in outcomes[:-1]:
        assert outcome.startswith(f"{MalformedReply.__name__}: the global scheduler sent a malformed "
                                  "open_data_plane reply ("), (lie, outcome)
        assert repr(lie)[:20] in outcome, (lie, outcome)
    assert outcomes[-1] == (True, "served"), outcomes[-1]
