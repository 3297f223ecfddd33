"""The JSON inside tool calls' ``arguments`` is bounded before it is parsed, on every path
(review s33 F1): ``arguments`` is a JSON *string* in OpenAI's format, so the HTTP body's shape
check (``openai_api.bodies.check_body_shape``) counts it as one value, and it was parsed
(``chat_tools.template_call``: ``json.loads`` and a depth walk) before any bound, holding the
GIL: an 8 MiB body of 2.6M empty lists stalled the gateway's event loop 2-3.5 s per request
(``/tokenize`` too), and a session turn's calls were parsed again on the global scheduler's
one admission loop, 0.3-0.38 s for 0.75 MB within the characters' bound.

Now the characters are counted on the pydantic models and the calls' JSON values on their
text (``chat_tools.arguments_values``, ``MAX_ARGUMENTS_VALUES``) first: the HTTP API and gRPC
refuse more naming the call (400 / INVALID_ARGUMENT), the data plane refuses more than
``MAX_WIRE_CALL_VALUES`` before parsing, and the scheduler, which only routes, parses none
(the node does). The HTTP tests run the real ``HttpServer`` and ``OpenAIEdge``; the servicer
stands in (as ``test_openai_api_body_bounds``'s) and parses each request on a worker thread as
``InferenceServicer.generate`` does.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from hypothesis import given, settings

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services import data_plane
from services.chat_tools import (
    MAX_ARGUMENTS_VALUES,
    MAX_WIRE_CALL_VALUES,
    arguments_values,
    json_shape,
    template_call,
    wire_messages,
)
from services.gateway_inputs import input_from_pb
from services.global_scheduler_admission import GlobalSchedulerService
from services.node_request import NodeRequest
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.context import CallAborted
from services.openai_api.logprobs import TokenTexts
from services.openai_api.server import HttpServer
from tests.test_openai_api_error_bounds import _JSON, _shape
from tests.test_openai_api_units import _AnyKey

HUGE = json.dumps({"a": [[]] * 2_600_000}, separators=(",", ":"))  # 7.8 MB: past 1 Mi characters
BIG = json.dumps({"a": [[]] * 250_000}, separators=(",", ":"))  # 0.75 MB: within them, 500,001 values
WITHIN = json.dumps({"a": [[]] * (MAX_ARGUMENTS_VALUES // 2 - 1)}, separators=(",", ":"))  # 32,767 values: within
USER = {"role": "user", "content": "weather?"}


def _calls(*arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{j}", "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for j, a in enumerate(arguments)]}


def _chat(*arguments: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 1, "messages": [USER, _calls(*arguments),
                                                        {"role": "tool", "tool_call_id": "call_0", "content": "21"}]}


# ---- the count, on the text -----------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(_JSON)
def test_json_shape_counts_what_json_parses_in_text_as_in_bytes(value: Any) -> None:
    text = json.dumps(value, ensure_ascii=False)
    strings, separators, containers = json_shape(text, 1 << 20)
    assert (strings, separators) == _shape(json.loads(text))
    assert json_shape(text.encode(), 1 << 20) == (strings, separators, containers)
    assert containers == text.count("[") + text.count("{") - sum(  # the brackets inside strings are not
        s.count("[") + s.count("{") for s in _strings(json.loads(text)))
    assert arguments_values(text) == separators + containers


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [*value, *(s for v in value.values() for s in _strings(v))]
    return [s for v in value for s in _strings(v)] if isinstance(value, list) else []


def test_arguments_values_counts_the_reviewers_texts_at_scan_speed() -> None:
    assert arguments_values(WITHIN) == MAX_ARGUMENTS_VALUES - 1
    assert arguments_values(BIG) == 500_001
    assert arguments_values(json.dumps(["x"] * 70_000)) == MAX_ARGUMENTS_VALUES + 1  # strings: not split
    assert arguments_values('{"s": "[[[,,,{{{"}') == 1 and arguments_values("not json, at all") == 1
    started = time.perf_counter()
    assert arguments_values(HUGE) == 5_200_001
    assert time.perf_counter() - started < 0.5  # ~5-10 ms; parsing it took 2-3.5 s


# ---- HTTP: /v1/chat/completions and /tokenize ------------------------------------------------

class _Servicer(_AnyKey):  # its ``auth`` and ``off_loop``
    """The servicer parts the edge uses: every key is tenant ``t``; a request is parsed on a
    worker thread (``InferenceServicer.generate``'s ``off_loop``) and, once parsed, refused
    UNAVAILABLE (no node); each parsed input is kept in ``parsed``."""

    templater = None

    def __init__(self) -> None:
        self.parsed: list[Any] = []

    async def generate(self, context: Any, parse: Any, writer: Any) -> AsyncIterator[object]:
        try:
            self.parsed.append(await self.off_loop("t", parse))
        except ValueError as exc:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        raise CallAborted(grpc.StatusCode.UNAVAILABLE, "no cache node is healthy")
        yield  # an async generator


async def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, Any], float]:
    """(status, JSON answer, seconds) of one POST on a connection of its own."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    await writer.drain()
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)).decode().split("\r\n")
    length = int(next(line.split(": ")[1] for line in head if line.lower().startswith("content-length")))
    answer = json.loads(await reader.readexactly(length))
    writer.close()
    return int(head[0].split()[1]), answer, time.perf_counter() - started


