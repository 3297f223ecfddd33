"""A dead gateway's requests on the real data plane (CURVE sockets, a real CacheNode on the
tiny Llama, the GlobalScheduler's admission server, two gateways' ``NodeStreams``), without
Ray: the scheduler hears that a gateway is gone (``gateway_gone``, what its watch of the
gateway actor calls) and must release its slots and have the nodes abort its streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from cache_node.sampling_params import SamplingParams
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants
from tests.loop_plane import LoopPlane, call, wait_for

PROMPT = tuple(range(100, 140))


def request(rid: str, max_tokens: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


class Plane(LoopPlane):
    """A node, the scheduler and two gateways (``a``, ``b``) on one event loop thread."""

    def __init__(self) -> None:
        super().__init__(16, "kvstrata-gone-")
        know_tenants(self.scheduler, "t")
        self.a, self.b = (NodeStreams({"n0": None}, {"n0": self.node_address}, self.sched_address,
                                      security=self.keys.security("gateway")) for _ in range(2))
        self.run(self.a.start())
        self.run(self.b.start())

    def start(self, gateway: NodeStreams, rid: str, max_tokens: int) -> asyncio.Queue[dict[str, Any]]:
        """Admit ``rid`` through ``gateway`` and wait for its first token; its event queue."""
        async def go() -> asyncio.Queue[dict[str, Any]]:
            queue = gateway.open(rid)
            adm = await gateway.admit(request(rid, max_tokens), [])
            assert adm.code == "OK", adm
            while (await asyncio.wait_for(queue.get(), 60))["type"] != "delta":
                pass
            return queue

        return self.run(go())

    def in_flight(self) -> int:
        return self.run(call(self.scheduler.stats))["in_flight"]["n0"]

    async def close_gateways(self) -> None:
        self.a.shutdown()
        self.b.shutdown()


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def test_a_dead_gateways_requests_are_released_once_and_aborted_on_the_node(plane: Plane) -> None:
    """issue 18 (reliability suite, gateway kill): the scheduler freed a node slot only when
    the gateway that admitted the request called ``release``, and the node kept generating for
    a gateway that was gone: a dead gateway's requests stayed counted for good. Now: its 3
    slots are released at once, the node aborts its 3 streams and frees their blocks, the
    other gateway's request runs on, counted once; a late ``release`` of a dead gateway's id
    (reused by the live gateway) does not free the live one's slot; an admission still on its
    way from the dead gateway is refused UNAVAILABLE."""
    for i in range(3):
        plane.start(plane.a, f"t/a{i}", max_tokens=600)
    live = plane.start(plane.b, "t/b0", max_tokens=600)
    assert plane.in_flight() == 4

    released = plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))

    assert sorted(released) == ["t/a0", "t/a1", "t/a2"]
    assert plane.in_flight() == 1 and set(plane.scheduler.requests) == {"t/b0"}
    assert plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber)) == []  # idempotent
    # the abort ran on the node's loop, then on its step thread: ``stats`` is a snapshot taken
    # every 0.1 s at most, which could still show one request running from before the 4 started
    # (seen in a loop under load: 't/a0'..'t/a2' still in _streams); ``integrity_stats`` is taken
    # at the next step boundary, after the aborts queued so far
    wait_for(lambda: set(plane.node._streams) == {"t/b0"}, 5.0)
    assert plane.run(plane.node.integrity_stats())["running"] == 1
    assert plane.run(asyncio.wait_for(live.get(), 10))["type"] == "delta"  # b's stream runs on

    # the same client id again, from the live gateway, then the dead one's late release
    plane.start(plane.b, "t/a0", max_tokens=600)
    assert plane.in_flight() == 2
    plane.run(call(plane.scheduler.release, "t/b0"))
    assert plane.in_flight() == 1 and set(plane.scheduler.requests) == {"t/a0"}
    refused = plane.run(plane.a.admit(request("t/a9", 4), []))
    assert (refused.code, plane.in_flight()) == ("UNAVAILABLE", 1)

    plane.run(call(plane.scheduler.gateway_gone, plane.b.subscriber))
    assert plane.in_flight() == 0 and plane.scheduler.requests == {} and plane.scheduler.request_gateways == {}
    wait_for(lambda: not plane.node._streams, 5.0)  # the abort ran on the node's loop (as above)
    stats = plane.run(plane.node.integrity_stats())
    assert stats["running"] == stats["waiting"] == 0, stats
    assert stats["integrity_ok"], stats
    assert stats["num_blocks"] - stats["free_blocks"] - stats["cached_blocks"] == 0, stats


class StepGate:
    """Holds the node's step thread at one point of its loop (``where``: "turn_end", its
    ``_publish_stats`` after a step; "admin", its between-steps calls, after it took the
    aborts queued so far) until ``release``: what the loop does meanwhile lands in one turn."""

    def __init__(self, plane: Plane, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        node = plane.node
        if where == "admin":
            node._admin.append((self._hold, concurrent.futures.Future()))
            node._wake.set()
        else:
            publish = node._publish_stats

            def held() -> None:
                publish()
                if not self.released.is_set():
                    self._hold()

            monkeypatch.setattr(node, "_publish_stats", held)
        assert self.entered.wait(30), "the step thread never reached the gate"

    def _hold(self) -> None:
        self.entered.set()
        self.released.wait(30)

    def release(self) -> None:
        self.released.set()


@pytest.mark.parametrize("where", ["turn_end", "admin"])
def test_an_id_reused_as_its_aborted_request_leaves_the_engine_gets_its_own_stream(
        plane: Plane, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen in a loaded clean-clone CI (the test above, 60 s without a first token): a request
    whose id is that of a request the node aborted (its gateway gone) reached the node before
    the step thread was done with the old one. "turn_end": the old one's abort output (the next
    step's) took the new stream out of ``_streams`` and ended it with ``finished``/abort, and
    the new request ran unseen; "admin": the new one was added to the engine while the old one
    was still there (INVALID_ARGUMENT, a duplicate id). Now the new request starts once the
    engine is done with the old one, and only its own outputs reach its stream."""
    plane.start(plane.a, "t/a0", max_tokens=600)
    gate = StepGate(plane, where, monkeypatch)
    try:
        plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))
        wait_for(lambda: "t/a0" not in plane.node._streams, 10.0)  # the abort ran on the node's loop
        queue = plane.b.open("t/a0")
        adm = plane.run(plane.b.admit(request("t/a0", 600), []))
        assert adm.code == "OK", adm
        wait_for(lambda: "t/a0" in plane.node._streams, 10.0)  # the new stream is registered
    finally:
        gate.release()

    async def first_events() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in ("delta", "finished", "error"):
            events.append(await asyncio.wait_for(queue.get(), 20))
        return events

    events = plane.run(first_events())
    assert [e["type"] for e in events] == ["started", "delta"], events
    assert plane.run(asyncio.wait_for(queue.get(), 10))["type"] == "delta"  # and it runs on
    assert set(plane.node._streams) == {"t/a0"}


