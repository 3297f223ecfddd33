"""Tool calling in server-side sessions (``session_id``) on ``/v1/chat/completions``, served end
to end through the official ``openai`` client on the real stack of ``test_tool_calls_served``
(the real CacheNode, scheduler, gateway gRPC server and OpenAI app; a tiny random Llama with
SmolLM2's tokenizer), the node and the gateway rendering with a template that renders tools and
tool calls (``TOOL_TEMPLATE``).

Each session turn's prompt, as the node hands it to its engine, is compared token for token with
a fresh first-turn rendering of the whole conversation the client holds (with the tools, the
model's tool calls in the ids the client got): a turn continues its history only when the
template renders the history as its tokens hold it, else the conversation is rendered anew (the
node's ``session_rerenders``), never a prompt of other tokens.

Before this, ``tools`` or an assistant message's ``tool_calls`` with a ``session_id`` was a 400
naming ``tools`` ("not served with a session_id"), and so was ``prefix_messages`` with tools.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cache_node.sampling_params import SamplingParams
from services.chat import ChatTemplater, content_chars
from services.chat_tools import template_call, wire_messages
from services.data_plane_wire import request_from_wire, request_to_wire
from services.node_request import NodeRequest
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.logprobs import TokenTexts
from services.openai_api.tools import MAX_TOOLS_CHARS
from tenants.model import TenantSpec
from tests.loop_plane import call
from tests.test_logprobs_served import Served
from tests.test_tool_calls_served import CALL_REGEX, TOOL_TEMPLATE, TOOLS, WEATHER, _streamed

USER = {"role": "user", "content": "What is the weather in Paris?"}

SESSION_TEMPLATE = TOOL_TEMPLATE.replace("<|im_start|>assistant\n{%- endif %}", "<|im_start|>assistant\n{% endif %}")
"""``TOOL_TEMPLATE`` with a generation prompt that opens the assistant's message as the template
writes one (``TOOL_TEMPLATE``'s strips its newline): a history of it can be continued."""
assert SESSION_TEMPLATE != TOOL_TEMPLATE

IDS_TEMPLATE = SESSION_TEMPLATE.replace('<tool_call>{"name": ', '<tool_call>{"id": "{{ call.id }}", "name": ')
"""``SESSION_TEMPLATE`` writing each call's id too (as Mistral's templates do)."""
assert IDS_TEMPLATE != SESSION_TEMPLATE


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The stack with ``SESSION_TEMPLATE`` on the node and the gateway, a hermes app, a second
    tenant, and every prompt the node's engine takes recorded by session (``served.prompts``)."""
    s = Served()
    tokenizer = copy.deepcopy(s.tokenizer)
    tokenizer.chat_template = SESSION_TEMPLATE
    s.templater = ChatTemplater(tokenizer)
    s.node.templater = s.templater
    s.servicer.templater = s.templater
    s.prompts = {}
    add = s.node.engine.add_request

    def recording(prompt: list[int], *args: Any, **kwargs: Any) -> Any:
        s.prompts.setdefault(kwargs.get("session_id"), []).append(list(prompt))
        return add(prompt, *args, **kwargs)

    s.node.engine.add_request = recording
    info = s.node.describe()
    s.hermes = HttpServer(create_app(OpenAIEdge(s.servicer, info["model_id"], list, lambda: 1,
                                                tokens=TokenTexts(s.tokenizer), tool_call_parser="hermes")))
    s.hermes_base = f"http://127.0.0.1:{s.run(s.hermes.start('127.0.0.1', 0))}/v1"
    s.other_key = s.run(call(s.scheduler.register_tenant, TenantSpec(name="other")))[1]
    yield s
    s.run(s.hermes.stop())
    s.close()


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base, api_key=served.key, max_retries=0)


@pytest.fixture(scope="module")
def no_whitespace(served: Served) -> dict[str, float]:
    tok = served.tokenizer
    return {str(i): -100.0 for i in range(len(tok)) if (text := tok.decode([i])) and not text.strip()}


