"""A gateway's ``release`` of an admission it gave up on can reach the scheduler before the
admission itself (review s34 B F7): after a stall of the scheduler's loop, Ray's queued calls
run before the admission socket is read. The release must still win: the admission is refused
CANCELLED (``released_early``) and nothing is submitted. The real ``GlobalSchedulerService``
with its real admission ROUTER, a gateway's DEALER and a node's command PULL, without Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.global_scheduler_admission import GlobalSchedulerService
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(corr: int, rid: str) -> bytes:
    req = NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                      sampling=SamplingParams(max_tokens=1))
    return data_plane.pack({"id": corr, "req": data_plane.request_to_wire(req), "sub": "tcp://127.0.0.1:1",
                            "hashes": []})


@contextlib.asynccontextmanager
async def scheduler_with_sockets(clock: Any = time.monotonic) -> AsyncIterator[tuple[GlobalSchedulerService, Any, Any]]:
    """The scheduler (node "n0", 4 slots) serving on this loop; a node's command PULL and a
    gateway's DEALER, both plain sockets; all closed at the end."""
    sched = GlobalSchedulerService(tempfile.mkdtemp(prefix="kvstrata-early-"), {"n0": 4}, clock=clock)
    know_tenants(sched, "t")
    ctx = zmq.Context.instance()
    node = ctx.socket(zmq.PULL)
    node.setsockopt(zmq.LINGER, 0)
    port = node.bind_to_random_port("tcp://127.0.0.1")
    sched.attach_nodes({"n0": f"tcp://127.0.0.1:{port}"})
    gateway = ctx.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(await sched.open_data_plane())
    try:
        yield sched, node, gateway
    finally:
        sched.close_data_plane()
        node.close()
        gateway.close()
        sched.store.close()


async def reply_to(gateway: Any) -> dict[str, Any]:
    for _ in range(1000):
        if gateway.poll(0):
            return data_plane.unpack(gateway.recv(), data_plane.REPLY_LIMITS)
        await asyncio.sleep(0.01)
    raise AssertionError("no admission reply in 10 s")


def test_a_release_that_overtakes_its_admission_still_wins() -> None:
    """Regression (review s34 B F7): the admission waited unread in the ROUTER while the
    scheduler's loop was blocked; the gateway's release ran first (a no-op then) and the
    admission was admitted after it: it held a place in n0's ``in_flight`` and the tenant's
    share for as long as the scheduler ran. Now it is refused CANCELLED and never submitted;
    the next admission is admitted and released as before, and leaves nothing remembered."""
    async def go() -> None:
        async with scheduler_with_sockets() as (sched, node, gateway):
            for i in range(4):  # capacity 4: each leaked place would be one of them
                rid = f"t/r{i}#attempt"
                gateway.send(admission(i, rid))
                time.sleep(0.2)  # noqa: ASYNC251 - the loop blocked (a stall, a stop): it waits in the socket
                sched.release(rid, None)  # the gateway gave up: Ray runs its release before the next select
                reply = await reply_to(gateway)
                assert reply["id"] == i and (reply["adm"]["code"], reply["adm"]["reason"]) == (
                    "CANCELLED", "released_early"), reply
                assert rid not in sched.requests and rid not in sched.nodes["n0"].in_flight
            assert not node.poll(300), "a released admission was submitted to its node"
            assert sched.stats()["in_flight"] == {"n0": 0} and sched.stats()["refused_released_early"] == 4
            assert not sched.released_early  # each answered once, then forgotten

            gateway.send(admission(9, "t/next#a"))  # in order: admitted, submitted, released
            assert (await reply_to(gateway))["adm"]["code"] == "OK"
            assert data_plane.unpack(node.recv())["op"] == "submit"
            sched.release("t/next#a", None)
            assert sched.stats()["in_flight"] == {"n0": 0} and not sched.released_early

    asyncio.run(go())


def test_ids_released_early_are_bounded_in_count_and_time() -> None:
    """The ids come from gateways on behalf of clients: a flood keeps the newest
    ``RELEASED_EARLY_MAX`` (by digest: a long id costs no more), and each is remembered for
    ``RELEASED_EARLY_S``, after which its admission is admitted as any other."""
    from services.global_scheduler_released import RELEASED_EARLY_MAX, RELEASED_EARLY_S

    async def go() -> None:
        clock = Clock()
        async with scheduler_with_sockets(clock) as (sched, _node, _gateway):
            sched.release("t/old#a", None)
            flood = [f"t/flood-{i}#{'x' * (i % 900)}" for i in range(RELEASED_EARLY_MAX + 100)]
            for rid in flood:
                sched.release(rid, None)
            assert len(sched.released_early) == RELEASED_EARLY_MAX
            assert sched._answer(admission(1, "t/old#a"))["adm"]["code"] == "OK"  # forgotten (the oldest)
            assert sched._answer(admission(2, flood[-1]))["adm"]["reason"] == (
                "released_early")

            clock.now += 1
            sched.release("t/late#a", None)
            clock.now += RELEASED_EARLY_S + 0.5  # its admission never came in time: forgotten
            assert sched._answer(admission(3, "t/late#a"))["adm"]["code"] == "OK"
            sched.release("t/other#a", None)  # (a release prunes the expired ones: the flood's)
            assert len(sched.released_early) == 1
            sched.release(12345, None)  # type: ignore[arg-type]  # no admission has such an id: ignored
            assert len(sched.released_early) == 1

    asyncio.run(go())
