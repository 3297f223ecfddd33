"""The global scheduler tells a gateway it counted gone with one call while that call is only
unanswered (``GlobalSchedulerService._tell_counted_gone``), without Ray: a handle whose calls
are answered as a stalled gateway's are, once its loop runs again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services import global_scheduler_admission as admission
from services.global_scheduler_admission import GlobalSchedulerService


class StalledGateway:
    """``counted_gone`` of a gateway whose loop is stalled: every call sent is queued (as Ray
    queues an actor call the caller stopped waiting for) and answered at ``resume``; the
    first ``fail`` calls fail at once instead (a call Ray could not deliver)."""

    def __init__(self, fail: int = 0) -> None:
        self.counted_gone = self
        self.sent: list[tuple[str, list[str]]] = []
        self.queued: list[asyncio.Future[bool]] = []
        self.fail = fail

    def remote(self, subscriber: str, request_ids: list[str]) -> Any:
        self.sent.append((subscriber, request_ids))
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self.fail:
            self.fail -= 1
            answer.set_exception(ConnectionError("not delivered"))
        else:
            self.queued.append(answer)
        return asyncio.shield(answer)  # as a Ray ref's wait: cancelling it does not cancel the call

    def resume(self) -> None:
        for answer in self.queued:
            answer.set_result(True)


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "GATEWAY_POLL_S", 0.02)
    monkeypatch.setattr(admission, "GATEWAY_RETRY_S", 0.0)


def test_a_tell_unanswered_is_awaited_again_not_sent_again() -> None:
    """Regression (s40 diff review r4 of f3fcdd0): each try past ``GATEWAY_POLL_S`` sent a new
    ``counted_gone``; Ray runs every one of them once the gateway's loop runs again, so a
    gateway stalled for minutes got up to ``GATEWAY_TELL_TRIES`` at once (each ending the
    same streams, attaching again and logging). Now the one call is awaited until it answers;
    a call that failed is sent again."""
    async def go() -> StalledGateway:
        gateway = StalledGateway(fail=2)
        tell = asyncio.ensure_future(GlobalSchedulerService._tell_counted_gone(gateway, "tcp://gw", ["t/a0"]))
        await asyncio.sleep(0.3)  # ~15 tries' bounds pass
        assert not tell.done()
        gateway.resume()
        await asyncio.wait_for(tell, 5)
        return gateway

    gateway = asyncio.run(go())
    assert gateway.sent == [("tcp://gw", ["t/a0"])] * 3  # 2 failed, then 1 awaited until answered


def test_a_tell_given_up_stops_waiting_and_leaves_the_call_to_run() -> None:
    async def go() -> StalledGateway:
        gateway = StalledGateway()
        await asyncio.wait_for(GlobalSchedulerService._tell_counted_gone(gateway, "tcp://gw", ["t/a0"]), 10)
        assert not asyncio.all_tasks() - {asyncio.current_task()}  # none of it left pending
        return gateway

    gateway = asyncio.run(go())
    assert len(gateway.sent) == 1 and not gateway.queued[0].cancelled()
