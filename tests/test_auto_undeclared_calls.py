"""``tool_choice: "auto"`` read from free text (tools not all ``strict``, gRPC's always) holds no
call of a function the request did not declare: when any ``<tool_call>`` block of a reply is not
a call of one of the request's tools (another ``name``, or ``arguments`` that is not a JSON
object), the reply holds no calls at all: its whole text as generated is the ``content``, with
the node's finish reason (``services.tool_calls``), whole and streamed alike, on both APIs, and a
session turn's node keeps it so (``NodeRequest.tool_output`` carries the declared names:
``chat_tools.tool_output_spec``).

Regression: a model that wrote ``<tool_call>{"name": "delete_files", ...}</tool_call>`` for a
function not among the request's tools got it back as a tool call with finish reason
``tool_calls`` (OpenAI's contract: only declared tools are called). Reproduced with the real
SmolLM2-135M (greedy, the few-shot of ``test_auto_tool_constraint``) and, served end to end on
the stack of ``test_session_tool_calls`` (tiny random Llama), with text forced by a regex.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services.cache_node_streams import _kept_reply
from services.chat_tools import MAX_TOOLS, check_tool_output, tool_output_spec
from services.data_plane_wire import request_from_wire, request_to_wire
from services.gateway import _read_tool_calls
from services.gateway_inputs import input_from_pb
from services.node_request import NodeRequest
from services.openai_api.schemas import ChatCompletionRequest
from services.tool_calls import ToolOutput
from tests import test_session_tool_calls as sessions
from tests.test_grpc_tool_calls import AUTO, NONE, generate, pb_tools, request
from tests.test_session_tool_calls import USER, _last_prompt
from tests.test_tool_call_parsing import _stream
from tests.test_tool_calls_served import TOOLS

NAMES = ("get_weather", "book_flight")  # TOOLS' names
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}\n</tool_call>'
DELETE = '<tool_call>\n{"name": "delete_files", "arguments": {"path": "/srv"}}\n</tool_call>'


def _block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def _both(text: str, finish: str | None = "stop", parallel: bool = True) -> tuple[dict[str, Any], str | None]:
    """``text``'s whole reading, checked equal to its streamed readings (one piece, per character)."""
    whole, reason = ToolOutput("auto", parallel=parallel, names=NAMES).message(text, finish)
    for pieces in ([text], list(text)):
        content, calls, streamed_reason = _stream(ToolOutput("auto", parallel=parallel, names=NAMES), pieces, finish)
        assert streamed_reason == reason, (text, pieces[:3])
        assert content == (whole["content"] or "")
        assert [c["function"] for c in calls] == [c["function"] for c in whole.get("tool_calls", [])]
    return whole, reason


@pytest.mark.parametrize("text", [
    DELETE,  # an undeclared function
    "Let me clean up. " + DELETE,
    WEATHER + DELETE,  # declared, then undeclared: none of the calls is handed out
    DELETE + WEATHER,
    WEATHER + DELETE[: -len("\n</tool_call>")],  # an undeclared last block left unclosed
    _block("get_weather", '"Paris"'),  # arguments that are not an object
    _block("get_weather", '["Paris"]'),
    _block("get_weather", "5"),
    _block("get_weather", "null"),
    WEATHER + _block("book_flight", '"CDG"'),
    _block("get_weather ", "{}"),  # names are matched exactly
    _block("Get_weather", "{}"),
])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_block_calling_no_declared_tool_makes_the_reply_its_text(text: str, finish: str) -> None:
    """Whole and streamed (the streamed reader held the text from ``<tool_call>`` on; ``end``
    sends it as content): the content is the text as generated, no calls, the node's finish
    reason. Before: ``delete_files`` (and the other blocks) came back as calls, ``tool_calls``."""
    whole, reason = _both(text, finish)
    assert (whole, reason) == ({"content": text}, finish)


def test_parallel_false_reads_every_block_before_keeping_the_first() -> None:
    """With ``parallel_tool_calls`` false only the first call is kept, but a later undeclared
    block still makes the reply its text (the rule is over the reply, not the kept calls)."""
    assert _both(WEATHER + DELETE, parallel=False) == ({"content": WEATHER + DELETE}, "stop")
    whole, reason = _both(WEATHER + WEATHER.replace("Paris", "Oslo"), parallel=False)
    assert reason == "tool_calls" and [c["function"]["arguments"] for c in whole["tool_calls"]] == \
        ['{"city": "Paris", "celsius": true}']


