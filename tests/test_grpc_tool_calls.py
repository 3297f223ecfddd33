"""Tool calling on kvstrata's own gRPC ``InferenceService.Generate`` (``GenerateRequest.tools``,
``tool_choice``, ``parallel_tool_calls``, ``ChatMessage.tool_calls``; the calls read back in
``GenerateFinished.tool_calls``), served end to end on the real stack of
``test_session_tool_calls`` (the real CacheNode with xgrammar, scheduler, gateway gRPC server
and OpenAI app; a tiny random Llama with SmolLM2's tokenizer; node and gateway rendering with a
template that renders tools and tool calls), and compared with the HTTP edge's answer to the
same conversation: the same prompt tokens, the same calls.

Before this, ``GenerateRequest`` had no tools and ``ChatMessage`` no tool calls ("Assistant
tool calls are not served"): the gRPC API could not call tools at all."""

from __future__ import annotations

import json
from typing import Any

import grpc
import openai
import pytest

from kvstrata.v1 import inference_pb2
from services.chat_tools import template_call
from services.convert import chat_messages_to_pb
from services.gateway_inputs import GenerateInput, grpc_refusal, input_from_pb
from tests import test_session_tool_calls as sessions
from tests.test_session_tool_calls import USER, _last_prompt, _one_token_reply
from tests.test_tool_calls_served import CALL_REGEX, SCHEMAS, TOOLS, WEATHER, Weather

# the stack of test_session_tool_calls: SESSION_TEMPLATE (renders tools and tool calls) on the node
# and the gateway, every prompt the node's engine takes recorded by session
served, client, no_whitespace = sessions.served, sessions.client, sessions.no_whitespace

NAMED = inference_pb2.ToolChoice(function="get_weather")
NONE = inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE)
REQUIRED = inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_REQUIRED)
AUTO = inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_AUTO)

CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}


def pb_tools(tools: list[dict[str, Any]]) -> list[inference_pb2.Tool]:
    """OpenAI's tools list as ``GenerateRequest.tools``."""
    return [inference_pb2.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                               parameters=json.dumps(t["function"]["parameters"]),
                               strict=t["function"].get("strict") is True) for t in tools]


def request(messages: list[dict[str, Any]], *, max_tokens: int = 8, logit_bias: dict[str, float] | None = None,
            sampling: dict[str, Any] | None = None, **fields: Any) -> inference_pb2.GenerateRequest:
    params = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                          logit_bias={int(k): v for k, v in (logit_bias or {}).items()},
                                          **(sampling or {}))
    return inference_pb2.GenerateRequest(chat=chat_messages_to_pb(messages), sampling=params, **fields)


def generate(served: Any, req: inference_pb2.GenerateRequest) -> tuple[Any, str, Any]:
    """(started, the deltas' text, finished) of a gRPC Generate call."""
    events = list(served.stub.Generate(req, metadata=(("authorization", f"Bearer {served.key}"),), timeout=60))
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    return events[0].started, "".join(e.delta.text for e in events if e.HasField("delta")), events[-1].finished


def refusal(served: Any, req: inference_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        generate(served, req)
    return err.value.code(), err.value.details() or ""


def test_a_named_tool_choice_returns_one_call_whose_arguments_match_the_schema(
        client: openai.OpenAI, served: Any, no_whitespace: dict[str, float]) -> None:
    """``tool_choice.function``: the output is constrained to the tool's parameters' schema and
    read as one call of it (finish reason ``tool_calls``), the same call and the same prompt
    (the tools rendered by the chat template) as the HTTP edge's for the same request."""
    started, text, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=NAMED,
                                                       max_tokens=60, logit_bias=no_whitespace))
    assert finished.finish_reason == "tool_calls", finished
    [call] = finished.tool_calls
    assert call.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    Weather.model_validate_json(call.arguments)  # JSON matching the schema
    assert call.arguments == text and finished.content == ""  # the deltas still carry the text
    assert started.prompt_tokens == len(served.templater.first_turn([USER], TOOLS))

    http = client.chat.completions.create(model=served.model, messages=[USER], tools=TOOLS, tool_choice=WEATHER,
                                          max_tokens=60, temperature=0.0, logit_bias=no_whitespace)
    assert http.usage.prompt_tokens == started.prompt_tokens
    assert http.choices[0].message.tool_calls[0].function.arguments == call.arguments


