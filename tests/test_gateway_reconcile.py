"""A gateway's streams whose requests the scheduler released without telling it (it counted
the gateway gone while its loop stalled, or could not reach it) end UNAVAILABLE within the
gateway's reconcile period (``NodeStreams.reconcile``, asking the scheduler's
``admitted_from``), on the real data plane: CURVE sockets, a real CacheNode on the tiny Llama,
the GlobalScheduler's admission server, two gateways' ``NodeStreams``, without Ray."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from services.gateway_server import RayGateway
from services.gateway_streams import NodeStreams
from services.global_scheduler_admission import GlobalSchedulerService
from tests.known_tenants import know_tenants
from tests.loop_plane import LoopPlane, call
from tests.test_gateway_gone import request

RECONCILE_S = 0.3


class Plane(LoopPlane):
    """A node, the scheduler and two gateways (``a``, ``b``) reconciling every ``RECONCILE_S``
    with the scheduler, as ``RayGateway`` wires them (``ask_admitted``)."""

    def __init__(self) -> None:
        super().__init__(16, "kvstrata-reconcile-")
        know_tenants(self.scheduler, "t")
        self.asked: list[tuple[str, list[str]]] = []
        self.unreachable = 0  # the next this many queries fail (the scheduler not reachable)
        self.a, self.b = (NodeStreams({"n0": None}, {"n0": self.node_address}, self.sched_address,
                                      security=self.keys.security("gateway"), reconcile_s=RECONCILE_S)
                          for _ in range(2))
        for gateway in (self.a, self.b):
            gateway.ask_admitted = self._asker(gateway)
            self.run(gateway.start())

    def _asker(self, gateway: NodeStreams) -> Any:
        async def ask(request_ids: list[str]) -> list[str]:
            self.asked.append((gateway.subscriber, request_ids))
            if self.unreachable:
                self.unreachable -= 1
                raise ConnectionError("the scheduler is not reachable")
            return await call(self.scheduler.admitted_from, subscriber=gateway.subscriber, request_ids=request_ids)
        return ask

    def start(self, gateway: NodeStreams, rid: str, max_tokens: int) -> asyncio.Queue[dict[str, Any]]:
        """Admit ``rid`` through ``gateway``, bind it as the gateway's ``_attempt`` does, and
        wait for its first token; its event queue."""
        async def go() -> asyncio.Queue[dict[str, Any]]:
            queue = gateway.open(rid)
            adm = await gateway.admit(request(rid, max_tokens), [])
            assert adm.code == "OK", adm
            gateway.bind(rid, adm.node_id)
            while (await asyncio.wait_for(queue.get(), 60))["type"] != "delta":
                pass
            return queue

        return self.run(go())

    def end_event(self, queue: asyncio.Queue[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
        async def end() -> dict[str, Any]:
            while (event := await asyncio.wait_for(queue.get(), timeout_s))["type"] == "delta":
                pass
            return event

        return self.run(end())

    async def close_gateways(self) -> None:
        self.a.shutdown()
        self.b.shutdown()


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def test_a_stream_the_scheduler_released_untold_ends_within_the_reconcile_period(plane: Plane) -> None:
    """Regression (s40): the scheduler counted a live gateway gone (its polls failed: its loop
    stalled, or the scheduler could not reach it), released its requests and had the node stop
    them without an event; its tells (``counted_gone``) never reached the gateway, and its
    stream waited for ever. Now the gateway's reconcile ends it UNAVAILABLE at the second
    answer of the scheduler that misses it (two queries failed first), and leaves running
    streams, the other gateway's, as they are."""
    gone = plane.start(plane.a, "t/a0", max_tokens=600)
    live = plane.start(plane.b, "t/b0", max_tokens=600)
    plane.unreachable = 2
    released = plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))  # the watch's, untold
    assert released == ["t/a0"]
    t0 = time.monotonic()
    event = plane.end_event(gone, 10.0)
    took = time.monotonic() - t0
    assert (event["type"], event["code"]) == ("error", "UNAVAILABLE"), event
    assert "no longer runs this request" in event["message"] and "retry" in event["message"]
    assert plane.unreachable == 0 and took < 5 * RECONCILE_S + 2.0, took  # 2 failed, 2 answered
    assert plane.a.reconciled_ends == 1

    # the other gateway's stream runs on through several reconciles
    asked = len(plane.asked)
    while len(plane.asked) < asked + 4:
        assert plane.run(asyncio.wait_for(live.get(), 10))["type"] == "delta"
    assert plane.b.reconciled_ends == 0 and not plane.b._queues["t/b0"].buffer.ended
    assert any("t/b0" in ids for sub, ids in plane.asked[asked:] if sub == plane.b.subscriber)


