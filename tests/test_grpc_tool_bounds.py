"""The bounds on tool calling are the same over gRPC and HTTP (README: "the same checks and
bounds"; review 30j F3, F4, F5).

- F3: the tools' characters are counted as compact JSON (``ensure_ascii=False``) on both: gRPC
  held the text as sent to ``MAX_TOOLS_CHARS``, so pretty-printed parameters or ``\\u00e9``
  escapes (``json.dumps``' default) that HTTP serves were refused, with a count the client never
  wrote.
- F4: the chat's characters are counted as the template takes them (a call's arguments as
  compact JSON: ``1E15`` is ``1000000000000000.0``) on both, with or without tools, naming
  ``chat.messages``: gRPC counted the arguments as sent when no tools were given.
- F5: at most ``MAX_REQUEST_TOOL_CALLS`` (1,024) tool calls in one request's messages on both:
  the bound was gRPC's alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstrata.v1 import inference_pb2
from services.chat_tools import MAX_ARGUMENTS_VALUES, MAX_TOOL_CALLS, MAX_TOOLS_CHARS
from services.convert import (
    MAX_PROMPT_CHARS,
    MAX_REQUEST_TOOL_CALLS,
    MAX_TOOLS_TEXT_CHARS,
    chat_messages_to_pb,
)
from services.gateway_inputs import input_from_pb
from services.openai_api.messages import check_tool_answers
from services.openai_api.schemas import ChatCompletionRequest
from tests.test_openai_api_units import _call, _chat_body

USER = {"role": "user", "content": "weather?"}
NONE = inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE)


def _schema(description: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"city": {"type": "string", "description": description}}}


def _http_tools(parameters: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]


def _grpc(parameters_text: str, messages: list[dict[str, Any]] | None = None) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=chat_messages_to_pb(messages or [USER]), sampling=inference_pb2.SamplingParams(max_tokens=4),
        tools=[inference_pb2.Tool(name="get_weather", parameters=parameters_text)] if parameters_text else [],
        tool_choice=NONE if parameters_text else None)


def _http_status(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, out = _call("POST", "/v1/chat/completions", (json.dumps(body).encode(),))
    return status, out


@pytest.mark.parametrize("as_sent", [
    lambda p: json.dumps(p, indent=40),  # pretty-printed: whitespace the compact JSON drops
    json.dumps,  # json.dumps' default: every non-ASCII character a 6-character escape
])
def test_tools_within_the_compact_bound_are_served_on_both_apis_however_they_are_spelled(as_sent: Any) -> None:
    description = "é" * (MAX_TOOLS_CHARS // 2) if as_sent is json.dumps else "x" * (MAX_TOOLS_CHARS // 2)
    parameters = _schema(description)
    if as_sent is not json.dumps:
        parameters = {**parameters, "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    text = as_sent(parameters)
    assert len(text) > MAX_TOOLS_CHARS  # refused over gRPC before
    compact = len(json.dumps(_http_tools(parameters), ensure_ascii=False, separators=(",", ":")))
    assert compact <= MAX_TOOLS_CHARS
    assert input_from_pb(_grpc(text)).tools == _http_tools(parameters)
    status, out = _http_status(_chat_body(tools=_http_tools(parameters), tool_choice="none"))
    assert status == 404, out  # parsed and checked: only the model is unknown


def test_tools_past_the_compact_bound_are_refused_on_both_apis_naming_tools() -> None:
    parameters = _schema("é" * MAX_TOOLS_CHARS)
    with pytest.raises(ValueError, match=r"^tools hold \d+ characters as JSON; at most 262144"):
        input_from_pb(_grpc(json.dumps(parameters, ensure_ascii=False)))
    status, out = _http_status(_chat_body(tools=_http_tools(parameters), tool_choice="none"))
    assert status == 400 and out["error"]["param"] == "tools", out
    # as sent, before any is parsed: a loose bound (six times: an escape per character)
    with pytest.raises(ValueError, match=rf"^tools hold \d+ characters as sent; at most {MAX_TOOLS_TEXT_CHARS}"):
        input_from_pb(_grpc("{" + " " * MAX_TOOLS_TEXT_CHARS + "}"))


@pytest.mark.parametrize("with_tools", [False, True])
def test_arguments_are_counted_as_the_template_takes_them_on_both_apis(with_tools: bool) -> None:
    """``1E15`` numbers come to ~3.8 times their characters as compact JSON: 30 calls of 1,000 of
    them (within ``MAX_ARGUMENTS_VALUES`` together) beside a long question are under the bound as
    sent and past it rendered. (Regression, diff review s33: HTTP counted them as sent again.)"""
    arguments = json.dumps({"n": [1e15] * 1000}).replace("1000000000000000.0", "1E15")
    calls = 30
    messages = [{"role": "user", "content": "q" * (MAX_PROMPT_CHARS - calls * len(arguments) - 300_000)}] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}_{j}", "type": "function", "function": {"name": "f", "arguments": arguments}}
            for j in range(10)]} for i in range(calls // 10)]
    assert calls * 1002 < MAX_ARGUMENTS_VALUES
    assert len(messages[0]["content"]) + sum(len(c["id"]) + 1 + len(c["function"]["arguments"])
                                             for m in messages[1:] for c in m["tool_calls"]) < MAX_PROMPT_CHARS
    parameters = json.dumps(_schema("x")) if with_tools else ""
    with pytest.raises(ValueError, match=r"^chat.messages hold \d+ characters.* as the chat template takes them"):
        input_from_pb(_grpc(parameters, messages))
    body = _chat_body(messages=messages, **({"tools": _http_tools(_schema("x")), "tool_choice": "none"}
                                            if with_tools else {}))
    with pytest.raises(ValueError, match=r"^messages: hold \d+ characters"):
        ChatCompletionRequest.model_validate(body).to_input()


def test_at_most_1024_tool_calls_in_one_request_on_both_apis() -> None:
    def messages(callers: int) -> list[dict[str, Any]]:
        return [USER] + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}_{j}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            for j in range(MAX_TOOL_CALLS)]} for i in range(callers)]

    most = MAX_REQUEST_TOOL_CALLS // MAX_TOOL_CALLS
    status, out = _http_status(_chat_body(model="m", messages=messages(most + 1)))
    assert status == 400 and out["error"]["param"] == "messages", out
    assert f"hold 1152 tool calls together; at most {MAX_REQUEST_TOOL_CALLS}" in out["error"]["message"], out
    with pytest.raises(ValueError, match=r"^messages: hold 1152 tool calls"):
        check_tool_answers(ChatCompletionRequest.model_validate(_chat_body(messages=messages(most + 1))).messages)
    check_tool_answers(ChatCompletionRequest.model_validate(_chat_body(messages=messages(most))).messages)
    assert input_from_pb(_grpc("", messages(most))).prompt