def test_required_reads_calls_of_the_tools_and_parallel_false_keeps_one(served: Any,
                                                                        no_whitespace: dict[str, float]) -> None:
    _, _, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=REQUIRED,
                                              parallel_tool_calls=False, max_tokens=80, logit_bias=no_whitespace))
    assert finished.finish_reason == "tool_calls", finished
    [call] = finished.tool_calls
    SCHEMAS[call.name].model_validate_json(call.arguments)


def test_an_assistant_call_and_its_result_in_the_history_render_as_over_http(client: openai.OpenAI,
                                                                             served: Any) -> None:
    """``ChatMessage.tool_calls`` and a tool message reach the chat template as the HTTP edge
    hands them to it (arguments as an object): the same prompt tokens, which hold the call."""
    conversation = [USER, CALLED, RESULT]
    started, _, finished = generate(served, request(conversation, tools=pb_tools(TOOLS), tool_choice=NONE,
                                                    max_tokens=1))
    http = client.chat.completions.create(model=served.model, messages=conversation, tools=TOOLS,
                                          tool_choice="none", max_tokens=1, temperature=0.0)
    call = CALLED["tool_calls"][0]
    rendered = served.templater.first_turn(
        [USER, {"role": "assistant", "content": "", "tool_calls": [
            template_call(call["id"], call["function"]["name"], call["function"]["arguments"])]},
         RESULT], TOOLS)
    assert started.prompt_tokens == http.usage.prompt_tokens == len(rendered)
    without_call = served.templater.first_turn([USER, {"role": "assistant", "content": ""}, RESULT], TOOLS)
    assert len(rendered) > len(without_call)  # the call is in the prompt
    assert not finished.tool_calls and finished.finish_reason in ("length", "stop")  # none: nothing read


def test_auto_needs_the_parser_and_reads_hermes_calls(served: Any) -> None:
    """"auto" (the default with tools) is INVALID_ARGUMENT naming tool_choice while the server's
    tool_call_parser is off, as the HTTP edge's 400; with hermes, ``<tool_call>`` blocks are read
    as calls and the text before them is the content."""
    code, details = refusal(served, request([USER], tools=pb_tools(TOOLS)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("tool_choice: \"auto\""), details
    served.servicer.tool_call_parser = "hermes"
    try:
        forced = inference_pb2.StructuredOutput(regex=CALL_REGEX)
        _, text, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=AUTO,
                                                     max_tokens=80, sampling={"structured_output": forced}))
    finally:
        served.servicer.tool_call_parser = ""
    assert finished.finish_reason == "tool_calls", (finished, text)
    [call] = finished.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments)["celsius"] is True
    assert finished.content == "Sure. " and text.startswith("Sure. <tool_call>")


GOOD = {"tools": pb_tools(TOOLS)}


@pytest.mark.parametrize(("fields", "named"), [
    ({"tools": [inference_pb2.Tool(name="bad name")]}, "tools[0].name"),
    ({"tools": [inference_pb2.Tool(name="f", parameters="{not json")]}, "tools[0].parameters"),
    ({"tools": [inference_pb2.Tool(name="f", parameters='"text"')]}, "tools[0].parameters"),
    ({"tools": [inference_pb2.Tool(name="f", parameters='{"type": "string"}')]}, "tools[0].parameters"),
    ({"tools": [inference_pb2.Tool(name="f", parameters='{"enum": ["Paris"]}')]}, "tools[0].parameters"),
    ({"tools": [inference_pb2.Tool(name="f", parameters="[" * 40 + "]" * 40)]}, "tools[0].parameters"),
    ({"tools": [inference_pb2.Tool(name="f"), inference_pb2.Tool(name="f")]}, "tools"),
    ({"tools": [inference_pb2.Tool(name="f", parameters=json.dumps({"type": "object", "description": "x" * (1 << 18)}))]},
     "tools"),
    ({"tool_choice": NAMED}, "tool_choice"),  # without tools
    ({**GOOD, "tool_choice": inference_pb2.ToolChoice(function="book_hotel")}, "tool_choice"),
    ({**GOOD, "tool_choice": inference_pb2.ToolChoice()}, "tool_choice"),
    ({**GOOD, "tool_choice": inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_UNSPECIFIED)},
     "tool_choice.mode"),
    ({**GOOD, "tool_choice": inference_pb2.ToolChoice(mode=7)}, "tool_choice.mode"),
    ({**GOOD, "tool_choice": inference_pb2.ToolChoice(function="bad name")}, "tool_choice.function"),
    ({**GOOD, "tool_choice": NAMED, "sampling": {"structured_output": inference_pb2.StructuredOutput(json_object=True)}},
     "tool_choice"),
])
def test_bad_tools_and_tool_choices_are_invalid_argument_naming_the_field(served: Any, fields: dict[str, Any],
                                                                          named: str) -> None:
    code, details = refusal(served, request([USER], **fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(named), details


def test_bad_tool_calls_in_the_history_and_tools_with_tokens_are_invalid_argument(served: Any) -> None:
    wrong_answer = chat_messages_to_pb([USER, CALLED, RESULT])
    wrong_answer.messages[2].tool_call_id = "call_from_elsewhere"
    chat = chat_messages_to_pb([USER, CALLED, RESULT])
    chat.messages[0].tool_calls.add(id="c", name="get_weather", arguments="{}")  # a user's calls
    no_id = chat_messages_to_pb([USER, CALLED, RESULT])
    no_id.messages[1].tool_calls[0].id = ""
    sampling = inference_pb2.SamplingParams(max_tokens=1)
    for req, named in (
        (inference_pb2.GenerateRequest(chat=wrong_answer, sampling=sampling, tools=pb_tools(TOOLS), tool_choice=NONE),
         "chat.messages[2].tool_call_id"),
        (inference_pb2.GenerateRequest(chat=chat, sampling=sampling), "chat.messages[0].tool_calls"),
        (inference_pb2.GenerateRequest(chat=no_id, sampling=sampling), "chat.messages[1].tool_calls[0].id"),
        (inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2]), sampling=sampling, **GOOD), "tools"),
        (inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2]), sampling=sampling,
                                       tool_choice=NAMED), "tool_choice"),
        (inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2]), sampling=sampling,
                                       parallel_tool_calls=True), "parallel_tool_calls"),
    ):
        code, details = refusal(served, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(named), (named, details)
    # tool_choice none with tokens is a no-op, as a text completion's
    _, _, finished = generate(served, inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2]),
                                                                    sampling=sampling, tool_choice=NONE))
    assert finished.completion_tokens == 1


