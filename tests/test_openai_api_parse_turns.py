"""Parsing request bodies at the HTTP edge, bounded in structure and shared fairly between tenants
(review s35 E F1, F2), on the real ``HttpServer``, ``OpenAIEdge`` and ``InferenceServicer``
(its real ``off_loop``), tenants and keys in a real ``GlobalSchedulerService``'s store and
checked by the real ``Authenticator``; no cache node (a parsed request for an unknown model is a
404).

F1: ``check_body_shape`` counted commas and quotes only, so an 8 MiB body of nested empty arrays
(4.2M lists, ~4,700 commas) passed it and ``json.loads`` held the GIL for seconds. Now arrays and
objects count as values (``MAX_BODY_VALUES``) and a body nesting deeper than any valid request
(``MAX_BODY_DEPTH``) is refused, both before ``json.loads``.

F2: bodies of at most 256 KiB were parsed on the event loop with no per-tenant bound: one
tenant's connections posting 255 KiB bodies of ``[[]]`` (~10-100 ms each to parse, by the host's
load) took another tenant's ``GET /v1/models`` from 1 ms to seconds. Now each tenant's bodies are parsed one at a
time (``OpenAIEdge.turn``), on the loop only when small in JSON values too (``OFF_LOOP_VALUES``).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

from pydantic import ValidationError

from services.auth import Authenticator
from services.gateway import InferenceServicer
from services.global_scheduler_admission import GlobalSchedulerService
from services.openai_api import app
from services.openai_api.app import (
    MAX_BODY_BYTES,
    MAX_BODY_DEPTH,
    MAX_BODY_VALUES,
    OFF_LOOP_BYTES,
    OFF_LOOP_VALUES,
    OpenAIEdge,
    check_body_shape,
    create_app,
)
from services.openai_api.context import CallAborted
from services.openai_api.schemas import CompletionRequest
from services.openai_api.server import HttpServer
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, LocalActor


def _fill(item: bytes, limit: int) -> bytes:
    """A completion body of at most ``limit`` bytes whose prompt is ``item`` repeated."""
    prefix, suffix = b'{"model":"tiny","prompt":[', b"]}"
    return prefix + b",".join([item] * ((limit - len(prefix) - len(suffix)) // (len(item) + 1))) + suffix


def _request(key: str, method: str, path: str, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> tuple[int, Any]:
    """(status, JSON body) of one request on a kept-alive connection."""
    writer.write(data)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in head if line.lower().startswith("content-length"))
    return int(head[0].split(" ")[1]), json.loads(await reader.readexactly(length))


async def _serving(tmp_path: Path, run: Any) -> Any:
    """``run(port, keys, edge)`` against the real edge; ``keys``: tenant name -> API key."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    keys = {}
    for name in ("attacker", "victim"):
        keys[name] = (await scheduler.register_tenant(TenantSpec(name=name)))[1]
    handle = LocalActor(scheduler)
    servicer = InferenceServicer(handle, Authenticator(handle), {}, {"n0": NODE_INFO}, None, "tcp://127.0.0.1:9")
    edge = OpenAIEdge(servicer, NODE_INFO["model_id"], list, lambda: 1)
    server = HttpServer(create_app(edge))
    port = await server.start("127.0.0.1", 0)
    try:
        return await run(port, keys, edge)
    finally:
        await server.stop()


def test_a_deeply_nested_body_is_refused_before_json_loads_naming_the_bound(tmp_path: Path) -> None:
    """An 8 MiB body of nested empty arrays (900 deep; 4.2M lists, 4,657 commas) and a small one
    nesting ``MAX_BODY_DEPTH`` + 1 deep are 400 invalid_request_error naming their bound, and
    neither is parsed (``load_json``); a body as deep as the bound is parsed (and refused by the
    schema: a prompt is no list of lists of lists). Before: both passed the check, and the big one's ``json.loads`` held the GIL
    2.4-3.8 s."""
    big = _fill(b"[" * 900 + b"]" * 900, MAX_BODY_BYTES)
    deep = b'{"model":"tiny","prompt":' + b"[" * MAX_BODY_DEPTH + b"]" * MAX_BODY_DEPTH + b"}"
    at_bound = b'{"model":"tiny","prompt":' + b"[" * (MAX_BODY_DEPTH - 1) + b"]" * (MAX_BODY_DEPTH - 1) + b"}"
    loads = mock.Mock(wraps=app.load_json)

    async def run(port: int, keys: dict[str, str], edge: OpenAIEdge) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with mock.patch.object(app, "load_json", loads):
            status, answer = await _exchange(reader, writer, _request(keys["attacker"], "POST", "/v1/completions", big))
            assert status == 400 and answer["error"]["type"] == "invalid_request_error"
            assert f"more than {MAX_BODY_VALUES} JSON values and containers" in answer["error"]["message"]
            status, answer = await _exchange(reader, writer, _request(keys["attacker"], "POST", "/v1/completions", deep))
            assert status == 400 and answer["error"]["type"] == "invalid_request_error"
            assert f"more than {MAX_BODY_DEPTH} levels deep" in answer["error"]["message"]
            assert loads.call_count == 0
            status, answer = await _exchange(reader, writer, _request(keys["attacker"], "POST", "/v1/completions",
                                                                      at_bound))
            assert status == 400 and "levels deep" not in answer["error"]["message"] and loads.call_count == 1
        writer.close()

    asyncio.run(_serving(tmp_path, run))


