"""A cache node hands each request's end to exactly its own stream, when an abort and a new
request of the same id land meanwhile (a real CacheNode on the tiny Llama, the real data plane
with the scheduler and two gateways' ``NodeStreams``, without Ray: ``test_gateway_gone.Plane``).

The node's streams are taken out of ``_streams`` (claimed) by the step thread (a request's last
output, an error) and by the event loop (an abort, an in-process consumer leaving), and a
request's id may be reused once its stream was aborted: each claim must take its own stream
and never one of the same id opened since (``Streams._claim``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from services.cache_node_streams import _Stream
from tests.loop_plane import call, wait_for
from tests.test_gateway_gone import Plane, request


@pytest.fixture
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


class HeldHandOver(dict[str, _Stream]):
    """The node's ``_engine_streams``, holding the step thread as it takes ``request_id`` out
    (the hand-over of that request's last output, ``Streams._deliver_step``) until ``release``."""

    def __init__(self, step_thread: threading.Thread, request_id: str) -> None:
        super().__init__()
        self.step_thread, self.request_id = step_thread, request_id
        self.entered, self.released = threading.Event(), threading.Event()

    def pop(self, key: str, *default: Any) -> Any:
        if key == self.request_id and threading.current_thread() is self.step_thread and not self.entered.is_set():
            self.entered.set()
            self.released.wait(30)
        return super().pop(key, *default)


def test_a_last_output_handed_over_as_its_id_is_aborted_and_reused_never_takes_the_new_stream(
        plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s40, the race 884564c left): the step thread checked that the finishing
    request's stream was still open, then popped its id from ``_streams``: an abort (its gateway
    gone) and a new request of the same id from the other gateway landing between the two (the
    step thread held there) had it pop the new stream: the new request's client got the old
    request's last delta and ``finished``, and its own request never ran. Now the check and the
    pop are one step (``Streams._claim``): the new request starts and runs to its own end."""
    node = plane.node
    held = HeldHandOver(node._thread, "t/a0")
    monkeypatch.setattr(node, "_engine_streams", held)
    plane.a.open("t/a0")
    assert plane.run(plane.a.admit(request("t/a0", 4), [])).code == "OK"
    try:
        assert held.entered.wait(30), "the old request never ended"
        old = node._streams["t/a0"]  # its last output is being handed over: its stream is open
        plane.run(call(plane.scheduler.gateway_gone, plane.a.subscriber))
        wait_for(lambda: "t/a0" not in node._streams, 10.0)  # the abort claimed it, on the node's loop
        queue = plane.b.open("t/a0")
        assert plane.run(plane.b.admit(request("t/a0", 6), [])).code == "OK"
        wait_for(lambda: node._streams.get("t/a0") not in (None, old), 10.0)  # the new stream is open
    finally:
        held.released.set()

    async def to_the_end() -> list[dict[str, Any]]:
        events = [await asyncio.wait_for(queue.get(), 20)]
        while events[-1]["type"] not in ("finished", "error"):
            events.append(await asyncio.wait_for(queue.get(), 20))
        return events

    events = plane.run(to_the_end())
    kinds = [e["type"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished", events
    assert events[-1]["finish_reason"] == "length", events[-1]
    assert sum(len(e["token_ids"]) for e in events if e["type"] == "delta") == 6, events
    assert node._streams == {} and dict(held) == {}


async def _until(gen: Any, kind: str) -> list[dict[str, Any]]:
    """``gen``'s events up to the first of type ``kind`` (or its last)."""
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in (kind, "finished", "error"):
        events.append(await asyncio.wait_for(gen.__anext__(), 20))
    return events


def test_a_generate_left_after_its_id_was_reused_does_not_abort_the_new_request(plane: Plane) -> None:
    """Regression (s40): closing an in-process ``generate`` before its last event aborted
    whatever request the engine held under its id (``engine.abort_request(id)``, on the event
    loop): the caller aborted by an admin abort (no event reaches it) that closed its generator
    only after a new request of the id had started ended that request ``finished``/"abort" at
    once. Now the consumer leaving aborts its own stream's request alone (``_run_aborts``)."""
    node = plane.node

    async def run() -> list[dict[str, Any]]:
        first = node.generate(request("t/g", 600))
        assert (await _until(first, "delta"))[-1]["type"] == "delta"
        assert node.abort("t/g")
        while "t/g" in node._engine_streams:  # the engine is done with the first request
            await asyncio.sleep(0.01)
        second = node.generate(request("t/g", 200))
        events = await _until(second, "started")
        assert events[-1]["type"] == "started", events
        await first.aclose()  # its consumer leaves now, its stream aborted long ago
        events += await _until(second, "finished")
        return events

    events = plane.run(run())
    assert events[-1]["type"] == "finished" and events[-1]["finish_reason"] == "length", events[-1]
    assert sum(len(e["token_ids"]) for e in events if e["type"] == "delta") == 200


def test_a_second_generate_of_a_running_id_is_refused_and_the_first_runs_on(plane: Plane) -> None:
    """Regression (s40): a second in-process ``generate`` of an id running here replaced the
    first's stream in ``_streams``: the first request's outputs went to no stream (its caller
    waited for ever) and the second started only once the first had run to its end unseen. Now
    the second gets ALREADY_EXISTS at once (as ``submit`` answers another gateway's request of a
    running id), and the first runs on to its end."""
    node = plane.node

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        first = node.generate(request("t/g", 40))
        events = await _until(first, "delta")
        second = [e async for e in node.generate(request("t/g", 40))]
        events += await _until(first, "finished")
        return events, second

    events, second = plane.run(run())
    assert [(e["type"], e["code"]) for e in second] == [("error", "ALREADY_EXISTS")], second
    assert events[-1]["type"] == "finished" and events[-1]["finish_reason"] == "length", events[-1]
    assert sum(len(e["token_ids"]) for e in events if e["type"] == "delta") == 40
    assert node._streams == {}