def test_a_live_gateway_counted_gone_attaches_again_and_its_requests_run(plane: Plane) -> None:
    """Regression: the scheduler's watch of a gateway once failed a poll of a gateway that still
    served (it counted it gone), and every request from that gateway was refused
    ``gateway_gone`` for as long as it ran. Now the refusal makes the gateway attach again
    (``NodeStreams.on_gone``; ``RayGateway.reattach``), the scheduler serves the inbox again,
    the admission is sent once more and its stream runs on the node."""
    plane.start(plane.a, "t/a0", max_tokens=600)
    plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))  # wrongly: a still serves
    wait_for(lambda: plane.node.stats()["running"] == 0, 5.0)
    attached = []

    async def reattach() -> bool:
        await plane.scheduler.attach_gateway("gw-a", "127.0.0.1:1", plane.a.subscriber)
        attached.append(1)
        return True

    plane.a.on_gone = reattach
    plane.start(plane.a, "t/a1", max_tokens=8)  # admitted on the second try; its first token arrives
    assert attached == [1] and plane.in_flight() == 1
    assert plane.a.subscriber not in plane.scheduler.gone_gateways
    plane.start(plane.a, "t/a2", max_tokens=8)  # no refusal now: no second attach
    assert attached == [1]


class _Told:
    """``counted_gone`` of a gateway whose first ``fail`` calls fail (its loop still stalled)."""

    def __init__(self, told: list[tuple[str, list[str]]], fail: int = 0) -> None:
        self.told, self.fail = told, fail

    def remote(self, subscriber: str, request_ids: list[str]) -> Any:
        async def record() -> bool:
            if self.fail:
                self.fail -= 1
                raise TimeoutError
            self.told.append((subscriber, request_ids))
            return True
        return record()


def told_all(plane: Plane) -> None:
    """Wait for the scheduler's ``counted_gone`` tells (tasks of their own) to end."""
    async def wait() -> None:
        while plane.scheduler._tells:
            await asyncio.gather(*list(plane.scheduler._tells))
    plane.run(asyncio.wait_for(wait(), 30))


class FlakyGateway:
    """A gateway actor handle whose ``serves.remote`` answers from a script: True/False, or an
    exception to raise."""

    def __init__(self, answers: list[Any], tell_fails: int = 0) -> None:
        self.answers = answers
        self.serves = self
        self.told: list[tuple[str, list[str]]] = []  # counted_gone calls
        self.counted_gone = _Told(self.told, tell_fails)

    def remote(self, subscriber: str, wait_s: float) -> Any:
        async def answer() -> bool:
            a = self.answers.pop(0)
            if isinstance(a, BaseException):
                raise a
            if a == "silent":  # a stopped gateway: the call is never answered
                await asyncio.Event().wait()
            return bool(a)
        return answer()


