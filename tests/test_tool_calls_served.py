"""Tool calling on ``/v1/chat/completions`` served end to end through the official ``openai``
client, without Ray: the real CacheNode (xgrammar on the node), scheduler, gateway gRPC server
and OpenAI app of ``test_logprobs_served`` (a tiny random Llama with SmolLM2's tokenizer), with
a second app whose ``tool_call_parser`` is ``hermes``.

A named ``tool_choice`` and ``"required"`` constrain the output to the tools' schemas and come
back as ``message.tool_calls`` (whole, streamed, every choice of ``n``); ``"none"`` renders the
tools and parses nothing; ``"auto"`` needs the parser (else a 400 naming ``tool_choice``) and
reads ``<tool_call>`` blocks (forced here with a regex: the random model writes none of its
own). Tools and the history's tool calls reach the chat template (a tool-rendering template
swapped in shows it in ``prompt_tokens``). Bad input is a 400 naming its field.

Before this, ``tools`` was a 400 "unsupported field", ``tool_choice`` anything but "none" a
400, and an assistant message's ``tool_calls`` a 400. Tools in session turns and with
``prefix_messages``: ``test_session_tool_calls``."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from services.chat import ChatTemplater
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.logprobs import TokenTexts
from tests.test_logprobs_served import Served


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]
    celsius: bool


class Flight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: Literal["LHR", "CDG"]


def _tool(name: str, model: type[BaseModel]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": model.model_json_schema()}}


TOOLS = [_tool("get_weather", Weather), _tool("book_flight", Flight)]
SCHEMAS = {"get_weather": Weather, "book_flight": Flight}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}

TOOL_TEMPLATE = (  # a Hermes-style template that renders tools and tool calls
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}"
    "<|im_end|>\n{%- endif %}{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    info = s.node.describe()
    s.hermes = HttpServer(create_app(OpenAIEdge(s.servicer, info["model_id"], list, lambda: 1,
                                                tokens=TokenTexts(s.tokenizer), tool_call_parser="hermes")))
    s.hermes_base = f"http://127.0.0.1:{s.run(s.hermes.start('127.0.0.1', 0))}/v1"
    yield s
    s.run(s.hermes.stop())
    s.close()


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base, api_key=served.key, max_retries=0)


@pytest.fixture(scope="module")
def hermes(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.hermes_base, api_key=served.key, max_retries=0)


@pytest.fixture(scope="module")
def no_whitespace(served: Served) -> dict[str, float]:
    """``logit_bias`` banning whitespace-only tokens (the random model's JSON would be spaces)."""
    tok = served.tokenizer
    return {str(i): -100.0 for i in range(len(tok)) if (text := tok.decode([i])) and not text.strip()}


def _create(client: openai.OpenAI, served: Served, **fields: Any) -> Any:
    return client.chat.completions.create(model=served.model, **{"messages": MESSAGES, "max_tokens": 60, **fields})


def _check_call(call: Any) -> None:
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    SCHEMAS[call.function.name].model_validate_json(call.function.arguments)


def test_named_tool_choice_is_one_call_of_that_function(client: openai.OpenAI, served: Served,
                                                        no_whitespace: dict[str, float]) -> None:
    for temperature in (0.0, 1.0):
        reply = _create(client, served, tools=TOOLS, tool_choice=WEATHER, temperature=temperature, seed=3,
                        logit_bias=no_whitespace)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)


def test_required_tool_choice_is_calls_of_the_tools(client: openai.OpenAI, served: Served,
                                                    no_whitespace: dict[str, float]) -> None:
    """``parallel_tool_calls`` false: one call (the array holds one item), of either tool. With
    parallel calls the random model may go on adding items until ``max_tokens``: then the text
    that did not close is the content, with no calls, and ``length`` (vLLM's fallback)."""
    names = set()
    for seed in (1, 2, 3, 4):
        reply = _create(client, served, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                        logit_bias=no_whitespace, parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls
        _check_call(call)
        names.add(call.function.name)
    assert names <= set(SCHEMAS)
    choice = _create(client, served, tools=TOOLS, tool_choice="required", logit_bias=no_whitespace, max_tokens=120,
                     temperature=1.0, seed=1).choices[0]
    if choice.finish_reason == "tool_calls":
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)
    else:
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert choice.message.content.startswith('[{"name":')