def _turn(client: openai.OpenAI, served: Served, session: str, messages: list[dict[str, Any]], **fields: Any) -> Any:
    extra = {"session_id": session, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model=served.model, messages=messages, extra_body=extra,
                                          **{"max_tokens": 8, "temperature": 0.0, **fields})


def _last_prompt(served: Served, session: str) -> list[int]:
    return [p for sid, ps in served.prompts.items() if sid and sid.endswith(session) for p in ps][-1]


def _rerenders(served: Served) -> int:
    """The node's ``session_rerenders`` stat: session turns rendered anew, not continued."""
    return served.node.stats()["session_rerenders"]


def _called(message: Any) -> dict[str, Any]:
    """The assistant message the client holds for a reply of tool calls, as the chat template
    takes it (the HTTP edge's conversion: content "" for null, arguments an object)."""
    return {"role": "assistant", "content": message.content or "", "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
        for c in message.tool_calls]}


def _one_token_reply(served: Served, word: str) -> dict[str, Any]:
    """``allowed_token_ids`` for a one-token reply ``word`` whose text tokenizes back to it (so
    the history's tokens are the template's rendering of the reply, exactly)."""
    [token] = served.templater.encode(word)
    return {"allowed_token_ids": [token]}


def test_a_tool_calling_session_renders_each_turn_as_the_whole_conversation(
        client: openai.OpenAI, served: Served, no_whitespace: dict[str, float]) -> None:
    """User asks, the model calls a named tool, the client sends its result as the next turn,
    the model answers, the user asks on: each turn's prompt is the first-turn rendering of the
    whole conversation with the tools (turn 2 renders it anew: the model wrote the bare
    arguments, the template writes ``<tool_call>{...}</tool_call>``), and turns 2 and 3 reuse
    the KV (turn 3 continues its history)."""
    templater, session = served.templater, "tools-s1"
    first = _turn(client, served, session, [USER], tools=TOOLS, tool_choice=WEATHER, max_tokens=60,
                  logit_bias=no_whitespace)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert _last_prompt(served, session) == templater.first_turn([USER], TOOLS)

    result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21"}
    rerenders = _rerenders(served)
    second = _turn(client, served, session, [result], tools=TOOLS, tool_choice="none", max_tokens=1,
                   extra_body=_one_token_reply(served, "Sure"))
    conversation = [USER, _called(choice.message), result]
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)
    assert _rerenders(served) == rerenders + 1  # the call's form differs from the model's text
    assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage  # the tools' and the question's

    follow = {"role": "user", "content": "And in Rome?"}
    third = _turn(client, served, session, [follow], tools=TOOLS, tool_choice="none", max_tokens=2)
    conversation += [{"role": "assistant", "content": second.choices[0].message.content}, follow]
    assert second.choices[0].message.content == "Sure"
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)
    assert _rerenders(served) == rerenders + 1  # continued
    assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens - 16, third.usage


def test_a_tool_message_answering_no_call_of_the_session_is_a_400(client: openai.OpenAI, served: Served,
                                                                    no_whitespace: dict[str, float]) -> None:
    """Trial 29k P2: in a session, a ``tool`` message whose ``tool_call_id`` matches no call of
    the session's kept history was served (the HTTP edge sees only the turn), while the same
    mistake without ``session_id`` was a 400. The node checks it against the kept calls; the
    right id is served, and the refused turn leaves the session as it was."""
    session = "tools-wrong-id"
    first = _turn(client, served, session, [USER], tools=TOOLS, tool_choice=WEATHER, max_tokens=60,
                  logit_bias=no_whitespace)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    wrong = {"role": "tool", "tool_call_id": "call_from_elsewhere", "content": "sunny, 21"}
    with pytest.raises(openai.BadRequestError) as refused:
        _turn(client, served, session, [wrong], tools=TOOLS, tool_choice="none", max_tokens=1)
    assert refused.value.body["param"] == "messages.0.tool_call_id", refused.value.body
    right = {**wrong, "tool_call_id": first.choices[0].message.tool_calls[0].id}
    reply = _turn(client, served, session, [right], tools=TOOLS, tool_choice="none", max_tokens=1)
    assert reply.choices[0].finish_reason in ("length", "stop"), reply


