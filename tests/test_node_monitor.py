"""The gateway's ``NodeMonitor`` against a scheduler and nodes it only calls (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from services import data_plane
from services.global_scheduler import GlobalScheduler
from services.node_monitor import NodeMonitor
from tests.known_tenants import know_tenants


def _remote(fn: Any) -> SimpleNamespace:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return SimpleNamespace(remote=call)


def _health(down: dict[str, str]) -> dict[str, Any]:
    """The scheduler's ``health`` answer: one process all along, and the nodes it holds down."""
    return {"pid": 7, "restarts": 0, "data_address": "", "down": dict(down)}


class _Node:
    """A node that answers its health poll healthy, from the process it was described with."""

    def __init__(self) -> None:
        self.health = _remote(lambda wait_s: {"healthy": True, "failure": "", "pid": 41, "restarts": 0,
                                              "data_address": "tcp://127.0.0.1:9"})


class _Streams:
    def __init__(self) -> None:
        self.reconnected: list[str] = []

    def reconnect(self, node_id: str, address: str) -> None:
        self.reconnected.append(node_id)

    def fail_node(self, node_id: str, reason: str) -> None:
        raise AssertionError("the node never went down here")


def test_a_node_the_scheduler_holds_down_rejoins_from_a_monitor_that_never_saw_it_go(tmp_path) -> None:
    """Regression (diff review): a gateway that reported a node down and died before its
    ``node_up`` came back taking the node for healthy (its ``describe()``), so no monitor ever
    reported it up again: the scheduler kept it out of routing for good, and every turn of its
    sessions was refused ``session_node_down``. Now a monitor starts from the scheduler's
    view and reports the node up at its first healthy answer; its sessions go on there."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), "t1")
    assert sched.admit("t1", "t1/a", session_id="t1/s").node_id == "n0"  # its session lives on n0
    sched.release("t1/a", finished)
    sched.node_down("n0", "did not answer within 15 s")  # the dead gateway's last word
    assert sched.admit("t1", "t1/b", session_id="t1/s").reason == "session_node_down"
    scheduler = SimpleNamespace(down_nodes=_remote(sched.down_nodes), node_up=_remote(sched.node_up),
                                node_down=_remote(sched.node_down), health=_remote(lambda: _health(sched.down)))
    streams = _Streams()
    healthy: list[int] = []

    async def run() -> None:
        monitor = NodeMonitor({"n0": _Node()}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=healthy.append, poll_s=0.05, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        for _ in range(200):
            if not sched.down:
                break
            await asyncio.sleep(0.01)
        monitor.stop()

    asyncio.run(run())
    assert not sched.down and streams.reconnected == ["n0"] and healthy[-1] == 1
    back = sched.admit("t1", "t1/c", session_id="t1/s")
    assert (back.code, back.continues_session) == ("OK", True)  # the same process: history there


def test_a_dead_scheduler_makes_the_gateway_unhealthy_and_fails_admissions_at_once() -> None:
    """Regression (review 23b, F2): after the scheduler's process died the gateway's health
    stayed SERVING, a Generate waiting for its admission waited the whole 30 s and was told to
    retry in 1 s, and later calls ended UNKNOWN. Now the monitor's poll of the scheduler gets
    Ray's ``ActorDiedError``: the healthy count is 0 (``on_change``), the admission waiting on a
    scheduler that no longer answers ends UNAVAILABLE at once with ``SCHEDULER_DOWN`` and no
    retry hint, and so does the next call, before anything is sent."""
    import grpc
    import ray.exceptions

    from kvstrata.v1 import inference_pb2
    from services.gateway import InferenceServicer, input_from_pb
    from services.ray_errors import SCHEDULER_DOWN
    from tenants.model import Tenant, TenantSpec
    from tests.gateway_harness import NODE_INFO
    from tests.grpc_context import Refused
    from tests.test_gateway_stream_bounds import Auth, Plane
    from tests.test_gateway_wire_values import Trailing

    class Silent(Plane):
        async def _answer(self, sock: Any) -> None:  # the admissions are never answered
            while True:
                self.admitted.append(data_plane.unpack((await sock.recv_multipart())[1])["req"]["request_id"])

    polls = []

    async def health() -> dict[str, Any]:
        polls.append(1)
        if len(polls) > 1:
            raise ray.exceptions.ActorDiedError()
        return _health({})

    async def run() -> None:
        plane = await Silent().start()
        scheduler = SimpleNamespace(down_nodes=_remote(dict), health=SimpleNamespace(remote=health),
                                    release=SimpleNamespace(remote=lambda request_id, usage=None: None))
        auth = Auth()
        servicer = InferenceServicer(scheduler, auth, {"n0": None}, {"n0": {**NODE_INFO, "data_address": plane.node_address}},
                                     None, plane.sched_address)
        plane.streams = servicer.streams  # the plane's own was never started
        await servicer.streams.start()
        pb = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]),
                                           sampling=inference_pb2.SamplingParams(max_tokens=2))

        async def generate() -> tuple[Refused, Trailing, float]:
            context = Trailing()
            context.trailing = ()
            auth.tenant_of[id(context)] = Tenant("a1", TenantSpec(name="ann"), 0.0)
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(Refused) as refused:
                await servicer.generate(context, lambda: input_from_pb(pb)).__anext__()
            return refused.value, context, asyncio.get_running_loop().time() - t0

        healthy: list[int] = []
        monitor = NodeMonitor({"n0": _Node()}, {"n0": {"pid": 41, "restarts": 0}}, servicer.streams, scheduler,
                              on_change=healthy.append, poll_s=0.3, timeout_s=1.0, retry_s=0.01)
        waiting = asyncio.ensure_future(generate())
        for _ in range(500):  # its admission reached the scheduler's socket: it waits for an answer
            if plane.admitted:
                break
            await asyncio.sleep(0.01)
        monitor.start()
        try:
            refused, context, waited_s = await asyncio.wait_for(waiting, 5)
            assert plane.admitted and not waiting.cancelled()
            assert (refused.code, str(refused), waited_s < 3) == (grpc.StatusCode.UNAVAILABLE, SCHEDULER_DOWN, True)
            assert context.trailing == ()  # no retry hint: retrying cannot help
            sent = len(plane.admitted)
            refused, _, waited_s = await generate()
            assert (refused.code, str(refused), waited_s < 1) == (grpc.StatusCode.UNAVAILABLE, SCHEDULER_DOWN, True)
            assert len(plane.admitted) == sent and monitor.num_healthy() == 0 and healthy[-1] == 0
        finally:
            monitor.stop()
            plane.close()

    asyncio.run(run())


@pytest.mark.parametrize("restarting", [False, True], ids=["dead", "restarting"])
def test_the_http_api_answers_a_dead_actor_with_a_503_error_body(restarting: bool) -> None:
    """Regression (review 23b, F2): over the HTTP API a call whose scheduler call failed with
    Ray's ``ActorDiedError`` was a 500 in plain text ("Internal Server Error"); it is now
    UNAVAILABLE's 503 with an OpenAI error body naming ``PROCESS_UNREACHABLE``. Regression
    (bench.chaos ``kill_scheduler``): one failed with ``ActorUnavailableError`` (Ray restarts
    the scheduler) had no ``Retry-After``, unlike the gRPC API's admissions; it has 1 s now,
    and a dead-for-good actor's has none."""
    import json

    import ray.exceptions

    from services.openai_api.app import OpenAIEdge, create_app
    from services.ray_errors import PROCESS_UNREACHABLE

    async def tenant(context: Any) -> Any:
        if restarting:
            raise ray.exceptions.ActorUnavailableError("The actor is temporarily unavailable", None)
        raise ray.exceptions.ActorDiedError()

    edge = OpenAIEdge(servicer=SimpleNamespace(auth=SimpleNamespace(tenant=tenant)), model_id="m@0:f16",  # type: ignore[arg-type]
                      encode=list, num_healthy=lambda: 1)
    app = create_app(edge)
    sent: list[dict] = []

    async def run() -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "path": "/v1/models", "raw_path": b"/v1/models", "query_string": b"", "scheme": "http",
                 "headers": [(b"authorization", b"Bearer k")], "client": ("203.0.113.9", 5000),
                 "server": ("127.0.0.1", 8000), "root_path": ""}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert sent[0]["status"] == 503 and body["error"]["message"] == PROCESS_UNREACHABLE
    headers = dict(sent[0]["headers"])
    assert (headers.get(b"retry-after"), headers.get(b"retry-after-ms")) == ((b"1", b"1000") if restarting else (None, None))