def test_reconcile_ends_no_stream_still_running_finished_or_not_yet_admitted(plane: Plane) -> None:
    """A stream whose admission is not answered yet (not bound) is not asked about; one that
    finished keeps its ``finished`` event though the scheduler released it; one admitted and
    running is admitted at the scheduler and runs on."""
    done = plane.start(plane.a, "t/done", max_tokens=4)
    assert plane.end_event(done, 30.0)["type"] == "finished"
    plane.run(call(plane.scheduler.release, "t/done"))  # as the gateway's ``_attempt`` does at it
    running = plane.start(plane.a, "t/run", max_tokens=600)
    plane.a.open("t/waiting")  # its admission still on its way
    asked = len(plane.asked)

    assert plane.run(plane.a.reconcile()) == []
    assert any("t/run" in ids for _, ids in plane.asked[asked:])
    assert all("t/waiting" not in ids and "t/done" not in ids for _, ids in plane.asked[asked:])
    assert plane.run(asyncio.wait_for(running.get(), 10))["type"] == "delta"
    assert plane.a._queues["t/done"].finished and plane.a.reconciled_ends == 0


def test_admitted_from_answers_only_its_gateways_requests_and_checks_its_arguments(plane: Plane) -> None:
    plane.start(plane.a, "t/a0", max_tokens=600)
    plane.start(plane.b, "t/b0", max_tokens=600)
    sched = plane.scheduler
    assert sched.admitted_from(plane.a.subscriber, ["t/a0", "t/b0", "t/none"]) == ["t/a0"]
    assert sched.admitted_from("tcp://another", ["t/a0"]) == []
    bad = sched.bad_messages
    for subscriber, ids in ((plane.a.subscriber, "t/a0"), (plane.a.subscriber, [1]), (None, ["t/a0"]),
                            (plane.a.subscriber, ["t/x"] * 4097)):
        with pytest.raises(ValueError):
            sched.admitted_from(subscriber, ids)
    assert sched.bad_messages == bad + 4


def test_the_ray_gateway_asks_with_its_inbox_by_keyword() -> None:
    """``RayGateway._admitted`` calls the scheduler's ``admitted_from`` with keyword arguments
    its signature takes (a class the caller's process could not load takes keywords only)."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def remote(*args: Any, **kwargs: Any) -> list[str]:
        calls.append((args, kwargs))
        return ["t/a"]

    gateway = SimpleNamespace(streams=SimpleNamespace(subscriber="tcp://gw"),
                              scheduler_calls=SimpleNamespace(admitted_from=SimpleNamespace(remote=remote)))
    assert asyncio.run(RayGateway._admitted(gateway, ["t/a", "t/b"])) == ["t/a"]
    assert calls == [((), {"subscriber": "tcp://gw", "request_ids": ["t/a", "t/b"]})]
    inspect.signature(GlobalSchedulerService.admitted_from).bind(None, **calls[0][1])


def test_a_stream_missed_by_one_answer_only_runs_on(plane: Plane) -> None:
    """A stream the scheduler's answer misses once (a restarted scheduler that rebuilt only
    what its nodes still ran, the stream's ``finished`` event on its way) is ended only when
    the next answer misses it too; an answer that counts it admitted in between starts over."""
    running = plane.start(plane.a, "t/run", max_tokens=600)
    plane.a.reconcile_s = 1000.0  # the periodic run out of the way (its current sleep ends first)
    plane.run(asyncio.sleep(2 * RECONCILE_S))
    real = plane.a.ask_admitted

    async def missing(request_ids: list[str]) -> list[str]:
        return []

    for ask, ended in ((missing, []), (real, []), (missing, []), (missing, ["t/run"])):
        plane.a.ask_admitted = ask
        assert plane.run(plane.a.reconcile()) == ended
        if not ended:
            assert plane.run(asyncio.wait_for(running.get(), 10))["type"] == "delta"
    assert plane.end_event(running, 10.0)["code"] == "UNAVAILABLE"
