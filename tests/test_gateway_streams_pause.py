"""A gateway whose own event loop stalls (SIGSTOP, a VM pause, swapping, a long GC) past its
data plane's deadlines must not blame the scheduler or its clients for its own pause (helper
29h, the kind of review 29a F6).

The gateway's ``NodeStreams`` runs on its own event loop thread, stalled by a blocking sleep on
it, while a real CacheNode (the tiny Llama) and the GlobalScheduler's admission server run on
another (``tests.loop_plane``). What the other side did during the stall is seen by the gateway
a moment after it resumes, as under a SIGSTOP or a VM pause (every thread of the process
stopped, ZeroMQ's I/O thread included, or the scheduler's machine paused as well): the
deadlines, overdue, run first. Before: an admission the scheduler admitted and answered as the
pause ended was refused (``admit_timeout_s``), and a stream whose reader was mid-write to a
client that was reading was ended as "the client did not read" (``stream_idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.gateway_streams import NodeStreams
from services.loop_lag import LAG_STALL_S
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants
from tests.loop_plane import LoopPlane

ADMIT_TIMEOUT_S = 1.0
IDLE_TIMEOUT_S = 1.0
STALL_S = 2.5  # past either timeout, and past LoopLag's threshold
SEEN_DELAY_S = 0.05  # what a client did during the stall is seen this long after the resume
PAUSE_SKEW_S = 0.2  # the scheduler resumes this long after the gateway
PROMPT = tuple(range(100, 140))

assert STALL_S > max(ADMIT_TIMEOUT_S, IDLE_TIMEOUT_S) + LAG_STALL_S


def request(rid: str, max_tokens: int) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=PROMPT,
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def stall_loop(seconds: float) -> None:
    """Block the running event loop (what a SIGSTOP, a VM pause or a long GC does to it)."""
    time.sleep(seconds)


def stall_other(loop: asyncio.AbstractEventLoop, seconds: float) -> None:
    """Block ``loop`` (another thread's) for ``seconds``; returns once it is blocked."""
    began = threading.Event()

    def block() -> None:
        began.set()
        time.sleep(seconds)

    loop.call_soon_threadsafe(block)
    assert began.wait(10)


class GatewayLoop:
    """An event loop thread of its own for the gateway: stalling it leaves the plane's running."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Plane(LoopPlane):
    """Node "n0" and the scheduler on the plane's loop; a gateway (``streams``) on ``gateway``'s."""

    def __init__(self) -> None:
        super().__init__(8, "kvstrata-pause-")
        know_tenants(self.scheduler, "t")
        self.gateway = GatewayLoop()
        self.streams = NodeStreams({"n0": None}, {"n0": self.node_address}, self.sched_address,
                                   admit_timeout_s=ADMIT_TIMEOUT_S, security=self.keys.security("gateway"),
                                   stream_idle_timeout_s=IDLE_TIMEOUT_S)
        self.gateway.run(self.streams.start())

    def close(self) -> None:
        async def shutdown() -> None:
            self.streams.shutdown()

        with contextlib.suppress(Exception):
            self.gateway.run(shutdown(), 10.0)
        self.gateway.close()
        super().close()


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def test_an_admission_answered_as_the_gateway_resumes_is_served(plane: Plane) -> None:
    """A pause (past ``admit_timeout_s``) of the gateway and the scheduler both, the admission
    sent just before: the scheduler admits it and replies as the pause ends, read just after
    the gateway's deadline ran out; the reply is read in the second wait, the admission is OK
    and the stream runs to its end. Before: TimeoutError (the client got UNAVAILABLE) for a
    request the scheduler admitted."""
    streams = plane.streams

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        queue = streams.open("t/r0")
        stall_other(plane.loop, STALL_S + PAUSE_SKEW_S)  # its machine paused too: it answers after
        admission = asyncio.ensure_future(streams.admit(request("t/r0", 4), []))
        await asyncio.sleep(0)  # sent; waiting for the reply
        assert len(streams._pending) == 1 and not any(f.done() for f in streams._pending.values())
        stall_loop(STALL_S)
        adm = await admission
        events = [await asyncio.wait_for(queue.get(), 30)]
        while events[-1]["type"] not in ("finished", "error"):
            events.append(await asyncio.wait_for(queue.get(), 30))
        return adm, events

    adm, events = plane.gateway.run(go())
    assert adm.code == "OK" and adm.node_id == "n0", adm
    assert events[-1]["type"] == "finished" and events[-1]["completion_tokens"] == 4, events[-1]
    assert streams.admit_lag_waits == 1


def _silent_scheduler(ctx: Any) -> tuple[Any, str]:
    sock = ctx.socket(zmq.ROUTER)  # reads admissions and never answers
    return sock, data_plane.bind_random(sock, "127.0.0.1")


def test_a_silent_scheduler_still_fails_the_admission_within_the_bound() -> None:
    """A scheduler that never answers: the admission fails TimeoutError after
    ``admit_timeout_s``; when the gateway stalled during the wait, after one more
    ``admit_timeout_s`` (at most ``2 * admit_timeout_s`` plus the stall), not later."""
    gateway = GatewayLoop()

    async def go(stall_s: float) -> float:
        ctx = data_plane.context(asyncio_=True)
        sched, address = _silent_scheduler(ctx)
        streams = NodeStreams({}, {}, address, admit_timeout_s=ADMIT_TIMEOUT_S)
        await streams.start()
        try:
            t0 = time.monotonic()
            admission = asyncio.ensure_future(streams.admit(request("t/r1", 4), []))
            await asyncio.sleep(0)
            if stall_s:
                stall_loop(stall_s)
            with pytest.raises(asyncio.TimeoutError):
                await admission
            assert streams._pending == {} and streams.admit_lag_waits == 0
            return time.monotonic() - t0
        finally:
            streams.shutdown()
            sched.close(linger=0)
            ctx.term()

    try:
        took = gateway.run(go(0.0))
        assert ADMIT_TIMEOUT_S - 0.05 <= took <= ADMIT_TIMEOUT_S + 1.0, took
        took = gateway.run(go(STALL_S))
        assert STALL_S + ADMIT_TIMEOUT_S - 0.05 <= took <= 2 * ADMIT_TIMEOUT_S + STALL_S + 1.0, took
    finally:
        gateway.close()


def _admitted(plane: Plane, rid: str, max_tokens: int, on_idle: Any = None) -> Any:
    """Open and admit ``rid`` on the gateway's loop (to "n0"); its buffer."""
    async def go() -> Any:
        queue = plane.streams.open(rid, on_idle=on_idle)
        adm = await plane.streams.admit(request(rid, max_tokens), [])
        assert adm.code == "OK", adm
        plane.streams.bind(rid, adm.node_id)
        return queue

    return plane.gateway.run(go())


def test_a_stream_whose_client_reads_is_not_ended_idle_after_a_gateway_stall(plane: Plane) -> None:
    """The stream's reader is mid-write (a client on another thread takes each event 0.1 s
    later; its take is seen by the gateway a moment after it comes) when the gateway stalls
    past ``stream_idle_timeout_s``: the stall is not the client's, the stream runs to its end.
    Before: the idle sweep, run first on resume, ended it RESOURCE_EXHAUSTED ("the client did
    not read this stream") and aborted its request on the node."""
    queue = _admitted(plane, "t/r2", 24)
    streams, loop = plane.streams, plane.gateway.loop
    writing = threading.Event()

    def client_takes(fut: asyncio.Future[None]) -> None:  # on the client's side, then seen
        time.sleep(0.1)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(loop.call_later, SEEN_DELAY_S, _settle, fut)

    async def reader() -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] not in ("finished", "error"):
            events.append(await asyncio.wait_for(queue.get(), 30))
            written: asyncio.Future[None] = loop.create_future()
            threading.Thread(target=client_takes, args=(written,), daemon=True).start()
            writing.set()
            await written  # the write to the client, held by flow control until it reads
            writing.clear()
        return events

    async def go() -> list[dict[str, Any]]:
        task = asyncio.ensure_future(reader())
        while not writing.is_set():
            await asyncio.sleep(0.001)
        stall_loop(STALL_S)  # mid-write
        return await task

    events = plane.gateway.run(go())
    assert events[-1]["type"] == "finished", events[-1]
    assert events[-1]["completion_tokens"] == 24 and streams.idle_ends == 0