def test_streamed_calls_are_kept_with_the_ids_the_client_got(client: openai.OpenAI, served: Served,
                                                             no_whitespace: dict[str, float]) -> None:
    """Streamed named and ``required`` calls of a session turn: the node keeps them with the ids
    the stream gave (derived from one seed at the edge and the node), so the next turn's
    ``tool`` messages answer them and its prompt is the whole conversation's rendering."""
    tokenizer = copy.deepcopy(served.tokenizer)
    tokenizer.chat_template = IDS_TEMPLATE
    templater = ChatTemplater(tokenizer)
    kept = served.node.templater, served.servicer.templater
    served.node.templater = served.servicer.templater = templater
    try:
        _stream_turns(client, served, templater, no_whitespace)
    finally:
        served.node.templater, served.servicer.templater = kept


def _stream_turns(client: openai.OpenAI, served: Served, templater: ChatTemplater,
                  no_whitespace: dict[str, float]) -> None:
    for choice in (WEATHER, "required"):
        session = f"tools-stream-{'named' if choice is WEATHER else choice}"
        stream = _turn(client, served, session, [USER], tools=TOOLS, tool_choice=choice, max_tokens=60,
                       logit_bias=no_whitespace, parallel_tool_calls=False, stream=True)
        content, calls, finish = _streamed(stream)
        assert finish == "tool_calls" and len(calls) == 1, (content, calls, finish)
        [call] = calls.values()
        assert call["id"].startswith("chatcmpl-tool-")
        result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21"}
        _turn(client, served, session, [result], tools=TOOLS, tool_choice="none", max_tokens=1)
        assistant = {"role": "assistant", "content": "", "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}]}
        assert _last_prompt(served, session) == templater.first_turn([USER, assistant, result], TOOLS)
        other = copy.deepcopy(assistant)
        other["tool_calls"][0]["id"] = "chatcmpl-tool-0"
        assert templater.first_turn([USER, other, result], TOOLS) != templater.first_turn([USER, assistant, result], TOOLS)


def test_a_tool_call_the_template_writes_as_the_model_did_continues(served: Served) -> None:
    """hermes ``auto``: the model's ``<tool_call>`` block is what the template writes for the
    call, so the next turn continues the history (no re-render), its text the whole
    conversation's rendering."""
    hermes = openai.OpenAI(base_url=served.hermes_base, api_key=served.key, max_retries=0)
    templater, session = served.templater, "tools-hermes"
    first = _turn(hermes, served, session, [USER], tools=TOOLS, max_tokens=80,
                  extra_body={"structured_outputs": {"regex": CALL_REGEX.removeprefix(r"Sure\. ")}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    result = {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21"}
    rerenders = _rerenders(served)
    _turn(hermes, served, session, [result], tools=TOOLS, tool_choice="none", max_tokens=1)
    assert _rerenders(served) == rerenders
    whole = templater.render([USER, _called(choice.message), result], tools=TOOLS)
    assert templater.tokenizer.decode(_last_prompt(served, session)) == whole
    # token for token, too (review 30a F2: the history holds the call's text as the rendering's tokens)
    assert _last_prompt(served, session) == templater.first_turn([USER, _called(choice.message), result], TOOLS)


def test_a_reply_the_template_opens_otherwise_renders_the_conversation_anew(
        client: openai.OpenAI, served: Served) -> None:
    """``TOOL_TEMPLATE``'s generation prompt lacks the newline it writes after an assistant
    message's role: a plain text reply's history (the generation prompt, then the reply) is not
    how the template renders the conversation, so the next turn renders it anew, exactly.
    Before, it continued the history: a prompt one token off the conversation's rendering."""
    tokenizer = copy.deepcopy(served.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    templater, session = ChatTemplater(tokenizer), "tools-quirk"
    kept = served.node.templater, served.servicer.templater
    served.node.templater = served.servicer.templater = templater
    try:
        one = _one_token_reply(served, "Sure")
        _turn(client, served, session, [USER], max_tokens=1, extra_body=one)
        rerenders = _rerenders(served)
        follow = {"role": "user", "content": "And in Rome?"}
        _turn(client, served, session, [follow], max_tokens=1, extra_body=one)
        conversation = [USER, {"role": "assistant", "content": "Sure"}, follow]
        assert _last_prompt(served, session) == templater.first_turn(conversation)
        assert _rerenders(served) == rerenders + 1
    finally:
        served.node.templater, served.servicer.templater = kept


def test_other_tools_in_a_later_turn_render_the_conversation_anew(client: openai.OpenAI, served: Served) -> None:
    """OpenAI's API takes any tools per call: a turn whose tools differ from the history's is
    served, rendered as a first turn of the whole conversation with its own tools (counted in
    ``session_rerenders``), and the next turn with those tools continues it."""
    templater, session = served.templater, "tools-change"
    conversation: list[dict[str, Any]] = [USER]
    one = _one_token_reply(served, "Sure")
    reply = _turn(client, served, session, [USER], tools=TOOLS, tool_choice="none", max_tokens=1, extra_body=one)
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)
    rerenders = _rerenders(served)
    for tools, rendered_anew in ((TOOLS[:1], 1), (TOOLS[:1], 0), (None, 1)):
        follow = {"role": "user", "content": f"and {len(conversation)}?"}
        conversation += [{"role": "assistant", "content": reply.choices[0].message.content}, follow]
        fields = {"tools": tools, "tool_choice": "none"} if tools else {}
        reply = _turn(client, served, session, [follow], max_tokens=1, extra_body=one, **fields)
        assert _last_prompt(served, session) == templater.first_turn(conversation, tools)
        assert _rerenders(served) == rerenders + rendered_anew
        rerenders += rendered_anew
    # and on the node's /metrics (its stats snapshot, refreshed by the step loop)
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def exported() -> float:
        text = generate_latest(served.node.metrics.registry).decode()
        return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
                   if x.name == "kvstrata:session_rerenders_total")
    deadline = time.monotonic() + 10
    while exported() != rerenders and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exported() == rerenders


def test_another_tenants_session_of_that_id_is_its_own(client: openai.OpenAI, served: Served) -> None:
    """A session id is its tenant's: another tenant's turn with tools under the same id neither
    sees nor changes the first tenant's history."""
    templater, session = served.templater, "tools-shared-id"
    _turn(client, served, session, [USER], tools=TOOLS, tool_choice="none", max_tokens=1)
    other = openai.OpenAI(base_url=served.base, api_key=served.other_key, max_retries=0)
    theirs = {"role": "user", "content": "Book me a flight."}
    _turn(other, served, session, [theirs], tools=TOOLS[1:], tool_choice="none", max_tokens=1)
    assert _last_prompt(served, session) == templater.first_turn([theirs], TOOLS[1:])
    sessions = {sid for sid in served.prompts if sid and sid.endswith(session)}
    assert len(sessions) == 2, sessions  # one per tenant


def test_tool_bounds_in_a_session_turn_are_a_400_naming_the_field(served: Served) -> None:
    too_many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    status, body = served.post("/chat/completions", {"messages": [USER], "max_tokens": 1, "session_id": "tools-b",
                                                     "tools": too_many, "tool_choice": "none"})
    assert status == 400 and body["error"]["param"] == "tools", body
    long = [{"type": "function", "function": {"name": f"f{i}", "description": "d" * 4000}} for i in range(70)]
    status, body = served.post("/chat/completions", {"messages": [USER], "max_tokens": 1, "session_id": "tools-b",
                                                     "tools": long, "tool_choice": "none"})
    assert status == 400 and body["error"]["param"] == "tools" and str(MAX_TOOLS_CHARS) in body["error"]["message"]


def test_prefix_messages_render_with_the_tools(client: openai.OpenAI, served: Served) -> None:
    """A ``prefix_messages`` prefix renders with the chat's tools, as the whole chat does (it is
    a token prefix of it); before, a 400 naming ``prefix_messages``."""
    reply = client.chat.completions.create(model=served.model, messages=[USER, {"role": "user", "content": "hi"}],
                                           tools=TOOLS, tool_choice="none", max_tokens=1,
                                           extra_body={"prefix_messages": 1})
    assert reply.usage.prompt_tokens == len(served.templater.first_turn([USER, {"role": "user", "content": "hi"}],
                                                                         TOOLS))


def test_tool_calls_a_template_leaves_out_do_not_refuse_the_next_turn(served: Served) -> None:
    """SmolLM2's template renders no tool calls: a kept reply's long call is text without tokens
    in the conversation's rendering. The next turn (rendered anew: the reply's text is not what
    the template writes) is bounded by its own text against its tokens, as a continuation is,
    not refused for the kept call's text (the session text budget counts that)."""
    templater = ChatTemplater(served.tokenizer)
    kept, served.node.templater = served.node.templater, templater
    texts, sid = served.node._session_messages, "t/long-call"
    try:
        arguments = json.dumps({"q": "x" * 20_000})
        call_message = {"role": "assistant", "content": "",
                        "tool_calls": json.dumps([template_call("c1", "search", arguments)])}
        history = templater.first_turn([USER]) + templater.encode(arguments)
        texts.add(sid, "t", [USER, call_message], tool_reply=arguments)
        result = {"role": "tool", "tool_call_id": "c1", "content": "found it"}
        req = NodeRequest("long", "t", "ns", SamplingParams(max_tokens=1), messages=(result,), session_id=sid)
        assert served.node._prompt(req, history) == templater.first_turn([USER, call_message, result])
    finally:
        served.node.templater = kept
        texts.pop(sid)


def test_a_session_turn_holding_a_long_call_the_template_leaves_out_is_served(client: openai.OpenAI,
                                                                             served: Served) -> None:
    """Review 29i F1: a session opened with a prior conversation whose assistant call has long
    arguments (SmolLM2's template renders no calls) was refused "... characters came to only
    ... tokens ... control characters: remove them" by the gateway's and the node's check of a
    turn's text against its tokens, which counted the calls' text; the same body without
    ``session_id`` was served. The check covers the text a template renders (``covered_chars``);
    the calls' text stays bounded by the session text budget."""
    plain = ChatTemplater(served.tokenizer)
    kept = served.node.templater, served.servicer.templater
    served.node.templater = served.servicer.templater = plain
    try:
        arguments = json.dumps({"text": "lorem ipsum dolor sit amet " * 200})
        messages = [{"role": "user", "content": "Save my document."},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "save_doc", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "saved"},
                    {"role": "user", "content": "Did it work?"}]
        tools = [{"type": "function", "function": {"name": "save_doc", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}}}}]
        stateless = client.chat.completions.create(model=served.model, messages=messages, tools=tools,
                                                   tool_choice="none", max_tokens=1)
        reply = _turn(client, served, "long-call-first", messages, tools=tools, tool_choice="none", max_tokens=1)
        assert reply.usage.prompt_tokens == stateless.usage.prompt_tokens
    finally:
        served.node.templater, served.servicer.templater = kept


