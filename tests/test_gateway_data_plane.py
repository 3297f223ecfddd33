"""The gateway's end of the data plane (``services.gateway_streams.NodeStreams``) over real ZeroMQ
sockets, with a scheduler socket and node handles standing in for the Ray actors: admissions
are matched to their replies, a scheduler failure reaches the caller, events reach their
stream's queue, aborts reach the node's inbox, and a node found down ends its streams (those
open on it and any bound to it later) until it rejoins at a new address."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.gateway_streams import NodeStreams
from services.node_request import NodeRequest


def request(rid: str) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                       sampling=SamplingParams(max_tokens=2))


async def _scheduler(sock, answer) -> None:
    """Answer admissions: ``answer(message)`` -> reply fields; replies go out in reverse
    order of arrival, two at a time, so matching by id is exercised."""
    while True:
        held = []
        for _ in range(2):
            peer, payload = await sock.recv_multipart()
            held.append((peer, data_plane.unpack(payload)))
        for peer, msg in reversed(held):
            await sock.send_multipart([peer, data_plane.pack({"id": msg["id"], **answer(msg)})])


def _answer(msg):
    req = data_plane.request_from_wire(msg["req"])
    if req.request_id.startswith("bad"):
        return {"error": "KeyError: 'n9'"}
    return {"adm": {"node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0,
                    "spill_blocks": 0, "reason": "", "continues_session": False}}


async def _admissions_are_matched(streams: NodeStreams) -> tuple[asyncio.Queue, asyncio.Queue]:
    a, b = streams.open("a"), streams.open("b")
    adm_a, adm_b = await asyncio.gather(streams.admit(request("a"), [b"h"]),
                                        streams.admit(request("b"), []))
    assert (adm_a.code, adm_a.node_id, adm_b.node_id) == ("OK", "n0", "n0")
    with pytest.raises(RuntimeError, match="n9"):
        await asyncio.gather(streams.admit(request("bad"), []), streams.admit(request("c"), []))
    return a, b


async def _events_and_aborts_arrive(streams: NodeStreams, inbox, a, b) -> None:
    # a node's step: one message for both streams, to this gateway's inbox
    push = data_plane.PushSockets()
    push.send(streams.subscriber, [["a", {"type": "delta", "token_ids": [7], "text": ""}],
                                   ["b", {"type": "delta", "token_ids": [8], "text": ""}],
                                   ["gone", {"type": "delta", "token_ids": [9], "text": ""}]])
    assert (await asyncio.wait_for(a.get(), 5))["token_ids"] == [7]
    assert (await asyncio.wait_for(b.get(), 5))["token_ids"] == [8]
    push.close()
    streams.abort("n0", "a")
    assert data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) == {"op": "abort", "id": "a"}


async def _node_down_then_rejoins(streams: NodeStreams, ctx, a, b) -> None:
    streams.bind("a", "n0")
    streams.close("b")
    streams.fail_node("n0", "cache node n0 died")
    event = a.get_nowait()
    assert (event["type"], event["code"]) == ("error", "UNAVAILABLE") and "n0 died" in event["message"]
    assert b.empty()
    c = streams.open("c")
    streams.bind("c", "n0")  # bound to a node down already: ends at once
    assert c.get_nowait()["code"] == "UNAVAILABLE"

    # the node rejoins at a new address: aborts go there, new streams are not failed
    inbox2 = ctx.socket(zmq.PULL)
    streams.reconnect("n0", data_plane.bind_random(inbox2, "127.0.0.1"))
    d = streams.open("d")
    streams.bind("d", "n0")
    assert d.empty() and streams.down == {}
    streams.abort("n0", "d")
    assert data_plane.unpack(await asyncio.wait_for(inbox2.recv(), 5)) == {"op": "abort", "id": "d"}

    # the node's process dies: its connection closes, and the gateway hears of it at once
    lost: asyncio.Queue[str] = asyncio.Queue()
    streams.on_disconnect = lost.put_nowait
    inbox2.close(linger=0)
    assert await asyncio.wait_for(lost.get(), 5) == "n0"


def test_admissions_events_aborts_and_a_dead_node() -> None:
    async def run():
        ctx = data_plane.context(asyncio_=True)
        sched = ctx.socket(zmq.ROUTER)
        sched_address = data_plane.bind_random(sched, "127.0.0.1")
        inbox = ctx.socket(zmq.PULL)
        node_address = data_plane.bind_random(inbox, "127.0.0.1")
        server = asyncio.get_running_loop().create_task(_scheduler(sched, _answer))
        streams = NodeStreams({"n0": None}, {"n0": node_address}, sched_address)
        await streams.start()
        a, b = await _admissions_are_matched(streams)
        await _events_and_aborts_arrive(streams, inbox, a, b)
        await _node_down_then_rejoins(streams, ctx, a, b)
        server.cancel()
        streams.shutdown()
        ctx.destroy(linger=0)

    asyncio.run(run())
