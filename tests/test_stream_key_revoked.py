"""A stream ends when the API key that opened it is rotated away (security hardening, session 36).

The fault: a key was checked when a call was made and when its request was admitted, never
again while the call streamed. A stolen key its owner rotated away (``kvstrata tenant
rotate-key``: ``RotateKey`` through this gateway, or through another one) kept every stream it
had opened, gRPC ``Generate`` calls, the HTTP edge's streamed and whole completions and session
turns, generating on the node up to ``max_tokens`` and holding their blocks there.

Now each gateway watches the keys of its open streams (``services.gateway_key_watch.KeyWatch``):
a stream whose key the tenant store no longer holds ends UNAUTHENTICATED (HTTP 401 / an SSE
error event), its request aborted on its node (blocks freed) and released with its usage; the
same tenant's stream under its new key and another tenant's stream run on.

The real path without Ray: a real CacheNode (the tiny Llama) and the GlobalScheduler's
admission server on the real data plane (``tests.loop_plane``), the gateway's
``InferenceServicer`` and ``TenantServicer`` on a real gRPC server and the OpenAI app on
uvicorn, all on one event loop thread; clients are real gRPC channels and HTTP connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from bench.chaos_stack import BLOCK_SIZE, block_bytes, tiny_checkpoint
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.auth import Authenticator
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.data_plane_auth import DataPlaneKeys
from services.gateway import InferenceServicer
from services.gateway_admin import TenantServicer
from services.global_scheduler_admission import GlobalSchedulerService
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.loop_plane import Actor, LoopPlane, call, wait_for

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 1500
"""Each stream's length: far longer than the test (the tiny Llama makes ~70 tokens a second here)."""
PROMPT = list(range(100, 120))
CHECK_S = 1.0
"""The key watch's interval in this test (``KEY_CHECK_S`` is 5 s)."""


class Plane(LoopPlane):
    """Node "n0" with room for every stream's whole length at once (no preemption), the
    scheduler, and one gateway: gRPC (Generate, CloseSession, the tenant service) and the HTTP
    edge."""

    def __init__(self) -> None:  # (``LoopPlane``'s, with a pool of 1,024 blocks)
        self.keys = DataPlaneKeys.generate()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE,
                            kv_pool_bytes=1024 * block_bytes(), host_bytes=0, max_num_seqs=16)
        self.node = CacheNode("n0", config, num_threads=1, security=self.keys.security("node"))
        self.scheduler = GlobalSchedulerService(tempfile.mkdtemp(prefix="kvstrata-revoke-"), {"n0": 16},
                                                security=self.keys.security("scheduler"))
        self.node_address = self.run(self.node.open_data_plane())
        self.scheduler.attach_nodes({"n0": self.node_address})
        self.sched_address = self.run(self.scheduler.open_data_plane())
        info = self.node.describe()
        handle = Actor(self.scheduler)
        self.auth = Authenticator(handle)
        self.servicer = InferenceServicer(handle, self.auth, {"n0": None}, {"n0": info}, None,
                                          self.sched_address, security=self.keys.security("gateway"))
        self.watch = getattr(self.servicer, "key_watch", None)  # (None before the fix: the test then fails on
        if self.watch is not None:  # what the streams do, not here)
            self.watch.interval_s = CHECK_S
        self.run(self.servicer.streams.start())
        self.model = info["model_id"].split("@", 1)[0]
        self.http = HttpServer(create_app(OpenAIEdge(self.servicer, info["model_id"], list, lambda: 1)))
        self.http_port = self.run(self.http.start("127.0.0.1", 0))
        self.grpc_port = self.run(self._serve_grpc(handle))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    async def _serve_grpc(self, handle: Actor) -> int:
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        tenant_pb2_grpc.add_TenantServiceServicer_to_server(TenantServicer(handle, self.auth), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    async def close_gateways(self) -> None:
        await self.server.stop(0)
        await self.http.stop()
        self.servicer.streams.shutdown()

    def close(self) -> None:
        self.channel.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        super().close()

    def register(self, name: str) -> tuple[str, str]:
        """(tenant id, key) of a new tenant."""
        tenant, key = self.run(call(self.scheduler.register_tenant, TenantSpec(name=name)))
        return tenant.tenant_id, key

    def grpc_stream(self, key: str, session_id: str = "") -> concurrent.futures.Future[tuple[Any, int]]:
        """A long Generate call, read to its end: (its status code, tokens it got)."""
        call_ = inference_pb2_grpc.InferenceServiceStub(self.channel).Generate(
            inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROMPT), session_id=session_id,
                                          sampling=inference_pb2.SamplingParams(max_tokens=MAX_TOKENS,
                                                                                ignore_eos=True)),
            metadata=(("authorization", f"Bearer {key}"),), timeout=90)

        def read() -> tuple[Any, int]:
            tokens = 0
            try:
                for event in call_:
                    tokens += len(event.delta.token_ids)
            except grpc.RpcError as err:
                return err.code(), tokens
            return grpc.StatusCode.OK, tokens

        future = self.pool.submit(read)
        future.call = call_  # type: ignore[attr-defined]
        return future

    def http_completion(self, key: str, stream: bool, **extra: Any) -> concurrent.futures.Future[tuple[int, str]]:
        """A long /v1/completions (``extra``: more body fields), read to its end: (its HTTP
        status, its body)."""

        def post() -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=90)
            body = {"model": self.model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "stream": stream, **extra}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
            reply = conn.getresponse()
            try:
                return reply.status, reply.read().decode()
            finally:
                conn.close()

        return self.pool.submit(post)

    def node_streams(self) -> dict[str, int]:
        """Tenant id -> its requests running on the node."""
        counts: dict[str, int] = {}
        for stream in list(self.node._streams.values()):
            counts[stream.request.tenant] = counts.get(stream.request.tenant, 0) + 1
        return counts

    def in_flight(self) -> int:
        return self.run(call(self.scheduler.stats))["in_flight"]["n0"]


