"""The gateway's end of the data plane (``services.gateway.NodeStreams``) over real ZeroMQ
sockets, with a scheduler socket and node handles standing in for the Ray actors: admissions
are matched to their replies, a scheduler failure reaches the caller, events reach their
stream's queue, aborts reach the node's inbox, and a dead node ends its streams."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.gateway import NodeStreams
from services.node_request import NodeRequest


def request(rid: str) -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                       sampling=SamplingParams(max_tokens=2))


class _Ping:
    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def remote(self):
        async def answer() -> bool:
            if not self.alive:
                raise ConnectionError("actor died")
            return True

        return answer()


class _NodeHandle:
    """A CacheNode actor handle as far as ``NodeStreams`` uses it: ``ping.remote()``."""

    def __init__(self) -> None:
        self.ping = _Ping(True)


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


def test_admissions_events_aborts_and_a_dead_node() -> None:
    async def run():
        ctx = data_plane.context(asyncio_=True)
        sched = ctx.socket(zmq.ROUTER)
        sched_address = data_plane.bind_random(sched, "127.0.0.1")
        inbox = ctx.socket(zmq.PULL)
        node_address = data_plane.bind_random(inbox, "127.0.0.1")

        def answer(msg):
            req = data_plane.request_from_wire(msg["req"])
            if req.request_id.startswith("bad"):
                return {"error": "KeyError: 'n9'"}
            return {"adm": {"node_id": "n0", "code": "OK", "message": "", "retry_after_s": 0.0,
                            "spill_blocks": 0}}

        server = asyncio.get_running_loop().create_task(_scheduler(sched, answer))
        node = _NodeHandle()
        streams = NodeStreams({"n0": node}, {"n0": node_address}, sched_address, watch_s=0.05)
        await streams.start()
        a, b = streams.open("a"), streams.open("b")
        adm_a, adm_b = await asyncio.gather(streams.admit(request("a"), [b"h"]),
                                            streams.admit(request("b"), []))
        assert (adm_a.code, adm_a.node_id, adm_b.node_id) == ("OK", "n0", "n0")
        with pytest.raises(RuntimeError, match="n9"):
            await asyncio.gather(streams.admit(request("bad"), []), streams.admit(request("c"), []))

        # a node's step: one message for both streams, to this gateway's inbox
        push = data_plane.PushSockets()
        push.send(streams.subscriber, [["a", {"type": "delta", "token_ids": [7]}],
                                       ["b", {"type": "delta", "token_ids": [8]}],
                                       ["gone", {"type": "delta", "token_ids": [9]}]])
        assert (await asyncio.wait_for(a.get(), 5))["token_ids"] == [7]
        assert (await asyncio.wait_for(b.get(), 5))["token_ids"] == [8]

        streams.abort("n0", "a")
        assert data_plane.unpack(await asyncio.wait_for(inbox.recv(), 5)) == {"op": "abort", "id": "a"}

        streams.bind("a", "n0")
        streams.close("b")
        node.ping.alive = False
        event = await asyncio.wait_for(a.get(), 5)
        assert (event["type"], event["code"]) == ("error", "UNAVAILABLE") and "actor died" in event["message"]
        assert b.empty()
        server.cancel()
        push.close()
        streams.shutdown()
        ctx.destroy(linger=0)

    asyncio.run(run())
