"""Reading generated text as tool calls (``services.openai_api.tool_calls``), whole and
streamed in any split, and the request side's schemas (``services.openai_api.tools``) and
setting (``ServiceConfig.tool_call_parser``). Served end to end: ``test_tool_calls_served``."""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from services.config import ServiceConfig
from services.openai_api.tool_calls import ToolOutput, parse_hermes, parse_required
from services.openai_api.tools import Tool, tool_constraint

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
NAMES = ("get_weather", "f")  # an "auto" request's declared tools (a call of another is content)


def _stream(out: ToolOutput, pieces: list[str], finish: str | None = "stop"
            ) -> tuple[str, list[dict[str, Any]], str | None]:
    """``pieces`` fed to ``out`` as a stream, then its end: the content, the calls, the finish reason."""
    content, calls = "", []
    for piece in pieces:
        delta = out.delta(piece)
        content += delta.get("content", "")
        calls += delta.get("tool_calls", [])
    delta, reason = out.end(finish)
    return content + delta.get("content", ""), calls + delta.get("tool_calls", []), reason


@pytest.mark.parametrize("text", [
    f"Let me check. {CALL}", f"{CALL}\n{CALL.replace('Paris', 'Rome')}", CALL[: -len("</tool_call>")],
    "no call here", "<tool_call>{not json}</tool_call>", "a < b <tool", '<tool_call>["x"]</tool_call>',
    "<tool_call>" + "[" * 100_000,
])
def test_hermes_whole_and_every_split_agree(text: str) -> None:
    """The whole reading (vLLM's hermes parser: content before the first block, a last unclosed
    block counts, unparsable blocks leave the text as content) equals the streamed one, split
    at every character; content never shows a ``<tool_call>``'s start."""
    fields, reason = ToolOutput("auto", names=NAMES).message(text, "stop")
    calls = fields.get("tool_calls", [])
    assert reason == ("tool_calls" if calls else "stop")
    assert fields["content"] == (text[: text.find("<tool_call>")] or None if calls else text)
    splits = [[text], list(text[:300])] if len(text) > 1000 else [[text], list(text), [text[:5], text[5:17], text[17:]]]
    for pieces in splits:
        content, streamed, streamed_reason = _stream(ToolOutput("auto", names=NAMES), pieces + ([text[300:]] if len(text) > 1000 and
                                                                                  len(pieces) > 1 else []))
        assert streamed_reason == reason
        assert content == (fields["content"] or "")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert [c["index"] for c in streamed] == list(range(len(streamed)))


def test_hermes_calls_and_parallel_off() -> None:
    calls = parse_hermes(f"{CALL} {CALL.replace('Paris', 'Rome')}")
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    fields, _ = ToolOutput("auto", parallel=False, names=NAMES).message(f"{CALL}{CALL}", "stop")
    assert len(fields["tool_calls"]) == 1
    assert parse_hermes('<tool_call>{"name": 5}</tool_call>') is None


def test_required_reads_an_array_and_falls_back_to_content() -> None:
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parse_required(text)] == \
        [("a", '{"x": 1}'), ("b", "{}")]
    for bad in ('[{"name": "a", "param', "[]", '{"name": "a"}', '[{"name": "a"}]', "[" * 100_000):
        assert parse_required(bad) is None
        assert ToolOutput("required").message(bad, "length") == ({"content": bad}, "length")
    content, calls, reason = _stream(ToolOutput("required"), [text[:7], text[7:]])
    assert (content, reason, len(calls)) == ("", "tool_calls", 2)


