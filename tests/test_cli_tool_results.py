"""``kvstrata generate --tool-result ID=TEXT`` / ``--messages JSON|@FILE``: a tool call's result
sent back from the CLI, so the tool-calling loop is completed there (trial P3: ``generate`` sent
tools and printed the model's calls, but could send no ``tool`` message, so a call's result
could reach the model only through the gRPC or HTTP API).

Served end to end on the real stack of ``test_session_tool_calls`` (the real CacheNode,
scheduler and gateway gRPC server; a tiny random Llama with SmolLM2's tokenizer; a template that
renders tools, tool calls and tool messages), the prompt the node's engine takes compared token
for token with the template's rendering of the conversation; bad input is a usage error naming
its option (exit 2), before anything is sent.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli.messages import MAX_MESSAGES_BYTES
from kvstrata.v1 import inference_pb2
from services.chat_tools import template_call
from tests import test_session_tool_calls as sessions
from tests.test_session_tool_calls import USER, _last_prompt, _one_token_reply
from tests.test_tool_calls_served import TOOLS

served, no_whitespace = sessions.served, sessions.no_whitespace

NOWHERE = "127.0.0.1:1"  # nothing listens: a call that got past the CLI's checks fails UNAVAILABLE (exit 1)
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}


def _words(output: str) -> str:
    """The output's words (rich's error box and line breaks removed)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def _invoke(args: list[str]) -> Any:
    result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "1000"})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    return result


