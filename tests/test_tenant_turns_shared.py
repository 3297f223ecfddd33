"""A tenant's one turn at a gateway, shared by its gRPC and HTTP APIs and pruned as requests end
(``services.tenant_turns``), on the real ``InferenceServicer`` served by a real gRPC server,
the real ``OpenAIEdge`` on a real ``HttpServer`` over that servicer (as ``Gateway.start``
builds them), tenants and keys in a real ``GlobalSchedulerService``'s store checked by the real
``Authenticator``; no cache node (a parsed request for an unknown model is a 404, a Generate
with a bad temperature INVALID_ARGUMENT after its parse).

Regressions (s36): the HTTP edge's turns (``OpenAIEdge.turns``) and the servicer's
(``InferenceServicer._tokenizing``) were two tables of locks, so one tenant's body parsed on
the event loop ran while its Generate's prompt was parsed on a worker thread; and neither table
was ever pruned (a lock for every tenant id ever seen, for the gateway's life).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
from starlette.requests import Request

from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services import gateway
from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.global_scheduler_admission import GlobalSchedulerService
from services.openai_api import app
from services.openai_api.app import OFF_LOOP_VALUES, OpenAIEdge, create_app
from services.openai_api.response_budget import Held
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, LocalActor
from tests.test_openai_api_parse_turns import _exchange, _request

SMALL = json.dumps({"model": "no-such-model", "prompt": [5, 6, 7], "max_tokens": 1}).encode()
"""Parsed on the event loop, then a 404."""

OTHER = SMALL.replace(b"no-such-model", b"other-model")
"""``SMALL`` of another tenant's (not counted by ``_Gate``)."""

MANY_VALUES = json.dumps({"model": "no-such-model", "prompt": [1] * (OFF_LOOP_VALUES + 8), "max_tokens": 1}).encode()
"""Parsed on a worker thread (past ``OFF_LOOP_VALUES``), then a 404."""

BAD_GENERATE = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2]),
                                             sampling=inference_pb2.SamplingParams(max_tokens=1, temperature=-1))
"""Parsed on a worker thread (``input_from_pb``), then INVALID_ARGUMENT."""


class _Served:
    """The servicer on gRPC and HTTP; ``keys``: tenant name -> API key; ``ids``: tenant name ->
    tenant id (what the turns are keyed by)."""

    def __init__(self, servicer: InferenceServicer, edge: OpenAIEdge, stub: Any, port: int,
                 keys: dict[str, str], ids: dict[str, str]) -> None:
        self.servicer, self.edge, self.stub, self.port, self.keys = servicer, edge, stub, port, keys
        self.ids = ids

    def users(self, name: str) -> int:
        """The holder and waiters of tenant ``name``'s turn now."""
        return self.servicer.turns.users(self.ids[name])

    def generate(self, name: str) -> Any:
        """A Generate call of ``name``'s (``BAD_GENERATE``), its response stream."""
        return self.stub.Generate(BAD_GENERATE, metadata=(("authorization", f"Bearer {self.keys[name]}"),))

    async def post(self, name: str, body: bytes) -> int:
        """The status of ``name``'s ``POST /v1/completions`` of ``body``, on a new connection."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            return (await _exchange(reader, writer, _request(self.keys[name], "POST", "/v1/completions", body)))[0]
        finally:
            writer.close()


async def _code(call: Any) -> grpc.StatusCode:
    """The status ``call`` ends with (CANCELLED: cancelled by this client)."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    except asyncio.CancelledError:
        if not call.cancelled():
            raise
        return await call.code()
    return grpc.StatusCode.OK