def test_aclose_ends_a_watch_that_let_a_cancel_pass() -> None:
    """Python 3.11's ``wait_for`` drops a cancel that lands as its call completes, and the
    watch polled on after ``stop`` (found by the gateway-restart tests: a failed start left a
    NodeMonitor of its own running). A poll that swallows one cancel stands for it here:
    ``aclose`` cancels again until every watch has ended, and ``stop`` is sticky."""
    swallowed = []

    async def health(wait_s: float) -> dict[str, Any]:
        try:
            await asyncio.sleep(wait_s)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(1)  # the cancel is lost once
        return {"healthy": True, "failure": "", "pid": 41, "restarts": 0, "data_address": "tcp://127.0.0.1:9"}

    async def down_nodes() -> dict[str, str]:
        return {}

    scheduler = SimpleNamespace(down_nodes=SimpleNamespace(remote=down_nodes), health=_remote(lambda: _health({})))

    async def run() -> bool:
        node = SimpleNamespace(health=SimpleNamespace(remote=health))
        monitor = NodeMonitor({"n0": node}, {"n0": {"pid": 41, "restarts": 0}}, _Streams(), scheduler, poll_s=0.2)
        monitor.start()
        await asyncio.sleep(0.05)
        await asyncio.wait_for(monitor.aclose(), 5)
        return all(task.done() for task in monitor._tasks) and monitor.stopped

    assert asyncio.run(run()) and swallowed == [1]


