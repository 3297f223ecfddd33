"""The OpenAI-compatible API as OpenAI and vLLM clients expect it (review oairev20): request ids
(O3), context-overflow errors (O4), retry hints (O8), the model card and retrieve (O6, O9),
error codes (O9). The app runs over a stand-in servicer (its ``generate`` refuses or answers as
the gateway's does); the official ``openai`` client drives it over HTTP where its behaviour is
the point."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import types
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import openai
import pytest

from cache_node.outputs import SessionBusy
from services.gateway_key_watch import DELETED_MESSAGE
from services.openai_api.app import OpenAIEdge, create_app
from services.openai_api.context import CallAborted
from services.openai_api.server import HttpServer

INFO = {"max_model_len": 8192, "pool_tokens": 4368}


class _Servicer:
    """The servicer parts the edge uses: ``auth`` (key "good" only), ``off_loop``, ``info`` and
    ``generate``, which records each call's ``GenerateInput`` and then refuses it with
    ``refusal`` (code, message, retry-after-ms or None) or answers "hi"."""

    info = INFO

    def __init__(self, refusal: tuple[grpc.StatusCode, str, int | None] | None = None) -> None:
        self.refusal, self.calls = refusal, []

        class auth:
            @staticmethod
            async def tenant(context: Any) -> object:
                if dict(context.invocation_metadata())["authorization"] != "Bearer good":
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
                return types.SimpleNamespace(tenant_id="t", spec=types.SimpleNamespace(max_context_tokens=0))

        self.auth = auth

    @staticmethod
    async def off_loop(tenant_id: str, work: Callable[[], object]) -> object:
        return work()

    async def generate(self, context: Any, parse: Callable[[], Any], writer: Any) -> AsyncIterator[dict]:
        try:
            call = parse()
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.calls.append(call)
        if self.refusal is not None:
            code, message, retry_after_ms = self.refusal
            if retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
            await context.abort(code, message)
        yield {"type": "started", "prompt_tokens": 3, "request_id": call.request_id}
        yield {"type": "delta", "token_ids": [7], "text": "hi"}
        yield {"type": "finished", "prompt_tokens": 3, "completion_tokens": 1, "finish_reason": "stop"}


def _call(servicer: _Servicer, method: str, path: str, body: dict | None = None,
          headers: tuple[tuple[str, str], ...] = (("authorization", "Bearer good"),)) -> tuple[int, dict, Any]:
    """One request through the app's ASGI interface: (status, headers, JSON body or SSE text)."""
    app = create_app(OpenAIEdge(servicer, "m@0:f16", list, lambda: 1))  # type: ignore[arg-type]
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http",
             "headers": [(k.encode(), v.encode()) for k, v in headers], "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000), "root_path": ""}
    parts, sent = [raw], []

    async def receive() -> dict:
        if parts:
            return {"type": "http.request", "body": parts.pop(), "more_body": False}
        await asyncio.Event().wait()  # the client stays
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    out = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    data = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], out, (data.decode() if out.get("content-type", "").startswith("text/event-stream")
                                    else json.loads(data))