async def _serving(tmp_path: Path, names: list[str], run: Callable[[_Served], Any]) -> Any:
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    keys, ids = {}, {}
    for name in names:
        tenant, keys[name] = await scheduler.register_tenant(TenantSpec(name=name))
        ids[name] = tenant.tenant_id
    handle = LocalActor(scheduler)
    servicer = InferenceServicer(handle, Authenticator(handle), {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9")
    edge = OpenAIEdge(servicer, NODE_INFO["model_id"], list, lambda: 1)
    http = HttpServer(create_app(edge))
    port = await http.start("127.0.0.1", 0)
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    try:
        return await run(_Served(servicer, edge, inference_pb2_grpc.InferenceServiceStub(channel), port, keys, ids))
    finally:
        await channel.close()
        await server.stop(0)
        await http.stop()
        servicer._tokenizer_pool.shutdown(wait=False, cancel_futures=True)


class _Gate:
    """``input_from_pb`` held on its worker thread until ``gate`` is set (``entered`` once it
    is), and the pieces of work (it and ``load_json`` of any body but ``OTHER``) running at once
    counted (``peak``)."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        self.running = self.peak = 0
        self._guard = threading.Lock()

    def _count(self, step: int) -> None:
        with self._guard:
            self.running += step
            self.peak = max(self.peak, self.running)

    def patches(self) -> tuple[Any, Any]:
        real_input, real_load = gateway.input_from_pb, app.load_json

        def held_input(*args: Any, **kwargs: Any) -> Any:
            self._count(1)
            try:
                self.entered.set()
                self.gate.wait(10)
                return real_input(*args, **kwargs)
            finally:
                self._count(-1)

        def counted_load(data: bytes) -> Any:
            if data == OTHER:
                return real_load(data)
            self._count(1)
            try:
                return real_load(data)
            finally:
                self._count(-1)

        return (mock.patch.object(gateway, "input_from_pb", held_input),
                mock.patch.object(app, "load_json", counted_load))


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_one_tenants_http_and_grpc_work_takes_one_turn(tmp_path: Path) -> None:
    """Tenant "t"'s Generate is parsed on a worker thread (held there); meanwhile its small
    completion body, which is parsed on the event loop, waits for the same turn: it is parsed
    only once the Generate's parse has ended (at most one piece of "t"'s work at a time),
    while tenant "u"'s body is served at once. Before: the HTTP body took the edge's own turn
    and was parsed while the Generate held the servicer's (two at once)."""
    gate = _Gate()

    async def run(s: _Served) -> None:
        held = s.generate("t")
        holder = asyncio.ensure_future(_code(held))
        assert await asyncio.to_thread(gate.entered.wait, 10)
        waiting = asyncio.ensure_future(s.post("t", SMALL))
        assert await asyncio.wait_for(s.post("u", OTHER), 10) == 404  # another tenant is not held up
        await asyncio.sleep(0.2)
        assert not waiting.done() and gate.peak == 1, gate.peak  # "t"'s body waits for its turn
        assert s.edge.turns is s.servicer.turns and s.users("t") == 2
        gate.gate.set()
        assert await asyncio.wait_for(holder, 10) == grpc.StatusCode.INVALID_ARGUMENT
        assert await asyncio.wait_for(waiting, 10) == 404

    held_input, counted_load = gate.patches()
    with held_input, counted_load:
        asyncio.run(_serving(tmp_path, ["t", "u"], run))
    assert gate.peak == 1, f"{gate.peak} pieces of one tenant's work ran at once"


def test_the_turn_table_empties_once_many_tenants_requests_end_cancelled_waiters_too(tmp_path: Path) -> None:
    """24 tenants each post a body parsed on the loop and one parsed on a thread and make a
    Generate call: once answered, no tenant keeps an entry (before: 24 locks at the edge and 24
    at the servicer, kept for good). Then tenant "t0"'s turn is held by a Generate's parse,
    3 HTTP clients of "t0" hang up and 3 Generate calls of "t0" are cancelled while waiting for
    it, and the holder's own call is cancelled while its parse runs: the waiters leave at once,
    the turn stays held until the parse ends (no second piece of "t0"'s work starts), then the
    table is empty."""
    names = [f"t{i}" for i in range(24)]
    gate = _Gate()
    gate.gate.set()  # (open for the first part)

    async def run(s: _Served) -> None:
        async def each(name: str) -> None:
            assert await s.post(name, SMALL) == 404
            assert await s.post(name, MANY_VALUES) == 404
            assert await _code(s.generate(name)) == grpc.StatusCode.INVALID_ARGUMENT

        for name in names:  # (one tenant at a time: each key's first check counts against this peer's limit)
            await asyncio.wait_for(each(name), 30)
        assert len(s.edge.turns) == 0, f"{len(s.edge.turns)} entries at the edge after every request ended"
        assert len(s.servicer.turns) == 0

        gate.gate.clear()
        gate.entered.clear()
        holder = s.generate("t0")
        held = asyncio.ensure_future(_code(holder))
        assert await asyncio.to_thread(gate.entered.wait, 10)
        connections = []
        for _ in range(3):
            _, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(_request(s.keys["t0"], "POST", "/v1/completions", SMALL))
            connections.append(writer)
        waiters = [s.generate("t0") for _ in range(3)]
        waiting = [asyncio.ensure_future(_code(call)) for call in waiters]
        assert await _until(lambda: s.users("t0") == 7), s.users("t0")
        for writer in connections:
            writer.close()
        for call in waiters:
            call.cancel()
        holder.cancel()
        assert await _until(lambda: s.users("t0") == 1), s.users("t0")
        assert [await w for w in waiting] == [grpc.StatusCode.CANCELLED] * 3
        assert await held == grpc.StatusCode.CANCELLED
        await asyncio.sleep(0.1)
        assert s.users("t0") == 1  # the cancelled holder's parse still runs on its turn
        gate.gate.set()
        assert await _until(lambda: len(s.servicer.turns) == 0), s.users("t0")
        assert await s.post("t0", SMALL) == 404 and len(s.servicer.turns) == 0

    held_input, counted_load = gate.patches()
    with held_input, counted_load:
        asyncio.run(_serving(tmp_path, names, run))


def test_a_whole_response_waiting_for_its_turn_is_given_up_when_its_client_goes(tmp_path: Path) -> None:
    """A whole response waits for its tenant's turn (held by the tenant's other work); its
    client disconnects: the response is a 499 at once, never built, and no waiter is left.
    Before: it waited on, then built the body for a client long gone."""
    built: list[int] = []

    async def run() -> None:
        handle = LocalActor(GlobalSchedulerService(str(tmp_path), {"n0": 1}))
        servicer = InferenceServicer(handle, Authenticator(handle), {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9")
        edge = OpenAIEdge(servicer, NODE_INFO["model_id"], list, lambda: 1)
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""},
                          receive)
        request.state.tenant_id = "t"
        release = asyncio.Event()

        async def hold() -> None:
            async with edge.turn("t"):
                await release.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
        rendering = asyncio.ensure_future(edge.render(request, Held(0, 10), lambda: built.append(1) or {"a": 1}))
        await asyncio.sleep(0.1)
        assert not rendering.done()
        gone.set()
        response = await asyncio.wait_for(asyncio.shield(rendering), 2)
        assert response.status_code == 499 and servicer.turns.users("t") == 1
        release.set()
        await holder
        assert len(servicer.turns) == 0
        servicer._tokenizer_pool.shutdown()

    asyncio.run(run())
    assert built == []