async def _longest_stall(work: Awaitable[Any]) -> tuple[Any, float]:
    """``work``'s result and the event loop's longest stall (seconds past a 5 ms sleep) meanwhile."""
    stalls = [0.0]

    async def tick() -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(0.005)
            stalls.append(time.perf_counter() - before - 0.005)

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        return await work, max(stalls)
    finally:
        ticker.cancel()


def _serve(servicer: _Servicer, tokens: TokenTexts | None, body: Callable[[int], Awaitable[None]]) -> None:
    async def run() -> None:
        server = HttpServer(create_app(OpenAIEdge(servicer, "m@0:f16", list, lambda: 1,  # type: ignore[arg-type]
                                                  tokens=tokens)))
        port = await server.start("127.0.0.1", 0)
        try:
            await body(port)
        finally:
            await server.stop()

    asyncio.run(run())


def test_http_chat_refuses_huge_arguments_quickly_and_serves_the_rest() -> None:
    """7.8 MB of arguments (past the prompt's characters): a 400 naming the call, the loop never
    stalled; 0.75 MB (within them, 500,001 values): a 400 naming it too; two calls of 20,000
    values each: the second named; 32,767 values and a small call: parsed, each reaching the
    template as an object (``template_call``). Before: the 7.8 MB body stalled the loop 2-3.5 s
    (400 after 3.5-5 s), the 0.75 MB one 250-480 ms and was accepted."""
    servicer = _Servicer()
    two = json.dumps({"a": [[]] * 10_000}, separators=(",", ":"))

    async def body(port: int) -> None:
        (status, answer, took), stall = await _longest_stall(
            _post(port, "/v1/chat/completions", json.dumps(_chat(HUGE)).encode()))
        assert stall < 1 and took < 3, (stall, took)  # (a loaded 2-core host: ~0.02-0.1 s, ~0.1-0.3 s; before 3.8-4.6 s, 5.8-7 s)
        assert status == 400 and answer["error"]["param"] == "messages.1.tool_calls.0.function.arguments", answer
        for arguments, param in (((BIG,), "messages.1.tool_calls.0.function.arguments"),
                                 ((two, two), "messages.1.tool_calls.1.function.arguments")):
            (status, answer, took), stall = await _longest_stall(
                _post(port, "/v1/chat/completions", json.dumps(_chat(*arguments)).encode()))
            assert status == 400 and answer["error"]["param"] == param, answer
            assert "JSON values" in answer["error"]["message"] and str(MAX_ARGUMENTS_VALUES) in answer["error"]["message"]
            assert stall < 0.5, stall
        assert servicer.parsed == []
        status, answer, _ = await _post(port, "/v1/chat/completions",
                                        json.dumps(_chat(WITHIN, '{"city": "Paris"}')).encode())
        assert status == 503, answer  # parsed, then no node
        calls = servicer.parsed[0].prompt[1]["tool_calls"]
        assert calls[0]["function"]["arguments"] == json.loads(WITHIN)
        assert calls[1]["function"]["arguments"] == {"city": "Paris"}

    _serve(servicer, None, body)