def test_a_session_turn_with_tools_keeps_the_call_the_client_got(served: Any, no_whitespace: dict[str, float]) -> None:
    """A session's first turn calls a named tool; the next turn sends its result (answering the
    call's id as the gRPC reply gave it) and is rendered as the whole conversation the client
    holds; a result answering no call of the session is INVALID_ARGUMENT and changes nothing."""
    session, templater = "grpc-tools-s1", served.templater
    _, _, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=NAMED,
                                              max_tokens=60, logit_bias=no_whitespace, session_id=session))
    assert finished.finish_reason == "tool_calls", finished
    assert _last_prompt(served, session) == templater.first_turn([USER], TOOLS)
    [call] = finished.tool_calls

    wrong = {"role": "tool", "tool_call_id": "call_from_elsewhere", "content": "sunny, 21"}  # (no calls to match here)
    code, details = refusal(served, request([wrong], tools=pb_tools(TOOLS), tool_choice=NONE, session_id=session))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tool_call_id" in details, details

    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"}
    allowed = _one_token_reply(served, "Sure")["allowed_token_ids"]
    _, text, second = generate(served, request([result], tools=pb_tools(TOOLS), tool_choice=NONE, max_tokens=1,
                                               session_id=session, sampling={"allowed_token_ids": allowed}))
    assert text == "Sure" and not second.tool_calls
    conversation = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]}, result]
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)
    served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                             metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)