def test_the_watch_counts_a_gateway_gone_only_when_it_is(plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed poll is retried (``GATEWAY_POLL_FAILURES`` in a row count the gateway gone);
    Ray's ``ActorDiedError`` or the gateway's own "no" count at once."""
    import ray

    from services import global_scheduler_admission as admission

    monkeypatch.setattr(admission, "GATEWAY_RETRY_S", 0.0)
    watch = plane.scheduler._watch_gateway
    flaky = FlakyGateway([RuntimeError("slow"), RuntimeError("slow"), True, RuntimeError("slow"), False])
    plane.run(watch(flaky, "tcp://gw-flaky"))
    assert flaky.answers == [] and "tcp://gw-flaky" in plane.scheduler.gone_gateways  # gone at its "no"
    assert flaky.told == []  # it answered "no": it serves another inbox, nothing to tell

    down = FlakyGateway([RuntimeError("x")] * admission.GATEWAY_POLL_FAILURES + [True])
    plane.run(watch(down, "tcp://gw-down"))
    told_all(plane)
    assert down.answers == [True] and "tcp://gw-down" in plane.scheduler.gone_gateways
    assert down.told == [("tcp://gw-down", [])]  # it may still run: told, with what was released

    # review 29a F3: a stopped gateway's poll never returned, so it never counted as gone
    monkeypatch.setattr(admission, "GATEWAY_POLL_S", 0.05)
    monkeypatch.setattr(admission, "GATEWAY_ANSWER_SLACK_S", 0.05)
    stopped = FlakyGateway(["silent"] * admission.GATEWAY_POLL_FAILURES + [True])
    plane.run(asyncio.wait_for(watch(stopped, "tcp://gw-stopped"), 10))
    told_all(plane)
    assert stopped.answers == [True] and "tcp://gw-stopped" in plane.scheduler.gone_gateways
    assert len(stopped.told) == 1  # it may run again: told (within its own bound)

    dead = FlakyGateway([ray.exceptions.ActorDiedError(), True])
    plane.run(watch(dead, "tcp://gw-dead"))
    assert dead.answers == [True] and "tcp://gw-dead" in plane.scheduler.gone_gateways
    assert dead.told == []


def test_a_gateway_still_stalled_at_the_first_tell_is_told_once_it_answers(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s40 security hunt): a gateway counted gone because its loop stalled past its
    watch's polls was told which requests were released once, within ``GATEWAY_POLL_S``; one
    still stalled then was never told, and the streams of its released requests (stopped on
    their nodes without an event) waited for ever once it ran again. The tell is tried again
    until the gateway answers (``GATEWAY_TELL_TRIES``), on a task of its own."""
    from services import global_scheduler_admission as admission

    monkeypatch.setattr(admission, "GATEWAY_RETRY_S", 0.0)
    queue = plane.start(plane.a, "t/a0", max_tokens=600)
    stalled = FlakyGateway([RuntimeError("stalled")] * admission.GATEWAY_POLL_FAILURES, tell_fails=2)
    plane.run(plane.scheduler._watch_gateway(stalled, plane.a.subscriber))
    told_all(plane)
    assert stalled.told == [(plane.a.subscriber, ["t/a0"])]  # at its third try (before: never)
    # what the gateway then does with it (``RayGateway.counted_gone``): the stream ends
    assert plane.a.fail_requests(stalled.told[0][1], "stopped: send it again") == 1

    async def end_event() -> dict[str, Any]:
        while (event := await asyncio.wait_for(queue.get(), 10))["type"] == "delta":
            pass
        return event

    assert plane.run(end_event())["code"] == "UNAVAILABLE"


class _StandInMethod:
    """A method of a Ray actor handle in a process that could not load the actor's class: Ray
    checks a call's arguments in the caller (``ActorMethod._remote``: ``signature.flatten_args``)
    against the stand-in class it then keeps (``FunctionActorManager._create_fake_actor_class``)
    before the call leaves; a call that passes reaches the real gateway, whose method
    (``RayGateway``'s) must take those arguments too, and answers with ``answer``."""

    def __init__(self, name: str, answer: Any) -> None:
        from ray._common import signature
        from ray._private.function_manager import FunctionActorManager

        from services.gateway_server import RayGateway

        stand_in = FunctionActorManager._create_fake_actor_class(None, "RayGateway", [name], "import failed")
        self.flatten = signature.flatten_args
        self.stand_in = signature.extract_signature(getattr(stand_in, name), ignore_first=True)
        self.real = inspect.signature(getattr(RayGateway, name))
        self.answer = answer

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        self.flatten(self.stand_in, args, kwargs)  # TypeError, as Ray's, before the call leaves
        bound = self.real.bind(None, *args, **kwargs)  # (None: self)
        return self.answer(*list(bound.arguments.values())[1:])


def test_the_watch_reaches_a_gateway_whose_class_this_process_could_not_load(plane: Plane) -> None:
    """Regression (s40 security hunt, a live ``kvstrata up``): the scheduler's process had
    failed once to import the gateway's module (its files changed on disk under it), so Ray
    checked each call on the gateway's handle against a stand-in whose methods take keywords
    only: every positional ``serves`` poll failed in the scheduler (``TypeError: too many
    positional arguments``), the live gateway was counted gone a few seconds after each attach
    with its requests in flight released, and the ``counted_gone`` telling it failed the same
    way, so their clients waited with no answer (one HTTP call over 10 minutes). The watch
    calls with keywords: its polls reach the gateway, which stays until its own "no"."""
    answers = [True, True, False]
    told: list[tuple[str, list[str]]] = []

    async def serves(subscriber: str, wait_s: float) -> bool:
        return answers.pop(0)

    async def counted_gone(subscriber: str, request_ids: list[str]) -> bool:
        told.append((subscriber, request_ids))
        return True

    handle = SimpleNamespace(serves=_StandInMethod("serves", serves),
                             counted_gone=_StandInMethod("counted_gone", counted_gone))
    plane.run(asyncio.wait_for(plane.scheduler._watch_gateway(handle, "tcp://gw-stand-in"), 30))
    assert answers == []  # every poll reached the gateway (before: none did)
    assert "tcp://gw-stand-in" in plane.scheduler.gone_gateways  # at its own "no" only
    # and a tell reaches it (``_tell_counted_gone``, after polls that failed)
    plane.run(plane.scheduler._tell_counted_gone(handle, "tcp://gw-stand-in", ["t/x"]))
    assert told == [("tcp://gw-stand-in", ["t/x"])]


def test_a_gone_inbox_in_use_again_keeps_its_socket(plane: Plane) -> None:
    """The node closes its socket to a gone gateway's inbox on its step thread, later than the
    abort: when the gateway has attached again and a new request of it already streams there,
    closing the socket (linger 0) would drop that request's events. It is kept then."""
    queue = plane.start(plane.a, "t/a0", max_tokens=400)
    sock = plane.node._pusher._socks[plane.a.subscriber]
    plane.node._gone_subscribers.append(plane.a.subscriber)  # as if the abort_subscriber came first
    plane.node._wake.set()
    wait_for(lambda: not plane.node._gone_subscribers, 5.0)
    assert plane.node._pusher._socks.get(plane.a.subscriber) is sock  # not closed (and reopened)
    assert plane.run(asyncio.wait_for(queue.get(), 10))["type"] == "delta"  # still streaming


def test_a_live_gateway_counted_gone_ends_its_stopped_streams(plane: Plane) -> None:
    """Review 21b, G1: counted as gone while it ran, a gateway's requests were released and
    stopped on the node without an event: their streams waited for ever. Told which requests
    were released (``RayGateway.counted_gone``), it ends them with UNAVAILABLE."""
    queue = plane.start(plane.a, "t/a0", max_tokens=600)
    released = plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))
    assert released == ["t/a0"]
    assert plane.a.fail_requests([*released, "t/unknown"], "stopped: send it again") == 1

    async def end_event() -> dict[str, Any]:
        while (event := await asyncio.wait_for(queue.get(), 10))["type"] == "delta":
            pass
        return event

    event = plane.run(end_event())
    assert (event["type"], event["code"]) == ("error", "UNAVAILABLE") and "send it again" in event["message"]


def test_a_stale_attach_with_a_restarted_gateways_old_inbox_is_ignored(plane: Plane) -> None:
    """Review 21b, G2: a late attach carrying the inbox a gateway had before Ray restarted it
    revived that dead inbox and counted the live one as gone (its streams aborted)."""
    sched = plane.scheduler
    plane.run(sched.attach_gateway("gw-r", "127.0.0.1:9", "tcp://old-inbox"))
    plane.run(sched.attach_gateway("gw-r", "127.0.0.1:9", "tcp://new-inbox"))  # restarted
    assert "tcp://old-inbox" in sched.gone_gateways
    assert plane.run(sched.attach_gateway("gw-r", "127.0.0.1:9", "tcp://old-inbox")) == ""  # stale
    assert "tcp://old-inbox" in sched.gone_gateways and "tcp://new-inbox" not in sched.gone_gateways
    assert sched.gateways["gw-r"].subscriber == "tcp://new-inbox"