def test_a_calls_arguments_nested_past_the_bound_render_as_their_text(client: openai.OpenAI, served: Served) -> None:
    """A history's call whose arguments nest 500 deep reaches the template as its text, not as an
    object whose ``tojson`` recursed past Python's limit (before: a RecursionError on the
    gateway's render, a 500; in a session, on the node's, every turn): stateless and in a
    session turn alike."""
    deep = json.dumps({"a": json.loads("[" * 500 + "]" * 500)})
    calling = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    as_text = {**calling, "content": "", "tool_calls": [template_call("c1", "get_weather", deep)]}
    assert as_text["tool_calls"][0]["function"]["arguments"] == deep
    expected = served.templater.first_turn([USER, as_text, result], TOOLS)
    for extra in ({}, {"session_id": "tools-deep"}):
        reply = client.chat.completions.create(model=served.model, messages=[USER, calling, result], tools=TOOLS,
                                               tool_choice="none", max_tokens=1, extra_body=extra)
        assert reply.usage.prompt_tokens == len(expected), extra
    assert _last_prompt(served, "tools-deep") == expected


# ---- the node's checks of what the data plane brings ----------------------------------------

def _wire(**fields: Any) -> dict[str, Any]:
    req = NodeRequest("r", "t", "ns", SamplingParams(max_tokens=4), messages=({"role": "user", "content": "hi"},),
                      session_id="s")
    return request_to_wire(req) | fields