def test_kvstrata_generate_sends_tools_and_prints_the_call(served: Any, no_whitespace: dict[str, float],
                                                          tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvstrata generate --tools @FILE --tool-choice NAME`` (session 30): the CLI sends OpenAI's
    tools list as ``GenerateRequest.tools`` and the choice as ``tool_choice.function``, and prints
    the reply's call on a line of its own before the finish line (``tool_calls``); a choice
    without tools, or tools that are not a list, are refused before anything is sent."""
    from typer.testing import CliRunner

    from cli import main as cli

    monkeypatch.setenv("KVSTRATA_STATE_DIR", str(tmp_path / "state"))  # no saved TLS / address
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    base = ["generate", USER["content"], "--api-key", served.key, "--gateway", served.address, "--max-tokens", "60"]
    bias = [f"--logit-bias={k}={v:g}" for k, v in no_whitespace.items()]
    result = CliRunner().invoke(cli.app, [*base, "--tools", f"@{tmp_path / 'tools.json'}",
                                          "--tool-choice", "get_weather", *bias])
    assert result.exit_code == 0, (result.output, result.exception)
    [line] = [line for line in result.output.splitlines() if line.startswith("tool call ")]
    call_id, _, rest = line[len("tool call "):].partition(": get_weather(")
    assert call_id.startswith("chatcmpl-tool-") and rest.endswith(")"), line
    Weather.model_validate_json(rest[:-1])
    assert "tool_calls: the model called the tools listed above" in " ".join(result.output.split())
    # the call's JSON is not streamed as text before its line (trial 30n P7: it came twice)
    assert [ln for ln in result.output.splitlines() if "city" in ln] == [line], result.output
    flat = json.dumps([{"type": "function", "name": "f", "parameters": {}}])  # the Responses API's shape
    for args, error in ((["--tool-choice", "auto"], "needs --tools"), (["--tools", "{}"], "must be a JSON list"),
                        (["--tools", flat], "go in its \"function\" object")):
        result = CliRunner().invoke(cli.app, [*base, *args])
        assert result.exit_code == 2 and error in " ".join(result.output.split()), result.output


LONE_ARGUMENTS = '{"city": "\\ud800", "celsius": true}'  # the JSON text of a lone surrogate: no UTF-8 text
LONE_PARAMETERS = json.dumps(TOOLS[0]["function"]["parameters"])[:-1] + ', "description": "\\ud800"}'


@pytest.mark.parametrize("session", ["", "grpc-tools-lone"])
def test_a_lone_surrogate_in_json_text_is_refused_on_both_apis(served: Any, client: openai.OpenAI,
                                                               session: str) -> None:
    """Review 30j F1: ``"\\ud800"`` in a tool's ``parameters`` or a call's ``arguments`` (JSON text
    in a string field) passed every check and ended INTERNAL over gRPC (``UnicodeEncodeError``
    packing a session turn, a ``TypeError`` tokenizing the rendered prompt), a 500 over HTTP.
    Now INVALID_ARGUMENT / 400 naming the field, with or without a session; the stack serves on."""
    lone_tools = [inference_pb2.Tool(name="get_weather", parameters=LONE_PARAMETERS)]
    called = {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": LONE_ARGUMENTS}}]}
    lone_call = request([USER, CALLED, RESULT], session_id=session)  # (the client's helper refuses it too)
    lone_call.chat.messages[1].tool_calls[0].arguments = LONE_ARGUMENTS
    with_tools = request([USER, CALLED, RESULT], tools=pb_tools(TOOLS), tool_choice=NONE, session_id=session)
    with_tools.chat.CopyFrom(lone_call.chat)
    for req, named in (
        (request([USER], tools=lone_tools, tool_choice=NONE, session_id=session), "tools[0].parameters"),
        (request([USER], tools=lone_tools, tool_choice=NAMED, session_id=session), "tools[0].parameters"),
        (lone_call, "chat.messages[1].tool_calls[0].arguments"),
        (with_tools, "chat.messages[1].tool_calls[0].arguments"),
    ):
        code, details = refusal(served, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(named + " holds a lone UTF-16"), \
            (named, code, details)
    extra = {"session_id": session} if session else {}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served.model, messages=[USER, called, RESULT], tools=TOOLS,
                                       tool_choice="none", max_tokens=1, extra_body=extra)
    assert refused.value.body["param"] == "messages.1.tool_calls.0.function.arguments", refused.value.body
    _, _, finished = generate(served, request([USER, CALLED, RESULT], tools=pb_tools(TOOLS), tool_choice=NONE,
                                              max_tokens=1, session_id=session))
    assert finished.completion_tokens == 1
    if session:
        served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                                 metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)


def test_a_tool_schema_the_compiler_refuses_names_tool_choice_as_over_http(served: Any,
                                                                          client: openai.OpenAI) -> None:
    """Review 30j F2: the node's refusal ("structured_output json_schema does not compile: ...")
    named a field the client never sent; it names ``tool_choice`` (HTTP's param), and a
    ``sampling.structured_output`` the client sent is named by its gRPC path."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "(["}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    for choice in (NAMED, REQUIRED):
        code, details = refusal(served, request([USER], tools=pb_tools(tools), tool_choice=choice))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "tool_choice: json_schema does not compile"), details
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served.model, messages=[USER], tools=tools, tool_choice=WEATHER,
                                       max_tokens=1)
    assert refused.value.body["param"] == "tool_choice", refused.value.body
    own = inference_pb2.StructuredOutput(json_schema=json.dumps(schema))
    code, details = refusal(served, request([USER], sampling={"structured_output": own}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "sampling.structured_output json_schema does not compile"), details


def test_a_session_turns_unmatched_tool_message_names_the_grpc_path(served: Any,
                                                                   no_whitespace: dict[str, float]) -> None:
    """Review 30j F7: the node's refusal named HTTP's ``messages.0.tool_call_id``."""
    session = "grpc-tools-f7"
    _, _, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=NAMED, max_tokens=60,
                                              logit_bias=no_whitespace, session_id=session))
    assert finished.finish_reason == "tool_calls", finished
    wrong = {"role": "tool", "tool_call_id": "nope", "content": "sunny, 21"}
    code, details = refusal(served, request([wrong], tools=pb_tools(TOOLS), tool_choice=NONE, session_id=session))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "chat.messages[0].tool_call_id: 'nope' answers no tool call"), details
    served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                             metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)