def test_a_stream_whose_client_stops_reading_is_still_ended_idle(plane: Plane) -> None:
    """A reader that takes nothing: ended RESOURCE_EXHAUSTED after ``stream_idle_timeout_s``
    of its own, the gateway's stall during that time not counted (here: ended within
    ``stream_idle_timeout_s`` + the stall + a sweep or two after its last take)."""
    ended: list[float] = []
    queue = _admitted(plane, "t/r3", 400, lambda message: ended.append(time.monotonic()))
    streams = plane.streams

    async def go() -> float:
        await asyncio.wait_for(queue.get(), 30)  # its started event; none taken after it
        t0 = time.monotonic()
        await asyncio.sleep(0.3)
        stall_loop(STALL_S)
        while not ended:
            assert time.monotonic() - t0 < IDLE_TIMEOUT_S + STALL_S + 3.0, "never ended"
            await asyncio.sleep(0.02)
        return ended[0] - t0

    took = plane.gateway.run(go())
    assert STALL_S + IDLE_TIMEOUT_S - 0.1 <= took <= STALL_S + IDLE_TIMEOUT_S + 1.5, took
    assert streams.idle_ends == 1


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# The gateway's other waits on the other side, each on a loop of its own (``asyncio.run``):
# what the other side answered during the stall is seen a moment after the resume.

DEADLINE_S = 1.0


