"""One cache node's flood of events cannot starve another node's streams at the gateway, nor
grow its memory without bound (s38 fault 2): ``NodeStreams`` queues each sender's event
messages apart (``services.gateway_event_turns.SenderTurns``, bounded in bytes) and routes them
in turns of ``EVENTS_PER_TURN`` events; a message past its sender's bound is dropped and that
sender's streams end UNAVAILABLE (retried), never with events silently missing.

The real ``NodeStreams`` on the real data plane (CURVE, a key per node), its senders ZeroMQ
``PUSH`` sockets holding the nodes' keys, as a node's are.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import zmq

from services import data_plane
from services.data_plane_auth import DataPlaneKeys
from services.gateway_event_turns import (
    BEHIND,
    EVENTS_PER_TURN,
    MESSAGE_OVERHEAD_BYTES,
    SenderTurns,
)
from services.gateway_streams import NodeStreams
from services.metrics import GatewayMetrics
from tests.test_http_metrics import samples

pytestmark = pytest.mark.timeout(60)

FLOOD_EVENTS = 2000
"""Events in each of the flooding node's messages (~70 KB)."""


def delta(text: str) -> dict[str, Any]:
    return {"type": "delta", "token_ids": [7], "text": text}


def flood_message(request_id: str) -> bytes:
    return data_plane.pack([[request_id, delta("f")] for _ in range(FLOOD_EVENTS)])


class Node:
    """A cache node's event socket to the gateway, with its own key."""

    def __init__(self, keys: DataPlaneKeys, node_id: str, address: str) -> None:
        self.sock = data_plane.context(asyncio_=True).socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.security("node", node_id=node_id).connect_to(self.sock, "gateway")
        self.sock.connect(address)

    async def send(self, message: bytes) -> None:
        await asyncio.wait_for(self.sock.send(message), 30)  # (the first waits for the handshake)


def blocking_node(context: Any, keys: DataPlaneKeys, node_id: str, address: str) -> Any:
    """A node's event socket whose sends never run the gateway's loop (a blocking one)."""
    sock = context.socket(zmq.PUSH)
    keys.security("node", node_id=node_id).connect_to(sock, "gateway")
    sock.connect(address)
    return sock


@asynccontextmanager
async def gateway(**kwargs: Any) -> AsyncIterator[tuple[NodeStreams, DataPlaneKeys, Node, Node]]:
    """A gateway's ``NodeStreams``, the keys, and nodes n0 and n1 connected to its event inbox."""
    keys = DataPlaneKeys.generate(("n0", "n1"))
    streams = NodeStreams({}, {}, "tcp://127.0.0.1:9", security=keys.security("gateway"), **kwargs)
    await streams.start()
    n0, n1 = Node(keys, "n0", streams.subscriber), Node(keys, "n1", streams.subscriber)
    try:
        yield streams, keys, n0, n1
    finally:
        n0.sock.close()
        n1.sock.close()
        streams.shutdown()