def _chat(**fields: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# O3 ------------------------------------------------------------------------------------------

def test_x_request_id_is_the_request_id_and_comes_back() -> None:
    """Regression (oairev20 O3): ``X-Request-Id`` was neither read nor returned, and the body's
    ``id`` was a fresh uuid no log or node saw. Now the header's id is the gateway's request id,
    the body's id is ``chatcmpl-<id>`` (vLLM's) and the response carries it back."""
    servicer = _Servicer()
    headers = (("authorization", "Bearer good"), ("x-request-id", "trace-42.a:b"))
    status, out, body = _call(servicer, "POST", "/v1/chat/completions", _chat(), headers)
    assert status == 200 and out["x-request-id"] == "trace-42.a:b" and body["id"] == "chatcmpl-trace-42.a:b"
    assert servicer.calls[0].request_id == "trace-42.a:b"
    status, out, text = _call(servicer, "POST", "/v1/completions", {"model": "m", "prompt": [1], "stream": True},
                              headers)
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert status == 200 and out["x-request-id"] == "trace-42.a:b"
    # the text and the finish (no empty first chunk since a5183d5, as vLLM's completions)
    assert {c["id"] for c in chunks} == {"cmpl-trace-42.a:b"} and len(chunks) == 2


@pytest.mark.parametrize("sent", ["", "has space", "a/b", "a#b", "x" * 129, "ünï"])
def test_an_invalid_x_request_id_is_replaced_by_a_new_one(sent: str) -> None:
    """An id the gateway could not take as sent (too long, a separator, a character no trace
    id holds) is not refused: the request gets a new id, returned as every id is."""
    servicer = _Servicer()
    headers = (("authorization", "Bearer good"), ("x-request-id", sent))
    status, out, body = _call(servicer, "POST", "/v1/chat/completions", _chat(), headers)
    rid = out["x-request-id"]
    assert status == 200 and rid != sent and len(rid) == 32 and int(rid, 16) >= 0
    assert body["id"] == f"chatcmpl-{rid}" and servicer.calls[0].request_id == rid


def test_errors_carry_the_request_id_too() -> None:
    status, out, _ = _call(_Servicer(), "POST", "/v1/chat/completions", _chat(model="nope"),
                              (("authorization", "Bearer good"), ("x-request-id", "r1")))
    assert status == 404 and out["x-request-id"] == "r1"


# O4 ------------------------------------------------------------------------------------------

OVER_CONTEXT = ("This model's maximum context length is 8192 tokens. However, you requested 9031 tokens "
                "(31 in the prompt, 9000 in the completion). Please reduce the length of the prompt or completion.")
OVER_POOL = ("This model's maximum context length is 4368 tokens on a cache node (its KV pool holds 4368 tokens: "
             "the prompt and at least one generated token). However, you requested 5031 tokens in the messages. "
             "Please reduce the length of the messages.")
NODE_POOL = ("prompt (48 tokens) + max_tokens (300) needs 348 tokens of KV at once; this node's KV pool "
             "holds 160 tokens")
TURN_POOL = ("This model's maximum context length is 4368 tokens on a cache node under a KV policy that keeps "
             "every token (its KV pool holds 4368 tokens). However, you requested at least 9040 tokens (40 at "
             "least in the messages, with the session's history on top, 9000 in the completion): that can never "
             "fit. Please reduce the length of the messages or completion.")
OVER_CONTEXT_CHAT = OVER_CONTEXT.replace("prompt", "messages")
"""``OVER_CONTEXT`` as a chat's refusal reads: the gateway renders a chat at the edge and refuses it
as a token prompt; ``errors.refusal_about`` names the messages (what the client sent)."""
REWORDED = ("This model's maximum context length is 8192 tokens. However, you requested 9031 tokens "
            "(31 in the messages, 9000 in the completion).")


@pytest.mark.parametrize(("message", "fields", "path", "param"), [
    (OVER_CONTEXT, {"max_tokens": 9000}, "/v1/chat/completions", "max_tokens"),
    (OVER_CONTEXT, {"max_completion_tokens": 9000}, "/v1/chat/completions", "max_completion_tokens"),
    (REWORDED, {"max_completion_tokens": 9000}, "/v1/chat/completions", "max_completion_tokens"),
    (OVER_POOL, {"max_tokens": 5}, "/v1/chat/completions", "messages"),
    (OVER_POOL, {}, "/v1/chat/completions", "messages"),
    (NODE_POOL, {}, "/v1/chat/completions", "messages"),  # no max_tokens sent: the prompt is at fault
    (TURN_POOL, {"max_tokens": 9000}, "/v1/chat/completions", "max_tokens"),
    (NODE_POOL, {"max_tokens": 300}, "/v1/completions", "max_tokens"),
    (OVER_CONTEXT, {}, "/v1/completions", "prompt"),  # max_tokens 16 by default: not sent
])
def test_context_overflow_is_context_length_exceeded(message: str, fields: dict, path: str, param: str) -> None:
    """Regression (oairev20 O4): the gateway's and the nodes' refusals for size were
    ``invalid_argument`` with ``param`` null (and the second case named max_tokens though the
    client sent max_completion_tokens), so LiteLLM's context-window handling never triggered.
    Now: OpenAI's ``context_length_exceeded``, OpenAI's phrase, the field the client sent."""
    body = _chat(**fields) if path.endswith("chat/completions") else {"model": "m", "prompt": [1], **fields}
    status, _, out = _call(_Servicer((grpc.StatusCode.INVALID_ARGUMENT, message, None)), "POST", path, body)
    error = out["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == param
    assert error["type"] == "invalid_request_error"
    shown = OVER_CONTEXT_CHAT if message == OVER_CONTEXT and path.endswith("chat/completions") else message
    assert error["message"].startswith("This model's maximum context length is") and shown in error["message"]
    assert error["message"].count("maximum context length") == 1


@pytest.mark.parametrize(("message", "param"), [
    ("policy: a KV policy spec must match [A-Za-z0-9][A-Za-z0-9_.-]{0,255}, got 'KV pool'", "policy"),
    ("policy: bad part 'max_context_tokens' in policy spec 'snapkv-max_context_tokens'", "policy"),
    ("session 'a1b2/x: 5 characters can never fit in 3 tokens' already has a turn running", None),
    ("session 'a1b2/This model's maximum context length is' already has a turn running", None),
])
def test_a_refusal_quoting_the_clients_text_is_not_taken_for_a_context_overflow(message: str,
                                                                               param: str | None) -> None:
    """Regression (review of 6b09071, L1): the size markers were searched anywhere in the
    message, so a policy named "KV pool" or a session id holding a marker turned a bad policy or
    a busy session into ``context_length_exceeded`` (param "messages"), which clients answer by
    trimming history. Size refusals are now recognised by how they start."""
    status, _, out = _call(_Servicer((grpc.StatusCode.INVALID_ARGUMENT, message, None)), "POST",
                           "/v1/chat/completions", _chat(max_tokens=4))
    assert status == 400 and (out["error"]["code"], out["error"]["param"]) == ("invalid_argument", param)


def test_other_400s_stay_invalid_argument_naming_their_field() -> None:
    status, _, out = _call(_Servicer((grpc.StatusCode.INVALID_ARGUMENT, "priority must be in [-1000, 1000]", None)),
                           "POST", "/v1/chat/completions", _chat(max_tokens=4))
    assert status == 400 and (out["error"]["code"], out["error"]["param"]) == ("invalid_argument", "priority")


# O8 ------------------------------------------------------------------------------------------

TOO_MANY_SESSIONS = ("the tenant has 1 open sessions (max_sessions_per_tenant; 0 of them lost with a restarted "
                     "cache node): close one (CloseSession) or let an idle one expire")
SESSION_LOST = ("this session's history was lost when its cache node restarted: close the session "
                "(CloseSession) and start it again")
SESSION_TEXT = ("this turn's 90 characters of messages would take the tenant's sessions on this node past "
                "max_session_text_chars_per_tenant (100; they keep 20): close sessions (CloseSession) or let "
                "idle ones expire")
STREAM_CAP = "the tenant has 1 calls open at this gateway (max_streams_per_tenant): read or cancel them first"
STEP_FAILED = "this request's step failed on the cache node (see its log); the node's other requests went on"
SESSION_GONE = ("the session ended (closed, expired or its first turn failed) before this turn started; its "
                "history is gone: send the turn again to start it anew")
SESSION_BUSY = str(SessionBusy("conc-1"))
MOVED_SESSION = ("session 's1' was opened under another cache namespace (another cache_salt, or the tenant's cache "
                 "namespace changed since): ... close it (gRPC CloseSession, HTTP DELETE /v1/sessions/{session_id}) "
                 "and start a new session")  # (cache_node.sessions.check_turn's)


@pytest.mark.parametrize(("code", "message", "retry_after_ms", "status", "retry"), [
    (grpc.StatusCode.UNAVAILABLE, "the gateway that sent this request is gone", None, 503, "false"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_SESSIONS, None, 429, "false"),
    (grpc.StatusCode.ABORTED, SESSION_LOST, None, 409, "false"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, SESSION_TEXT, None, 429, "false"),
    (grpc.StatusCode.INTERNAL, STEP_FAILED, None, 500, "false"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full (9 waiting, limit 8)", 1500, 429, None),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, STREAM_CAP, None, 429, None),
    (grpc.StatusCode.UNAVAILABLE, "no cache node is healthy: n0: marked down", None, 503, None),
    (grpc.StatusCode.ABORTED, SESSION_GONE, None, 409, None),  # sending the turn again starts it anew
    (grpc.StatusCode.ABORTED, SESSION_BUSY, None, 409, None),  # sent again after the running turn, it runs
    # (review s36 R4 F2, N2: both were retried, the first's message saying to close the session)
    (grpc.StatusCode.FAILED_PRECONDITION, MOVED_SESSION, None, 400, "false"),
    (grpc.StatusCode.ABORTED, DELETED_MESSAGE, None, 409, "false"),
    (grpc.StatusCode.ABORTED, "the tenant was deleted", None, 409, "false"),
])
def test_refusals_a_retry_cannot_fix_say_so(code: grpc.StatusCode, message: str, retry_after_ms: int | None,
                                            status: int, retry: str | None) -> None:
    """Regression (oairev20 O8): the official client retried every 409/429/5xx, so a tenant at
    its session cap waited ~1.3 s for three refusals (three admissions). Refusals only a
    CloseSession ends, and a failed step, now say ``x-should-retry: false``; transient ones
    (``Retry-After``, a stream cap, no healthy node) leave the client's retries on."""
    got, headers, _ = _call(_Servicer((code, message, retry_after_ms)), "POST", "/v1/chat/completions", _chat())
    assert got == status and headers.get("x-should-retry") == retry
    assert ("retry-after" in headers) == (retry_after_ms is not None)


@pytest.mark.parametrize(("code", "message", "error_code"), [
    (grpc.StatusCode.ALREADY_EXISTS, "request 'r1' is in flight already", "already_exists"),
    (grpc.StatusCode.ABORTED, SESSION_BUSY, "aborted"), (grpc.StatusCode.ABORTED, SESSION_LOST, "aborted"),
    (grpc.StatusCode.ABORTED, DELETED_MESSAGE, "aborted")])
def test_every_409_has_one_type(code: grpc.StatusCode, message: str, error_code: str) -> None:
    """Every 409 is OpenAI's ``invalid_request_error`` (OpenAI has no error type of its own for a
    conflict; its client tells them by status, ``ConflictError``), its ``code`` saying which
    conflict. Regression (s40 new-user trial): a request id in flight was
    ``invalid_request_error`` / ``already_exists``, a busy session ``conflict_error`` / ``aborted``."""
    got, _, body = _call(_Servicer((code, message, None)), "POST", "/v1/chat/completions", _chat())
    assert got == 409 and body["error"] == {"message": message, "type": "invalid_request_error", "param": None,
                                            "code": error_code}, body


def test_the_openai_client_does_not_retry_a_session_cap() -> None:
    """The official client, at its default ``max_retries=2``: one request reaches the server
    (three before), and the refusal is raised at once."""
    servicer = _Servicer((grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_SESSIONS, None))
    with _served(servicer) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="good")
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert len(servicer.calls) == 1  # (no time bound: the test machines are loaded)


class _served:
    """The app over ``servicer`` on a loopback port, its loop on a thread; the base URL."""

    def __init__(self, servicer: _Servicer) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = HttpServer(create_app(OpenAIEdge(servicer, "m@0:f16", list, lambda: 1)))  # type: ignore[arg-type]

    def __enter__(self) -> str:
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        port = asyncio.run_coroutine_threadsafe(self.server.start("127.0.0.1", 0), self.loop).result(10)
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


# O6, O9 --------------------------------------------------------------------------------------

def test_models_retrieve_and_the_model_card() -> None:
    """Regression (oairev20 O6, O9): ``GET /v1/models/{model}`` (``client.models.retrieve``) was
    a 404 "no such endpoint", and the card's ``created`` was 0 with no ``max_model_len``. Now
    the card is served by either name, ``created`` is the server's start, ``max_model_len`` the
    most a request may hold (here the pool's 4368 tokens, under the model's 8192)."""
    before = int(time.time())
    servicer = _Servicer()
    status, _, listed = _call(servicer, "GET", "/v1/models")
    card = listed["data"][0]
    assert status == 200 and card["id"] == "m" and card["max_model_len"] == 4368
    assert before - 5 <= card["created"] <= time.time()
    for name in ("m", "m@0:f16"):
        status, _, got = _call(servicer, "GET", f"/v1/models/{name}")
        assert status == 200 and {k: v for k, v in got.items() if k != "created"} == {
            k: v for k, v in card.items() if k != "created"}
    status, _, got = _call(servicer, "GET", "/v1/models/other/model")
    assert status == 404 and got["error"]["code"] == "model_not_found" and got["error"]["param"] == "model"
    assert _call(servicer, "GET", "/v1/models/m", headers=(("authorization", "Bearer bad"),))[0] == 401


def test_error_codes_are_openais() -> None:
    """Regression (oairev20 O9): an unknown model was code ``not_found``, a bad key
    ``unauthenticated``; OpenAI says ``model_not_found`` (type invalid_request_error) and
    ``invalid_api_key``."""
    status, _, out = _call(_Servicer(), "POST", "/v1/chat/completions", _chat(model="nope"))
    assert status == 404 and out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
    assert out["error"]["type"] == "invalid_request_error"
    status, _, out = _call(_Servicer(), "POST", "/v1/chat/completions", _chat(),
                           (("authorization", "Bearer bad"),))
    assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert out["error"]["type"] == "authentication_error"
    assert json.loads(CallAborted(grpc.StatusCode.NOT_FOUND, "x").response().body)["error"]["code"] == "not_found"


def test_a_size_refusal_after_the_first_chunk_reads_the_same_in_a_stream() -> None:
    """Regression (review of 6b09071, L4): a size refusal arriving after ``started`` (the
    node's "rejected": a running request its pool can never hold) was ``context_length_exceeded``
    in a whole response but ``invalid_argument`` with ``param`` null in a stream."""
    import asyncio
    import json

    from services.openai_api.app import _stream, refusal_about
    from services.openai_api.context import CallAborted
    from services.openai_api.responses import Generation
    from services.openai_api.schemas import ChatCompletionRequest
    from services.openai_api.stream_shape import StreamShape

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 9, "stream": True})

    async def events():  # type: ignore[no-untyped-def]
        yield {"type": "delta", "token_ids": [1], "text": "a"}
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, "the request can never fit this node's KV pool (4368 "
                          "tokens)")

    async def run() -> dict:  # type: ignore[type-arg]
        generation = Generation(events(), {"type": "started", "prompt_tokens": 5, "cached_tokens": {}}, True, "m", "r")
        chunks = [c async for c in _stream(generation, StreamShape(), lambda exc: refusal_about(exc, body))]
        return next(json.loads(c.decode()[6:]) for c in chunks if b'"error"' in c)["error"]

    error = asyncio.run(run())
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