def answered_later(value: Any, after_s: float = 0.1) -> asyncio.Future[Any]:
    """A future another thread settles with ``value`` after ``after_s``, seen by the loop
    ``SEEN_DELAY_S`` after that reaches it (a Ray actor's answer, a message in a socket)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle() -> None:
        time.sleep(after_s)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(loop.call_later, SEEN_DELAY_S, _settle_with, fut, value)

    threading.Thread(target=settle, daemon=True).start()
    return fut


def _settle_with(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


async def _stalled_wait(awaitable: Any, stall_s: float) -> tuple[Any, float]:
    """(``awaitable``'s result or exception, seconds it took), the loop stalled ``stall_s``
    just after its wait began."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(awaitable)
    await asyncio.sleep(0.02)
    if stall_s:
        stall_loop(stall_s)
    try:
        result: Any = await task
    except Exception as exc:  # noqa: BLE001 - what the test looks at
        result = exc
    return result, time.monotonic() - t0


def test_the_gateways_scheduler_calls_wait_past_its_own_stall() -> None:
    """``BoundedActor`` (every awaited call to the scheduler: key checks, CloseSession, the
    Tenant and Admin calls): an answer that came during the gateway's stall past the deadline
    is taken, not ``ActorSilent``; a scheduler that never answers is still ``ActorSilent``
    within ``2 * timeout_s`` plus the stall (``timeout_s`` without a stall)."""
    from services.actor_calls import ActorSilent, BoundedActor

    async def run() -> None:
        def remote(answers: bool) -> Any:
            return answered_later("answer") if answers else asyncio.get_running_loop().create_future()

        handle = SimpleNamespace(get_tenant=SimpleNamespace(remote=remote))
        actor = BoundedActor(handle, timeout_s=DEADLINE_S)
        result, _ = await _stalled_wait(actor.get_tenant.remote(True), STALL_S)
        assert result == "answer", result
        result, took = await _stalled_wait(actor.get_tenant.remote(False), 0.0)
        assert isinstance(result, ActorSilent) and DEADLINE_S - 0.05 <= took <= DEADLINE_S + 1.0, (result, took)
        result, took = await _stalled_wait(actor.get_tenant.remote(False), STALL_S)
        assert isinstance(result, ActorSilent) and took <= 2 * DEADLINE_S + STALL_S + 1.0, (result, took)

    asyncio.run(run())


def test_admin_calls_to_nodes_wait_past_the_gateways_own_stall() -> None:
    """``gateway_admin.ask_live`` (Flush, Drain, Stats): a node that answered during the
    gateway's stall past ``node_timeout_s`` is not reported as late (Flush and Drain
    incomplete, naming it); one that never answers still is."""
    from services.gateway_admin import ask_live

    async def run() -> None:
        nodes = {"n0": True, "n1": False}  # n1 never answers

        def call(answers: bool) -> Any:
            return answered_later({"freed": 3}) if answers else asyncio.get_running_loop().create_future()

        answers, took = await _stalled_wait(ask_live(nodes, None, call, DEADLINE_S), STALL_S)
        assert answers["n0"] == {"freed": 3}, answers
        late = [nid for nid, answer in answers.items() if isinstance(answer, asyncio.TimeoutError)]
        assert late == ["n1"] and took <= 2 * DEADLINE_S + STALL_S + 1.0, (answers, took)

    asyncio.run(run())


def test_a_grpc_calls_message_that_came_during_the_gateways_stall_is_taken() -> None:
    """``CallGate``'s wait for a call's request message (``message_timeout_s``): a message the
    client sent during the gateway's stall past the timeout is taken, not DEADLINE_EXCEEDED
    (the stall is not the client's time); a call whose message never comes still ends
    DEADLINE_EXCEEDED."""
    import grpc

    from services.grpc_bounds import GrpcLimits
    from services.grpc_call_gate import CallGate

    class Aborted(Exception):
        pass

    class Context:
        def peer(self) -> str:
            return "ipv4:10.0.0.1:5000"

        def set_trailing_metadata(self, metadata: Any) -> None:
            pass

        async def abort(self, code: grpc.StatusCode, message: str) -> None:
            raise Aborted(code, message)

    class Requests:
        def __init__(self, sends: bool) -> None:
            self.sends = sends

        def __aiter__(self) -> Requests:
            return self

        def __anext__(self) -> asyncio.Future[bytes]:
            return answered_later(b"message") if self.sends else asyncio.get_running_loop().create_future()

    limits = GrpcLimits(handshake_timeout_s=0.5, max_connection_idle_s=60.0, max_connection_age_s=60.0,
                        max_connection_age_grace_s=60.0, min_ping_interval_s=5.0, max_connections=64,
                        message_timeout_s=DEADLINE_S, max_unverified_calls=1024, max_health_watchers=1024)

    async def run() -> None:
        gate = CallGate(None, limits, frozenset())  # type: ignore[arg-type]
        result, _ = await _stalled_wait(gate._receive(Requests(True), Context(), True, "tenant"), STALL_S)
        assert result == b"message", result
        result, took = await _stalled_wait(gate._receive(Requests(False), Context(), True, "tenant"), STALL_S)
        assert isinstance(result, Aborted) and result.args[0] == grpc.StatusCode.DEADLINE_EXCEEDED, result
        assert took <= 2 * DEADLINE_S + STALL_S + 1.0 and gate.timeouts == 1, took

    asyncio.run(run())
