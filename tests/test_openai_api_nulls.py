"""The OpenAI-compatible API's request bodies as OpenAI clients send them (a fresh-user trial):
a JSON ``null`` is the field left out, no string or decimal is coerced to a boolean or an
integer, and every 400 names its field in ``param`` with one ``code``, ``invalid_argument``,
through the gateway's real call path (no node behind it: a valid body ends at the context
limit, before admission)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from services.chat import ChatTemplater
from services.gateway import MAX_ID_CHARS, InferenceServicer
from services.openai_api.app import OpenAIEdge, create_app, invalid
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import NODE_INFO

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": [1, 2, 3]}

OPTIONAL = ["temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user", "logprobs",
            "top_logprobs", "frequency_penalty", "presence_penalty", "max_tokens", "session_id", "policy",
            "cache_salt", "prompt_cache_key", "priority", "top_k", "min_tokens", "repetition_penalty", "ignore_eos", "min_p",
            "logit_bias", "allowed_token_ids", "response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "prompt_logprobs",
            "tools", "tool_choice"]  # a completion's: null only
CHAT_ONLY = ["max_completion_tokens", "parallel_tool_calls", "prefix_messages"]
COMPLETION_ONLY = ["echo", "best_of", "suffix", "prefix_tokens"]


@pytest.mark.parametrize(("kind", "base", "field"), [
    *[(ChatCompletionRequest, CHAT, f) for f in OPTIONAL + CHAT_ONLY],
    *[(CompletionRequest, COMPLETION, f) for f in OPTIONAL + COMPLETION_ONLY],
])
def test_null_is_the_field_left_out(kind: Any, base: dict, field: str) -> None:
    """Fault: ``"temperature": null`` (and every other optional field's null) was a 400,
    where OpenAI, vLLM and SGLang take null as "not given"."""
    sent = kind.model_validate({**base, field: None})
    assert sent.model_dump() == kind.model_validate(base).model_dump()
    sent.check_supported()


def test_a_null_max_tokens_is_the_default_not_the_context() -> None:
    """``/v1/completions``' ``max_tokens: null`` is OpenAI's default, 16 (it was "up to the
    context limit"); a chat's is up to the context limit, as when left out."""
    call = CompletionRequest.model_validate({**COMPLETION, "max_tokens": None}).to_input(list)
    assert call.sampling.max_tokens == 16 and not call.fill_context
    assert ChatCompletionRequest.model_validate({**CHAT, "max_tokens": None}).to_input().fill_context


def test_null_in_nested_objects_and_for_required_fields() -> None:
    """``stream_options.include_usage: null`` is false; an assistant message sent back with
    OpenAI's null ``tool_calls``/``refusal`` is taken; a required field's null is still named."""
    body = ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": {"include_usage": None},
                                                 "messages": [{"role": "assistant", "content": "x", "name": None,
                                                               "tool_calls": None, "refusal": None}]})
    assert body.include_usage() is False and body.to_input().prompt == [{"role": "assistant", "content": "x"}]
    for sent, field in (({**CHAT, "model": None}, "model"), ({**CHAT, "messages": None}, "messages"),
                        ({**CHAT, "tools": []}, "tools"), ({**CHAT, "foo": None}, "foo")):
        with pytest.raises(ValidationError) as info:
            ChatCompletionRequest.model_validate(sent)
        assert json.loads(invalid(info.value).body)["error"]["param"] == field


@pytest.mark.parametrize(("field", "value"), [
    ("stream", "yes"), ("stream", "true"), ("stream", 1), ("temperature", "1"), ("temperature", True),
    ("top_p", "0.5"), ("n", "1"), ("n", 1.0), ("max_tokens", "5"), ("max_tokens", 5.0), ("seed", "3"),
    ("frequency_penalty", "0"), ("priority", "1"), ("priority", 1.0),
    ("stream_options.include_usage", "yes"), ("stream_options.include_usage", 1),
])
def test_no_string_or_decimal_is_coerced(field: str, value: object) -> None:
    """Fault: ``"stream": "yes"`` was taken as true and streamed (OpenAI: 400); strings were
    read as numbers and booleans, decimals as integers."""
    body: dict[str, Any] = {**CHAT, "stream": True}
    if field == "stream_options.include_usage":
        body["stream_options"] = {"include_usage": value}
    else:
        body[field] = value
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = json.loads(invalid(info.value).body)["error"]
    assert (error["param"], error["code"]) == (field, "invalid_argument")


