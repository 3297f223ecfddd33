"""A structured fuzz of the OpenAI-compatible HTTP API (``services.openai_api.app``: every route)
over real sockets against the real server on a real node (``Edge``: the tiny Llama, the
scheduler's admission, the gateway's servicer, without Ray). Every byte is the network's:
bodies mutated field by field (wrong types, huge / negative / NaN / inf numbers, deep nesting,
huge strings, lone surrogates, NUL and control characters, unknown fields, duplicate keys),
broken framing (truncated or invalid JSON, wrong or no content type, wrong charset, a short
body, chunked bodies ending early, oversized bodies), headers with CR / LF, many headers and
bad Authorization forms, and paths of the GET / DELETE routes.

The invariants (``check_answer``): every answer comes within ``ANSWER_S`` and is a success of
its route's shape or an error in OpenAI's shape, never a 5xx, never a traceback or a server path
in its body; a 400 about a body field names it in ``param``. After the fuzz the node holds no
request and no block (its pool's integrity checked) and a greedy request's text is what it was
before (``test_after_the_fuzz_the_node_is_clean_and_greedy_output_unchanged``).

The suite runs a derandomized, modest number of examples; ``HTTP_FUZZ_EXAMPLES`` (random
seeds when set) runs a longer hunt.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import socket
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.chat import encode_text
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.bodies import MAX_BODY_BYTES
from services.openai_api.logprobs import TokenTexts
from tests.loop_plane import call, wait_for
from tests.test_logprobs_served import Served

HUNT = int(os.environ.get("HTTP_FUZZ_EXAMPLES", "0"))
"""Examples per fuzz test in a hunt (0: the suite's derandomized ``SUITE_EXAMPLES``)."""
SUITE_EXAMPLES = 40
ANSWER_S = 20.0
"""Seconds within which every answer must have come whole (the tiny model's longest
generation here takes a fraction of it)."""
MAX_TOKENS_CAP = 8
"""Generations a fuzzed body may run are kept short: ``max_tokens`` a mutation does not name is
this (the fuzz is about the bytes, not about the model's speed)."""

LEAKS = re.compile(r"Traceback|File \"|/work/|site-packages|\.py\b|<module>|object at 0x")
"""What an answer's body must not show: a traceback, a server path or a Python repr."""


def fuzz_settings(examples: int = SUITE_EXAMPLES) -> settings:
    return settings(max_examples=HUNT or examples, derandomize=not HUNT, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    seconds: float


def exchange(port: int, request: bytes, timeout_s: float = ANSWER_S, half_close: bool = False,
             method: str = "POST") -> Answer | None:
    """Send ``request``'s bytes on a new connection (``half_close``: then shut our side's
    writing, as a client whose body ended early) and read the answer whole; None when the server
    closed the connection without one (h11's own refusal of a malformed request may do so)."""
    t0 = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        try:
            sock.sendall(request)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent: its answer may still be readable
        resp = http.client.HTTPResponse(sock, method=method)
        try:
            resp.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError):
            return None
        body = resp.read()
        assert time.monotonic() - t0 < timeout_s, f"answer took {time.monotonic() - t0:.1f}s"
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body, time.monotonic() - t0)
    except TimeoutError:
        raise AssertionError(f"no whole answer within {timeout_s}s to {request[:300]!r}") from None
    finally:
        sock.close()


def raw_request(method: str, path: str, body: bytes | None, headers: dict[str, str] | list[tuple[str, str]],
                content_length: bool = True) -> bytes:
    """An HTTP/1.1 request's bytes (``Connection: close``)."""
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    lines = [f"{method} {path} HTTP/1.1"] + ([] if any(k == "Host" for k, _ in pairs) else ["Host: fuzz"])
    lines += [f"{k}: {v}" for k, v in pairs]
    if body is not None and content_length:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
    return head + (body or b"")


