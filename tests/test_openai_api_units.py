"""The OpenAI-compatible API's parts that need no cluster: stop strings over streamed text (the
node's ``cache_node.stop_strings``), request bodies, and gRPC statuses as OpenAI errors (issue 20)."""

from __future__ import annotations

import asyncio
import http.client
import json
import types
from collections.abc import Callable

import grpc
import pytest
from fastapi import FastAPI, Request
from pydantic import ValidationError

from cache_node.stop_strings import StopMatcher
from services.openai_api.app import MAX_BODY_BYTES, MAX_BODY_DEPTH, OpenAIEdge, create_app, invalid
from services.openai_api.context import CallAborted, HttpCallContext
from services.openai_api.responses import Generation
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from services.openai_api.server import HttpServer
from services.openai_api.stream_shape import StreamShape
from services.openai_api.streaming import _stream


def feed_all(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out if matcher.stopped else out + matcher.flush()


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. END", " more"], ["Hello world. E", "N", "D more"],
                                    ["H", "e", "l", "l", "o", " ", "w", "o", "r", "l", "d", ".", " ", "E", "N", "D"]])
def test_stop_string_across_increments_is_cut(pieces: list[str]) -> None:
    """A stop string split over increments is still found, and never sent."""
    matcher = StopMatcher(("END",))
    assert feed_all(matcher, pieces) == "Hello world. " and matcher.stopped


def test_held_back_prefix_is_released() -> None:
    """Text that only looked like a stop string's start goes out once it is clear (or at the end)."""
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("AR") == "STAR"
    assert matcher.feed("S") == "" and matcher.flush() == "S" and not matcher.stopped


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(("b", "xyz"))
    assert matcher.feed("axyzb") == "a" and matcher.stopped


def test_no_stops_pass_everything_through() -> None:
    assert StopMatcher(()).feed("abc") == "abc"


def _chat(**body: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **body})


def test_chat_body_as_generate_input() -> None:
    call = _chat(max_completion_tokens=5, temperature=0, top_p=0.5, seed=3, stop="x",
                 session_id="s", policy="snapkv", cache_salt="salt", prompt_cache_key="k", priority=-7).to_input()
    assert call.prompt == [{"role": "user", "content": "hi"}]
    assert (call.sampling.max_tokens, call.sampling.temperature, call.sampling.top_p, call.sampling.seed) == (
        5, 0, 0.5, 3)
    assert (call.session_id, call.policy, call.cache_salt, call.routing_key) == ("s", "snapkv", "salt", "k")
    assert call.sampling.stop == ("x",) and call.priority == -7  # both travel to the node
    assert _chat(stop=["a", "b"]).to_input().sampling.stop == ("a", "b") and _chat().to_input().priority == 0
    assert not call.fill_context and _chat().to_input().fill_context  # no max_tokens: up to the context limit
    parts = _chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]).to_input()
    assert parts.prompt == [{"role": "system", "content": "a\nb"}]


