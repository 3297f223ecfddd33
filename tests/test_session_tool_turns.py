"""A session turn may both add assistant tool calls and answer (``role: "tool"``,
``tool_call_id``) a call an earlier turn made; an answer to an id no turn issued is refused.

A session turn carries only its new messages; the session's earlier calls are kept on its cache
node. Regression (F9): each API's whole-request check (``chat_tools.check_tool_answers``, run by
the HTTP edge and the gRPC conversion) matched a tool message against the calls of the turn's
own messages whenever one of them carried ``tool_calls``: a turn answering the session's earlier
call and adding calls of its own (a valid OpenAI conversation, which the same messages sent
whole without ``session_id`` pass) was refused 400 / INVALID_ARGUMENT. Now a session turn's
answers are checked on its node against the session's kept calls and the turn's
(``Requests._prompt``; its first turn against its own messages, as a whole request is): an id
that no turn issued is still INVALID_ARGUMENT, naming the message.

The real stack of ``test_session_tool_calls`` (CacheNode, scheduler, gateway gRPC server, OpenAI
app through the official client; a template rendering tools and tool calls): each served turn's
prompt is compared token for token with the whole conversation's first-turn rendering.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import openai
import pytest

from kvstrata.v1 import inference_pb2
from services.convert import chat_messages_to_pb
from tests import test_session_tool_calls as sessions
from tests.test_grpc_tool_calls import NAMED, NONE, generate, pb_tools, refusal, request
from tests.test_session_tool_calls import USER, _called, _last_prompt, _one_token_reply, _turn
from tests.test_tool_calls_served import TOOLS, WEATHER

served, client, no_whitespace = sessions.served, sessions.client, sessions.no_whitespace

ROME = {"id": "call_rome", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "celsius": True})}}


def _rome_call() -> dict[str, Any]:
    """An assistant message the client adds, calling the tool for Rome (as the template takes it)."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {**ROME, "function": {**ROME["function"], "arguments": json.loads(ROME["function"]["arguments"])}}]}


def _wire(messages: list[dict[str, Any]]) -> inference_pb2.ChatMessages:
    """``messages`` as the wire carries them, built field by field, unchecked (what any gRPC
    client sends: the server's checks are under test)."""
    msg = inference_pb2.ChatMessages()
    for message in messages:
        added = msg.messages.add(role=message["role"], content=message.get("content") or "",
                                 tool_call_id=message.get("tool_call_id", ""))
        for call in message.get("tool_calls") or ():
            added.tool_calls.add(id=call["id"], name=call["function"]["name"], arguments=call["function"]["arguments"])
    return msg


def test_a_turn_adding_calls_may_answer_an_earlier_turns_call_over_http(
        client: openai.OpenAI, served: Any, no_whitespace: dict[str, float]) -> None:
    """Failed on the old code: turn 2 (the answer to turn 1's call, then a call the client adds
    and its answer) was a 400 naming ``messages.0.tool_call_id``."""
    session, templater = "tool-turns-http", served.templater
    first = _turn(client, served, session, [USER], tools=TOOLS, tool_choice=WEATHER, max_tokens=60,
                  logit_bias=no_whitespace)
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    paris = {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "sunny, 21"}
    rome = {"role": "tool", "tool_call_id": ROME["id"], "content": "rainy, 14"}
    messages = [paris, {"role": "assistant", "content": "", "tool_calls": [ROME]}, rome]
    second = _turn(client, served, session, messages, tools=TOOLS, tool_choice="none", max_tokens=1,
                   extra_body=_one_token_reply(served, "Sure"))
    assert second.choices[0].message.content == "Sure"
    conversation = [USER, _called(first.choices[0].message), paris, _rome_call(), rome]
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)

    # an id no turn issued: refused, naming the message, whether or not the turn adds calls
    never = {"role": "tool", "tool_call_id": "call_never_issued", "content": "cloudy"}
    for turn, where in (([never], "messages.0.tool_call_id"),
                        ([{"role": "assistant", "content": "", "tool_calls": [{**ROME, "id": "call_oslo"}]}, never],
                         "messages.1.tool_call_id"),
                        ([never, {"role": "assistant", "content": "", "tool_calls": [{**ROME, "id": "call_oslo"}]}],
                         "messages.0.tool_call_id")):
        with pytest.raises(openai.BadRequestError) as refused:
            _turn(client, served, session, turn, tools=TOOLS, tool_choice="none", max_tokens=1)
        assert refused.value.body["param"] == where, refused.value.body
        assert "'call_never_issued' answers no tool call" in refused.value.body["message"]
    # the refusals changed nothing: the session goes on from turn 2
    follow = {"role": "user", "content": "Thanks."}
    _turn(client, served, session, [follow], tools=TOOLS, tool_choice="none", max_tokens=1)
    conversation += [{"role": "assistant", "content": "Sure"}, follow]
    assert _last_prompt(served, session) == templater.first_turn(conversation, TOOLS)