async def until(predicate: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_turns_alternate_senders_within_messages_in_order() -> None:
    """``SenderTurns`` gives each sender with messages waiting a turn of at most
    ``events_per_turn`` events in turn, over as many of its messages as they take (one split
    where the turn ends), each sender's events in the order sent; a bad message is handed on as
    its error (it counts one event) and its bytes no longer count. An empty message counts
    (it counted 0: a sender with two queued was dropped from the turns with one still queued,
    and the next turn raised KeyError, ending the gateway's routing for good)."""
    def unpack(message: bytes) -> list[tuple[str, Any]]:
        if message in (b"bad", b""):
            raise ValueError(message.decode() or "empty")
        return [(message.decode(), i) for i in range(int(message[1:]))]

    async def go() -> list[Any]:
        turns = SenderTurns(unpack, max_queued_bytes=1000, events_per_turn=2)
        assert turns.add("n1", b"a5") and turns.add("n1", b"bad") and turns.add("n0", b"c1")
        assert turns.add("n0", b"d3")
        assert turns.queued_bytes("n1") == 5 + 2 * MESSAGE_OVERHEAD_BYTES
        assert turns.queued_bytes("n0") == 4 + 2 * MESSAGE_OVERHEAD_BYTES
        got = []
        assert turns.add("n2", b"") and turns.add("n2", b"")
        assert turns.queued_bytes("n2") == 2 * MESSAGE_OVERHEAD_BYTES
        while any(turns.queued_bytes(n) for n in ("n0", "n1", "n2")):
            sender, items, first = await turns.take()
            got.append((sender, items if isinstance(items, list) else repr(items), first))
        return got

    bad, empty = "ValueError('bad')", "ValueError('empty')"
    assert asyncio.run(go()) == [
        ("n1", [("a5", 0), ("a5", 1)], True),
        ("n0", [("c1", 0)], True), ("n0", [("d3", 0)], True),  # one turn, over two messages
        ("n2", empty, True), ("n2", empty, True),
        ("n1", [("a5", 2), ("a5", 3)], False),
        ("n0", [("d3", 1), ("d3", 2)], False),
        ("n1", [("a5", 4)], False), ("n1", bad, True)]


def test_a_dropped_message_leaves_one_mark_at_its_place() -> None:
    """A message past its sender's bound is dropped and a ``BEHIND`` mark takes its place in the
    sender's queue (one for drops with nothing queued between them; it counts
    ``MESSAGE_OVERHEAD_BYTES``): ``take`` hands it on after the messages queued before the drop
    and before those queued after it. Regression (s38): nothing marked the drop's place."""
    def unpack(message: bytes) -> list[tuple[str, Any]]:
        return [(message.decode(), 0)]

    async def go() -> list[Any]:
        size = 2 + MESSAGE_OVERHEAD_BYTES
        turns = SenderTurns(unpack, max_queued_bytes=2 * size + MESSAGE_OVERHEAD_BYTES, events_per_turn=100)
        assert turns.add("n1", b"a1") and turns.add("n1", b"b1")
        assert not turns.add("n1", b"c1") and not turns.add("n1", b"d1")
        assert turns.queued_bytes("n1") == 2 * size + MESSAGE_OVERHEAD_BYTES
        got = [await turns.take()]
        assert turns.add("n1", b"e1")  # (room again)
        while turns.queued_bytes("n1"):
            got.append(await turns.take())
        return got

    assert asyncio.run(go()) == [("n1", [("a1", 0)], True), ("n1", [("b1", 0)], True),
                                 ("n1", BEHIND, True), ("n1", [("e1", 0)], True)]


def test_a_turn_ends_past_its_bytes() -> None:
    """A turn of messages of few events each ends once it has unpacked ``bytes_per_turn`` bytes
    (its first message always): its decoding work is bounded, not only its events."""
    async def go() -> list[str | None]:
        turns = SenderTurns(lambda m: [("r", 0)], events_per_turn=100, bytes_per_turn=25)
        for _ in range(4):
            assert turns.add("n1", b"x" * 10)
        assert turns.add("n0", b"y" * 40) and turns.add("n0", b"y")
        return [(await turns.take())[0] for _ in range(6)]

    # n1's turn ends at its third message (30 bytes), n0's at its first (40)
    assert asyncio.run(go()) == ["n1", "n1", "n1", "n0", "n1", "n0"]


def test_a_senders_bound_holds_its_messages_memory() -> None:
    """Regression (review s38 r1): a message counted its bytes alone against its sender's bound,
    so a node sending 2-byte messages had 5,000 held under a 10,000-byte bound, taking ~215 KB
    (a ``bytes`` object's header and its queue slot each: ~1.4 GB under the real 64 MiB bound).
    Now what the messages held take (``sys.getsizeof`` and a queue slot each) stays within the
    bound."""
    turns = SenderTurns(lambda m: [], max_queued_bytes=10_000)
    held = []
    while turns.add("n1", message := len(held).to_bytes(2, "big")):
        held.append(message)
    taken = sum(sys.getsizeof(m) + 8 for m in held)
    assert taken <= 10_000, f"{len(held)} messages held, taking {taken} bytes"


def test_a_node_of_small_messages_keeps_up_beside_a_flood() -> None:
    """Regression (review s38 r1): a turn ended with its sender's message, so beside a node
    flooding 2,000-event messages a node sending one-event messages (a node's step events
    are a message a step) had one message routed per flood turn of ``EVENTS_PER_TURN`` events:
    with 10 flood messages and 200 of n0's waiting, n0's last event came after every flood event
    (20,000). Now n0's turn takes ``EVENTS_PER_TURN`` of its events over its messages: its last
    comes within the flood's first few turns."""
    async def go() -> tuple[int, int]:
        async with gateway() as (streams, keys, _, _):
            flood_routed, n0_routed = [0], []
            streams.open("a", on_event=lambda e: n0_routed.append(flood_routed[0]))
            streams.bind("a", "n0")
            streams.open("b", on_event=lambda e: flood_routed.__setitem__(0, flood_routed[0] + 1))
            streams.bind("b", "n1")
            context = zmq.Context()
            n0, n1 = (blocking_node(context, keys, node_id, streams.subscriber) for node_id in ("n0", "n1"))
            try:
                n0.send(data_plane.pack([["a", delta("hello")]]))  # both keys' handshakes done
                n1.send(data_plane.pack([["b", delta("hello")]]))
                await until(lambda: n0_routed and flood_routed[0])
                n0_routed.clear()
                for _ in range(10):  # (sent without the gateway's loop running meanwhile)
                    n1.send(flood_message("b"))
                for i in range(200):
                    n0.send(data_plane.pack([["a", delta(f"t{i}")]]))
                await asyncio.to_thread(time.sleep, 0.3)  # all of them at the gateway's inbox
                await until(lambda: len(n0_routed) == 200 and flood_routed[0] == 1 + 10 * FLOOD_EVENTS)
            finally:
                context.destroy(linger=0)
            return n0_routed[-1] - 1, n0_routed[0] - 1

    last, first = asyncio.run(go())
    assert last <= 3 * EVENTS_PER_TURN, f"n0's last event came after {last} flood events (its first after {first})"


class Sender(threading.Thread):
    """A node sending from a thread of its own (the gateway's loop busy routing cannot slow it):
    ``messages`` from ``pace_s`` apart, each sent at ``sent_at[i]`` (monotonic), until
    ``stop`` is set or all are sent."""

    def __init__(self, keys: DataPlaneKeys, node_id: str, address: str, messages: list[bytes],
                 pace_s: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        keys.security("node", node_id=node_id).connect_to(self.sock, "gateway")
        self.sock.connect(address)
        self.messages, self.pace_s, self.stop = messages, pace_s, stop
        self.sent_at: list[float] = []

    def run(self) -> None:
        for message in self.messages:
            if self.stop.is_set():
                break
            self.sent_at.append(time.monotonic())
            self.sock.send(message)
            time.sleep(self.pace_s)
        self.stop.wait()
        self.sock.close()
        self.context.term()


def test_a_flooding_node_does_not_hold_another_nodes_events_back() -> None:
    """Regression (s38 fault 2): the gateway routed event messages one by one as read, a whole
    message at a time, so in a flood (node n1 sending 2,000-event messages faster than they
    are routed) node n0 had one message routed per n1 message: its 50 messages, sent 20 ms
    apart, fell seconds behind (at d2556ec: the last one routed ~2-4 s after it was sent).
    Now n0's messages are routed in n0's turns between n1's turns of ``EVENTS_PER_TURN``
    events: each within 1 s of being sent."""
    async def go() -> tuple[list[float], int]:
        async with gateway() as (streams, keys, n0, n1):
            routed_at: dict[str, float] = {}
            flood_routed = [0]

            def on_a(event: dict[str, Any]) -> None:
                routed_at[event["text"]] = time.monotonic()

            streams.open("a", on_event=on_a)
            streams.bind("a", "n0")
            streams.open("b", on_event=lambda e: flood_routed.__setitem__(0, flood_routed[0] + 1))
            streams.bind("b", "n1")
            await n0.send(data_plane.pack([["a", delta("hello")]]))  # both keys' handshakes done
            await n1.send(flood_message("b"))
            await until(lambda: "hello" in routed_at and flood_routed[0] == FLOOD_EVENTS)
            stop = threading.Event()
            flooder = Sender(keys, "n1", streams.subscriber, [flood_message("b")] * 400, 0.005, stop)
            normal = Sender(keys, "n0", streams.subscriber,
                            [data_plane.pack([["a", delta(f"t{i}")]]) for i in range(50)], 0.02, stop)
            flooder.start()
            await until(lambda: flood_routed[0] > 2 * FLOOD_EVENTS)  # n1's flood is being routed
            normal.start()
            try:
                await until(lambda: len(normal.sent_at) == 50 and (
                    len(routed_at) == 51 or time.monotonic() > normal.sent_at[-1] + 5))
            finally:
                stop.set()
                flooder.join(10)
                normal.join(10)
            lags = [routed_at.get(f"t{i}", float("inf")) - sent for i, sent in enumerate(normal.sent_at)]
            return lags, flood_routed[0]

    lags, flood_routed = asyncio.run(go())
    assert flood_routed > 3 * FLOOD_EVENTS  # n1's flood was routed meanwhile, in its turns
    assert max(lags) < 1.0, f"n0's events routed {max(lags):.2f} s after they were sent at worst"


def test_a_node_past_its_bound_loses_its_streams_not_another_nodes() -> None:
    """n1 sends ~2.8 MB of events past a 200 KB bound: its messages past the bound are dropped
    unread and counted (``behind_drops``, exported as ``node_event_messages_dropped_total``);
    its stream ends UNAVAILABLE (retried, its request aborted on the node) and so does one of
    its not bound yet, at ``bind`` (events of them may be among the dropped ones); n0's stream
    is routed on, not ended."""
    metrics = GatewayMetrics()

    async def go() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], int]:
        async with gateway(max_queued_bytes_per_node=200_000) as (streams, _, n0, n1):
            metrics.watch_streams(lambda: streams)
            a, b, u = streams.open("a"), streams.open("b"), streams.open("u")
            streams.bind("a", "n0")
            streams.bind("b", "n1")
            await n0.send(data_plane.pack([["a", delta("before")]]))
            for _ in range(40):
                await n1.send(flood_message("b"))
            await until(lambda: streams.behind_drops["n1"] > 0)
            await n0.send(data_plane.pack([["a", delta("after")]]))
            got_a = [await asyncio.wait_for(a.get(), 20)]
            while "after" not in got_a[-1]["text"]:
                got_a.append(await asyncio.wait_for(a.get(), 20))
            b_end = await asyncio.wait_for(b.get(), 20)
            while b_end["type"] != "error":
                b_end = await asyncio.wait_for(b.get(), 20)
            streams.bind("u", "n1")
            scraped = samples(metrics)
            assert scraped[("kvstrata:node_event_messages_dropped_total", (("node", "n1"),))] \
                == streams.behind_drops["n1"] > 0
            assert ("kvstrata:node_event_messages_dropped_total", (("node", "n0"),)) not in scraped
            return b_end, await asyncio.wait_for(u.get(), 20), got_a, streams.behind_drops["n0"]

    b_end, u_end, got_a, n0_drops = asyncio.run(go())
    for end in (b_end, u_end):
        assert end["type"] == "error" and end["code"] == "UNAVAILABLE", end
        assert "cache node n1 sent events faster than the gateway routes them" in end["message"]
        assert end["message"].endswith("retry the request")
    assert all(e["type"] == "delta" for e in got_a) and n0_drops == 0
    assert "".join(e["text"] for e in got_a) == "beforeafter"


