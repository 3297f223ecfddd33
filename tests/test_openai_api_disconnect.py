"""An HTTP client that hangs up while its request waits in a node's queue, on the real call path
without Ray: a real CacheNode (the tiny Llama, one running slot), the GlobalScheduler's
admission server, the gateway's ``InferenceServicer`` and the OpenAI app served by uvicorn, all
on one event loop thread; the client is a raw socket, so the test decides when it goes away."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from bench.chaos_stack import BLOCK_SIZE, POOL_BLOCKS
from cache_node.sampling_params import SamplingParams
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.node_request import NodeRequest
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.known_tenants import know_tenants
from tests.loop_plane import Actor, LoopPlane, call, wait_for


class Edge(LoopPlane):
    """One node (``max_num_seqs=1``), the scheduler, a gateway servicer and its HTTP API."""

    def __init__(self) -> None:
        super().__init__(1, "kvstrata-hangup-")
        info = self.node.describe()
        handle = Actor(self.scheduler)
        self.servicer = InferenceServicer(handle, Authenticator(handle), {"n0": None}, {"n0": info}, None,
                                          self.sched_address, security=self.keys.security("gateway"))
        self.run(self.servicer.streams.start())
        self.key = self.run(call(self.scheduler.register_tenant, TenantSpec(name="hangup")))[1]
        know_tenants(self.scheduler, "other")  # the blockers' tenant (sent past the gateway)
        self.model = info["model_id"].split("@", 1)[0]
        self.http = HttpServer(create_app(OpenAIEdge(self.servicer, info["model_id"], list, lambda: 1)))
        self.port = self.run(self.http.start("127.0.0.1", 0))

    def stats(self) -> tuple[int, int]:
        """The node's (running, waiting) requests."""
        stats = self.node.stats()
        return stats["running"], stats["waiting"]

    def post(self, path: str, body: dict[str, Any]) -> socket.socket:
        """Send one request on a new connection; the socket, its reply unread."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        data = json.dumps(body)
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.key}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n{data}").encode())
        return sock

    async def close_gateways(self) -> None:
        await self.http.stop()
        self.servicer.streams.shutdown()


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    e = Edge()
    yield e
    e.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_its_request_is_queued_leaves_the_queue_at_once(edge: Edge, stream: bool) -> None:
    """Regression: the HTTP edge awaited the request's ``started`` event (admission, the
    node's queue, its first step) with nothing watching the connection (uvicorn does not
    cancel a handler whose client hangs up): an abandoned request kept its place in the
    node's queue and its tenant's share until the slot ahead of it freed, then ran its first
    prefill for nobody. Now it is aborted as soon as its client goes, as a cancelled gRPC
    call is: gone from the node's queue and released at the scheduler while the request
    ahead of it still runs."""
    blocker = NodeRequest(request_id=f"other/blocker-{stream}", tenant="other", cache_namespace="ns",
                          token_ids=tuple(range(100, 140)),
                          sampling=SamplingParams(max_tokens=POOL_BLOCKS * BLOCK_SIZE - 100, ignore_eos=True))
    streams = edge.servicer.streams
    edge.run(call(streams.open, blocker.request_id))
    assert edge.run(streams.admit(blocker, [])).code == "OK"
    wait_for(lambda: edge.stats() == (1, 0), 10.0)
    sock = edge.post("/v1/completions", {"model": edge.model, "prompt": [5] * 20, "max_tokens": 8,
                                         "stream": stream})
    wait_for(lambda: edge.stats() == (1, 1), 10.0)  # queued behind the blocker
    assert edge.run(call(edge.scheduler.stats))["in_flight"]["n0"] == 2
    sock.close()
    took = wait_for(lambda: edge.stats() == (1, 0), 3.0)
    wait_for(lambda: edge.run(call(edge.scheduler.stats))["in_flight"]["n0"] == 1, 1.0)  # released there
    assert blocker.request_id in edge.node._streams  # the slot ahead is still taken: not run at all
    edge.run(call(streams.abort, "n0", blocker.request_id))  # its sockets are the loop's
    edge.run(call(edge.scheduler.release, blocker.request_id))
    edge.run(call(streams.close, blocker.request_id))
    wait_for(lambda: edge.stats() == (0, 0), 10.0)
    assert took < 2.0


def test_a_client_gone_while_being_admitted_is_released_after_its_admission(edge: Edge) -> None:
    """Regression (seen as n > 1's all-or-nothing refusals leaving a choice in flight: a choice
    whose sibling was refused ends while its own admission is on its way): a call that ended
    while being admitted sent its release at once, which reached the scheduler before the
    admission (another channel): a no-op there, and the admission then held its node's place
    (``in_flight``) for as long as the scheduler ran, while the node, told to abort it, ran
    nothing. The release now goes once the admission is answered. The admission is delayed
    here as if in transit."""
    real, sent, admitted = edge.servicer.streams.admit, threading.Event(), threading.Event()

    async def late_admit(req: NodeRequest, hashes: list[bytes], key_id: str = "", spec: str = "",
                         siblings: tuple[str, ...] = ()) -> Any:
        sent.set()
        await asyncio.sleep(0.3)  # still on its way to the scheduler
        adm = await real(req, hashes, key_id, spec, siblings)
        if adm.code == "OK":
            admitted.set()
        return adm

    edge.servicer.streams.admit = late_admit  # type: ignore[method-assign]
    try:
        sock = edge.post("/v1/completions", {"model": edge.model, "prompt": [5] * 20, "max_tokens": 8})
        assert sent.wait(10.0)
        sock.close()  # gone while being admitted
        assert admitted.wait(10.0)  # admitted after its client left
        wait_for(lambda: edge.run(call(edge.scheduler.stats))["in_flight"]["n0"] == 0, 5.0)
    finally:
        del edge.servicer.streams.admit
    assert edge.scheduler.requests == {}
    wait_for(lambda: edge.stats() == (0, 0), 5.0)


@pytest.mark.parametrize("failure", [asyncio.TimeoutError, RuntimeError])
def test_a_client_gone_while_being_admitted_whose_admission_fails_is_aborted_and_released(
        edge: Edge, failure: type[Exception]) -> None:
    """Review 26c F3: the scheduler admits the request, but its answer fails at the gateway
    (late past ``admit_timeout_s``, or malformed) after the client left. The call's path took
    that as "nothing was admitted": the scheduler kept it in flight (its node's place held)
    and the node ran it, unseen, to max_tokens. Now it is aborted on every node and released,
    as a connected call's failed admission is."""
    real, sent, admitted = edge.servicer.streams.admit, threading.Event(), threading.Event()

    async def failed_admit(req: NodeRequest, hashes: list[bytes], key_id: str = "", spec: str = "",
                           siblings: tuple[str, ...] = ()) -> Any:
        sent.set()
        await asyncio.sleep(0.3)  # the client leaves meanwhile
        assert (await real(req, hashes, key_id, spec, siblings)).code == "OK"  # the scheduler admits it ...
        admitted.set()
        raise failure("the admission's reply did not come in time")  # ... its answer fails here

    edge.servicer.streams.admit = failed_admit  # type: ignore[method-assign]
    try:
        sock = edge.post("/v1/completions", {"model": edge.model, "prompt": [5] * 20, "max_tokens": 400,
                                             "ignore_eos": True})
        assert sent.wait(10.0)
        sock.close()  # gone while being admitted
        assert admitted.wait(10.0)
        wait_for(lambda: edge.run(call(edge.scheduler.stats))["in_flight"]["n0"] == 0, 5.0)
        wait_for(lambda: edge.stats() == (0, 0), 5.0)  # aborted on its node: not run to its end
    finally:
        del edge.servicer.streams.admit
        for rid in list(edge.scheduler.requests):  # (a failure above: the next case starts clean)
            edge.run(call(edge.scheduler.release, rid))
    assert edge.scheduler.requests == {}