@pytest.fixture(scope="module")
def plane() -> Iterator[Plane]:
    p = Plane()
    yield p
    p.close()


def _sse_error(body: str) -> dict[str, Any]:
    """The ``error`` of a streamed response's error event (the last data event before none)."""
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events and events[-1] != "[DONE]", body[-500:]
    return json.loads(events[-1])["error"]


def test_streams_of_a_key_rotated_away_end_unauthenticated_and_free_their_node(plane: Plane) -> None:
    """ann's key opens a gRPC stream, a session turn, a streamed and a whole HTTP completion; bob
    has a stream of his own. ann's key is rotated away at another gateway (the scheduler's
    ``rotate_tenant_key``, as ``kvstrata tenant rotate-key`` there), and ann opens a stream with
    her new key. Old code: all six ran on to ``max_tokens``. Now, within the key watch's
    interval, ann's four old streams end (gRPC UNAUTHENTICATED, HTTP 401 and an SSE error event
    ``invalid_api_key``), their requests leave the node and the scheduler, their tokens are in
    ann's usage, and bob's stream and ann's new one run on. Then a rotation through this
    gateway's own ``RotateKey`` ends ann's new-key stream at once (no wait for the interval)."""
    ann, ann_key = plane.register("ann")
    bob, bob_key = plane.register("bob")
    old = [plane.grpc_stream(ann_key), plane.grpc_stream(ann_key, session_id="chat-1")]
    http_streamed, http_whole = plane.http_completion(ann_key, True), plane.http_completion(ann_key, False)
    bobs = plane.grpc_stream(bob_key)
    wait_for(lambda: plane.node_streams() == {ann: 4, bob: 1}, 30)
    time.sleep(0.5)  # a few tokens each

    t0 = time.monotonic()
    new_key = plane.run(call(plane.scheduler.rotate_tenant_key, "ann"))  # at another gateway
    anns_new = plane.grpc_stream(new_key)
    results = [f.result(30) for f in old]
    took = time.monotonic() - t0
    streamed, whole = http_streamed.result(30), http_whole.result(30)

    assert [code for code, _ in results] == [grpc.StatusCode.UNAUTHENTICATED] * 2, results
    assert all(tokens > 0 for _, tokens in results), results  # they ran until then
    assert took < CHECK_S + 5.0, took
    assert streamed[0] == 200 and _sse_error(streamed[1])["code"] == "invalid_api_key", streamed[1][-500:]
    assert whole[0] == 401 and json.loads(whole[1])["error"]["code"] == "invalid_api_key", whole
    wait_for(lambda: plane.node_streams() == {ann: 1, bob: 1}, 10)  # aborted on the node
    wait_for(lambda: plane.in_flight() == 2, 10)  # released at the scheduler
    assert not bobs.done() and not anns_new.done()
    usage = plane.run(call(plane.scheduler.usage_of, ann))
    assert usage.requests >= 4 and usage.completion_tokens >= sum(tokens for _, tokens in results), usage
    assert plane.watch.ended == 4

    # through this gateway: its own RotateKey tells the watch at once
    plane.watch.interval_s = 60.0
    time.sleep(CHECK_S + 0.5)  # the watch now waits 60 s for its next check
    t1 = time.monotonic()
    tenants = tenant_pb2_grpc.TenantServiceStub(plane.channel)
    tenants.RotateKey(tenant_pb2.RotateKeyRequest(name="ann"), metadata=(("authorization", f"Bearer {new_key}"),))
    code, _ = anns_new.result(30)
    assert code == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() - t1 < 5.0
    wait_for(lambda: plane.node_streams() == {bob: 1}, 10)
    assert not bobs.done()
    bobs.call.cancel()  # type: ignore[attr-defined]
    assert bobs.result(30)[0] == grpc.StatusCode.CANCELLED
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)
    stats = plane.run(plane.node.integrity_stats())  # (fresh, at a step boundary)
    assert stats["used_blocks"] == 0 and stats["running"] == 0, stats  # every block freed
    assert stats["used_blocks"] == 0 and stats["running"] == 0, stats  # every block freed