@pytest.mark.parametrize(("text", "content", "calls"), [
    (WEATHER, None, [("get_weather", '{"city": "Paris", "celsius": true}')]),
    ("Sure. " + WEATHER + _block("book_flight", '{"to": "CDG"}'), "Sure. ",
     [("get_weather", '{"city": "Paris", "celsius": true}'), ("book_flight", '{"to": "CDG"}')]),
    ('<tool_call>{"name": "book_flight"}</tool_call>', None, [("book_flight", "{}")]),  # arguments left out: {}
    (_block("get_weather", '{"city": "Atlantis"}'), None, [("get_weather", '{"city": "Atlantis"}')]),  # (unchecked)
])
def test_calls_of_declared_tools_are_read_as_before(text: str, content: str | None, calls: list[Any]) -> None:
    """Declared names with object arguments are calls (arguments are not checked against the
    schema: that needs the strict constraint, ``test_auto_tool_constraint``)."""
    whole, reason = _both(text)
    assert reason == "tool_calls" and whole["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == calls


def test_auto_reads_no_calls_without_the_declared_names() -> None:
    with pytest.raises(ValueError, match="names must be given"):
        ToolOutput("auto")
    assert ToolOutput("named", "get_weather").spec() == tool_output_spec("named", "get_weather", True, "", ["get_weather"])


def test_both_edges_send_the_declared_names_to_the_node() -> None:
    """HTTP (``ToolFields.tool_output``) and gRPC (``input_from_pb``) specs carry the request's
    tools' names, which the node's ``_kept_reply`` reads a session turn's reply with."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], "tools": TOOLS})
    http = body.tool_output("seed-1")
    assert http is not None and check_tool_output(http.spec()) == ("auto", "", True, "seed-1", NAMES)
    grpc_spec = input_from_pb(request([USER], tools=pb_tools(TOOLS), tool_choice=AUTO), tool_call_parser="hermes",
                              seed="seed-2").tool_output
    assert check_tool_output(grpc_spec) == ("auto", "", True, "seed-2", NAMES)
    assert _kept_reply(grpc_spec, "Ok. " + DELETE, "stop") == {"role": "assistant", "content": "Ok. " + DELETE}
    kept = _kept_reply(grpc_spec, "Ok. " + WEATHER, "stop")
    assert kept["content"] == "Ok. " and [c["function"]["name"] for c in json.loads(kept["tool_calls"])] == \
        ["get_weather"]
    # the gRPC edge's reading of the finished event (the HTTP API's whole reading)
    texts: list[str] = []
    for event in ({"type": "delta", "text": DELETE[:9]}, {"type": "delta", "text": DELETE[9:]}):
        _read_tool_calls(grpc_spec, texts, event)
    finished = {"type": "finished", "finish_reason": "stop"}
    assert _read_tool_calls(grpc_spec, texts, finished) == finished


def _wire(tool_output: str) -> NodeRequest:
    req = NodeRequest("r", "t", "ns", SamplingParams(max_tokens=4), messages=({"role": "user", "content": "hi"},),
                      session_id="s")
    return request_from_wire(request_to_wire(req) | {"tool_output": tool_output})


@pytest.mark.parametrize(("spec", "words"), [
    ('["auto", "", true, "ab"]', "request.tool_output must be [mode"),  # the 4-element spec of before
    ('["auto", "", true, "ab", []]', "1 to 128 declared tools' names"),
    ('["auto", "", true, "ab", "get_weather"]', "request.tool_output must be [mode"),
    (json.dumps(["auto", "", True, "ab", [f"f{i}" for i in range(MAX_TOOLS + 1)]]), "request.tool_output must be"),
    ('["auto", "", true, "ab", ["get weather"]]', "request.tool_output's names must match"),
    ('["auto", "", true, "ab", [5]]', "request.tool_output's names must match"),
    ('["auto", "", true, "ab", ["' + "x" * 65 + '"]]', "request.tool_output's names must match"),
    (json.dumps(["auto", "", True, "ab", ["f"] * 100_000]), "characters of JSON; at most"),
])
def test_a_tool_output_spec_off_the_wire_is_checked(spec: str, words: str) -> None:
    with pytest.raises(ValueError) as err:
        _wire(spec)
    assert words in str(err.value), err.value


def test_the_largest_spec_crosses_the_wire() -> None:
    names = [f"{i:03d}".ljust(64, "x") for i in range(MAX_TOOLS)]
    spec = tool_output_spec("auto", None, False, "s" * 64, names)
    assert _wire(spec).tool_output == spec and check_tool_output(spec) == ("auto", "", False, "s" * 64, tuple(names))


# served end to end: the stack of test_session_tool_calls (SESSION_TEMPLATE on node and gateway)
served, client = sessions.served, sessions.client
FORCED = r'Ok\. <tool_call>\n\{"name": "delete_files", "arguments": \{"path": "/srv"\}\}\n</tool_call>'
FORCED_TEXT = "Ok. " + DELETE


@pytest.fixture(scope="module")
def hermes(served: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.hermes_base, api_key=served.key, max_retries=0)


def _forced(regex: str = FORCED, **fields: Any) -> dict[str, Any]:
    extra = {"structured_outputs": {"regex": regex}, **fields.pop("extra_body", {})}
    return {"model": "m", "messages": [USER], "tools": TOOLS, "max_tokens": 160, "temperature": 0.0,
            "extra_body": extra, **fields}


def test_an_undeclared_call_served_over_http_is_content(hermes: openai.OpenAI, served: Any) -> None:
    """The model's text (forced) calls ``delete_files``: the whole response's and the stream's
    content is that text, no ``tool_calls``, finish reason ``stop``; so with a declared call
    beside it."""
    mixed = FORCED.replace(r"Ok\. ", r'Ok\. <tool_call>\{"name": "get_weather", "arguments": \{\}\}</tool_call>')
    for regex in (FORCED, mixed):
        fields = _forced(regex, model=served.model)
        choice = hermes.chat.completions.create(**fields).choices[0]
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None, choice
        assert choice.message.content.endswith(FORCED_TEXT[4:]) and choice.message.content.startswith("Ok. <tool_call>")
        content, calls, finish = "", [], None
        for chunk in hermes.chat.completions.create(stream=True, **fields):
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert (content, calls, finish) == (choice.message.content, [], "stop")


def test_an_undeclared_call_served_over_grpc_is_content(served: Any) -> None:
    """gRPC "auto" (its ``Tool`` has no ``strict``: always read from free text): the finished
    event holds no calls and the node's finish reason; the deltas are the text."""
    served.servicer.tool_call_parser = "hermes"
    try:
        forced = inference_pb2.StructuredOutput(regex=FORCED)
        _, text, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=AUTO, max_tokens=160,
                                                     sampling={"structured_output": forced}))
    finally:
        served.servicer.tool_call_parser = ""
    assert text == FORCED_TEXT
    assert finished.finish_reason == "stop" and not finished.tool_calls, finished