def check_answer(answer: Answer | None, what: str, field: str | None = None) -> dict[str, Any] | None:
    """The invariants of one answer (None: the connection was closed without one, as h11 does
    for framing it cannot parse; allowed). Returns the error object of a refusal, else None.

    ``field``: the top-level body field the request's one mutation was in; a 400 with code
    ``invalid_argument`` must then name a ``param``, unless it refuses the whole body's shape
    ("body: ...": ``bodies.check_body_shape``'s bounds, counted before any field is parsed)."""
    if answer is None:
        return None
    text = answer.body.decode("utf-8", "replace")
    assert answer.status < 500 or answer.status == 503 and "no cache node" in text, \
        f"{what}: {answer.status} {text[:500]}"
    assert not LEAKS.search(text), f"{what}: the answer shows the server's insides: {text[:800]}"
    if answer.status >= 400:
        try:
            error = json.loads(answer.body)["error"]
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"{what}: {answer.status} not in OpenAI's error shape: {text[:500]}") from None
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], (what, error)
        assert isinstance(error.get("type"), str) and "param" in error and "code" in error, (what, error)
        assert error["param"] is None or isinstance(error["param"], str), (what, error)
        whole_body = error["message"].startswith("body: ")  # a bound of the whole body's shape or size
        if field is not None and answer.status == 400 and error.get("code") == "invalid_argument" and not whole_body:
            assert error["param"], f"{what}: a 400 about a body field names no param: {error}"
        return error
    assert answer.status in (200,), f"{what}: {answer.status} {text[:300]}"
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = [b[len("data: "):] for b in text.split("\n\n") if b.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: a stream not ended by [DONE]: {text[-300:]}"
        for data in events[:-1]:
            json.loads(data)
    else:
        json.loads(answer.body)
    return None


# -- values a mutation puts into a body --------------------------------------------------------

def nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


NASTY_STRINGS = st.sampled_from([
    "", "\x00", "a\x00b", "\ud800", "\udfff", "x\ud83d", "\u202e\u200b", "\r\n", "\x1b[31m", "\x7f",
    "%s%n", "{{7*7}}", "<|endoftext|>", "</s>", "\\", "\"", "null", "NaN", "-1", "1e309", "9" * 400,
    "a" * 70_000, "\u00e9" * 5000, "\U0001f600" * 3000,
]) | st.text(max_size=40)
NASTY_NUMBERS = st.sampled_from([
    0, -1, 1, 2, 3, -(2 ** 31), 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, 10 ** 400,
    0.0, -0.0, 0.5, 1.5, -1.5, 1e308, -1e308, 5e-324, float("nan"), float("inf"), float("-inf"),
    True, False,
]) | st.integers() | st.floats()
NASTY_SHAPES = st.sampled_from([None, [], {}, [None], [[]], [{}], {"": None}, nested(40), nested(200),
                                [1] * 5000, ["a"] * 3000, {f"k{i}": i for i in range(3000)},
                                [{"type": "text", "text": "x"}], {"type": "json_schema"}])
NASTY = st.one_of(NASTY_STRINGS, NASTY_NUMBERS, NASTY_SHAPES,
                  st.lists(st.one_of(NASTY_STRINGS, NASTY_NUMBERS), max_size=6),
                  st.dictionaries(NASTY_STRINGS, NASTY_NUMBERS | NASTY_STRINGS, max_size=4))

TOOL = {"type": "function", "function": {"name": "get", "description": "d",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
PLAUSIBLE: dict[str, Any] = {
    # per field, values of the right type at and past their bounds
    "n": st.sampled_from([1, 2, 16, 17, 1000, 2 ** 40]),
    "max_tokens": st.sampled_from([1, 2 ** 31, 10 ** 9, 2 ** 63]),
    "max_completion_tokens": st.sampled_from([1, 2 ** 31, 10 ** 12]),
    "logprobs": st.sampled_from([True, 0, 5, 20, 21, 10 ** 6]),
    "top_logprobs": st.sampled_from([0, 5, 20, 21, 10 ** 6]),
    "logit_bias": st.sampled_from([{"1": 100}, {"1": 101}, {"-1": 1}, {"999999999": 1}, {"x": 1},
                                   {str(i): 1 for i in range(2000)}, {"1": "nan"}]),
    "stop": st.sampled_from([["\n"], [""], ["a"] * 5, ["a"] * 100, "x" * 100_000, [["a"]], [None]]),
    "tools": st.sampled_from([[TOOL], [TOOL] * 200, [{"type": "function"}], [{"type": "x", "function": {}}],
                              [{"type": "function", "function": {"name": "a" * 10_000}}],
                              [{"type": "function", "function": {"name": "f", "parameters": nested(500)}}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", "x", {"type": "function", "function": {}},
                                    {"type": "function", "function": {"name": "nope"}}]),
    "response_format": st.sampled_from([
        {"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {"type": "nope"},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": nested(300)}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "(a*)*b"}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "minItems": 10 ** 9}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "maxLength": 10 ** 12}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": []}}},
    ]),
    "temperature": st.sampled_from([0, 2, 2.0001, 1e30]),
    "top_p": st.sampled_from([0, 1e-30, 1, 1.0001]),
    "seed": st.sampled_from([0, -1, 2 ** 63, 2 ** 64]),
    "stream": st.sampled_from([True, False]),
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": "yes"}, {"x": 1}]),
    "echo": st.sampled_from([True, False]),
    "best_of": st.sampled_from([1, 2, 100]),
    "suffix": st.sampled_from(["x", ""]),
    "cache_salt": st.sampled_from(["s", "", "a" * 10_000, "\x00"]),
    "prompt": st.sampled_from(["", [], [[]], [0], [-1], [2 ** 40], [[1, 2], [3]], ["a", "b"], "x" * 200_000,
                               list(range(5000))]),
    "messages": st.sampled_from([
        [], [{"role": "user"}], [{"role": "nope", "content": "x"}], [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
                                                               "function": {"name": "f", "arguments": "{"}}]}],
        [{"role": "tool", "content": "x", "tool_call_id": "nope"}],
        [{"role": "user", "content": "x"}] * 5000,
    ]),
    "tokens": st.sampled_from([[], [-1], [2 ** 40], [1.5], ["a"], list(range(100_000))]),
}