class _SchedulerStreams(_Streams):
    """``_Streams`` with the scheduler's side of ``NodeStreams``, recording each call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def scheduler_failed(self, reason: str, restarting: bool = False) -> None:
        self.calls.append(("failed", reason, restarting))

    def scheduler_recovered(self) -> None:
        self.calls.append(("recovered",))

    def reconnect_scheduler(self, address: str) -> None:
        self.calls.append(("reconnect", address))


def test_a_restarted_scheduler_is_rejoined_and_the_gateway_serves_again() -> None:
    """Regression: the scheduler was never restarted and the monitor took it for down for good.
    Now its admission connection closing fails admissions at once with a retry hint
    (``scheduler_failed(..., restarting=True)``) and health is 0; when it answers from a new
    process (Ray restarted it) the gateway connects to its new admission socket, attaches again
    (``on_scheduler_back``), takes down the node the restarted scheduler holds down (it rejoins
    at its next healthy answer: ``node_up``) and serves again."""
    from services.ray_errors import SCHEDULER_RESTARTING

    process = {"pid": 7, "restarts": 0, "data_address": "tcp://127.0.0.1:9001", "down": {}}
    ups: list[str] = []
    backs: list[int] = []

    async def back() -> None:
        backs.append(1)

    scheduler = SimpleNamespace(health=_remote(lambda: dict(process)), down_nodes=_remote(dict),
                                node_up=_remote(lambda node_id, inbox, pid=0, previous_pid=0, restarts=-1, previous_restarts=-1: ups.append(node_id)),
                                node_down=_remote(lambda node_id, reason: None))
    streams = _SchedulerStreams()
    healthy: list[int] = []

    async def wait(predicate: Any) -> None:
        for _ in range(300):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not within 3 s")

    async def run() -> NodeMonitor:
        monitor = NodeMonitor({"n0": _Node()}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=healthy.append, poll_s=0.05, timeout_s=1.0, retry_s=0.01)
        monitor.on_scheduler_back = back
        monitor.start()
        await wait(lambda: monitor.scheduler_identity == (7, 0))
        process.update(pid=8, restarts=1, data_address="tcp://127.0.0.1:9002", down={"n0": "did not report"})
        streams.on_scheduler_disconnect()  # its process died: at once, before any poll
        assert monitor.num_healthy() == 0 and healthy[-1] == 0
        await wait(lambda: not monitor.scheduler_failure and ups)
        await wait(lambda: monitor.num_healthy() == 1)
        monitor.stop()
        return monitor

    monitor = asyncio.run(run())
    assert streams.calls[:3] == [("failed", SCHEDULER_RESTARTING, True), ("reconnect", "tcp://127.0.0.1:9002"),
                                 ("recovered",)]
    assert backs == [1] and ups == ["n0"] and monitor.scheduler_identity == (8, 1)


async def _until(predicate: Any, what: str, within_s: float = 3.0) -> None:
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {within_s:g} s: {what}")


_SOUND = {"healthy": True, "failure": "", "pid": 41, "restarts": 0, "data_address": "tcp://127.0.0.1:9"}
_BAD_NODE_ANSWERS = {
    "none": None, "a list": [True], "no pid": {"healthy": True}, "restarts a str": {**_SOUND, "restarts": "0"},
    "pid a bool": {**_SOUND, "pid": True}, "pid negative": {**_SOUND, "pid": -1},
    "healthy a str": {**_SOUND, "healthy": "yes"}, "failure an int": {**_SOUND, "failure": 5},
    "address not tcp": {**_SOUND, "data_address": "http://127.0.0.1:9"},
    "address too long": {**_SOUND, "data_address": "tcp://" + "a" * 300},
}


class _ScriptedNode:
    """A node whose health poll answers ``answer`` (set by the test) after 10 ms; ``served``:
    every answer it gave, in order."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.served = answer, []

        async def health(wait_s: float) -> Any:
            await asyncio.sleep(0.01)
            self.served.append(self.answer)
            return self.answer

        async def open_data_plane() -> str:
            return "tcp://127.0.0.1:9"

        self.health, self.open_data_plane = SimpleNamespace(remote=health), SimpleNamespace(remote=open_data_plane)


