"""Tools and tool calls as a cache node takes them: a session turn's ``tools`` and its
messages' ``tool_calls`` cross the data plane as JSON text (``NodeRequest.tools``, a message's
``"tool_calls"`` string), so a message stays a map of strings and the wire's container bounds
stay those of plain chat; the node checks that text (``check_wire_tools``,
``check_wire_tool_calls``: it comes off the network) and renders it with the chat template
(``template_message``). Plain ``json``, no pydantic: the HTTP edge's own checks are
``services.openai_api.tools``.

A generated reply the HTTP edge reads as tool calls is kept in the session's messages in the
form the edge hands it to the client (``template_call``), with the same call ids: the edge and
the node derive them from one seed (``seeded_call_id``, the turn's ``NodeRequest.tool_output``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, AnyStr

from cache_node.structured_output import TOOL_CALLS_KIND, StructuredOutputSpec

if TYPE_CHECKING:
    from services.chat import ChatTemplater

MAX_TOOLS = 128
"""Most tools one body may list (OpenAI's bound)."""

MAX_TOOLS_CHARS = 256 << 10
"""Most characters of a body's ``tools`` as JSON (compact): text the chat template may render
and the ``required`` schema is built from."""

MAX_TOOL_CALLS = 128
"""Most ``tool_calls`` in one assistant message of the history."""

MAX_CALL_ID_CHARS = 256
"""Longest tool call id (``services.convert.MAX_MESSAGE_ID_CHARS``, not imported: protobuf)."""

MAX_ARGUMENTS_VALUES = 1 << 15
"""Most JSON values the ``arguments`` of one request's tool calls may hold together (32,768:
``arguments_values``, counted on the text before it is parsed; both APIs refuse more naming the
call, a 400 / INVALID_ARGUMENT). A model's calls hold tens; this leaves room for bulk ones.
Parsing them (``template_call``) costs ~1-5 us a value while holding the GIL: the bound keeps a
request's to milliseconds. Regression (review s33 F1): they were parsed before any bound, and
only the prompt's characters bounded them: one 0.75 MB arguments text of 250k empty lists stalled
the gateway's event loop 250-480 ms, an 8 MiB one 2-3.5 s (the body's shape check sees one
string), and each session turn's scheduler admission 0.3-0.38 s."""

MAX_WIRE_CALL_VALUES = MAX_ARGUMENTS_VALUES + 8 * 1024
"""Most JSON values a ``NodeRequest``'s messages' ``tool_calls`` texts hold together
(``arguments_values``): ``MAX_ARGUMENTS_VALUES`` of arguments and each call's envelope (2
objects and 4 separators; at most ``services.convert.MAX_REQUEST_TOOL_CALLS``, 1,024, calls a
request), counted before any is parsed (``services.data_plane_wire.request_from_wire``)."""

MAX_TOOL_DEPTH = 64
"""Deepest nesting of the JSON of ``tools`` or of one message's ``tool_calls`` on the wire (a
tool's ``parameters`` at most ``MAX_SCHEMA_DEPTH`` (32) below its envelope; arguments as deep as
a model writes them): past it the node refuses the request before rendering (the template's
``tojson`` recurses)."""

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's pattern for a function's name."""

LONE_SURROGATE = "holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff unpaired: not UTF-8 text)"
"""How a JSON text whose value is not UTF-8 text is refused (``lone_surrogate``)."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_UNPARSED: Any = object()

_TOOL_OUTPUT_MODES = ("named", "required", "auto")


def json_depth(value: Any, most: int = MAX_TOOL_DEPTH) -> int:
    """Nesting of objects and arrays in ``value``, counted without recursion (a body's JSON may
    nest ~1,000 deep, which ``json.dumps`` would recurse into), past ``most`` not further."""
    deepest, level = 0, [value]
    while level and deepest <= most:
        deepest += 1
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item)
                 if isinstance(v, (dict, list))]
    return deepest