@pytest.fixture()
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tools.json`` (``TOOLS``) and ``messages.json`` (the user's question and the assistant's
    call of ``call_1``) under ``tmp_path``; no saved gateway address or TLS options."""
    monkeypatch.setenv("KVSTRATA_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "messages.json").write_text(json.dumps([USER, CALLED]))
    return tmp_path


def _first_turn_call(served: Any, session: str, no_whitespace: dict[str, float], files: Path
                     ) -> tuple[list[str], Any, str, Any]:
    """A session's first turn, the model made to call ``get_weather``: the turns' common
    arguments, the CLI's result, the call's id as printed and its parsed arguments."""
    base = ["generate", "--api-key", served.key, "--gateway", served.address, "--session", session,
            "--tools", f"@{files / 'tools.json'}"]
    first = _invoke([*base, USER["content"], "--tool-choice", "get_weather", "--max-tokens", "60",
                     *[f"--logit-bias={k}={v:g}" for k, v in no_whitespace.items()]])
    assert first.exit_code == 0, first.output
    [line] = [ln for ln in first.output.splitlines() if ln.startswith("tool call ")]
    call_id, _, rest = line[len("tool call "):].partition(": get_weather(")
    return base, first, call_id, json.loads(rest[:-1])


def test_a_session_sends_a_tool_result_back_and_the_model_reads_it(served: Any, no_whitespace: dict[str, float],
                                                                   files: Path) -> None:
    """First turn: the model calls ``get_weather`` (its line, and a hint naming
    ``--tool-result``). Next turn, in the same session: ``--tool-result ID=TEXT`` alone (no
    PROMPT) is sent as a tool message answering the call, and the node's prompt is the whole
    conversation as the template renders it, the call (with the id the CLI printed) and the
    result included. A result answering no call of the session is the gateway's
    INVALID_ARGUMENT, on one line naming ``--tool-result``, exit 1."""
    session = "cli-tool-results-s1"
    base, first, call_id, arguments = _first_turn_call(served, session, no_whitespace, files)
    assert f"kvstrata generate --session {session} --tools ... --tool-choice none --tool-result ID=RESULT" in _words(first.output)

    wrong = _invoke([*base, "--tool-choice", "none", "--tool-result", "call_from_elsewhere=sunny, 21"])
    assert wrong.exit_code == 1, wrong.output
    [refusal] = [ln for ln in wrong.output.splitlines() if ln.strip()]
    assert refusal.startswith("INVALID_ARGUMENT: --tool-result call_from_elsewhere (its ID): 'call_from_elsewhere' "
                              "answers no tool call of this session's history"), refusal

    [sure] = _one_token_reply(served, "Sure")["allowed_token_ids"]
    second = _invoke([*base, "--tool-choice", "none", "--tool-result", f"{call_id}=sunny, 21", "--max-tokens", "1",
                      "--allowed-token-id", str(sure)])
    assert second.exit_code == 0, second.output
    assert second.output.startswith("Sure\n") and "tool call " not in second.output, second.output
    conversation = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21"}]
    assert _last_prompt(served, session) == served.templater.first_turn(conversation, TOOLS)
    served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                             metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)


def test_a_session_turn_adding_calls_may_answer_the_previous_turns_call(
        served: Any, no_whitespace: dict[str, float], files: Path) -> None:
    """Turn 1 in a session: the model calls ``get_weather`` (for Paris). Turn 2: ``--messages``
    adds an assistant message calling it for Rome (``call_rome``), and ``--tool-result`` answers
    both turn 1's call (an id only the session's node holds) and ``call_rome``: served, the
    node's prompt token for token the whole conversation's rendering. Failed on the old code:
    the CLI matched the results against ``--messages``' calls alone (exit 2, "'<id>' is no tool
    call of --messages"; its conversion, without ``in_session``, refused it too), where the
    gateway serves the turn. An id no turn issued is still refused, by the node (a turn adding
    ``call_oslo``): INVALID_ARGUMENT on one line naming the ``--tool-result``, exit 1."""
    session = "cli-tool-results-adding"
    base, _, call_id, arguments = _first_turn_call(served, session, no_whitespace, files)
    rome = {"id": "call_rome", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "celsius": true}'}}
    (files / "rome.json").write_text(json.dumps([{"role": "assistant", "content": None, "tool_calls": [rome]}]))
    (files / "oslo.json").write_text(json.dumps([{"role": "assistant", "content": None,
                                                  "tool_calls": [{**rome, "id": "call_oslo"}]}]))

    [sure] = _one_token_reply(served, "Sure")["allowed_token_ids"]
    second = _invoke([*base, "--tool-choice", "none", "--messages", f"@{files / 'rome.json'}",
                      "--tool-result", f"{call_id}=sunny, 21", "--tool-result", "call_rome=rainy, 14",
                      "--max-tokens", "1", "--allowed-token-id", str(sure)])
    assert second.exit_code == 0, second.output
    assert second.output.startswith("Sure\n") and "tool call " not in second.output, second.output
    conversation = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "assistant", "content": "", "tool_calls": [
            template_call(rome["id"], rome["function"]["name"], rome["function"]["arguments"])]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21"},
        {"role": "tool", "tool_call_id": "call_rome", "content": "rainy, 14"}]
    assert _last_prompt(served, session) == served.templater.first_turn(conversation, TOOLS)

    never = _invoke([*base, "--tool-choice", "none", "--messages", f"@{files / 'oslo.json'}",
                     "--tool-result", "call_never_issued=cloudy"])
    assert never.exit_code == 1, never.output
    [refusal] = [ln for ln in never.output.splitlines() if ln.strip()]
    assert refusal.startswith("INVALID_ARGUMENT: --tool-result call_never_issued (its ID): 'call_never_issued' "
                              "answers no tool call of this session's history or this turn"), refusal
    served.stub.CloseSession(inference_pb2.CloseSessionRequest(session_id=session),
                             metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)


def test_messages_and_a_tool_result_are_rendered_as_the_conversation(served: Any, files: Path) -> None:
    """Without a session: ``--messages @FILE`` (the question and the assistant's call, content
    null, as OpenAI's API returns it), then ``--tool-result`` (``ID=@FILE``: the result read
    from a file): the prompt holds both, token for token the template's rendering of
    [user, call, result] with the tools; a PROMPT after them is one more user message."""
    (files / "result.txt").write_text(RESULT["content"])
    base = ["generate", "--api-key", served.key, "--gateway", served.address, "--tools", f"@{files / 'tools.json'}",
            "--tool-choice", "none", "--max-tokens", "1", "--messages", f"@{files / 'messages.json'}",
            "--tool-result", f"call_1=@{files / 'result.txt'}"]
    call = CALLED["tool_calls"][0]
    as_template = [USER, {"role": "assistant", "content": "", "tool_calls": [
        template_call(call["id"], call["function"]["name"], call["function"]["arguments"])]}, RESULT]
    for extra, conversation in (([], as_template),
                                (["And in Rome?"], [*as_template, {"role": "user", "content": "And in Rome?"}])):
        result = _invoke([*base, *extra])
        assert result.exit_code == 0, result.output
        prompt_tokens = int(re.search(r"(\d+) prompt tokens", _words(result.output))[1])
        assert prompt_tokens == len(served.templater.first_turn(conversation, TOOLS)), result.output
    without_result = served.templater.first_turn(as_template[:2], TOOLS)
    assert len(served.templater.first_turn(as_template, TOOLS)) > len(without_result)  # the result is in it


@pytest.mark.parametrize(("args", "option", "words"), [
    ([], "PROMPT", "give a PROMPT, or --messages or --tool-result"),
    (["--tool-result", "call_1=sunny"], "--tool-result", "give the --session whose reply made the call"),
    (["--session", "s", "--tool-result", "call_1"], "--tool-result", "expected ID=TEXT"),
    (["--session", "s", "--tool-result", "=sunny"], "--tool-result", "expected ID=TEXT"),
    (["--session", "s", "--tool-result", "a=1", "--tool-result", "a=2"], "--tool-result", "'a' is given twice"),
    (["--session", "s", "--tool-result", "a=@{tmp}/missing.txt"], "--tool-result", "cannot read"),
    (["--messages", "@{tmp}/messages.json", "--tool-result", "call_9=sunny"], "--tool-result",
     "'call_9' is no tool call of --messages (their ids: call_1)"),
    (["--messages", '[{"role": "user", "content": "hi"}'], "--messages", "not JSON (a file is given as @FILE)"),
    (["--messages", "{tmp}/messages.json"], "--messages", "not JSON (a file is given as @FILE)"),
    (["--messages", "@{tmp}/big.json"], "--messages", f"is over {MAX_MESSAGES_BYTES} bytes"),
    (["--messages", "@{tmp}/missing.json"], "--messages", "cannot read"),
    (["--messages", '{"role": "user", "content": "hi"}'], "--messages", "must be a JSON list of messages"),
    (["--messages", '["hi"]'], "--messages", "messages[0] must be an object"),
    (["--messages", '[{"role": "user", "content": "hi", "tool_call": []}]'], "--messages",
     "messages[0] has unknown keys 'tool_call'"),
    (["--messages", '[{"role": "user"}]'], "--messages", "messages[0] has no \"content\""),
    (["--messages", '[{"role": "user", "content": 7}]'], "--messages", "messages[0].content must be text"),
    (["--messages", '[{"role": "robot", "content": "hi"}]'], "--messages", "--messages[0].role must be one of"),
    (["--messages", '[{"role": "user", "content": "hi", "tool_calls": [{"id": "c"}]}]'], "--messages",
     "--messages[0].tool_calls"),
    (["--messages", '[{"role": "tool", "content": "hi"}]'], "--messages", "--messages[0]"),
    (["--session", "s", "--tool-result", "c" * 300 + "=sunny"], "--tool-result", f"--tool-result {'c' * 80} (its ID)"),
], ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else None)
def test_bad_messages_and_tool_results_are_usage_errors_naming_the_option(
        args: list[str], option: str, words: str, files: Path) -> None:
    """Each is exit 2, ``Invalid value for '<option>'`` and what is wrong, no traceback, and
    nothing sent (the gateway is nowhere: a call would exit 1, UNAVAILABLE)."""
    with (files / "big.json").open("wb") as big:
        big.truncate(MAX_MESSAGES_BYTES + 1)
    args = [a.replace("{tmp}", str(files)) for a in args]
    result = _invoke(["generate", "--api-key", "k", "--gateway", NOWHERE, *args])
    assert result.exit_code == 2, result.output
    text = _words(result.output)
    assert f"Invalid value for '{option}'" in text and words in text, text


def test_a_session_turns_results_are_left_to_its_node(files: Path) -> None:
    """In a ``--session`` a result's ID may be a call of an earlier turn, which only the node
    holds: ``--messages`` holding other calls does not make it a usage error (the call gets past
    the CLI's checks and fails UNAVAILABLE at the nowhere gateway, exit 1); without a session it
    is one. Failed on the old code (exit 2, "'call_earlier' is no tool call of --messages")."""
    args = ["generate", "--api-key", "k", "--gateway", NOWHERE, "--messages", f"@{files / 'messages.json'}",
            "--tool-result", "call_earlier=sunny", "--tool-result", "call_1=rainy"]
    in_session = _invoke([*args, "--session", "s"])
    assert in_session.exit_code == 1 and "UNAVAILABLE" in in_session.output, in_session.output
    stateless = _invoke(args)
    assert stateless.exit_code == 2, stateless.output
    assert "'call_earlier' is no tool call of --messages" in _words(stateless.output), stateless.output


def test_a_plain_prompt_is_still_one_user_message(files: Path) -> None:
    """Without --messages and --tool-result the checks pass a PROMPT alone through (the call
    fails UNAVAILABLE at the nowhere gateway, exit 1, after them)."""
    result = _invoke(["generate", "hi", "--api-key", "k", "--gateway", NOWHERE])
    assert result.exit_code == 1 and "UNAVAILABLE" in result.output, result.output