def test_named_streams_arguments_and_keeps_length() -> None:
    out = ToolOutput("named", "f")
    assert out.delta("") == {}
    first = out.delta('{"a"')["tool_calls"][0]
    assert first["index"] == 0 and first["function"] == {"name": "f", "arguments": '{"a"'}
    assert out.delta(": 1}") == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert out.end("stop") == ({}, "tool_calls")
    fields, reason = ToolOutput("named", "f").message('{"a": 1}', "length")  # whole JSON: the call, length kept
    assert reason == "length" and fields["content"] is None and fields["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize("text", ["{", '{"a": ', "", '{"a": 1} x'])
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_named_text_that_is_not_json_is_no_call(text: str, finish: str) -> None:
    """A stop string (or max_tokens) cut the constrained JSON: no ``tool_calls`` finish reason,
    the text is the content (whole); streamed, the deltas went as arguments (or none: no text)
    and the finish reason is the node's. Before: ``arguments "{"``, ``tool_calls``."""
    assert ToolOutput("named", "f").message(text, finish) == ({"content": text}, finish)
    out = ToolOutput("named", "f")
    sent = [out.delta(c) for c in text]
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in sent) == text
    assert out.end(finish) == ({}, finish)


@pytest.mark.parametrize(("value", "arguments"), [
    ('"x"', '"x"'), ('"Paris"', '"Paris"'), ('"{\\"city\\": \\"Paris\\"}"', '"{\\"city\\": \\"Paris\\"}"'),
    ("5", "5"), ("null", "null"), ('["a", "é"]', '["a", "é"]'), ('{"city": "Zürich"}', '{"city": "Zürich"}'),
])
def test_arguments_are_always_json_text(value: str, arguments: str) -> None:
    """hermes and required: ``arguments`` is the JSON text of the value written (vLLM's
    ``json.dumps(..., ensure_ascii=False)``), a str value too. Before: a str went as is
    (``Paris``: not JSON, with finish_reason tool_calls)."""
    [call] = parse_hermes(f'<tool_call>{{"name": "f", "arguments": {value}}}</tool_call>')
    assert call["function"]["arguments"] == arguments
    assert json.loads(arguments) == json.loads(value)
    [call] = parse_required(f'[{{"name": "f", "parameters": {value}}}]')
    assert call["function"]["arguments"] == arguments
    text = f'<tool_call>{{"name": "f", "arguments": {value}}}</tool_call>'
    fields, reason = ToolOutput("auto", names=NAMES).message(text, "stop")
    if value.startswith("{"):
        assert reason == "tool_calls" and fields["tool_calls"][0]["function"]["arguments"] == arguments
    else:  # an auto call's arguments must be an object, else the reply is its text (test_auto_undeclared_calls)
        assert (fields, reason) == ({"content": text}, "stop")
    _, calls, reason = _stream(ToolOutput("required"), list(f'[{{"name": "f", "parameters": {value}}}]'))
    assert reason == "tool_calls" and calls[0]["function"]["arguments"] == arguments
    assert parse_hermes('<tool_call>{"name": "f"}</tool_call>')[0]["function"]["arguments"] == "{}"


def _delta_seconds(mode: str, n: int) -> float:
    out = ToolOutput(mode, names=NAMES)
    out.delta("<tool_call>")
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(n):
            out.delta(" tok")
        took = time.perf_counter() - start
    finally:
        gc.enable()
    out.end("length")
    return took


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_held_stream_is_linear(mode: str) -> None:
    """131,072 held deltas cost about 16x what 8,192 do (linear), not ~300x (the old
    ``self.held += text``, an attribute's append copying everything held each time: 2.5 s
    against 0.01 s). The bound (128x) leaves room for a busy shared host (up to ~60x seen);
    the best of several runs each."""
    small = min(_delta_seconds(mode, 8_192) for _ in range(20))
    large = min(_delta_seconds(mode, 131_072) for _ in range(3))
    assert large < 128 * small, (small, large, large / small)
    out = ToolOutput(mode, names=NAMES)  # the same reading as one piece
    text = '[{"name": "f", "parameters": {"a": 1}}]' if mode == "required" else CALL
    for c in text:
        assert out.delta(c) == {}
    assert out.end("stop")[0]["tool_calls"][0]["function"]["arguments"] == json.dumps(
        {"a": 1} if mode == "required" else {"city": "Paris"})


def test_required_schema_lifts_defs_and_refuses_conflicts() -> None:
    def tool(name: str, defs: dict[str, Any]) -> Tool:
        return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}}})

    spec = tool_constraint("required", [tool("a", {"P": {"type": "integer"}}), tool("b", {"P": {"type": "integer"}})],
                           None, parallel=False)
    schema = json.loads(spec.spec)
    assert schema["$defs"] == {"P": {"type": "integer"}} and schema["maxItems"] == 1
    assert all("$defs" not in o["properties"]["parameters"] for o in schema["items"]["anyOf"])
    with pytest.raises(ValueError, match=r"^tool_choice: tools define \$defs 'P' differently"):
        tool_constraint("required", [tool("a", {"P": {"type": "integer"}}), tool("b", {"P": {"type": "string"}})],
                        None, parallel=True)


def test_the_parser_setting() -> None:
    assert ServiceConfig().tool_call_parser == ""
    assert ServiceConfig(tool_call_parser="hermes").tool_call_parser == "hermes"
    with pytest.raises(ValidationError, match="tool_call_parser"):
        ServiceConfig(tool_call_parser="mistral")