class _RecordingScheduler(SimpleNamespace):
    """The scheduler's side a node watch calls: ``node_down`` and ``node_up`` recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        super().__init__(calls=self.calls, down_nodes=_remote(dict), health=_remote(lambda: _health({})),
                         node_down=_remote(lambda node_id, reason: self.calls.append(("down", node_id, reason))),
                         node_up=_remote(
                             lambda node_id, inbox, pid=0, previous_pid=0, restarts=-1, previous_restarts=-1:
                             self.calls.append(("up", node_id, inbox, pid, previous_pid, restarts, previous_restarts))))


class _FailingStreams(_Streams):
    def __init__(self) -> None:
        super().__init__()
        self.failed: list[tuple[str, str]] = []

    def fail_node(self, node_id: str, reason: str) -> None:
        self.failed.append((node_id, reason))


@pytest.mark.parametrize("bad", list(_BAD_NODE_ANSWERS.values()), ids=list(_BAD_NODE_ANSWERS))
def test_a_malformed_node_answer_is_a_failed_poll_and_the_watch_goes_on(bad: Any) -> None:
    """Regression (review 25a A): the node watch read the answer outside its ``try``; one
    malformed answer ended it for good, so the node's later failure (``healthy: False``) was
    never reported and the scheduler kept routing every tenant to a failed node. Now the
    malformed answer is a failed poll (the node is down, "malformed health answer", counted)
    and the watch goes on: the node rejoins at its next sound answer and its failure is
    reported."""
    node, scheduler, streams = _ScriptedNode(dict(_SOUND)), _RecordingScheduler(), _FailingStreams()
    healthy: list[int] = []

    async def run() -> NodeMonitor:
        monitor = NodeMonitor({"n0": node}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=healthy.append, poll_s=0.01, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        try:
            await _until(lambda: node.served, "a first answer")
            node.answer = bad
            await _until(lambda: ("down", "n0", "cache node n0: malformed health answer") in scheduler.calls,
                         "node_down for the malformed answer")
            assert streams.failed == [("n0", "cache node n0: malformed health answer")] and monitor.num_healthy() == 0
            node.answer = dict(_SOUND)
            await _until(lambda: monitor.num_healthy() == 1, "the node back at its sound answer")
            node.answer = {**_SOUND, "healthy": False, "failure": "step loop failed: boom"}
            await _until(lambda: ("down", "n0", "step loop failed: boom") in scheduler.calls, "node_down for its failure")
            assert not monitor._tasks[0].done()
        finally:
            await monitor.aclose()
        return monitor

    monitor = asyncio.run(run())
    assert [c[0] for c in scheduler.calls] == ["down", "up", "down"] and healthy[-1] == 0
    assert monitor.state["n0"].bad_answers >= 1 and monitor.state["n0"].failure == "step loop failed: boom"


@pytest.mark.parametrize("bad", [None, {"healthy": True}, {**_SOUND, "restarts": "0"}], ids=["none", "no pid", "restarts a str"])
def test_a_node_that_answered_malformed_rejoins_after_a_restart(bad: Any) -> None:
    """Regression (review 25a A): after one malformed answer the node watch was gone, so a node
    whose process then died and came back (Ray restarted it) was never reported up again: its
    capacity was lost for as long as the gateway ran. Now it rejoins from its new process."""
    node, scheduler, streams = _ScriptedNode(dict(_SOUND)), _RecordingScheduler(), _FailingStreams()

    async def run() -> NodeMonitor:
        monitor = NodeMonitor({"n0": node}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              poll_s=0.01, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        try:
            await _until(lambda: node.served, "a first answer")
            node.answer = bad
            await _until(lambda: bad in node.served, "the malformed answer")
            node.answer = {**_SOUND, "pid": 42, "restarts": 1, "data_address": "tcp://127.0.0.1:10"}
            streams.on_disconnect("n0")  # its process died: at once
            await _until(lambda: monitor.num_healthy() == 1 and monitor.state["n0"].pid == 42, "the node back")
        finally:
            await monitor.aclose()
        return monitor

    asyncio.run(run())
    assert ("up", "n0", "tcp://127.0.0.1:10", 42, 41, 1, 0) in scheduler.calls
    assert streams.reconnected[-1] == "n0"


_SCHEDULER_SOUND = {"pid": 7, "restarts": 0, "data_address": "tcp://127.0.0.1:9001", "down": {}}
_BAD_SCHEDULER_ANSWERS = {
    "none": None, "no restarts": {"pid": 7}, "pid a str": {**_SCHEDULER_SOUND, "pid": "x"},
    "restarts negative": {**_SCHEDULER_SOUND, "restarts": -1}, "down a list": {**_SCHEDULER_SOUND, "down": ["n0"]},
    "down to an int": {**_SCHEDULER_SOUND, "down": {"n0": 5}},
    "address an int": {**_SCHEDULER_SOUND, "data_address": 5},
    "address not tcp": {**_SCHEDULER_SOUND, "data_address": "udp://127.0.0.1:9"},
}


@pytest.mark.parametrize("bad", list(_BAD_SCHEDULER_ANSWERS.values()), ids=list(_BAD_SCHEDULER_ANSWERS))
def test_a_malformed_scheduler_answer_is_asked_again_and_a_restart_still_serves_again(bad: Any) -> None:
    """Regression (review 25a A): the scheduler watch read the answer outside its ``try``; one
    malformed answer ended it, and after the scheduler's next restart the gateway stayed
    NOT_SERVING, refusing every tenant's admissions UNAVAILABLE until the gateway itself
    restarted. Now the answer is logged, counted and asked again after ``retry_s``; the
    restarted scheduler is rejoined and the gateway serves again."""
    answer: dict[str, Any] = {"now": dict(_SCHEDULER_SOUND)}
    served: list[Any] = []

    def health() -> Any:
        served.append(answer["now"])
        return answer["now"]

    scheduler = SimpleNamespace(health=_remote(health), down_nodes=_remote(dict), node_up=_remote(lambda node_id, inbox, pid=0, previous_pid=0, restarts=-1, previous_restarts=-1: None),
                                node_down=_remote(lambda node_id, reason: None))
    streams = _SchedulerStreams()
    healthy: list[int] = []

    async def run() -> NodeMonitor:
        monitor = NodeMonitor({"n0": _Node()}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=healthy.append, poll_s=0.01, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        try:
            await _until(lambda: monitor.scheduler_identity == (7, 0), "the first answer")
            answer["now"] = bad
            await _until(lambda: served.count(bad) >= 2, "the malformed answer, asked again")
            answer["now"] = {**_SCHEDULER_SOUND, "pid": 8, "restarts": 1, "data_address": "tcp://127.0.0.1:9002"}
            streams.on_scheduler_disconnect()  # it restarts: its admission connection closes
            assert monitor.num_healthy() == 0
            await _until(lambda: not monitor.scheduler_failure and monitor.num_healthy() == 1, "serving again")
        finally:
            await monitor.aclose()
        return monitor

    monitor = asyncio.run(run())
    assert ("reconnect", "tcp://127.0.0.1:9002") in streams.calls and streams.calls[-1] == ("recovered",)
    assert monitor.scheduler_identity == (8, 1) and monitor.scheduler_bad_answers >= 2 and healthy[-1] == 1


def test_a_turn_that_raises_ends_no_watch() -> None:
    """Whatever else fails in a turn of a watch (here the gateway's ``on_change`` raising once,
    as the node goes down) is logged and the watch goes on: the node still rejoins."""
    node, scheduler, streams = _ScriptedNode(dict(_SOUND)), _RecordingScheduler(), _FailingStreams()
    raised: list[int] = []

    def on_change(num_healthy: int) -> None:
        if not raised:
            raised.append(num_healthy)
            raise RuntimeError("a bug in a health callback")

    async def run() -> NodeMonitor:
        monitor = NodeMonitor({"n0": node}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=on_change, poll_s=0.01, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        try:
            await _until(lambda: node.served, "a first answer")
            node.answer = {**_SOUND, "healthy": False, "failure": "step loop failed: boom"}
            await _until(lambda: raised, "the failing callback")
            node.answer = dict(_SOUND)
            await _until(lambda: monitor.num_healthy() == 1, "the node back")
        finally:
            await monitor.aclose()
        return monitor

    asyncio.run(run())
    assert [c[0] for c in scheduler.calls] == ["down", "up"] and raised == [0]


def test_health_answers_are_checked_field_by_field() -> None:
    """The checkers keep what they pass bounded: free text cut to ``MAX_TEXT_CHARS``, only the
    known fields, an unopened inbox ("") allowed."""
    from services.data_plane_wire import MAX_TEXT_CHARS
    from services.node_monitor import MAX_DOWN_NODES, down_map, node_answer, scheduler_answer
    from services.recovery_report import BadReport

    checked = node_answer({**_SOUND, "failure": "x" * 10_000, "data_address": "", "extra": [1]})
    assert len(checked["failure"]) == MAX_TEXT_CHARS and checked["data_address"] == "" and "extra" not in checked
    assert scheduler_answer({**_SCHEDULER_SOUND, "down": {"n0": "y" * 10_000}})["down"]["n0"][-1] == "\u2026"
    for bad in ({str(i): "" for i in range(MAX_DOWN_NODES + 1)}, {"n" * 2000: "why"}, {1: "why"}):
        with pytest.raises(BadReport):
            down_map(bad, "down")