def test_text_parts_are_joined_with_newlines_as_vllm_joins_them() -> None:
    """Regression (oairev20 O1): parts were joined with nothing, so "Hello" + "World" reached
    the chat template as "HelloWorld" (32 prompt tokens, vLLM's "Hello\nWorld" 33): another
    prompt and answer than vLLM's. The parts' prompt is now the "\n"-joined string's."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    as_parts = _chat(messages=[{"role": "user", "content": parts}]).to_input().prompt
    as_text = _chat(messages=[{"role": "user", "content": "Hello\nWorld"}]).to_input().prompt
    assert as_parts == as_text == [{"role": "user", "content": "Hello\nWorld"}]
    one = _chat(messages=[{"role": "user", "content": parts[:1]}]).to_input().prompt
    assert one == [{"role": "user", "content": "Hello"}]  # one part: no separator


TOOL_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}{% if m.name %} name={{ m.name }}{% endif %}"
                 "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}]{{ m['content'] }}\n{% endfor %}")
"""A chat template that renders ``name`` and ``tool_call_id`` where a message has them (as
tool-calling models' templates read them: ``message.tool_call_id``)."""


def test_a_tool_result_with_its_tool_call_id_reaches_the_chat_template() -> None:
    """Review 25b N3: an OpenAI ``tool`` message with ``tool_call_id`` (how an agent returns a
    tool's result) was a 400 "unsupported field", and ``name`` was dropped. Now both reach the
    chat template as transformers' ``apply_chat_template`` takes them (vLLM's way); a
    ``tool_call_id`` on another role, or past 256 characters, is a 400 naming it."""
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir
    from services.chat import ChatTemplater

    messages = [{"role": "user", "content": "2+2?", "name": "ann"},
                {"role": "assistant", "content": "add(2, 2)"},
                {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"}]
    prompt = _chat(messages=messages).to_input().prompt
    assert prompt == messages
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    tokenizer.chat_template = TOOL_TEMPLATE
    assert ChatTemplater(tokenizer).render(prompt, add_generation_prompt=False) == (
        "[user name=ann]2+2?\n[assistant]add(2, 2)\n[tool name=add id=call_1]4\n")
    for bad, field, message in [
        ({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages.0.tool_call_id",
         "applies to tool messages (role \"tool\"), not to role 'user'"),
        ({"role": "tool", "content": "4", "tool_call_id": "c" * 257}, "messages.0.tool_call_id",
         "String should have at most 256 characters"),
        ({"role": "user", "content": "hi", "name": "n" * 257}, "messages.0.name",
         "String should have at most 256 characters"),
    ]:
        with pytest.raises(ValidationError) as info:
            _chat(messages=[bad])
        error = json.loads(invalid(info.value).body)["error"]
        assert (error["param"], error["message"]) == (field, f"{field}: {message}")


def test_assistant_tool_calls_reach_the_template_and_function_call_is_refused() -> None:
    """An assistant's ``tool_calls`` with ``content`` null (OpenAI's shape) are taken: the
    message reaches the template with content "" and its calls, ``arguments`` as an object
    (vLLM's way; ``services.openai_api.tools``). They were a 400 before tool calling was served.
    The deprecated ``function_call`` is a 400 naming it, also when ``content`` is null (which
    was named instead: ``messages.1.content: Input should be a valid string ...``)."""
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]
    prompt = _chat(messages=[{"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": None, "tool_calls": calls}]).to_input().prompt
    assert prompt[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}
    with pytest.raises(ValidationError) as info:
        _chat(messages=[{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{}"}}])
    error = json.loads(invalid(info.value).body)["error"]
    assert error["param"] == "messages.1.function_call"
    assert error["message"].startswith("messages.1.function_call: the deprecated function_call is not served")


def _streamed(chat: bool) -> list[dict]:
    """The SSE chunks of a stream of two text deltas ending "length", with its usage chunk."""
    async def events():
        for text in ("Hel", "lo"):
            yield {"type": "delta", "token_ids": [1], "text": text}
        yield {"type": "finished", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2}

    async def run() -> list[bytes]:
        started = {"type": "started", "prompt_tokens": 3}
        return [b async for b in _stream(Generation(events(), started, chat, "m", "r1"), StreamShape(usage=True))]

    raw = b"".join(asyncio.run(run())).decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(event.removeprefix("data: ")) for event in raw.split("\n\n")[:-2]]


def test_a_text_completion_stream_starts_with_its_text_as_vllms() -> None:
    """Review 25b N5: a ``/v1/completions`` stream began with a chunk of empty text (a chat's
    role chunk has no counterpart in a text completion; vLLM sends none). It now starts with
    the first text; the finish reason comes in a chunk of its own (see ``_stream``), then the
    usage chunk. A chat stream still starts with its role chunk."""
    chunks = _streamed(chat=False)
    assert [[(c["text"], c["finish_reason"]) for c in chunk["choices"]] for chunk in chunks] == [
        [("Hel", None)], [("lo", None)], [("", "length")], []]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and {c["object"] for c in chunks} == {"text_completion"}
    chat = _streamed(chat=True)
    assert [c["choices"][0]["delta"] for c in chat[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert chat[-2]["choices"][0]["finish_reason"] == "length"


def test_values_that_ask_for_what_the_server_does_are_accepted() -> None:
    """Regression (oairev20 O5): ``response_format: {"type": "text"}``, ``tool_choice: "none"``,
    ``store: false`` and a negative ``seed`` were 400s; each asks for what the request gets
    anyway (OpenAI and vLLM accept them). A negative seed is its two's complement."""
    call = _chat(response_format={"type": "text"}, tool_choice="none", store=False, seed=-1).to_input()
    assert call.sampling.seed == (1 << 64) - 1
    assert _chat(seed=-(1 << 63)).to_input().sampling.seed == 1 << 63
    assert _chat(seed=5).to_input().sampling.seed == 5


@pytest.mark.parametrize(("body", "field"), [
    ({"n": 2, "session_id": "s"}, "n"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tokens": 2, "max_completion_tokens": 2}, "max_tokens"), ({"messages": []}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),  # two constraints
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"store": True}, "store"),
])
def test_unsupported_values_name_their_field(body: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        _chat(**body).to_input()


@pytest.mark.parametrize(("body", "field"), [
    ({"tools": []}, "tools"), ({"metadata": {}}, "metadata"),
    ({"temperature": 3}, "temperature"), ({"stop": ["a"] * 5}, "stop"), ({"seed": -(1 << 63) - 1}, "seed"),
    ({"seed": 1 << 64}, "seed"),
    ({"stop": ["x" * 257]}, "stop"), ({"priority": "5"}, "priority"), ({"priority": 1.5}, "priority"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_tokens": -1}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_bodies_are_400_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        _chat(**body)
    response = invalid(info.value)
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and error["param"] == field and error["message"].startswith(f"{field}:")
    assert "Value error" not in error["message"] and "pydantic" not in error["message"]
    assert error["code"] == "invalid_argument"  # as every 400 (was invalid_value here, invalid_argument after)


@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty",
                                   "repetition_penalty"])
def test_a_nan_or_infinite_sampling_value_is_refused_as_not_finite(field: str) -> None:
    """Regression (review 24h M1): a NaN temperature was refused "temperature: Input should be
    less than or equal to 2", which it is not; it is now "should be a finite number"."""
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValidationError) as info:
            _chat(**{field: value})
        error = json.loads(invalid(info.value).body)["error"]
        assert (error["param"], error["message"]) == (field, f"{field}: Input should be a finite number")


@pytest.mark.parametrize(("messages", "field", "message"), [
    ([{"role": "user", "content": None}], "messages.0.content", "Input should be a valid string or a valid list"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text", "Field required"),
])
def test_a_union_field_is_named_as_the_client_wrote_it(messages: list, field: str, message: str) -> None:
    """A fresh-user trial: ``"content": null`` was refused as ``messages.0.content.str: Input
    should be a valid string`` (pydantic's union member tag in the field's name); the field is
    now named as sent, with what each member would accept, or the member that got further."""
    with pytest.raises(ValidationError) as info:
        _chat(messages=messages)
    error = json.loads(invalid(info.value).body)["error"]
    assert (error["param"], error["message"]) == (field, f"{field}: {message}")


def test_validator_messages_carry_no_library_text() -> None:
    """Fault: a validator's ValueError reached the client as pydantic's "stop: Value error, at
    most 4 ..."; the message is now the validator's own text after the field."""
    with pytest.raises(ValidationError) as info:
        _chat(stop=["a"] * 5)
    assert json.loads(invalid(info.value).body)["error"]["message"] == (
        "stop: at most 4 stop strings are allowed, got 5")


class _AnyKey:
    """The servicer part ``OpenAIEdge.parse`` reaches before the body: every key is a tenant's,
    and a big body is parsed on a thread (``InferenceServicer.off_loop``)."""

    class auth:  # stands in for the servicer's ``auth`` attribute
        @staticmethod
        async def tenant(context: object) -> object:
            return types.SimpleNamespace(tenant_id="t")

    @staticmethod
    async def off_loop(tenant_id: str, work: Callable[[], object]) -> object:
        return await asyncio.to_thread(work)


def _call(method: str, path: str, chunks: tuple[bytes, ...] = (), headers: tuple[tuple[str, str], ...] = ()
          ) -> tuple[int, dict[str, str], dict]:
    """One request straight through the app's ASGI interface: (status, headers, JSON body);
    ``chunks``: the body, as the client sends it."""
    edge = OpenAIEdge(servicer=_AnyKey(), model_id="m@0:f16", encode=list, num_healthy=lambda: 1)  # type: ignore[arg-type]
    app, sent = create_app(edge), []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http",
             "headers": [(k.encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "root_path": ""}
    parts = list(chunks) or [b""]

    async def receive() -> dict:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], headers, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.mark.parametrize(("method", "path", "status", "kind"), [
    ("GET", "/v1/chat/completions", 405, "invalid_request_error"), ("GET", "/metrics", 404, "not_found_error"),
    ("POST", "/health", 405, "invalid_request_error"),
])
def test_framework_errors_in_openai_shape(method: str, path: str, status: int, kind: str) -> None:
    """Fault: FastAPI's own 404/405 answered {"detail": "Not Found"}, which OpenAI clients cannot
    read; they are now {"error": {"message", "type", "param", "code"}} (405 keeps ``Allow``)."""
    got, headers, body = _call(method, path)
    assert got == status and set(body) == {"error"} and body["error"]["type"] == kind
    assert path in body["error"]["message"] and body["error"]["code"] in ("not_found", "method_not_allowed")
    if status == 405:
        assert method not in headers["allow"] and headers["allow"]


def test_completion_prompt_forms() -> None:
    encode = lambda text: [len(w) for w in text.split()]  # a stand-in tokenizer: word lengths
    assert CompletionRequest(model="m", prompt="ab cde").to_input(encode).prompt == [2, 3]
    assert CompletionRequest(model="m", prompt=[[5, 6]]).to_input(encode).prompt == [5, 6]
    assert CompletionRequest(model="m", prompt="a").to_input(encode).sampling.max_tokens == 16  # OpenAI's default
    with pytest.raises(ValueError, match="only one prompt per request is supported, got 2"):
        CompletionRequest(model="m", prompt=["a", "b"])  # refused before either is validated
    # echo is served: an echoed prompt's logprobs ask the node for prompt logprobs (at least k)
    assert CompletionRequest(model="m", prompt="a", echo=True).to_input(encode).sampling.prompt_logprobs is None
    assert CompletionRequest(model="m", prompt="a", echo=True, logprobs=2,
                             prompt_logprobs=1).to_input(encode).sampling.prompt_logprobs == 2
    assert CompletionRequest(model="m", prompt="a", echo=True, max_tokens=0).to_input(encode).sampling.max_tokens == 1
    with pytest.raises(ValueError, match="^max_tokens:"):
        CompletionRequest(model="m", prompt="a", max_tokens=0).to_input(encode)


def test_statuses_as_openai_errors() -> None:
    refused = CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after_ms=1500).response()
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert json.loads(refused.body)["error"] == {"message": "queue full", "type": "rate_limit_error",
                                                 "param": None, "code": "resource_exhausted"}
    for code, status in ((grpc.StatusCode.UNAUTHENTICATED, 401), (grpc.StatusCode.INVALID_ARGUMENT, 400),
                         (grpc.StatusCode.NOT_FOUND, 404), (grpc.StatusCode.UNAVAILABLE, 503),
                         (grpc.StatusCode.INTERNAL, 500)):
        assert CallAborted(code, "x").response().status_code == status


def _chat_body(**fields: object) -> dict:
    """A chat body valid but for its model (the app answers it 404 after parsing it)."""
    return {"model": "other", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_a_body_over_the_limit_is_413_before_it_is_buffered() -> None:
    """Regression: bodies were parsed whole whatever their size (48 MB held the shared event
    loop 3.9 s); one over ``MAX_BODY_BYTES`` is refused by its Content-Length, or, sent
    without one, as soon as that many bytes came."""
    declared = str(MAX_BODY_BYTES + 1)
    status, _, body = _call("POST", "/v1/chat/completions", (b"{",), (("content-length", declared),))
    assert status == 413 and body["error"]["code"] == "request_too_large" and declared in body["error"]["message"]
    mib = b" " * (1 << 20)
    status, _, body = _call("POST", "/v1/completions", (b"{",) + (mib,) * (MAX_BODY_BYTES >> 20))
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    status, _, body = _call("POST", "/v1/chat/completions", (json.dumps(_chat_body()).encode(), mib))
    assert status == 404  # under the limit, chunks and all: parsed


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b"[" * 100_000, b'{"model": "m\xff"}',
                                 b"\xef\xbb\xbf{}"])
def test_nesting_and_bytes_that_are_no_json_text_are_400(raw: bytes) -> None:
    """Regression: 100k nested arrays raised RecursionError (a 500); bytes that are not UTF-8
    are no JSON text either. Balanced nesting that deep is refused before it is parsed, naming
    ``MAX_BODY_DEPTH`` (review s35 E F1)."""
    status, _, body = _call("POST", "/v1/chat/completions", (raw,))
    deep = raw.endswith(b"]")
    assert status == 400 and body["error"]["message"].startswith(
        f"body: nests arrays and objects more than {MAX_BODY_DEPTH} levels deep" if deep else "body: not valid JSON")


@pytest.mark.parametrize("field", ["session_id", "cache_salt", "prompt_cache_key", "stop", "content", "model"])
def test_a_lone_surrogate_in_any_string_is_400(field: str) -> None:
    """Regression: ``"\\ud800"`` is valid JSON but no UTF-8 text; it passed the schema and
    raised UnicodeEncodeError in msgpack or the block hashes (a plain-text 500)."""
    lone = "a\ud800b"
    body = _chat_body(messages=[{"role": "user", "content": lone}]) if field == "content" else _chat_body(
        **{field: lone})
    status, _, out = _call("POST", "/v1/chat/completions", (json.dumps(body).encode(),))
    assert status == 400 and "surrogate" in out["error"]["message"]
    paired = _chat_body(messages=[{"role": "user", "content": "\ud83d\ude00"}])  # an emoji: a valid pair
    assert _call("POST", "/v1/chat/completions", (json.dumps(paired).encode(),))[0] == 404


def test_a_client_gone_before_a_whole_reply_is_499_and_aborts_the_generation() -> None:
    """Regression: the handler read the result of the generation task it had just cancelled,
    before the cancellation landed: InvalidStateError, a traceback in the gateway's log."""
    from services.openai_api.app import _whole

    closed: list[bool] = []

    class Endless:
        async def pieces(self):  # type: ignore[no-untyped-def]
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield "x"
            finally:
                closed.append(True)  # the stream was closed: the request is aborted on its node

    class Gone:
        def __init__(self) -> None:
            self.calls = 0

        async def receive(self) -> dict:
            self.calls += 1
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    response = asyncio.run(_whole(Endless(), Gone()))  # type: ignore[arg-type]
    assert response.status_code == 499 and json.loads(response.body)["error"]["code"] == "cancelled"
    assert closed == [True]


@pytest.mark.parametrize("trusted, expected", [(None, ["127.0.0.1"] * 2), ("127.0.0.1", ["127.0.0.1", "203.0.113.7"])])
def test_forwarded_for_counts_only_from_configured_proxies(trusted: str | None, expected: list[str]) -> None:
    """Regression (secrev16 fault B): uvicorn's proxy headers were on, trusting 127.0.0.1, so
    any loopback client chose its own address (the key of the auth failure limit) with
    X-Forwarded-For. Off unless the operator names trusted proxies (``forwarded_allow_ips``)."""
    probe = FastAPI()

    @probe.get("/peer")
    async def peer(request: Request) -> dict[str, str]:
        return {"peer": HttpCallContext(request).peer().split(":")[1]}

    def get(port: int, headers: dict[str, str]) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/peer", headers=headers)
            return json.loads(conn.getresponse().read())["peer"]
        finally:
            conn.close()

    async def run() -> list[str]:
        server = HttpServer(probe, forwarded_allow_ips=trusted)
        port = await server.start("127.0.0.1", 0)
        try:
            return [await asyncio.to_thread(get, port, h) for h in ({}, {"X-Forwarded-For": "203.0.113.7"})]
        finally:
            await server.stop()

    assert asyncio.run(run()) == expected