def test_grpc_refusals_name_grpc_fields() -> None:
    """``grpc_refusal``: the node's and the shared checks' words in the gRPC API's paths (F2, F7),
    other words as they are; ``constraint_field`` is the field that gave the constraint."""
    def worded(message: str, field: str = "") -> str:
        return grpc_refusal(message, GenerateInput(prompt=[USER], sampling=None,  # type: ignore[arg-type]
                                                   constraint_field=field))

    compile_error = "structured_output json_schema does not compile: Regex parsing error"
    assert worded(compile_error, "tool_choice") == "tool_choice: json_schema does not compile: Regex parsing error"
    assert worded(compile_error, "sampling.structured_output") == "sampling." + compile_error
    assert worded(compile_error) == compile_error
    assert worded("messages.0.tool_call_id: 'nope' answers no") == "chat.messages[0].tool_call_id: 'nope' answers no"
    assert worded("messages.3.tool_calls.1.function.arguments holds x") == \
        "chat.messages[3].tool_calls[1].function.arguments holds x"
    assert worded("messages: 3983877 characters can never fit") == "chat.messages: 3983877 characters can never fit"
    for kept in ("the messages alone take 9 tokens", "chat.messages[0].role must be", "tools[0].parameters x"):
        assert worded(kept) == kept
    assert input_from_pb(request([USER], tools=pb_tools(TOOLS), tool_choice=NONE)).constraint_field == ""
    assert input_from_pb(request([USER], tools=pb_tools(TOOLS), tool_choice=NAMED)).constraint_field == "tool_choice"
    own = inference_pb2.StructuredOutput(json_object=True)
    assert input_from_pb(request([USER], sampling={"structured_output": own})).constraint_field == \
        "sampling.structured_output"


@pytest.mark.parametrize(("tools", "named"), [
    ([{"function": {"name": "get_weather", "parametrs": {"type": "object"}}}], "tools[0].function has unknown keys 'parametrs'"),
    ([{"type": "function", "fuction": {"name": "g"}, "name": "g"}], "tools[0] has unknown keys 'fuction', 'type'"),
    ([{"type": "function", "function": {"name": "g"}, "strict": True}], "tools[0] has unknown keys 'strict'"),
    ([{"name": "g", "parameters": "{}"}], "tools[0].parameters must be a JSON schema object"),
    ([{"name": "g", "description": 3}], "tools[0].description must be text"),
])
def test_kvstrata_generate_names_a_misspelled_tool_key(tools: list[Any], named: str) -> None:
    """Review 30j F6: ``--tools`` dropped keys it did not read (``parametrs``: the tool went
    without parameters, a named choice constrained to any object); HTTP's strict models refuse
    them, and so does the CLI now, before anything is sent."""
    from typer import BadParameter

    from cli.tools import tools_from_text

    with pytest.raises(BadParameter) as refused:
        tools_from_text(json.dumps(tools))
    assert refused.value.message.startswith(named), refused.value.message


def test_kvstrata_generate_sends_compact_parameters_and_takes_nulls() -> None:
    """``parameters`` go as compact JSON with non-ASCII text as it is (F3: the gateway held the
    text as sent, escapes and spaces included, to the compact bound); a null ``description`` or
    ``parameters`` is not given, as HTTP takes it; ``strict`` is sent (``Tool.strict``)."""
    from cli.tools import tools_from_text

    parameters = {"type": "object", "properties": {"ville": {"type": "string", "description": "où"}}}
    [tool, bare] = tools_from_text(json.dumps([
        {"type": "function", "function": {"name": "g", "description": None, "parameters": parameters, "strict": True}},
        {"name": "h", "description": "d", "parameters": None}]))
    assert tool.parameters == json.dumps(parameters, ensure_ascii=False, separators=(",", ":"))
    assert (tool.name, tool.description, bare.name, bare.description, bare.parameters) == ("g", "", "h", "d", "")
    assert (tool.strict, bare.strict) == (True, False)