def test_the_shape_check_counts_containers_and_depth_in_its_fast_path_too() -> None:
    """The counts of a body under every bound in bytes (commas, quotes, brackets; the fast path)
    and past them (``body_shape``) both include arrays and objects: 255 KiB of ``[[]]`` counts
    ~156K values and containers (before: its ~52K commas), over ``OFF_LOOP_VALUES``; a body of
    ``MAX_BODY_VALUES`` empty arrays and commas is refused, one fewer is not."""
    assert check_body_shape(_fill(b"[[]]", OFF_LOOP_BYTES)) > 150_000
    assert check_body_shape(b'{"model":"m","prompt":[1,2,3]}') == 3 + 2 < OFF_LOOP_VALUES  # commas, {, [
    n = MAX_BODY_VALUES // 2 - 1  # "[" and "," a list: n lists in the prompt, 2n - 1 + 2 counted
    assert check_body_shape(b'{"prompt":[' + b",".join([b"[]"] * n) + b"]}") == MAX_BODY_VALUES - 1
    try:
        check_body_shape(b'{"prompt":[' + b",".join([b"[]"] * (n + 1)) + b"]}")
    except CallAborted as exc:
        assert "JSON values and containers" in str(exc)
    else:
        raise AssertionError("a body past MAX_BODY_VALUES values and containers passed")


def test_one_tenants_costly_bodies_do_not_starve_another_tenants_requests(tmp_path: Path) -> None:
    """Tenant "attacker" keeps 48 connections posting 255 KiB bodies of ``[[]]`` back to back;
    tenant "victim" meanwhile GETs ``/v1/models`` and posts a small completion (404 after its
    parse). The victim's median latency stays within 48 parses of one such body (measured here
    first: ~10 ms on an idle host, 30-70 ms on a loaded one), or 1 s: the attacker's bodies are
    parsed one at a time on its turn, off the loop, so each of the victim's steps on the loop
    waits for about one of them. Before: all 48 were parsed on the event loop at once (on a
    loaded 2-core host, victim median 5.6 s at 24 connections, now 0.3-0.9 s at 48)."""
    costly = _fill(b"[[]]", OFF_LOOP_BYTES - 1024)
    small = json.dumps({"model": "no-such-model", "prompt": [5, 6, 7], "max_tokens": 1}).encode()

    async def run(port: int, keys: dict[str, str], edge: OpenAIEdge) -> tuple[list[float], dict[int, int]]:
        stop = asyncio.Event()
        codes: dict[int, int] = {}  # status -> replies (0: connection cut)

        async def attack() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = _request(keys["attacker"], "POST", "/v1/completions", costly)
            while not stop.is_set():
                try:
                    status, _ = await _exchange(reader, writer, data)
                except (ConnectionError, asyncio.IncompleteReadError):  # (the old code's stalls: cut off)
                    status = 0
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                codes[status] = codes.get(status, 0) + 1
            writer.close()

        attackers = [asyncio.ensure_future(attack()) for _ in range(48)]
        await asyncio.sleep(0.5)  # every connection has a body in flight
        latencies: list[float] = []  # seconds (inf: the connection was cut)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):
                for data, expected in ((_request(keys["victim"], "GET", "/v1/models"), 200),
                                       (_request(keys["victim"], "POST", "/v1/completions", small), 404)):
                    t0 = time.monotonic()
                    try:
                        assert (await _exchange(reader, writer, data))[0] == expected
                        latencies.append(time.monotonic() - t0)
                    except (ConnectionError, asyncio.IncompleteReadError):  # cut off (the old code)
                        latencies.append(float("inf"))
                        writer.close()
                        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        finally:
            stop.set()
            writer.close()
            await asyncio.wait_for(asyncio.gather(*attackers), 60)
        return latencies, codes

    def parse_once() -> float:
        t0 = time.perf_counter()
        try:
            CompletionRequest.model_validate(app.load_json(costly))
        except ValidationError:
            pass
        return time.perf_counter() - t0

    cost = min(parse_once() for _ in range(3))
    latencies, codes = asyncio.run(_serving(tmp_path, run))
    assert statistics.median(latencies) < max(1.0, 48 * cost), (round(cost, 3), [round(x, 3) for x in latencies])
    assert set(codes) == {400} and sum(codes.values()) >= 48  # every costly body parsed and refused