def test_a_json_integer_is_a_valid_float() -> None:
    body = ChatCompletionRequest.model_validate({**CHAT, "temperature": 1, "top_p": 1, "frequency_penalty": 0,
                                                 "presence_penalty": 0, "logprobs": False, "top_logprobs": 0})
    assert (body.temperature, body.top_p) == (1.0, 1.0) and type(body.temperature) is float
    assert body.to_input().sampling.temperature == 1.0


class _Auth:
    """Every key is one tenant's (the gateway's checks after authentication are real)."""

    tenant_ = Tenant("t1", TenantSpec(name="ann"), 0.0)

    async def tenant(self, context: object) -> Tenant:
        return self.tenant_


def _post(path: str, body: dict, templater: ChatTemplater | None = None) -> tuple[int, dict]:
    """``body`` through the app and the gateway's real ``InferenceServicer`` (no node: a body
    past every check is refused at the context limit); with ``templater`` a chat is rendered
    and its prompt counted, as a gateway with the model's tokenizer does."""
    servicer = InferenceServicer(None, _Auth(), {}, {"n0": NODE_INFO}, templater,  # type: ignore[arg-type]
                                 "tcp://127.0.0.1:9")
    app, sent = create_app(OpenAIEdge(servicer, "m@0:f16", list, lambda: 1)), []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http", "headers": [],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "root_path": ""}
    parts = [json.dumps(body).encode()]

    async def receive() -> dict:
        if parts:
            return {"type": "http.request", "body": parts.pop(0), "more_body": False}
        await asyncio.Event().wait()  # the client stays connected (no http.disconnect) until the end
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    try:
        asyncio.run(app(scope, receive, send))
    finally:  # as ``Gateway.stop``: its tokenizer threads end
        servicer.close()
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


BEYOND = {"max_tokens": NODE_INFO["max_model_len"] + 1}
"""Past every other check, the request ends at the context limit (no node is there)."""


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", {**CHAT, "n": 17}, "n", "n: must be an integer in [1, 16], got 17"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs", "logprobs: Input should be a valid boolean"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs", "top_logprobs: needs logprobs true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs: Input should be less than or equal to 20"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "logprobs: Input should be less than or equal to 20"),
    ("/v1/completions", {**COMPLETION, "top_logprobs": 0}, "top_logprobs", "top_logprobs: "),
    ("/v1/chat/completions", {**CHAT, "min_p": 1.5}, "min_p", "min_p: Input should be less than or equal to 1"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, "frequency_penalty",
     "frequency_penalty: Input should be less than or equal to 2"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4, "min_tokens": 5}, "min_tokens",
     "min_tokens must be an integer in [0, max_tokens (4)], got 5"),
    ("/v1/completions", {**COMPLETION, "top_k": -3}, "top_k", "top_k: Input should be greater than or equal to -1"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "parallel_tool_calls: Input should be a valid boolean"),
    ("/v1/completions", {**COMPLETION, "parallel_tool_calls": True}, "parallel_tool_calls",
     "parallel_tool_calls: unsupported field"),
    ("/v1/completions", {**COMPLETION, "tool_choice": "auto"}, "tool_choice",
     'tool_choice: only "none" is supported'),
    ("/v1/chat/completions", {**CHAT, "echo": True}, "echo", "echo: unsupported field"),  # (a completion's is served)
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", "max_tokens: must be > 0, or 0 with echo"),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, "best_of", "best_of: only 1 is supported"),
    ("/v1/completions", {**COMPLETION, "suffix": "x"}, "suffix",
     'suffix: not supported (send null, or leave it out), got "x"'),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "messages: must hold at least one message"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options: only allowed when stream is true"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "max_completion_tokens": 2}, "max_tokens", "max_tokens:"),
    ("/v1/chat/completions", {**CHAT, "policy": "no-such-policy"}, "policy", "policy: "),
    ("/v1/chat/completions", {**CHAT, "priority": 1001}, "priority", "priority must be in [-1000, 1000]"),
    ("/v1/chat/completions", {**CHAT, "prefix_messages": 2}, "prefix_messages", "prefix_messages must be"),
    ("/v1/completions", {**COMPLETION, "prefix_tokens": 4}, "prefix_tokens", "prefix_tokens must be in [0, 3]"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt", "prompt: must not be empty"),
    ("/v1/chat/completions", {**CHAT, "session_id": "s" * (MAX_ID_CHARS + 1)}, "session_id", "session_id: "),
    ("/v1/chat/completions", {**CHAT, "prompt_cache_key": "k" * (MAX_ID_CHARS + 1)}, "prompt_cache_key",
     "prompt_cache_key: "),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, "temperature", "temperature: "),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "stream", "stream: Input should be a valid boolean"),
    # fresh-user trial 26d: a chat without max_tokens whose min_tokens the context cannot hold was
    # refused as the messages' context overflow ("100000 in the completion", param "messages")
    ("/v1/chat/completions", {**CHAT, "min_tokens": 100000}, "min_tokens",
     "min_tokens: asks for at least 100000 generated tokens, but the context leaves room for"),
])
def test_400s_name_their_field_with_one_code(path: str, body: dict, param: str | None, message: str) -> None:
    """Fault: refusals made after the schema (the edge's own checks, the gateway's bounds) had
    ``param`` null and code ``invalid_argument``, the schema's had ``param`` and code
    ``invalid_value``; messages read "logprobs: only None is supported, got True"."""
    status, out = _post(path, body)
    error = out["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert error["param"] == param and error["message"].startswith(message), error


@pytest.mark.parametrize(("path", "base"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_body_of_nulls_passes_every_check(path: str, base: dict) -> None:
    """Through the whole call path, a body whose optional fields are all null is the bare
    body: it reaches the context limit (the last check before admission) like the bare one."""
    fields = OPTIONAL + (CHAT_ONLY if base is CHAT else COMPLETION_ONLY)
    nulls = {f: None for f in fields if f != "max_tokens"}
    assert _post(path, {**base, **nulls, **BEYOND}) == _post(path, {**base, **BEYOND})
    assert _post(path, {**base, **BEYOND})[1]["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, **BEYOND}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": BEYOND["max_tokens"]}, "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, **BEYOND}, "max_tokens"),
])
def test_the_gateways_context_limit_is_context_length_exceeded(path: str, body: dict, param: str) -> None:
    """Regression (oairev20 O4): the gateway's refusal of prompt + max_tokens past the context
    limit was ``invalid_argument`` with ``param`` null (the max_completion_tokens case's message
    naming max_tokens); OpenAI's ``context_length_exceeded``, with its phrase, naming the
    field the client sent, is what LiteLLM and agent code recognise."""
    status, out = _post(path, body)
    error = out["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", param), error
    assert "maximum context length" in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("pool_tokens", "bound"), [(4096, 2048), (1024, 1024)])