def json_shape(text: AnyStr, max_quotes: int) -> tuple[int, int, int]:
    """``(strings, separators, containers)`` of a JSON text (``str`` or UTF-8 ``bytes``), counted
    without parsing it: its JSON strings (keys included), the value separators ``,`` and the
    containers' openings ``[`` ``{`` outside the strings. Scans at memcpy speed: escaped
    backslashes and quotes dropped, quotes counted, the text outside the strings joined and its
    separators and brackets counted; long strings cost nothing, only structure counts. For JSON
    the separators are the sum over arrays and objects of their length less one. Past
    ``max_quotes`` quotes the text outside the strings is not split (separators and containers
    0), so the cost stays linear in the text. Text that is no JSON gets counts of the same
    characters (no error). The HTTP edge's body check (``openai_api.bodies.body_shape``) and
    the bounds on tool calls' arguments (``arguments_values``) count with this."""
    if isinstance(text, bytes):
        plain = text.replace(b"\\\\", b"").replace(b'\\"', b"")
        quotes = plain.count(b'"')
        if quotes > max_quotes:
            return quotes // 2, 0, 0
        outside = b"".join(plain.split(b'"')[::2]) if quotes else plain
        return quotes // 2, outside.count(b","), outside.count(b"[") + outside.count(b"{")
    plain_text = text.replace("\\\\", "").replace('\\"', "")
    quotes = plain_text.count('"')
    if quotes > max_quotes:
        return quotes // 2, 0, 0
    outside_text = "".join(plain_text.split('"')[::2]) if quotes else plain_text
    return quotes // 2, outside_text.count(","), outside_text.count("[") + outside_text.count("{")


def arguments_values(text: str, most: int = MAX_ARGUMENTS_VALUES) -> int:
    """The JSON values of ``text`` (a call's ``arguments``, a message's ``tool_calls``) as the
    bounds count them, before it is parsed: its separators and containers (``json_shape``), an
    upper bound of its values less one; ``most + 1`` when it holds more than ``2 * most + 2``
    strings (more than any JSON text of at most ``most`` values holds: an object member is two,
    an element one), whose separators are not counted. Text that is no JSON is counted the same
    (a 0.75 MB arguments text of 250k empty lists: 500,000; ``"abc"``: 0)."""
    strings, separators, containers = json_shape(text, 4 * most + 4)
    return most + 1 if strings > 2 * most + 2 else separators + containers


def check_arguments_values(calls: Iterable[tuple[str, str]]) -> None:
    """Bound the tool calls' ``arguments`` of one request together, before any is parsed:
    ``calls`` yields ``(where, arguments text)``. Raises ValueError worded ``<where>: ...``, the
    call at which they pass ``MAX_ARGUMENTS_VALUES`` values (``arguments_values``)."""
    total = 0
    for where, arguments in calls:
        total += arguments_values(arguments, MAX_ARGUMENTS_VALUES - total)
        if total > MAX_ARGUMENTS_VALUES:
            raise ValueError(f"{where}: the tool calls' arguments hold more than {MAX_ARGUMENTS_VALUES} JSON values "
                             "(elements, members, containers) in one request; at most "
                             f"{MAX_ARGUMENTS_VALUES} are allowed")