FINISHED = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 1,
            "cached_tokens": {}, "ttft_ms": 1.0, "tpot_ms": 1.0, "preempted": False,
            "prefill_tokens_per_s": 1.0, "step_s": 0.1}


def test_a_drop_fails_the_streams_at_its_place_in_the_senders_queue() -> None:
    """Regression (s38): a message of n1 dropped past its bound ended n1's streams at the drop,
    before n1's messages queued ahead of it were routed, so stream "done", whose ``finished``
    came in n1's first message (queued, not routed yet), failed UNAVAILABLE anyway (retried,
    its answer complete). Now the drop's ``BEHIND`` mark ends them where it sits: "done" ends
    as sent; "late", whose events come after the drop, ends UNAVAILABLE.

    n1's messages are sent while the gateway's loop is blocked, so that they all wait in its
    inbox and are read in one batch (``READ_BATCH``) before any is routed."""
    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        async with gateway(max_queued_bytes_per_node=200_000) as (streams, keys, _, _):
            done, flood, late = streams.open("done"), streams.open("flood"), streams.open("late")
            for request_id in ("done", "flood", "late"):
                streams.bind(request_id, "n1")
            context = zmq.Context()
            n1 = blocking_node(context, keys, "n1", streams.subscriber)
            try:
                n1.send(data_plane.pack([["flood", delta("hello")]]))  # its key's handshake done
                await until(lambda: flood.qsize() == 1)
                n1.send(data_plane.pack([["done", delta("all")], ["done", FINISHED]]))
                for _ in range(8):  # ~560 KB past the 200 KB bound: some dropped
                    n1.send(flood_message("flood"))
                n1.send(data_plane.pack([["late", delta("after")]]))
                time.sleep(0.5)  # noqa: ASYNC251 - the loop blocked: all of them wait in the gateway's inbox
                got = {"done": [await asyncio.wait_for(done.get(), 20)],
                       "late": [await asyncio.wait_for(late.get(), 20)]}
                for request_id, buffer in (("done", done), ("late", late)):
                    while got[request_id][-1]["type"] not in ("finished", "error"):
                        got[request_id].append(await asyncio.wait_for(buffer.get(), 20))
            finally:
                context.destroy(linger=0)
            return got["done"], got["late"], streams.behind_drops["n1"]

    done, late, drops = asyncio.run(go())
    assert drops > 0
    assert [e["type"] for e in done] == ["delta", "finished"], done
    assert late[-1]["type"] == "error" and late[-1]["code"] == "UNAVAILABLE", late
    assert "cache node n1 sent events faster than the gateway routes them" in late[-1]["message"]