def test_http_tokenize_refuses_huge_arguments_quickly() -> None:
    """``/tokenize`` (no admission, no node) with the same calls: a 400 naming the call, the loop
    never stalled; a small call is tokenized. Before: parsed whole before its bounds (the 7.8 MB
    body stalled the loop 2.1-2.2 s, 400 after 4.4 s)."""
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))

    async def body(port: int) -> None:
        for arguments in (HUGE, BIG):
            request = {"model": "m", "messages": [USER, _calls(arguments)]}
            (status, answer, took), stall = await _longest_stall(_post(port, "/tokenize", json.dumps(request).encode()))
            assert stall < 1 and took < 3, (stall, took)
            assert status == 400 and answer["error"]["param"] == "messages.1.tool_calls.0.function.arguments", answer
        status, answer, _ = await _post(port, "/tokenize", json.dumps({"model": "m", "messages": [USER, _calls(
            '{"city": "Paris"}')]}).encode())
        # (this stand-in has no chat template: the chat passed every bound before that refusal)
        assert status == 400 and "no chat template" in answer["error"]["message"], answer

    _serve(_Servicer(), TokenTexts(tokenizer), body)


# ---- gRPC -------------------------------------------------------------------------------------

def _grpc(*arguments: str, session_id: str = "") -> inference_pb2.GenerateRequest:
    chat = inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role="user", content="weather?"),
        inference_pb2.ChatMessage(role="assistant", tool_calls=[
            inference_pb2.ToolCall(id=f"call_{j}", name="get_weather", arguments=a) for j, a in enumerate(arguments)]),
        inference_pb2.ChatMessage(role="tool", tool_call_id="call_0", content="21")])
    return inference_pb2.GenerateRequest(chat=chat, sampling=inference_pb2.SamplingParams(max_tokens=4),
                                         session_id=session_id)


@pytest.mark.parametrize("session_id", ["", "s-1"])
def test_grpc_refuses_huge_arguments_before_parsing_them(session_id: str) -> None:
    """0.75 MB of arguments (within the 1 Mi characters) and two calls of 20,000 values:
    INVALID_ARGUMENT (a ValueError) naming the call, in milliseconds; 32,767 values pass.
    Before: parsed (0.25-0.48 s holding the GIL) and served."""
    two = json.dumps({"a": [[]] * 10_000}, separators=(",", ":"))
    for arguments, named in (((BIG,), "chat.messages[1].tool_calls[0].arguments"),
                             ((two, two), "chat.messages[1].tool_calls[1].arguments")):
        started = time.perf_counter()
        with pytest.raises(ValueError, match="JSON values") as err:
            input_from_pb(_grpc(*arguments, session_id=session_id))
        assert str(err.value).startswith(named), err.value
        assert time.perf_counter() - started < 0.5
    call = input_from_pb(_grpc(WITHIN, session_id=session_id)).prompt[1]["tool_calls"][0]
    assert call["function"]["arguments"] == json.loads(WITHIN)


# ---- the data plane: the scheduler routes, the node parses -----------------------------------