def test_a_deleted_tenants_streams_end(plane: Plane) -> None:
    """A deleted tenant's streams end ABORTED (docs/architecture.md, API keys), whichever ends
    them first: its nodes' ``end_tenant`` or this gateway's key watch (which asks the scheduler
    whether the tenant still exists), and leave the node; another tenant's runs on. Deleted at
    the scheduler (another gateway), and through this gateway's own ``DeleteTenant``, whose
    check of the watch starts at once and raced the node's end. Regression (review R1 F2,
    session 36): through this gateway they ended UNAUTHENTICATED (the watch won the race)."""
    gone, gone_key = plane.register("gone")
    kept, kept_key = plane.register("kept")
    doomed, other = plane.grpc_stream(gone_key), plane.grpc_stream(kept_key)
    wait_for(lambda: plane.node_streams() == {gone: 1, kept: 1}, 30)
    plane.run(call(plane.scheduler.delete_tenant, "gone"))
    code, _ = doomed.result(30)
    assert code == grpc.StatusCode.ABORTED, code
    wait_for(lambda: plane.node_streams() == {kept: 1}, 10)

    admin = plane.run(call(plane.scheduler.rotate_admin_key))
    tenants = tenant_pb2_grpc.TenantServiceStub(plane.channel)
    codes = []
    for i in range(3):
        tenant_id, key = plane.register(f"gone{i}")
        streams = [plane.grpc_stream(key), plane.http_completion(key, False)]
        wait_for(lambda tenant_id=tenant_id: plane.node_streams().get(tenant_id, 0) == 2, 30)
        time.sleep(0.2)
        tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name=f"gone{i}"),
                             metadata=(("authorization", f"Bearer {admin}"),))
        grpc_code, _ = streams[0].result(30)
        status, body = streams[1].result(30)
        codes.append((grpc_code, status, json.loads(body)["error"]["type"] if status != 200 else body[:200]))
        wait_for(lambda tenant_id=tenant_id: plane.node_streams().get(tenant_id, 0) == 0, 10)
    assert all(grpc_code == grpc.StatusCode.ABORTED for grpc_code, _, _ in codes), codes
    whole = {(status, kind) for _, status, kind in codes}
    assert len(whole) == 1 and next(iter(whole))[0] != 401, codes  # the whole response: ABORTED's status
    assert not other.done()
    other.call.cancel()  # type: ignore[attr-defined]
    other.result(30)
    wait_for(lambda: plane.node_streams() == {} and plane.in_flight() == 0, 10)


def test_an_n2_completion_whose_key_goes_while_a_choice_waits_to_start_is_401(plane: Plane) -> None:
    """An ``n=2`` completion whose key is rotated away while choice 0 streams (unread: the
    response waits for every choice to start) and choice 1's admission is slow (a busy
    scheduler, > ``REVOKED_READ_S``): the writer is stopped UNAUTHENTICATED and the answer is
    401 ``invalid_api_key``. Regression (review R1 F4, session 36): a retryable 429 "did not all
    start in time" (``Choices.respond`` ignored the stop's code)."""
    tenant_id, key = plane.register("nann")
    plane.watch.interval_s = CHECK_S  # (the first test left it at 60 s: a check now makes the next wait CHECK_S)
    plane.watch.keys_gone(None)
    streams = plane.servicer.streams
    admit = streams.admit

    async def slow_admit(req: Any, *args: Any, **kwargs: Any) -> Any:  # choice 1's admission waits
        if req.request_id.split("/", 1)[-1].startswith("1_"):
            await asyncio.sleep(15.0)
        return await admit(req, *args, **kwargs)

    streams.admit = slow_admit  # type: ignore[method-assign]
    try:
        answer = plane.http_completion(key, False, n=2)
        wait_for(lambda: plane.node_streams().get(tenant_id, 0) == 1, 30)
        time.sleep(0.3)
        t0 = time.monotonic()
        plane.run(call(plane.scheduler.rotate_tenant_key, "nann"))  # at another gateway
        status, body = answer.result(30)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", (status, body[:300])
        assert time.monotonic() - t0 < 10.0
    finally:
        streams.admit = admit  # type: ignore[method-assign]
    wait_for(lambda: plane.node_streams().get(tenant_id, 0) == 0 and plane.in_flight() == 0, 20)
