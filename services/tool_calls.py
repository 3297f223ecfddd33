"""One choice's generated text read as OpenAI tool calls (``message.tool_calls`` of a whole
response, ``delta.tool_calls`` of a stream), as vLLM reads it; the request side is
``services.openai_api.tools``. The HTTP edge reads its responses with it
(``services.openai_api.tool_calls`` re-exports it), a cache node its session turns' replies
(``cache_node_streams._kept_reply``): it imports no web framework, so the node loads none
(review 29i F6: it lived in ``services.openai_api``, whose ``__init__`` imports FastAPI and
uvicorn, ~0.57 s on the node's step thread at its first session turn with tools).

A call is ``{"id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name", "arguments"}}``
with ``arguments`` a JSON text. Per ``tool_choice`` (``ToolOutput.mode``):

- ``named``: the text (constrained to the function's parameters' schema) is the one call's
  ``arguments`` when it is JSON text; else (a ``stop`` string or ``max_tokens`` cut it) it is
  the ``content``, with no call and the node's finish reason. Streamed: the call's id, type and
  name with the first text, then each text as an ``arguments`` delta (vLLM's); the finish
  reason is ``tool_calls`` only when the whole text parses (the deltas already went; no text:
  no call).
- ``required``: the text (constrained to a JSON array of ``{"name", "parameters"}``) is parsed;
  each item a call, ``parameters`` as ``arguments``. Streamed: the calls come whole in the last
  chunk (vLLM streams partial JSON instead).
- ``auto`` (the ``hermes`` parser, as vLLM's ``--tool-call-parser hermes``): each
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text is a call (a last one
  left unclosed counts too; ``arguments`` left out is ``{}``), the text before the first is
  ``content`` (null when empty), text after the last is dropped. Streamed: text goes out as
  ``content`` until ``<tool_call>`` starts (what may be its beginning is held back), the rest
  is held and its calls come in the last chunk. When every tool is ``strict`` (HTTP; gRPC's
  ``Tool`` has no such field yet) the text is constrained (``services.chat_tools.auto_constraint``:
  from ``<tool_call>`` on, only a call of a declared tool with arguments its parameters' schema
  takes can be generated), so every call read here is one of the request's tools; unless the
  client gave its own constraint beside "auto" (``response_format``, ``structured_outputs``),
  which is then the only one. Otherwise the text is free and read afterwards, as vLLM's
  default, held to OpenAI's contract that only declared tools are called: when
  any block is not a call of a declared tool (``ToolOutput.names``: its ``name`` is none of the
  request's tools', or its ``arguments`` is not a JSON object) the reply holds no call at all:
  its whole text as generated is the ``content``, with the node's finish reason, so no part of
  a set of calls is handed out to be run. Streamed, the text from ``<tool_call>`` on is held
  already; ``end`` sends it as ``content`` then. Regression: a model that wrote
  ``<tool_call>{"name": "delete_files", ...}</tool_call>`` for a function the request did not
  declare got it back as a call, finish reason ``tool_calls``.

A call's ``arguments`` is always the JSON text of the value the model wrote
(``json.dumps(value, ensure_ascii=False)``, as vLLM's hermes and required readers write it):
``"arguments": "Paris"`` is the text ``"Paris"`` with its quotes, never ``Paris``, so
``json.loads(arguments)`` holds for every call (a value that is not an object is kept as vLLM
keeps it, not refused: ``required`` and named outputs are constrained to the tools' parameters,
object schemas, ``tools.FunctionDef``; an ``auto`` block's non-object arguments make the reply
content, as above). ``content`` is null when calls came. Text that does not
read as calls (an unparsable ``required`` array, ``<tool_call>`` body or named JSON: the model
ran out of tokens or a ``stop`` string cut it, say) is the ``content``, with no calls, as vLLM
falls back (vLLM's named mode returns the cut text as the call instead). ``finish_reason`` is
``tool_calls`` when calls came and the model ended (``stop``); ``length`` stays ``length`` (a
streamed named call's arguments may be cut).
With ``parallel_tool_calls`` false only the first call is kept.

A call's id is random (vLLM's), or, given a ``seed`` (a session turn's), derived from it and the
call's index (``services.chat_tools.seeded_call_id``): the cache node keeps the reply in the
session's messages with the ids the client got (``ToolOutput.spec``), so a template that renders
ids renders the session as the client's whole conversation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any

from services.chat_tools import seeded_call_id, tool_output_spec

START, END = "<tool_call>", "</tool_call>"


def tool_call_id() -> str:
    """A new call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments(value: Any) -> str:
    """A call's ``arguments``: the value's JSON text, whatever its type (a str too); with
    ``\\uXXXX`` escapes when the value holds a lone surrogate (the model wrote ``"\\ud800"``), so
    that the text stays UTF-8. Regression (review 30j F1, the generated side): such a call's
    arguments held the surrogate itself, which no response (JSON or protobuf) can encode."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def parse_required(text: str) -> list[dict[str, Any]] | None:
    """The calls of a ``required`` choice's JSON array text, None when it is not one."""
    try:
        items = json.loads(text)
        if not isinstance(items, list) or not items:
            return None
        if not all(isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
            return None
        return [_call(i["name"], _arguments(i["parameters"])) for i in items]
    except (ValueError, RecursionError):
        return None


def parse_hermes(text: str, names: Collection[str] | None = None) -> list[dict[str, Any]] | None:
    """The calls of the ``<tool_call>`` blocks in ``text`` (None when there is none, or one does
    not hold a JSON object with a string ``name``; given ``names``, the declared tools', also
    when one's ``name`` is none of them or its ``arguments`` is not a JSON object). Linear in
    ``text``."""
    calls, at = [], text.find(START)
    if at < 0:
        return None
    try:
        while at >= 0:
            begin = at + len(START)
            end = text.find(END, begin)
            body = text[begin:] if end < 0 else text[begin:end]
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            if names is not None and (call["name"] not in names or not isinstance(call.get("arguments", {}), dict)):
                return None  # no call of a declared tool: the reply holds none (module docstring)
            calls.append(_call(call["name"], _arguments(call.get("arguments", {}))))
            at = -1 if end < 0 else text.find(START, end + len(END))
    except (ValueError, RecursionError):
        return None
    return calls


def _held(text: str) -> int:
    """Characters at the end of ``text`` that may begin ``START``."""
    for keep in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-keep:]):
            return keep
    return 0


