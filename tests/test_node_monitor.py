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
    from tests.test_gateway_stream_bounds import Auth, Plane, Refused
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
                                    release=SimpleNamespace(remote=lambda *a: None))
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
                                node_up=_remote(lambda node_id, *a: ups.append(node_id)),
                                node_down=_remote(lambda *a: None))
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