def test_a_chat_without_max_tokens_past_the_context_is_the_messages_overflow(
        pool_tokens: int, bound: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s39 fresh-user trial): a chat without ``max_tokens`` whose prompt alone is past
    the context (the model's, 2048 here, or a node's smaller KV pool) was refused "min_tokens:
    asks for at least 0 generated tokens, but the context leaves room for 0 after the prompt's
    N tokens; lower min_tokens", ``param`` min_tokens, code ``invalid_argument``: a field the
    client never sent. It is OpenAI's ``context_length_exceeded`` naming ``messages``."""
    monkeypatch.setitem(NODE_INFO, "pool_tokens", pool_tokens)
    templater = ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    body = {**CHAT, "messages": [{"role": "user", "content": "word " * 3000}]}
    status, out = _post("/v1/chat/completions", body, templater)
    error = out["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    assert error["message"].startswith(f"This model's maximum context length is {bound} tokens"), error


@pytest.mark.parametrize("min_tokens", [1, 2, 5])
@pytest.mark.parametrize("past", [0, 1])
def test_a_chat_without_max_tokens_past_the_context_with_min_tokens_is_the_messages_overflow(
        min_tokens: int, past: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s39 review r3 of 3c9b308): a chat without ``max_tokens``, with ``min_tokens``
    of 2 or more, whose prompt alone fills the context (``past`` tokens beyond it) was a 500
    (``SamplingParams`` refused the max_tokens of 1 the gateway gave it: "min_tokens must be an
    integer in [0, max_tokens (1)]"); before 3c9b308 it was the min_tokens refusal. Lowering
    min_tokens cannot make such a prompt fit: it is the messages' context overflow."""
    templater = ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    messages = [{"role": "user", "content": "word " * 300}]
    prompt_tokens = len(templater.first_turn(messages, None))
    monkeypatch.setitem(NODE_INFO, "max_model_len", prompt_tokens - past)
    monkeypatch.setitem(NODE_INFO, "pool_tokens", 4 * prompt_tokens)
    status, out = _post("/v1/chat/completions", {**CHAT, "messages": messages, "min_tokens": min_tokens}, templater)
    error = out["error"]
    assert status == 400 and (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    assert error["message"].startswith(f"This model's maximum context length is {prompt_tokens - past} tokens. "
                                       f"However, you requested {prompt_tokens + min_tokens} tokens "
                                       f"({prompt_tokens} in the messages, {min_tokens} in the completion)"), error
