"""JSON text inside a request's fields (review 30j F1): a tool's ``parameters`` and a call's
``arguments`` over gRPC, a call's ``arguments`` over HTTP, the data plane's ``tools``,
``tool_calls`` and ``tool_output``. ``"\\ud800"`` (a lone UTF-16 surrogate escape) is valid JSON
whose value is no UTF-8 text: it passed every check and ended INTERNAL (gRPC) or a 500 (HTTP)
where the value was packed or tokenized. It is refused at the edge naming the field, as the
HTTP edge refuses such a body (``openai_api.bodies.load_json``), with or without a session; a
valid pair (an emoji), an escaped backslash before ``ud800`` and plain text pass. A model's
generated call holding one is kept as escaped, UTF-8, text.

The served refusals, on the real stack, are in ``tests/test_grpc_tool_calls.py``
(``test_a_lone_surrogate_in_json_text_is_refused_on_both_apis``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvstrata.v1 import inference_pb2
from services import chat_tools
from services.chat_tools import (
    check_tool_output,
    check_wire_tool_calls,
    check_wire_tools,
    lone_surrogate,
    template_call,
    tool_output_spec,
)
from services.convert import chat_messages_to_pb
from services.gateway_inputs import input_from_pb
from services.tool_calls import ToolOutput, parse_hermes, parse_required
from tests.test_openai_api_units import _call, _chat_body

LONE = '{"city": "\\ud800"}'  # the JSON text: a backslash escape, no surrogate in the text itself
LONE_KEY = '{"\\udc00": 1}'
PAIR = '{"city": "\\ud83d\\ude00"}'  # an emoji's pair: UTF-8 text
ESCAPED_BACKSLASH = '{"city": "\\\\ud800"}'  # a backslash, then "ud800": no escape at all

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "X"}}}
USER = {"role": "user", "content": "weather?"}


def _schema_text(description_json: str) -> str:
    return json.dumps(SCHEMA).replace('"X"', description_json)


def _call_msg(arguments: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}


def _grpc(session_id: str = "", parameters: str = "", arguments: str | None = None) -> inference_pb2.GenerateRequest:
    messages = [USER] if arguments is None else [USER, _call_msg(arguments),
                                                  {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    return inference_pb2.GenerateRequest(
        chat=chat_messages_to_pb(messages), sampling=inference_pb2.SamplingParams(max_tokens=4),
        session_id=session_id, tools=[inference_pb2.Tool(name="get_weather", parameters=parameters)],
        tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE))


def test_lone_surrogate_sees_the_value_not_the_text() -> None:
    assert lone_surrogate(LONE) and lone_surrogate(LONE_KEY) and lone_surrogate('["a", ["\\udfff"]]')
    assert not lone_surrogate(PAIR) and not lone_surrogate(ESCAPED_BACKSLASH)
    assert not lone_surrogate('{"city": "Paris"}') and not lone_surrogate("not json \\ud800")


@pytest.mark.parametrize("session_id", ["", "s-1"])
@pytest.mark.parametrize(("fields", "named"), [
    ({"parameters": _schema_text('"\\ud800"')}, "tools[0].parameters"),
    ({"parameters": _schema_text('"\\udc00x"')}, "tools[0].parameters"),
    ({"arguments": LONE}, "chat.messages[1].tool_calls[0].arguments"),
    ({"arguments": LONE_KEY}, "chat.messages[1].tool_calls[0].arguments"),
])
def test_grpc_refuses_a_lone_surrogate_naming_the_field(session_id: str, fields: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match="lone UTF-16 surrogate") as err:
        input_from_pb(_grpc(session_id, **fields))
    assert str(err.value).startswith(named + " holds"), err.value


@pytest.mark.parametrize("session_id", ["", "s-1"])
def test_grpc_takes_pairs_and_escaped_backslashes(session_id: str) -> None:
    for text in (PAIR, ESCAPED_BACKSLASH):
        call = input_from_pb(_grpc(session_id, parameters=_schema_text(json.dumps(json.loads(text)["city"])),
                                   arguments=text))
        assert call.prompt[1]["tool_calls"][0]["function"]["arguments"] == json.loads(text)


@pytest.mark.parametrize("session_id", [None, "s-1"])
@pytest.mark.parametrize("arguments", [LONE, LONE_KEY])
def test_http_refuses_a_lone_surrogate_in_arguments_naming_it(session_id: str | None, arguments: str) -> None:
    """The body's own check sees ``\\\\ud800`` (an escaped backslash) in the body's text: the
    arguments' JSON is another text, checked when the request is parsed (on a worker thread),
    once the request's calls are bounded together (``schemas.template_messages``). Through the
    real HTTP server; the stand-in servicer parses as ``generate`` does."""
    from tests.test_tool_arguments_bounds import _post, _serve, _Servicer

    extra = {} if session_id is None else {"session_id": session_id}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "21"}
    bad = _chat_body(messages=[USER, _call_msg(arguments), tool], model="m", **extra)
    good = _chat_body(messages=[USER, _call_msg(PAIR), tool], model="m", **extra)
    servicer = _Servicer()

    async def body(port: int) -> None:
        status, out, _ = await _post(port, "/v1/chat/completions", json.dumps(bad).encode())
        assert status == 400, out
        assert out["error"]["param"] == "messages.1.tool_calls.0.function.arguments", out
        assert "lone UTF-16 surrogate" in out["error"]["message"], out
        assert (await _post(port, "/v1/chat/completions", json.dumps(good).encode()))[0] == 503  # parsed: no node
        assert len(servicer.parsed) == 1

    _serve(servicer, None, body)


def test_the_data_plane_refuses_it_too() -> None:
    """A session turn's tools, calls and tool output cross to the node as JSON text, which the
    node checks as bytes off the network."""
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": json.loads(
        _schema_text('"\\ud800"'))}}])
    with pytest.raises(ValueError, match=r"^request.tools holds a lone UTF-16 surrogate"):
        check_wire_tools(tools)
    calls = '[{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": "\\ud800"}}}]'
    with pytest.raises(ValueError, match=r"^messages.1.tool_calls holds a lone UTF-16 surrogate"):
        check_wire_tool_calls(calls, "messages.1.tool_calls")
    with pytest.raises(ValueError, match=r"^request.tool_output holds a lone UTF-16 surrogate"):
        check_tool_output(tool_output_spec("auto", None, True, "\ud800", ["f"]).replace("\ud800", "\\ud800"))
    assert check_wire_tools(tools.replace("\\ud800", "\\ud83d\\ude00"))


def test_generated_calls_holding_one_stay_utf8_text() -> None:
    """The model may write the escape (``auto``, or a constraint's JSON strings): the call's
    ``arguments`` keep it escaped (UTF-8 text, ``json.loads`` gives the same value), and a
    session's node keeps it as text for the template (``template_call``)."""
    text = '<tool_call>{"name": "f", "arguments": {"city": "\\ud800"}}</tool_call>'
    for calls in (parse_hermes(text), parse_required('[{"name": "f", "parameters": {"city": "\\ud800"}}]')):
        assert calls is not None
        arguments = calls[0]["function"]["arguments"]
        arguments.encode("utf-8")
        assert json.loads(arguments) == {"city": "\ud800"}
    message, finish = ToolOutput("named", "f").message(LONE, "stop")
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == LONE
    kept = template_call("c", "f", LONE)
    assert kept["function"]["arguments"] == LONE  # text, not an object holding the surrogate
    assert template_call("c", "f", PAIR)["function"]["arguments"] == {"city": "\U0001f600"}
    assert chat_tools.check_arguments("x", PAIR) == PAIR


SCHEMA_TEXT = '{"type": "object", "properties": {"city": {"const": "\\ud800"}}}'


@pytest.mark.parametrize("session_id", ["", "s-1"])
def test_a_structured_output_schemas_text_is_checked_alike(session_id: str) -> None:
    """A ``json_schema`` given as text is JSON text in a field too: the grammar compiler refused
    it as "does not compile" with a JSON syntax error it made up; now named at the edge."""
    req = inference_pb2.GenerateRequest(
        chat=chat_messages_to_pb([USER]), session_id=session_id, sampling=inference_pb2.SamplingParams(
            max_tokens=4, structured_output=inference_pb2.StructuredOutput(json_schema=SCHEMA_TEXT)))
    with pytest.raises(ValueError, match=r"^sampling.structured_output.json_schema holds a lone UTF-16"):
        input_from_pb(req)
    req.sampling.structured_output.json_schema = SCHEMA_TEXT.replace("\\ud800", "\\ud83d\\ude00")
    assert input_from_pb(req).sampling.structured_output is not None
    extra = {} if not session_id else {"session_id": session_id}
    for field in ({"structured_outputs": {"json": SCHEMA_TEXT}}, {"guided_json": SCHEMA_TEXT}):
        status, _, out = _call("POST", "/v1/chat/completions", (json.dumps(_chat_body(**field, **extra)).encode(),))
        assert status == 400 and "lone UTF-16 surrogate" in out["error"]["message"], out