def _admission(calls: list[dict[str, Any]] | str) -> bytes:
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "ok", "tool_call_id": "call_1"}, {"role": "user", "content": "and?"}]
    req = NodeRequest(request_id="ab12/r1", tenant="ab12", cache_namespace="tenant:ab12",
                      sampling=SamplingParams(max_tokens=1), messages=wire_messages(messages), session_id="ab12/s1")
    return data_plane.pack({"id": 1, "req": data_plane.request_to_wire(req), "sub": "tcp://127.0.0.1:9",
                            "hashes": []})


@pytest.fixture(scope="module")
def scheduler() -> Any:
    with tempfile.TemporaryDirectory(prefix="kv-toolargs-") as root:
        sched = GlobalSchedulerService(root, {"n0": 4})
        yield sched
        sched.store.close()


def test_the_scheduler_refuses_a_turn_of_huge_tool_calls_without_parsing_them(scheduler: Any) -> None:
    """A session turn whose call holds 0.75 MB of arguments (500,001 values) as the gateway
    sends it (``wire_messages``): refused as malformed naming the message's ``tool_calls``, in
    milliseconds, as the node refuses it. Before: the scheduler parsed it on its one admission
    loop (0.3-0.38 s a message) and answered on (no such tenant)."""
    payload = _admission(json.dumps([{"id": "call_1", "type": "function", "function": {  # (template_call's form)
        "name": "f", "arguments": json.loads(BIG)}}], separators=(",", ":")))
    started = time.perf_counter()
    reply = scheduler._answer(payload)
    took = time.perf_counter() - started
    assert "error" in reply and "request.messages[1].tool_calls" in reply["error"], reply
    assert f"more than {MAX_WIRE_CALL_VALUES} JSON values" in reply["error"]
    assert took < 0.5, took  # (~4 ms here, on a loaded host)
    with pytest.raises(ValueError, match="JSON values"):
        data_plane.request_from_wire(data_plane.unpack(payload)["req"])


def test_the_scheduler_routes_tool_calls_it_never_parses_and_the_node_checks_them(scheduler: Any) -> None:
    """Tool calls within the bounds but not of the shape a node renders (a call without an id):
    the scheduler takes the turn to its tenant check (it parses no tool call JSON: "no such
    tenant" here), the node's ``request_from_wire`` refuses it naming the field. Before: the
    scheduler parsed and checked them (refused it as malformed)."""
    payload = _admission('[{"type": "function", "function": {"name": "f", "arguments": "{}"}}]')
    reply = scheduler._answer(payload)
    assert "adm" in reply and reply["adm"]["code"] == "UNAUTHENTICATED", reply
    with pytest.raises(ValueError, match=r"request.messages\[1\].tool_calls\[0\] must be"):
        data_plane.request_from_wire(data_plane.unpack(payload)["req"])
    within = _admission([template_call("call_1", "f", WITHIN)])
    assert "adm" in scheduler._answer(within)
    req = data_plane.request_from_wire(data_plane.unpack(within)["req"])  # the node's parse: within bounds
    assert json.loads(req.messages[1]["tool_calls"])[0]["function"]["arguments"] == json.loads(WITHIN)


def test_grpc_refuses_tool_parameters_of_more_values_than_their_characters_allow_before_parsing() -> None:
    """A tool's ``parameters`` text (1.2 MB, within the 1.5 M characters as sent) of 400,000 empty
    lists: more JSON values than ``MAX_TOOLS_CHARS`` characters of compact JSON hold, refused
    naming ``tools`` in milliseconds. Before: parsed whole (~0.5-2 s holding the GIL), then refused
    for its compact JSON's characters."""
    parameters = json.dumps({"type": "object", "x": [[]] * 400_000}, separators=(",", ":"))
    request = _grpc('{"city": "Paris"}')
    request.tools.add(name="get_weather", parameters=parameters)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"^tools hold more than \d+ JSON values in their parameters"):
        input_from_pb(request)
    assert time.perf_counter() - started < 0.5