CALLS = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def test_tools_and_tool_calls_cross_the_wire_as_checked_json_text() -> None:
    tools = json.dumps(TOOLS)
    messages = wire_messages([USER, {"role": "assistant", "content": "", "tool_calls": CALLS}])
    req = request_from_wire(_wire(tools=tools, messages=list(messages), tool_output='["named", "get_weather", true, "ab", ["get_weather"]]'))
    assert req.tools == tools and json.loads(req.messages[1]["tool_calls"]) == CALLS


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": "[" * 100 + "]" * 100}, "request.tools nests more than 64 levels deep"),
    ({"tools": "{}"}, "request.tools must be a list"),
    ({"tools": json.dumps([{"type": "function", "function": {"name": "x" * 65}}])}, "request.tools[0].function.name"),
    ({"tools": json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)])},
     "1 to 128 tools"),
    ({"tools": json.dumps([{"type": "function", "function": {"name": "f", "description": "d" * MAX_TOOLS_CHARS}}])},
     f"at most {MAX_TOOLS_CHARS} are allowed"),
    ({"tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": []}}])},
     "request.tools[0].function.parameters must be dict"),
    ({"tools": json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"a": json.loads("[" * 70 + "]" * 70)}}}])},
     "nests more than 64 levels deep"),
    ({"tools": "not json"}, "request.tools must be JSON text"),
    ({"messages": [{"role": "user", "content": "", "tool_calls": json.dumps(CALLS)}]},
     "request.messages[0].tool_calls applies to assistant messages"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": json.dumps([{"id": "c"}])}]},
     "request.messages[0].tool_calls[0] must be"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": json.dumps(CALLS * 129)}]},
     "1 to 128 tool calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "x" * ((1 << 20) + 1)}]},
     "their tool_calls hold more than"),
    ({"tool_output": '["maybe", "", true, "ab"]'}, "request.tool_output must be"),
    ({"tool_output": '["named", "bad name", true, "ab", ["f"]]'}, "request.tool_output's name"),
    ({"tool_output": '["auto", "", true, ""]'}, "request.tool_output must be"),
])
def test_bad_tools_off_the_wire_are_refused(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError) as err:
        request_from_wire(_wire(**fields))
    assert words in str(err.value), err.value


def test_kept_tool_calls_count_against_the_session_text_budget() -> None:
    """A message's tool calls are text the session keeps: ``content_chars`` counts their ids,
    names and arguments (JSON text on the wire, a list at the edge), as ``SessionTexts`` charges
    a turn's tools; before, an assistant message of empty content and 1 MiB of arguments counted 0."""
    from services.cache_node_streams import SessionTexts

    arguments = {"q": "x" * 1000}
    message = {"role": "assistant", "content": "", "tool_calls": CALLS[:0] + [
        {"id": "c1", "type": "function", "function": {"name": "search", "arguments": arguments}}]}
    assert content_chars([message]) >= 1000 + len("c1search")
    [wired] = wire_messages([message])
    assert content_chars([wired]) >= 1000 + len("c1search")
    texts = SessionTexts()
    texts.add("s", "t", [wired], tools=json.dumps(TOOLS))
    assert texts.tenant_chars["t"] == content_chars([wired]) + len(json.dumps(TOOLS))
    texts.add("s", "t", [USER])  # no tools now: they are no longer kept
    assert texts.tenant_chars["t"] == content_chars([wired, USER]) and texts.tools("s") == ""
    texts.pop("s")
    assert not texts.tenant_chars