def lone_surrogate(text: str, value: Any = _UNPARSED) -> bool:
    """Whether the JSON ``text`` (parsed already: ``value``) holds a string that is no UTF-8
    text: an escape of a lone UTF-16 surrogate (``"\\ud800"``) is valid JSON, and ``json.loads``
    makes it a ``str`` that cannot be encoded. Text that does not parse: False. Only text with
    such an escape is parsed or walked (without recursion: any depth).

    Every JSON text a client sends inside a field (a tool's ``parameters`` and a call's
    ``arguments`` over gRPC, a call's ``arguments`` over HTTP; the data plane's ``tools`` and
    ``tool_calls``) is refused when this holds, naming the field, as the HTTP edge refuses such a
    body (``openai_api.bodies.load_json``). Regression (review 30j F1): ``"\\ud800"`` in them
    passed every check and ended INTERNAL (``UnicodeEncodeError`` packing a session turn for
    its node, a ``TypeError`` tokenizing the rendered prompt), a 500 over HTTP."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return False
    if value is _UNPARSED:
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return False
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _loads(what: str, text: str, limit: int) -> Any:
    if len(text) > limit:
        raise ValueError(f"{what} holds {len(text)} characters of JSON; at most {limit} are allowed")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise ValueError(f"{what} must be JSON text") from None
    if json_depth(value) > MAX_TOOL_DEPTH:
        raise ValueError(f"{what} nests more than {MAX_TOOL_DEPTH} levels deep")
    if lone_surrogate(text, value):
        raise ValueError(f"{what} {LONE_SURROGATE}")
    return value


def check_arguments(where: str, arguments: str) -> str:
    """A tool call's ``arguments`` as a client sends it (either API), returned as given. Raises
    ValueError naming ``where``: more than ``MAX_ARGUMENTS_VALUES`` JSON values, counted before
    it is parsed (``arguments_values``; the request's calls together are bounded the same by
    ``check_arguments_values``), or its JSON holds a lone surrogate (``lone_surrogate``, parsed
    only then, within that bound); any other text is taken (``template_call``)."""
    if arguments_values(arguments) > MAX_ARGUMENTS_VALUES:
        raise ValueError(f"{where} holds more than {MAX_ARGUMENTS_VALUES} JSON values (elements, members, "
                         f"containers); at most {MAX_ARGUMENTS_VALUES} are allowed")
    if lone_surrogate(arguments):
        raise ValueError(f"{where} {LONE_SURROGATE}")
    return arguments


def _name(what: str, value: Any) -> None:
    if not isinstance(value, str) or NAME_PATTERN.fullmatch(value) is None:
        raise ValueError(f"{what} must match ^[a-zA-Z0-9_-]{{1,64}}$")


def check_wire_tools(text: str) -> list[dict[str, Any]] | None:
    """``NodeRequest.tools`` (JSON text of OpenAI's tools list; "" none) as the template takes
    them. Raises ValueError naming ``request.tools``: more than ``MAX_TOOLS_CHARS`` characters,
    more than ``MAX_TOOLS`` tools, or not ``[{"type": "function", "function": {"name", ...}}]``
    (a name off OpenAI's pattern, ``description`` not text, ``parameters`` not an object)."""
    if not text:
        return None
    tools = _loads("request.tools", text, MAX_TOOLS_CHARS)
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ValueError(f"request.tools must be a list of 1 to {MAX_TOOLS} tools")
    for i, tool in enumerate(tools):
        where = f"request.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"} \
                or not isinstance(tool["function"], dict):
            raise ValueError(f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        if not set(function) <= {"name", "description", "parameters", "strict"}:
            raise ValueError(f"{where}.function has unknown fields {sorted(set(function) - {'name', 'description', 'parameters', 'strict'})}")
        _name(f"{where}.function.name", function.get("name"))
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if key in function and not isinstance(function[key], kind):
                raise ValueError(f"{where}.function.{key} must be {kind.__name__}")
    return tools


def check_wire_tool_calls(text: str, where: str) -> list[dict[str, Any]]:
    """A message's ``"tool_calls"`` (JSON text of ``template_call``'s dicts) as the template takes
    them. Raises ValueError naming ``where``: not a list of 1 to ``MAX_TOOL_CALLS`` calls
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` (an id of 1 to
    ``MAX_CALL_ID_CHARS`` characters, a name of OpenAI's pattern, arguments an object or text)."""
    calls = _loads(where, text, len(text))  # (the message's characters are bounded with its content)
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_TOOL_CALLS:
        raise ValueError(f"{where} must be a list of 1 to {MAX_TOOL_CALLS} tool calls")
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or set(call) != {"id", "type", "function"} or call["type"] != "function" \
                or not isinstance(call["function"], dict) or set(call["function"]) != {"name", "arguments"}:
            raise ValueError(f'{where}[{i}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
        if not isinstance(call["id"], str) or not 0 < len(call["id"]) <= MAX_CALL_ID_CHARS:
            raise ValueError(f"{where}[{i}].id must have 1 to {MAX_CALL_ID_CHARS} characters")
        _name(f"{where}[{i}].function.name", call["function"]["name"])
        if not isinstance(call["function"]["arguments"], (dict, str)):
            raise ValueError(f"{where}[{i}].function.arguments must be an object or text")  # noqa: TRY004 (a 400)
    return calls


MAX_ARGUMENTS_DEPTH = MAX_TOOL_DEPTH - 4
"""Deepest nesting of a call's ``arguments`` handed to the template as an object (a message's
``tool_calls`` list adds 4 levels: the list, the call, its function, the arguments)."""


def template_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One tool call as chat templates take it (vLLM's way: templates write ``arguments |
    tojson``): ``arguments`` an object when it is a JSON object's text nesting at most
    ``MAX_ARGUMENTS_DEPTH`` deep, else the text. Regression: arguments ~500 deep (a history's
    call, or a session's reply a regex made the model write) went to the template as an object,
    whose ``tojson`` recursed past Python's limit: RecursionError on every render of it.
    Arguments whose object holds a lone surrogate stay text too (a client's are refused before:
    ``check_arguments``; a session reply's, the model's escapes, are kept as written)."""
    value: Any = arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict) and json_depth(parsed) <= MAX_ARGUMENTS_DEPTH \
            and not lone_surrogate(arguments, parsed):
        value = parsed
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": value}}


def wire_messages(messages: Sequence[dict[str, Any]]) -> tuple[dict[str, str], ...]:
    """Chat ``messages`` (a message's ``tool_calls`` a list, as the template takes them) as a
    ``NodeRequest`` holds them: each a map of strings, ``tool_calls`` as compact JSON text."""
    return tuple({**m, "tool_calls": json.dumps(m["tool_calls"], ensure_ascii=False, separators=(",", ":"))}
                 if not isinstance(m.get("tool_calls", ""), str) else dict(m) for m in messages)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as the chat template takes it: a wire message's ``tool_calls`` text as its list
    (checked when it came off the wire: ``check_wire_tool_calls``)."""
    calls = message.get("tool_calls")
    return {**message, "tool_calls": json.loads(calls)} if isinstance(calls, str) else message


def check_tool_answers(messages: Sequence[dict[str, Any]], where: str = "messages.{}.tool_call_id") -> None:
    """Each tool message of ``messages`` (as the chat template takes them: a message's
    ``tool_calls`` a list of ``{"id", ...}`` or its JSON text) answers a call of an earlier
    assistant message, when any message carries ``tool_calls``; both APIs' rule for a whole
    request (the HTTP edge's ``openai_api.messages.check_tool_answers``, the gRPC API's
    ``convert.chat_messages_from_pb``).

    The edges do not check a session turn's messages (``session_id``) with this
    (``in_session``): they see the turn alone, and its tool messages may answer calls of the
    session's earlier turns, kept on its cache node. The node matches them
    (``cache_node_requests.check_turn_tool_answers``) against the kept calls and the turn's
    (``check_session_tool_answers``) when the kept messages carry any, and else with this, on
    the turn's messages as a whole request's (a first turn, or a session that made no call yet).

    OpenAI refuses a tool message whose ``tool_call_id`` answers no preceding assistant tool
    call; vLLM checks nothing. The check is as strict as OpenAI's where the request itself
    holds the calls: there a ``tool_call_id`` that matches none of them is a client's mistake
    (a typo, a call id from another conversation) that the model would otherwise see as an
    answer to nothing. It is skipped when no message carries ``tool_calls``: a client that
    trims its history to the latest tool results works on vLLM, and refusing it would break it
    for no gain. "Earlier" is any earlier assistant message, not only the one just before
    (OpenAI's rule).

    Raises:
        ValueError: worded ``<where>: ...``, ``where`` formatted with the first such message's
            index.
    """
    if not any(message.get("tool_calls") for message in messages):
        return
    ids: set[str] = set()
    for i, message in enumerate(messages):
        ids |= _call_ids(message.get("tool_calls"))
        if message.get("role") == "tool" and message.get("tool_call_id") not in ids:
            raise ValueError(f"{where.format(i)}: {message.get('tool_call_id')!r} answers no tool call of an "
                             "earlier assistant message (their tool_calls ids); a tool message must answer one")


def check_session_tool_answers(kept: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> None:
    """Each ``tool`` message of a session turn's ``new`` messages answers a call of an earlier
    assistant message, of the session's ``kept`` history or of the turn, when any of them
    carries ``tool_calls`` (the rule the HTTP edge applies to a whole request,
    ``openai_api.messages.check_tool_answers``, which cannot see a session's kept calls).
    Run on the session's node by ``cache_node_requests.check_turn_tool_answers`` when the kept
    messages carry calls. Regression (trial 29k P2): in a session a ``tool_call_id`` matching no
    call was served, while the same mistake without ``session_id`` was a 400.

    Raises:
        ValueError: worded ``messages.N.tool_call_id: ...`` (``N`` the turn's message).
    """
    if not any(message.get("role") == "tool" for message in new):  # nothing to check: the kept
        return  # calls' JSON is not parsed on every turn
    ids: set[str] = set()
    for message in kept:
        ids |= _call_ids(message.get("tool_calls"))
    for i, message in enumerate(new):
        ids |= _call_ids(message.get("tool_calls"))
        if message.get("role") == "tool" and ids and message.get("tool_call_id") not in ids:
            raise ValueError(f"messages.{i}.tool_call_id: {message.get('tool_call_id')!r} answers no tool call "
                             "of this session's history or this turn (their tool_calls ids); a tool message must "
                             "answer one")


def _call_ids(calls: Any) -> set[str]:
    """The ids of a message's ``tool_calls`` (a list, or its JSON text as on the wire)."""
    if isinstance(calls, str):
        calls = json.loads(calls) if calls else []
    return {str(c["id"]) for c in calls or () if isinstance(c, dict) and c.get("id")}


def tool_calls_chars(calls: Any) -> int:
    """Characters of a message's ``tool_calls``: their JSON text's, or for a list the ids,
    names and arguments (an object's as compact JSON)."""
    if not calls:
        return 0
    if isinstance(calls, str):
        return len(calls)
    total = 0
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        total += len(call.get("id") or "") + len(function.get("name") or "") + len(arguments)
    return total


def seeded_call_id(seed: str, index: int) -> str:
    """The id of the ``index``-th tool call of a reply whose ids come from ``seed`` (the HTTP edge
    and the cache node derive the same: the client's ids are the ones the session keeps)."""
    return "chatcmpl-tool-" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:32]


AUTO_CALL_TRIGGER = "<tool_call>"
"""Where a hermes tool call begins (``tool_calls.START``): the ``auto`` constraint's trigger."""


def strict_tools(tools: Sequence[dict[str, Any]] | None) -> bool:
    """Whether ``tools`` (OpenAI's shape) is not empty and every one has ``function.strict``
    true: the client asked that the calls follow the parameters' schemas exactly (OpenAI's
    strict function calling), which "auto" is then constrained to (``auto_constraint``)."""
    return bool(tools) and all(tool["function"].get("strict") is True for tool in tools or ())


def auto_constraint(tools: Sequence[dict[str, Any]], parallel: bool) -> StructuredOutputSpec | None:
    """The output constraint of ``tool_choice`` "auto" with the ``hermes`` parser (both APIs:
    ``openai_api.tools.ToolFields.structured_output``, ``gateway_inputs``): text is free until
    the model writes ``<tool_call>``; from there only a call of one of ``tools`` (OpenAI's
    shape, checked: ``tool_requests.check_tools``) can follow,
    ``<tool_call>\n{"name": "<a declared name>", "arguments": <an object matching its
    parameters' schema>}\n</tool_call>``, then free text again (with ``parallel`` false the
    output ends after the first call). xgrammar's structural tag (``TOOL_CALLS_KIND``), as vLLM
    constrains a hermes model's auto tool calls (``get_builtin_structural_tag("qwen_3")``'s
    format), compiled by the cache node like any other constraint (its bounds, cache and
    per-tenant fairness).

    Only when every tool is ``strict`` (``strict_tools``; as SGLang applies its auto structural
    tag to strict tools only): None otherwise, and "auto" is read from free text afterwards, as
    vLLM's default, held to the declared tools (``services.tool_calls``: a reply calling another
    function, or with arguments that are not an object, is its content). Regression (review 31, of the first version, which constrained every "auto" request):
    a plain reply that mentioned ``<tool_call>`` was forced into a call of a declared tool with
    made-up arguments; a tool schema xgrammar cannot compile (``\\p{L}``, a backreference) or
    compiles for over 10 s (``[a-z]{1,20000}``) failed requests that were served before; every
    tools request held one of its tenant's 16 grammar slots (``grammar_max_active_per_tenant``)
    and gave the admission pace no sample (``GlobalScheduler``: structured requests do not), so
    a tool-calling tenant was refused or locked out of admission. A strict tool's schema is
    the client's request to be held to it: one that does not compile is refused (OpenAI
    refuses unsupported strict schemas too).

    Earlier regression: "auto" was constrained by nothing and its text parsed afterwards, so a
    call of a function the request did not declare (or with arguments off its schema, or not
    JSON) came back as a tool call with finish reason ``tool_calls``.

    Raises:
        ValueError: the spec is refused (``StructuredOutputSpec``: past
            ``MAX_TOOL_CALLS_SPEC_BYTES`` or nested too deep; not reachable from checked tools).
    """
    if not strict_tools(tools):
        return None
    tags = []
    for tool in tools:
        function = tool["function"]
        params = function.get("parameters")
        name = json.dumps(function["name"], ensure_ascii=False)
        tags.append({"type": "tag", "begin": f'{AUTO_CALL_TRIGGER}\n{{"name": {name}, "arguments": ',
                     "content": {"type": "json_schema", "json_schema": params if params is not None else {"type": "object"}},
                     "end": "}\n</tool_call>"})
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [AUTO_CALL_TRIGGER],
                                                 "tags": tags, "at_least_one": False, "stop_after_first": not parallel}}
    return StructuredOutputSpec(TOOL_CALLS_KIND, json.dumps(tag, ensure_ascii=False, separators=(",", ":")))


TOOL_OUTPUT_CHARS = 256 + MAX_TOOLS * 70
"""Most characters of ``NodeRequest.tool_output``'s JSON: the mode, a name and a seed (at most
64 characters each), and ``MAX_TOOLS`` declared names of 64 characters (quoted, separated)."""


def tool_output_spec(mode: str, name: str | None, parallel: bool, seed: str, names: Sequence[str]) -> str:
    """``NodeRequest.tool_output``: how the edge reads a session turn's reply as tool calls, for
    the node to keep the reply as the edge hands it out: ``[mode, name, parallel, seed, names]``,
    ``names`` the request's declared tools' names (an "auto" reply calling any other function
    is no call: ``services.tool_calls``)."""
    return json.dumps([mode, name or "", parallel, seed, list(names)])


def check_tool_output(text: str) -> tuple[str, str, bool, str, tuple[str, ...]] | None:
    """``tool_output_spec``'s inverse ("": None); ``text`` comes off the network. Raises
    ValueError naming ``request.tool_output``: over ``TOOL_OUTPUT_CHARS`` characters, another
    shape (the 4-element ``[mode, name, parallel, seed]`` of before the declared names too: an
    edge and a node of one version speak the same), a mode other than named/required/auto, a
    named mode without a name of OpenAI's pattern, a seed not of 1 to 64 characters, ``names``
    not a list of 1 to ``MAX_TOOLS`` names of OpenAI's pattern."""
    if not text:
        return None
    spec = _loads("request.tool_output", text, TOOL_OUTPUT_CHARS)
    if not (isinstance(spec, list) and len(spec) == 5 and spec[0] in _TOOL_OUTPUT_MODES
            and isinstance(spec[1], str) and isinstance(spec[2], bool) and isinstance(spec[3], str)
            and 0 < len(spec[3]) <= 64 and isinstance(spec[4], list) and 0 < len(spec[4]) <= MAX_TOOLS):
        raise ValueError("request.tool_output must be [mode (named, required or auto), name, parallel, seed, "
                         f"names (1 to {MAX_TOOLS} declared tools' names)]")
    if spec[0] == "named":
        _name("request.tool_output's name", spec[1])
    for name in spec[4]:
        _name("request.tool_output's names", name)
    return spec[0], spec[1], spec[2], spec[3], tuple(spec[4])


def estimate_tools_tokens(templater: ChatTemplater | None, messages: Sequence[dict[str, Any]],
                          tools: list[dict[str, Any]] | None) -> int:
    """Prompt tokens ``tools`` add to a session's first turn of ``messages``, which the chat
    template renders with them (the gateway's ``extra["prompt_tokens_tools"]``; admission counts
    them for a turn that opens its session, ``services.global_scheduler_routing.prompt_size``):
    that turn rendered with the tools, less without them (0 for a template that leaves them
    out). Their compact JSON's tokens when the template refuses the messages alone (a later
    turn's), its characters / ``CHARS_PER_TOKEN`` without a template.

    Regression: admission estimated a session's first turn from its messages alone, so a turn
    whose template renders thousands of tokens of tools counted its few message tokens and was
    admitted against a TTFT its node could not meet.
    """
    if not tools:
        return 0
    # (services.chat imports this module)
    from services.chat import CHARS_PER_TOKEN, TemplateRefusal

    text = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    if templater is None:
        return len(text) // CHARS_PER_TOKEN + 1
    try:
        return max(len(templater.first_turn(messages, tools)) - len(templater.first_turn(messages)), 0)
    except TemplateRefusal:
        return len(templater.encode(text))