def test_a_session_keeps_an_undeclared_call_as_the_content_the_client_got(hermes: openai.OpenAI,
                                                                          served: Any) -> None:
    """A session turn (HTTP, then gRPC) whose reply calls ``delete_files``: the node keeps the
    reply as the client got it, its text, so the next turn's prompt is the first-turn rendering
    of the conversation the client holds. Before, the node kept a ``delete_files`` call, which
    the template writes in another form (no newlines in the block)."""
    templater = served.templater
    follow = {"role": "user", "content": "And /opt?"}
    session = "undeclared-http"
    first = hermes.chat.completions.create(**_forced(model=served.model, extra_body={"session_id": session}))
    reply = first.choices[0].message
    assert reply.tool_calls is None and reply.content == FORCED_TEXT, reply
    hermes.chat.completions.create(model=served.model, messages=[follow], tools=TOOLS, tool_choice="none",
                                   max_tokens=1, extra_body={"session_id": session})
    conversation = [USER, {"role": "assistant", "content": reply.content}, follow]
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)

    session = "undeclared-grpc"
    served.servicer.tool_call_parser = "hermes"
    try:
        forced = inference_pb2.StructuredOutput(regex=FORCED)
        _, text, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=AUTO, max_tokens=160,
                                                     session_id=session, sampling={"structured_output": forced}))
        assert text == FORCED_TEXT and not finished.tool_calls, finished
        generate(served, request([follow], tools=pb_tools(TOOLS), tool_choice=NONE, max_tokens=1, session_id=session))
    finally:
        served.servicer.tool_call_parser = ""
    assert _last_prompt(served, session) == templater.first_turn(
        [USER, {"role": "assistant", "content": text}, follow], TOOLS)


@pytest.mark.slow
def test_a_real_model_calling_an_undeclared_function_gets_its_text_back(real_model: Any) -> None:
    """SmolLM2-135M, greedy, after a few-shot history of ``delete_files`` calls, unconstrained
    (tools not strict): it writes a ``delete_files`` call. Read by the HTTP edge (whole and
    streamed, ``ToolFields.tool_output``), the gRPC edge (``_read_tool_calls`` with
    ``input_from_pb``'s spec) and a session's node (``_kept_reply``), it is the content, with
    finish reason as the engine's. Before: a ``delete_files`` tool call, ``tool_calls``."""
    from tests.conftest import make_engine
    from tests.test_auto_tool_constraint import _fewshot, _generate, _undeclared

    lm = real_model
    eng = make_engine(lm, kv_pool_bytes=32 << 20, max_num_batched_tokens=256)
    prompt = lm.tokenizer.apply_chat_template(_fewshot(), add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    text, reason = _generate(eng, lm.tokenizer, prompt, None)
    assert text.startswith(_undeclared("/srv")), text  # the model calls delete_files
    messages = [{"role": "user", "content": "Delete /srv"}]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS})
    assert body.structured_output() is None  # not strict: free text read afterwards
    http = body.tool_output("seed-1")
    assert http is not None and http.message(text, reason) == ({"content": text}, reason)
    content, calls, streamed_reason = _stream(body.tool_output("seed-1"), list(text), reason)  # type: ignore[arg-type]
    assert (content, calls, streamed_reason) == (text, [], reason)
    assert _kept_reply(http.spec(), text, reason) == {"role": "assistant", "content": text}
    spec = input_from_pb(request(messages, tools=pb_tools(TOOLS), tool_choice=AUTO), tool_call_parser="hermes",
                         seed="seed-2").tool_output
    texts: list[str] = []
    _read_tool_calls(spec, texts, {"type": "delta", "text": text})
    finished = {"type": "finished", "finish_reason": reason}
    assert _read_tool_calls(spec, texts, finished) == finished