def test_a_sessions_first_turn_is_checked_as_a_whole_request(client: openai.OpenAI, served: Any) -> None:
    """The edge leaves a session turn's answers to its node, which checks a first turn's against
    its own calls (the rule of a request without ``session_id``): a wrong id is a 400 there too,
    and a first turn holding a call and its answer is served. (It passes on the old code, where
    the edge checked it: it guards that the node does now.)"""
    templater = served.templater
    wrong = {"role": "tool", "tool_call_id": "call_never_issued", "content": "rainy, 14"}
    with pytest.raises(openai.BadRequestError) as refused:
        _turn(client, served, "tool-turns-first", [USER, {"role": "assistant", "content": "", "tool_calls": [ROME]},
                                                   wrong], tools=TOOLS, tool_choice="none", max_tokens=1)
    assert refused.value.body["param"] == "messages.2.tool_call_id", refused.value.body
    rome = {"role": "tool", "tool_call_id": ROME["id"], "content": "rainy, 14"}
    _turn(client, served, "tool-turns-first", [USER, {"role": "assistant", "content": "", "tool_calls": [ROME]}, rome],
          tools=TOOLS, tool_choice="none", max_tokens=1)
    assert _last_prompt(served, "tool-turns-first") == templater.first_turn([USER, _rome_call(), rome], TOOLS)


def test_a_turn_adding_calls_may_answer_an_earlier_turns_call_over_grpc(
        served: Any, no_whitespace: dict[str, float]) -> None:
    """Failed on the old code: INVALID_ARGUMENT 'chat.messages[0].tool_call_id: ... answers no tool
    call of an earlier assistant message' (``chat_messages_to_pb``, which clients use, refused it
    as the server did; it takes ``in_session`` now)."""
    session, templater = "tool-turns-grpc", served.templater
    _, _, finished = generate(served, request([USER], tools=pb_tools(TOOLS), tool_choice=NAMED, max_tokens=60,
                                              logit_bias=no_whitespace, session_id=session))
    assert finished.finish_reason == "tool_calls", finished
    [call] = finished.tool_calls
    paris = {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21"}
    rome = {"role": "tool", "tool_call_id": ROME["id"], "content": "rainy, 14"}
    allowed = _one_token_reply(served, "Sure")["allowed_token_ids"]
    turn = request([USER], tools=pb_tools(TOOLS), tool_choice=NONE, max_tokens=1, session_id=session,
                   sampling={"allowed_token_ids": allowed})
    turn.chat.CopyFrom(_wire([paris, {"role": "assistant", "content": None, "tool_calls": [ROME]}, rome]))
    _, text, _ = generate(served, turn)
    assert text == "Sure"
    assert turn.chat == chat_messages_to_pb([paris, {"role": "assistant", "content": None, "tool_calls": [ROME]}, rome],
                                            in_session=True)  # (a client's conversion takes the turn too)
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]}
    assert _last_prompt(served, session) == templater.first_turn([USER, called, paris, _rome_call(), rome], TOOLS)
    never = {"role": "tool", "tool_call_id": "call_never_issued", "content": "cloudy"}
    wrong = request([USER], tools=pb_tools(TOOLS), tool_choice=NONE, session_id=session)
    wrong.chat.CopyFrom(_wire([{"role": "assistant", "content": None, "tool_calls": [{**ROME, "id": "call_oslo"}]},
                               never]))
    code, details = refusal(served, wrong)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
        "chat.messages[1].tool_call_id: 'call_never_issued' answers no tool call"), details
    served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                             metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)