def _streamed(stream: Any) -> tuple[str, dict[tuple[int, int], dict[str, Any]], str | None]:
    """(content, calls by (choice, call) index: id, name and arguments joined, finish reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault((choice.index, delta.index), {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                if delta.function is not None:
                    call["name"] = call["name"] or delta.function.name
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def test_streamed_tool_calls_equal_the_whole_ones(client: openai.OpenAI, served: Served,
                                                  no_whitespace: dict[str, float]) -> None:
    """Greedy: the named call's arguments stream as deltas and join to the whole response's; the
    required calls come in the last chunk; both end ``tool_calls``."""
    for choice in (WEATHER, "required"):
        fields = {"tools": TOOLS, "tool_choice": choice, "temperature": 0.0, "logit_bias": no_whitespace,
                  "parallel_tool_calls": False}
        whole = _create(client, served, **fields).choices[0].message.tool_calls
        content, calls, finish = _streamed(_create(client, served, stream=True, **fields))
        assert content == "" and finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole]
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())


def test_every_choice_of_n_is_a_call(client: openai.OpenAI, served: Served, no_whitespace: dict[str, float]) -> None:
    reply = _create(client, served, tools=TOOLS, tool_choice=WEATHER, n=3, temperature=1.0, seed=5,
                    logit_bias=no_whitespace)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        _check_call(choice.message.tool_calls[0])
    _, calls, finish = _streamed(_create(client, served, tools=TOOLS, tool_choice=WEATHER, n=2, stream=True,
                                               temperature=0.0, logit_bias=no_whitespace))
    assert finish == "tool_calls" and sorted(calls) == [(0, 0), (1, 0)]  # greedy: the same call twice
    assert calls[0, 0]["arguments"] == calls[1, 0]["arguments"] and calls[0, 0]["id"] != calls[1, 0]["id"]
    for call in calls.values():
        assert call["name"] == "get_weather"
        Weather.model_validate_json(call["arguments"])


def test_tool_choice_none_answers_in_text_and_tools_reach_the_template(client: openai.OpenAI,
                                                                       served: Served) -> None:
    """``none``: content, no calls. SmolLM2's template renders no tools (as vLLM, they are left
    out: the same prompt tokens); a template that renders them gets them, and the history's
    tool calls, in the prompt."""
    plain = _create(client, served, max_tokens=4, temperature=0.0)
    none = _create(client, served, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0.0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "celsius": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    tokenizer = copy.deepcopy(served.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    kept, served.servicer.templater = served.servicer.templater, ChatTemplater(tokenizer)
    try:
        bare = _create(client, served, max_tokens=1, messages=history[:1]).usage.prompt_tokens
        with_tools = _create(client, served, max_tokens=1, messages=history[:1], tools=TOOLS,
                             tool_choice="none").usage.prompt_tokens
        with_calls = _create(client, served, max_tokens=1, messages=history, tools=TOOLS,
                             tool_choice="none").usage.prompt_tokens
    finally:
        served.servicer.templater = kept
    def tokens(messages: list[dict[str, Any]], tools: Any = None) -> int:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    as_template = copy.deepcopy(history)  # arguments as an object, as vLLM hands them to templates
    as_template[1]["content"] = ""
    as_template[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "celsius": True}
    assert bare == tokens(history[:1]) and with_tools == tokens(history[:1], TOOLS) > bare + 100
    assert with_calls == tokens(as_template, TOOLS)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}</tool_call>' in \
        tokenizer.apply_chat_template(as_template, tools=TOOLS, tokenize=False)


def test_auto_is_refused_without_the_parser(client: openai.OpenAI, served: Served) -> None:
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as err:
            _create(client, served, **fields)
        error = err.value.body
        assert error["param"] == "tool_choice" and "tool_call_parser: hermes" in error["message"], error


CALL_REGEX = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "celsius": true\}\}</tool_call>'


def test_auto_reads_hermes_tool_calls(hermes: openai.OpenAI, served: Served) -> None:
    """With ``tool_call_parser`` hermes: text forced to hold a ``<tool_call>`` block is a call
    (the text before it the content), whole and streamed; text without one is content."""
    forced = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": CALL_REGEX}}, "max_tokens": 80,
              "temperature": 0.0}
    choice = _create(hermes, served, **forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. ", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["celsius"] is True
    _check_call(call)
    content, calls, finish = _streamed(_create(hermes, served, stream=True, **forced))
    assert (content, finish) == ("Sure. ", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    plain = _create(hermes, served, tools=TOOLS, max_tokens=5, temperature=0.0).choices[0]
    assert plain.message.tool_calls is None and plain.message.content and plain.finish_reason == "length"
    content, calls, finish = _streamed(_create(hermes, served, tools=TOOLS, max_tokens=5, temperature=0.0,
                                               stream=True))
    assert (content, calls, finish) == (plain.message.content, {}, "length")


def test_a_streamed_auto_answer_sends_no_chunk_that_says_nothing(hermes: openai.OpenAI, served: Served) -> None:
    """Trial 28k F1: text the hermes parser held back (a call being read) went out as a chunk
    with ``delta: {}``, one per token (58 before one call's finish chunk); vLLM sends none."""
    forced = {"tools": TOOLS, "extra_body": {"structured_outputs": {"regex": CALL_REGEX}}, "max_tokens": 80,
              "temperature": 0.0, "stream": True}
    chunks = list(_create(hermes, served, **forced))
    silent = [c for c in chunks if c.choices and c.choices[0].finish_reason is None
              and c.choices[0].logprobs is None and c.choices[0].delta.model_dump(exclude_none=True) == {}]
    assert not silent and chunks[-1].choices[0].finish_reason == "tool_calls", len(silent)


def test_tool_call_arguments_are_json_text(hermes: openai.OpenAI, served: Served,
                                           no_whitespace: dict[str, float]) -> None:
    """auto: ``"arguments": {...}`` is the call's arguments as JSON text; ``"arguments": "Paris"``
    (a str, no object) is no call: the reply is its text, with the node's ``stop``
    (``test_auto_undeclared_calls``; before that, ``"Paris"`` with its quotes and ``tool_calls``,
    and before that ``Paris``, not JSON). named: a stop string
    that cuts the constrained JSON gives no call (whole: the text is the content) and the
    node's ``stop`` (before: arguments ``{`` and ``tool_calls``)."""
    forced = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    choice = _create(hermes, served, tools=TOOLS, extra_body={"structured_outputs": {"choice": [forced]}}).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    forced = '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'
    choice = _create(hermes, served, tools=TOOLS, extra_body={"structured_outputs": {"choice": [forced]}}).choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", forced, None), choice
    cut = {"tools": TOOLS, "tool_choice": WEATHER, "stop": ['"c'], "logit_bias": no_whitespace, "temperature": 0.0}
    choice = _create(hermes, served, **cut).choices[0]
    text = choice.message.content
    assert (choice.finish_reason, text.strip(), choice.message.tool_calls) == ("stop", "{", None), choice
    _, calls, finish = _streamed(_create(hermes, served, stream=True, **cut))
    assert finish == "stop" and [c["arguments"] for c in calls.values()] == [text]


def _calling(*ids: str) -> dict[str, Any]:
    """An assistant message of the history calling ``get_weather`` once per id."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        for i in ids]}


def _fn(name: str, **more: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **more}}


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [_fn("get weather")]}, "tools.0.function.name", "String should match pattern"),
    ({"tools": [_fn("x" * 65)]}, "tools.0.function.name", "String should match pattern"),
    ({"tools": [_fn("f")] * 2}, "tools", "names the function 'f' twice"),
    ({"tools": [_fn(f"f{i}") for i in range(129)]}, "tools", "List should have at most 128 items"),
    ({"tools": []}, "tools", "must hold at least one tool"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "Input should be 'function'"),
    ({"tools": [_fn("f", parameters={"enum": ["Paris", "Rome"]})]}, "tools.0.function.parameters",
     "must be an object's schema (OpenAI's: the root is an object, not 'enum')"),  # (review 28l F4)
    ({"tools": [_fn("f", parameters={"type": "object", "anyOf": [{"type": "integer"}]})]},
     "tools.0.function.parameters", "not 'anyOf'"),
    ({"tools": [_fn("f", parameters={"a": {"b": 1}} | {"x": json.loads("[" * 40 + "]" * 40)})]},
     "tools.0.function.parameters", "the schema nests more than 32 levels deep"),
    ({"tools": [_fn(f"f{i}", description="d" * 4000) for i in range(70)]}, "tools", "at most 262144 are allowed"),
    ({"tools": [_fn("f", parameters={"type": "object"}), _fn("g", parameters={"type": "string", "enum": ["hi"]})]},
     "tools.1.function.parameters", 'must be an object\'s schema (OpenAI\'s): its "type" is "string", not "object"'),
    ({"tools": [_fn("f", parameters={"type": ["object", "null"]})], "tool_choice": "required"},
     "tools.0.function.parameters", 'its "type" is ["object", "null"], not "object"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice: names the function 'nope', which is not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "Input should be"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice: a required tool choice constrains the output; it cannot go with response_format"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "applies to assistant messages, not to role 'user'"),
    ({"messages": [*MESSAGES, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.1.function_call", "the deprecated function_call is not served"),
    # OpenAI's: a tool message names the call it answers, one of an earlier assistant message's
    ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny"}]}, "messages.1.tool_call_id",
     "required on a tool message"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny", "tool_call_id": None}]},
     "messages.1.tool_call_id", "required on a tool message"),
    ({"messages": [*MESSAGES, _calling("call_1"), {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]},
     "messages.2.tool_call_id", "'call_2' answers no tool call of an earlier assistant message"),
    ({"messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, _calling("call_1")]},
     "messages.1.tool_call_id", "'call_1' answers no tool call of an earlier assistant message"),
])
def test_bad_tool_input_is_a_400_naming_the_field(served: Served, fields: dict[str, Any], param: str,
                                                  message: str) -> None:
    status, body = served.post("/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and message in body["error"]["message"], body


def test_a_tool_result_is_matched_only_against_the_requests_own_calls(served: Served) -> None:
    """A tool message answering a call of any earlier assistant message is served (not only the
    one just before it); with no assistant tool calls in the request (a client that trimmed its
    history, as vLLM serves it) its ``tool_call_id`` is not matched against anything."""
    for messages in ([*MESSAGES, _calling("call_1", "call_2"), {"role": "tool", "tool_call_id": "call_2", "content": "a"},
                      {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": "call_1", "content": "b"}],
                     [*MESSAGES, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]):
        status, body = served.post("/chat/completions", {"messages": messages, "max_tokens": 1})
        assert status == 200, body


def test_completions_still_refuse_tools(served: Served) -> None:
    status, body = served.post("/completions", {"prompt": "hi", "tools": TOOLS})
    assert status == 400 and body["error"]["param"] == "tools", body