class ToolOutput:
    """One choice's text as tool calls (module docstring). ``mode``: ``named`` (``name`` the
    function), ``required`` or ``auto``; ``parallel``: several calls may be kept; ``names``: the
    request's declared tools' names (needed for ``auto``, whose reply calling any other function,
    or with arguments that are not an object, is its content).

    Raises:
        ValueError: another mode, or ``auto`` without ``names``."""

    def __init__(self, mode: str, name: str | None = None, parallel: bool = True, seed: str = "",
                 names: Collection[str] | None = None) -> None:
        if mode not in ("named", "required", "auto"):
            raise ValueError(f"no tool calls are read for tool_choice mode {mode!r}")
        if mode == "auto" and names is None:
            raise ValueError("tool_choice auto reads calls of the declared tools only: their names must be given")
        self.mode, self.name, self.parallel = mode, name, parallel
        self.names = tuple(names) if names is not None else ((name,) if name else ())  # (the spec's, in order)
        self._declared = frozenset(self.names)
        self.seed = seed  # the calls' ids come from it (``chat_tools.seeded_call_id``); "": random
        self.tail = ""  # auto, before a <tool_call>: streamed text that may begin one, not sent yet
        self.parts: list[str] = []  # the text read at the end (named: sent already), joined once
        self.calling = False  # auto: a <tool_call> began (the rest is held)
        self.named_id: str | None = None  # named: the call's id, once its first delta went

    def spec(self) -> str:
        """How this reads a session turn's reply, for its cache node (``NodeRequest.tool_output``):
        the node keeps a reply read as calls as those very calls, ids included (and an "auto"
        reply calling an undeclared function as its text: ``names`` travel with it)."""
        return tool_output_spec(self.mode, self.name, self.parallel, self.seed, self.names)

    def _id(self, call: dict[str, Any], index: int) -> dict[str, Any]:
        if self.seed:
            call["id"] = seeded_call_id(self.seed, index)
        return call

    def _calls(self, text: str) -> list[dict[str, Any]] | None:
        if self.mode == "named":
            return [self._id(_call(self.name or "", text), 0)] if _is_json(text) else None
        calls = parse_required(text) if self.mode == "required" else parse_hermes(text, self._declared)
        calls = calls if calls is None or self.parallel else calls[:1]
        return calls if calls is None else [self._id(c, i) for i, c in enumerate(calls)]

    @staticmethod
    def _finish(finish_reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's ``content`` and ``tool_calls``, and its finish reason."""
        calls = self._calls(text)
        if not calls:
            return {"content": text}, finish_reason
        content = text[: text.find(START)] if self.mode == "auto" else ""
        return {"content": content or None, "tool_calls": calls}, self._finish(finish_reason, True)

    def delta(self, text: str) -> dict[str, Any]:
        """A streamed chunk's delta fields for the next ``text`` ({} while it is held). Linear in
        the whole stream: held text is kept as pieces, joined once by ``end``."""
        if self.mode == "named":
            if not text:
                return {}
            self.parts.append(text)
            if self.named_id is None:
                call = self._id(_call(self.name or "", text), 0)
                self.named_id = call["id"]
                return {"tool_calls": [{"index": 0, **call}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if self.mode == "required" or self.calling:
            self.parts.append(text)
            return {}
        text, self.tail = self.tail + text, ""  # the tail is shorter than START
        at = text.find(START)
        if at >= 0:
            self.calling = True
            self.parts.append(text[at:])
            text = text[:at]
        else:
            keep = _held(text)
            if keep:
                text, self.tail = text[:-keep], text[-keep:]
        return {"content": text} if text else {}

    def end(self, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last chunk's delta fields (what was held) and the finish reason."""
        held, self.parts = "".join(self.parts), []
        if self.mode == "named":  # the text went as arguments deltas; tool_calls only when it is JSON
            return {}, self._finish(finish_reason, _is_json(held))
        held, self.tail = self.tail + held, ""
        calls = self._calls(held) if (self.mode == "required" or self.calling) else None
        if not calls:
            return ({"content": held} if held else {}), finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, self._finish(finish_reason, True)