ROUTES = {
    "/v1/chat/completions": lambda model: {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4},
    "/v1/completions": lambda model: {"model": model, "prompt": "hello there", "max_tokens": 4},
    "/tokenize": lambda model: {"model": model, "prompt": "hello"},
    "/detokenize": lambda model: {"model": model, "tokens": [300, 301, 302]},
}
FIELDS = sorted(set(PLAUSIBLE) | {"model", "user", "presence_penalty", "frequency_penalty", "min_p", "top_k",
                                  "ignore_eos", "prefix_messages", "prefix_tokens", "parallel_tool_calls",
                                  "add_special_tokens", "session_id", "metadata", "stream_options",
                                  "unknown_field", "__proto__", ""})


def encode(body: Any) -> bytes:
    """``body`` as JSON text (NaN / Infinity as Python writes them: not JSON; lone surrogates as
    ``\\udXXX`` escapes)."""
    return json.dumps(body).encode()


@st.composite
def field_mutations(draw: st.DrawFn, model: str) -> tuple[str, dict[str, Any], str]:
    """A route, a valid body with one field mutated (or dropped) and up to two others set to
    values of their type at or past their bounds (``PLAUSIBLE``: streams with n, logprobs and
    tools together), and the first field."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = ROUTES[path](model)
    field = draw(st.sampled_from(FIELDS + list(body)))
    how = draw(st.sampled_from(["nasty", "plausible", "drop", "nested"]))
    if how == "drop":
        body.pop(field, None)
    elif how == "plausible" and field in PLAUSIBLE:
        body[field] = draw(PLAUSIBLE[field])
    elif how == "nested" and field in ("messages", "tools") and path == "/v1/chat/completions":
        container = body.setdefault(field, [TOOL] if field == "tools" else body["messages"])
        item = dict(container[0])
        key = draw(st.sampled_from(sorted(item) + ["name", "tool_calls", "function", "x"]))
        item[key] = draw(NASTY)
        body[field] = [item]
    else:
        body[field] = draw(NASTY)
    for other in draw(st.lists(st.sampled_from(sorted(set(PLAUSIBLE) - {field})), max_size=2, unique=True)):
        body[other] = draw(PLAUSIBLE[other])
    if body.get("max_tokens") == 4 or "max_tokens" not in body:
        body.setdefault("max_tokens", MAX_TOKENS_CAP)
    if field != "max_completion_tokens":
        body.pop("max_completion_tokens", None)
    return path, body, field


class Edge(Served):
    """``Served`` (one node, the scheduler, the gateway's servicer with the tiny model's chat
    template) with an HTTP API whose ``encode`` is the gateway's tokenizer and whose "auto"
    tool calls are read by the hermes parser, as ``gateway_server._start_http`` builds it."""

    def __init__(self) -> None:
        super().__init__()
        info = self.node.describe()
        self.api = HttpServer(create_app(OpenAIEdge(self.servicer, info["model_id"],
                                                    lambda text: encode_text(self.tokenizer, text), lambda: 1,
                                                    tokens=TokenTexts(self.tokenizer), tool_call_parser="hermes")))
        self.port = self.run(self.api.start("127.0.0.1", 0))
        self.sessions: set[tuple[str, str]] = set()  # (session_id, cache_salt) the fuzzed bodies named

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:  # type: ignore[override]
        answer = exchange(self.port, raw_request("POST", path, encode(body), auth(self)))
        assert answer is not None
        return answer.status, json.loads(answer.body)

    def assert_all_freed(self) -> None:
        """Nothing runs or waits on the node, the scheduler holds nothing in flight, the gateway
        no stream, and every pool block is free (cached ones included) but those of the sessions
        a fuzzed body opened (a ``session_id`` a client names holds its history until it is
        closed or expires, by design), the pool's integrity checked. Then each session a body
        named is closed (``DELETE /v1/sessions/{id}?cache_salt=``, answered in shape) and no
        session and no block is held."""
        def idle() -> bool:
            stats = self.node.stats()
            return (stats["running"], stats["waiting"]) == (0, 0) and not self.servicer.streams._pending \
                and self.run(call(self.scheduler.stats))["in_flight"]["n0"] == 0 \
                and not self.servicer.open_streams and not self.servicer._in_flight and not self.node._streams
        wait_for(idle, 10.0)
        stats = self.run(self.node.integrity_stats())
        assert stats["integrity_ok"], stats
        assert stats["num_blocks"] - stats["free_blocks"] - stats["cached_blocks"] <= stats["session_blocks"], stats
        for session_id, salt in sorted(self.sessions):
            path = f"/v1/sessions/{urllib.parse.quote(session_id, safe='')}"
            if salt:
                path += f"?cache_salt={urllib.parse.quote(salt, safe='')}"
            check_answer(exchange(self.port, raw_request("DELETE", path, None, auth(self)), method="DELETE"),
                         f"DELETE {path[:200]}")
        self.sessions.clear()
        stats = self.run(self.node.integrity_stats())
        assert stats["integrity_ok"] and stats["sessions"] == 0, stats
        assert stats["num_blocks"] - stats["free_blocks"] - stats["cached_blocks"] == 0, stats

    async def close_gateways(self) -> None:
        await self.api.stop()
        await super().close_gateways()


@pytest.fixture(scope="module")
def edge() -> Iterator[Edge]:
    e = Edge()
    yield e
    e.close()


@pytest.fixture(scope="module")
def greedy_before(edge: Edge) -> str:
    """The greedy text of a plain completion before any fuzz."""
    return greedy_text(edge)


def greedy_text(edge: Edge) -> str:
    status, answer = edge.post("/v1/completions", {"model": edge.model, "prompt": "The fuzz is over",
                                                   "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, answer
    return answer["choices"][0]["text"]


def auth(edge: Edge) -> dict[str, str]:
    return {"Authorization": f"Bearer {edge.key}", "Content-Type": "application/json"}


def no_internal_errors(caplog: pytest.LogCaptureFixture) -> None:
    """No error was logged while the test ran: an internal error the client never saw (it had
    gone) is one all the same."""
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, failed


def test_fuzzed_body_fields_are_answered_in_shape(edge: Edge, greedy_before: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """One field of each route's valid body mutated at a time: each answer a success or an
    OpenAI error (a 400 naming the field's ``param``), never a 5xx or the server's insides."""

    @fuzz_settings(SUITE_EXAMPLES * 3 // 2)
    @given(st.data())
    def run(data: st.DataObject) -> None:
        path, body, field = data.draw(field_mutations(edge.model))
        if isinstance(body.get("session_id"), str):
            salt = body.get("cache_salt")
            edge.sessions.add((body["session_id"], salt if isinstance(salt, str) else ""))
        request = raw_request("POST", path, encode(body), auth(edge))
        check_answer(exchange(edge.port, request), f"{path} {field}={str(body.get(field))[:200]!r}", field)

    run()
    no_internal_errors(caplog)


JSON_TEXTS = st.sampled_from([
    b"", b"{", b"[", b"}", b"null", b"1", b"\"x\"", b"[]", b"{\"model\":", b"{\"model\": \"x\",}",
    b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"{\"a\":\"\xc3\x28\"}", b"{\"prompt\": \"\\ud800\"}",
    b"{\"prompt\": \"\\u0000\"}", b"{\"prompt\": \"\\uZZZZ\"}", b"{'prompt': 'x'}", b"NaN", b"{\"n\": NaN}",
    b"{\"max_tokens\": Infinity}", b"{\"max_tokens\": 1e999999}", b"{\"max_tokens\": 1" + b"0" * 5000 + b"}",
    b"[" * 100_000, b"{\"a\":" * 50_000, b"\x00" * 100,
])


@st.composite
def framings(draw: st.DrawFn, edge: Edge) -> tuple[bytes, bool, str]:
    """A request whose bytes are wrong: its JSON, its content type, its length, its chunking,
    its headers or its credentials. Returns (bytes, half_close, what)."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = ROUTES[path](edge.model)
    valid = encode(body)
    headers: list[tuple[str, str]] = list(auth(edge).items())
    kind = draw(st.sampled_from(["json", "duplicate", "content_type", "short", "chunked", "oversized",
                                 "header_crlf", "many_headers", "authorization", "charset", "utf16"]))
    half_close = False
    if kind == "json":
        return raw_request("POST", path, draw(JSON_TEXTS), headers), False, kind
    if kind == "duplicate":
        dup = valid[:-1] + b", \"model\": " + json.dumps(draw(NASTY)).encode() + b", \"max_tokens\": 3}"
        return raw_request("POST", path, dup, headers), False, kind
    if kind == "content_type":
        value = draw(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                      "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                                      "application/jsonx", "", "*/*", "application/json\x00"]))
        headers = [(k, v) for k, v in headers if k != "Content-Type"]
        if value is not None:
            headers.append(("Content-Type", value))
        return raw_request("POST", path, valid, headers), False, kind
    if kind == "charset":
        headers = [(k, v) for k, v in headers if k != "Content-Type"] + [
            ("Content-Type", "application/json; charset=utf-16")]
        return raw_request("POST", path, valid, headers), False, kind
    if kind == "utf16":
        text = valid.decode().encode(draw(st.sampled_from(["utf-16", "utf-32", "utf-16-be", "latin-1"])))
        return raw_request("POST", path, text, headers), False, kind
    if kind == "short":  # Content-Length promises more than comes, then the client stops writing
        cut = draw(st.integers(0, len(valid) - 1))
        headers.append(("Content-Length", str(len(valid) + draw(st.integers(1, 10 ** 6)))))
        return raw_request("POST", path, valid[:cut], headers, content_length=False), True, kind
    if kind == "chunked":  # chunked, ending early (or with a bad chunk size)
        headers.append(("Transfer-Encoding", "chunked"))
        cut = draw(st.integers(0, len(valid)))
        tail = draw(st.sampled_from([b"", b"0\r\n", b"zz\r\n", b"ffffffffffffffffff\r\nab", b"5\r\nab"]))
        chunks = f"{cut:x}\r\n".encode() + valid[:cut] + b"\r\n" + tail
        return raw_request("POST", path, chunks, headers, content_length=False), True, kind
    if kind == "oversized":
        size = MAX_BODY_BYTES + draw(st.sampled_from([1, 1 << 20]))
        headers.append(("Content-Length", str(size)))
        return raw_request("POST", path, b"{\"prompt\": \"" + b"a" * 1000, headers, content_length=False), True, kind
    if kind == "header_crlf":
        value = draw(st.sampled_from(["a\rb", "a\nb", "a\r\nX-Injected: 1", "\x00", "a\x7fb", "\xff"]))
        name = draw(st.sampled_from(["X-Request-Id", "Authorization", "X-Foo", "Content-Type"]))
        if name == "Authorization":
            value = f"Bearer {edge.key}{value}"
        headers = [(k, v) for k, v in headers if k != name] + [(name, value)]
        return raw_request("POST", path, valid, headers), False, kind
    if kind == "many_headers":
        count = draw(st.sampled_from([100, 1000, 5000]))
        size = draw(st.sampled_from([1, 100, 10_000]))
        headers += [(f"X-H{i}", "v" * size) for i in range(count)]
        return raw_request("POST", path, valid, headers), False, kind
    # authorization
    value = draw(st.sampled_from([
        None, "", "Bearer", "Bearer ", "bearer " + edge.key, "BEARER " + edge.key, "Basic " + edge.key,
        "Bearer  " + edge.key, "Bearer " + edge.key + " x", "Bearer " + "a" * 100_000, "Bearer \u00e9\u00e9",
        "Bearer " + edge.key[:-1], "Bearer " + edge.key + edge.key, "Token " + edge.key, "Bearer\t" + edge.key,
    ]))
    headers = [(k, v) for k, v in headers if k != "Authorization"]
    if value is not None:
        headers.append(("Authorization", value))
    if draw(st.booleans()):
        headers.append(("Authorization", f"Bearer {edge.key}"))  # twice
    return raw_request("POST", path, valid, headers), half_close, kind


def test_broken_framing_headers_and_credentials_are_answered_in_shape(edge: Edge, greedy_before: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Wrong JSON, content types, lengths, chunking, headers and credentials: each answer in
    shape (or the connection closed by h11 without one), none a 5xx, none hanging."""

    @fuzz_settings()
    @given(st.data())
    def run(data: st.DataObject) -> None:
        request, half_close, kind = data.draw(framings(edge))
        check_answer(exchange(edge.port, request, half_close=half_close), f"{kind}: {request[:300]!r}")

    run()
    time.sleep(0.2)  # (the server's side of the last request ends on its loop)
    no_internal_errors(caplog)


PATH_PARTS = st.sampled_from(["", "x", "%00", "%2F", "..", "%2e%2e", "a" * 5000, "%ff", "%ud800", "\u00e9",
                              "?cache_salt=", "?cache_salt=a&cache_salt=b", "?cache_salt=%00", "#x", "//",
                              "s" * 300, "%20", "{model}"]) | st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="?#%"), max_size=20)


def test_fuzzed_paths_and_methods_of_every_route_are_answered_in_shape(edge: Edge, greedy_before: str) -> None:
    """Every route (and unknown ones) with fuzzed path parts, query strings and methods:
    ``/v1/models``, ``/v1/models/{model}``, ``DELETE /v1/sessions/{id}``, ``/health``,
    ``/metrics``, the POST routes with GET."""

    @fuzz_settings()
    @given(st.sampled_from(["GET", "DELETE", "POST", "PUT", "HEAD", "OPTIONS", "PATCH"]),
           st.sampled_from(["/v1/models", "/v1/models/", "/v1/sessions/", "/health", "/metrics",
                            "/v1/chat/completions", "/tokenize", "/", "/v1/"]),
           st.lists(PATH_PARTS, max_size=3), st.booleans())
    def run(method: str, base: str, parts: list[str], with_key: bool) -> None:
        path = base + "".join(parts)
        path = "".join(c if 0x20 < ord(c) < 0x7f else "%" + "%".join(f"{b:02X}" for b in c.encode(
            "utf-8", "surrogatepass")) for c in path) or "/"
        headers = auth(edge) if with_key else {}
        body = b"{}" if method in ("POST", "PUT", "PATCH") else None
        answer = exchange(edge.port, raw_request(method, path, body, headers), method=method)
        if method == "HEAD" and answer is not None:  # no body: its status alone
            assert answer.status < 500, (path, answer)
        else:
            check_answer(answer, f"{method} {path[:300]}")

    run()


def test_a_slow_body_is_answered_or_cut_within_bound(edge: Edge) -> None:
    """A body that trickles in (a byte every 50 ms, then stops): the server answers once it is
    whole, or in shape when the client stops writing; never a 5xx."""
    body = encode(ROUTES["/tokenize"](edge.model))
    head = raw_request("POST", "/tokenize", None, auth(edge)).removesuffix(b"\r\n")
    head += f"Content-Length: {len(body)}\r\n\r\n".encode()
    for stop_early in (False, True):
        sock = socket.create_connection(("127.0.0.1", edge.port), timeout=ANSWER_S)
        try:
            sock.sendall(head)
            sent = body[: len(body) // 2] if stop_early else body
            for i in range(0, len(sent), 8):
                sock.sendall(sent[i:i + 8])
                time.sleep(0.05)
            if stop_early:
                sock.shutdown(socket.SHUT_WR)
            resp = http.client.HTTPResponse(sock)
            try:
                resp.begin()
            except http.client.RemoteDisconnected:
                assert stop_early
                continue
            answer = Answer(resp.status, dict(resp.getheaders()), resp.read(), 0.0)
            check_answer(answer, f"slow body (stopped early: {stop_early})")
            assert stop_early or answer.status == 200, answer
        finally:
            sock.close()


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_refusals_of_the_connection_itself_are_in_openai_shape(edge: Edge, parser: str) -> None:
    """Bytes the HTTP parser refuses (a header value holding LF, CR, NUL or DEL, a bad chunk
    size) get a 400 in OpenAI's JSON, and a head over the byte cap a 431 in it, from either of
    uvicorn's parsers. Regression (s41 HTTP fuzz): uvicorn's plain-text "Invalid HTTP request
    received." and an empty 431."""
    server = HttpServer(create_app(OpenAIEdge(edge.servicer, edge.node.describe()["model_id"],
                                              lambda text: encode_text(edge.tokenizer, text), lambda: 1,
                                              tokens=TokenTexts(edge.tokenizer))), http=parser)
    port = edge.run(server.start("127.0.0.1", 0))
    try:
        body = encode(ROUTES["/tokenize"](edge.model))
        for name, value in (("X-Foo", "a\nb"), ("X-Foo", "a\rb"), ("Content-Type", "application/json\x00")):
            answer = exchange(port, raw_request("POST", "/tokenize", body, {**auth(edge), name: value}))
            assert answer is not None and answer.status == 400, (name, value, answer)
            assert check_answer(answer, f"{name}: {value!r}")["code"] == "invalid_argument"
        chunked = raw_request("POST", "/tokenize", b"5\r\nabcde\r\nzz\r\n",
                              {**auth(edge), "Transfer-Encoding": "chunked"}, content_length=False)
        answer = exchange(port, chunked, half_close=True)
        assert answer is not None and answer.status == 400, answer
        check_answer(answer, "bad chunk size")
        huge = raw_request("POST", "/tokenize", body, {**auth(edge), **{f"X-H{i}": "v" * 100 for i in range(2000)}})
        answer = exchange(port, huge)
        assert answer is not None and answer.status in (400, 431), answer
        check_answer(answer, "a head over the cap")
    finally:
        edge.run(server.stop())


def test_out_of_vocabulary_prompt_token_names_its_param(edge: Edge) -> None:
    """A completion's token prompt holding an id outside the vocabulary: a 400 naming
    ``prompt.<index>``. Regression (s41 HTTP fuzz): ``param`` was null ("token ids must lie in
    [0, 49152)")."""
    for prompt, index in (([300, 2 ** 40], 1), ([-0, 49152, 1], 1), ([2 ** 31], 0)):
        status, answer = edge.post("/v1/completions", {"model": edge.model, "prompt": prompt, "max_tokens": 2})
        assert status == 400, answer
        assert answer["error"]["param"] == f"prompt.{index}", answer
        assert answer["error"]["message"].startswith(f"prompt.{index}: token id {prompt[index]} "), answer


def test_a_trailing_slash_is_a_404_in_openai_shape_not_a_redirect(edge: Edge) -> None:
    """``/v1/completions/`` (and any route with a trailing slash): a 404 in OpenAI's shape.
    Regression (s41 HTTP fuzz): a 307 with an empty body and a ``Location`` built from the
    client's Host header."""
    for method, path in (("POST", "/v1/completions/"), ("POST", "/v1/chat/completions//"), ("GET", "/v1/models/"),
                         ("GET", "/health/"), ("POST", "/tokenize/")):
        request = raw_request(method, path, b"{}" if method == "POST" else None,
                              {**auth(edge), "Host": "evil.example"})
        answer = exchange(edge.port, request, method=method)
        assert answer is not None and answer.status == 404 and "location" not in answer.headers, (path, answer)
        check_answer(answer, f"{method} {path}")


def test_a_body_ending_early_is_a_client_gone_not_an_internal_error(edge: Edge,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A client that closes its side before its body is whole (a short ``Content-Length`` body,
    a chunked one without its last chunk), on every POST route: no internal error is logged
    (the client is gone, answered 499 if at all) and the node holds nothing. Regression (s41
    HTTP fuzz): starlette's ``ClientDisconnect`` reached the catch-all, "HTTP POST ... failed
    (incident ...)" with its traceback, counted INTERNAL."""
    caplog.set_level(logging.WARNING)
    for path in sorted(ROUTES):
        valid = encode(ROUTES[path](edge.model))
        short = raw_request("POST", path, valid[:20], {**auth(edge), "Content-Length": str(len(valid))},
                            content_length=False)
        chunked = raw_request("POST", path, b"%x\r\n" % 20 + valid[:20] + b"\r\n",
                              {**auth(edge), "Transfer-Encoding": "chunked"}, content_length=False)
        for request in (short, chunked):
            answer = exchange(edge.port, request, half_close=True)
            assert answer is None or answer.status == 499, answer
    time.sleep(0.2)  # (the server's side of the last request ends on its loop)
    no_internal_errors(caplog)
    edge.assert_all_freed()


def test_after_the_fuzz_the_node_is_clean_and_greedy_output_unchanged(edge: Edge, greedy_before: str) -> None:
    """After the fuzz (the tests above, in this module's order): no request runs or waits,
    no block is held, the pool's integrity holds, and the greedy text is what it was."""
    edge.assert_all_freed()
    assert greedy_text(edge) == greedy_before
    edge.assert_all_freed()
