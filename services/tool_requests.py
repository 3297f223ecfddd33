"""Tool calling's request side as both APIs check it: the HTTP edge (``services.openai_api.tools``,
its pydantic bodies) and the gRPC API (``services.convert``, ``GenerateRequest.tools``,
``tool_choice``, ``parallel_tool_calls`` and ``ChatMessage.tool_calls``) run these same checks on
the same values, so a request is served or refused the same way through either.

Tools are taken in the shape the chat template takes them (``apply_chat_template(tools=...)``,
OpenAI's): ``{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}``. Plain Python and ``json``, no web framework and no pydantic: the gateway's gRPC
path imports it without the HTTP stack.

- ``check_parameters``: a tool's ``parameters`` is an object's schema (OpenAI's rule) at most
  ``MAX_SCHEMA_DEPTH`` deep: its top-level ``"type"``, when given, is ``"object"``, and it uses
  none of ``NOT_OBJECT_KEYWORDS`` at its root.
- ``check_tools``: 1 or more tools, names unique, at most ``MAX_TOOLS_CHARS`` characters as JSON.
- ``choice_mode``: ``"none"``, ``"auto"``, ``"required"`` or ``"named"`` for a tool choice.
- ``tool_constraint``: the output constraint of a ``named`` or ``required`` choice (the named
  tool's parameters' schema, or vLLM's array of ``{"name", "parameters"}`` objects);
  ``check_one_constraint``: such a choice cannot go with another structured-output constraint.
- ``auto_refusal``: "auto" while the server's ``tool_call_parser`` is off.
- ``spec_of``: a constraint's value as a ``StructuredOutputSpec`` (structured outputs' too).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from cache_node.structured_output import MAX_SCHEMA_DEPTH, StructuredOutputSpec
from services.chat_tools import LONE_SURROGATE, MAX_TOOLS_CHARS, json_depth, lone_surrogate

TOOL_PARSERS = ("hermes",)
"""The server's ``tool_call_parser`` values ("" = off: ``tool_choice`` "auto" is refused)."""

TOOL_CHOICE_MODES = ("none", "auto", "required")
"""A tool choice that names no function."""

NOT_OBJECT_KEYWORDS = frozenset({"enum", "const", "anyOf", "oneOf", "allOf", "not", "items", "prefixItems"})
"""Top-level schema keywords a tool's ``parameters`` may not use: each makes the root something
other than one object (the compiler honours them over ``"type"``), as OpenAI refuses them there."""

_SPEC_PREFIX = re.compile(r"^structured_output (?:(?:json_object|json_schema|regex|choice|grammar) )?")


def spec_of(kind: str, value: Any) -> StructuredOutputSpec:
    """``value`` as a ``kind`` spec: a schema object (at most ``MAX_SCHEMA_DEPTH`` deep, checked
    before it is serialized) or text for ``json_schema``, a list of strings for ``choice``,
    text for ``regex`` and ``grammar``.

    Raises:
        ValueError: the spec's refusal, worded for the field that holds it (no
            ``structured_output`` prefix: the caller names the field); a schema's text whose
            JSON holds a lone surrogate (``chat_tools.lone_surrogate``, review 30j F1: the
            grammar compiler refused it as "does not compile", naming a JSON syntax error).
    """
    if kind == "json_schema" and isinstance(value, str) and lone_surrogate(value):
        raise ValueError(f"the schema's JSON text {LONE_SURROGATE}")
    if kind == "json_schema" and isinstance(value, dict):
        if schema_depth(value) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
        value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    elif kind == "choice":
        value = json.dumps(value, ensure_ascii=False)
    try:
        return StructuredOutputSpec(kind, value)
    except ValueError as exc:
        raise ValueError(_SPEC_PREFIX.sub("", str(exc))) from None


def schema_depth(value: Any) -> int:
    """Nesting of objects and arrays in ``value``, past ``MAX_SCHEMA_DEPTH`` not further
    (``chat_tools.json_depth``)."""
    return json_depth(value, MAX_SCHEMA_DEPTH)


def check_parameters(value: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters``, returned as given. Raises ValueError (worded for the field): more
    than ``MAX_SCHEMA_DEPTH`` levels deep, a top-level ``"type"`` other than ``"object"``, or one
    of ``NOT_OBJECT_KEYWORDS`` at its root (review 28l F4: ``{"enum": ["Paris"]}`` passed, and a
    named call's arguments were ``"Paris"``)."""
    if schema_depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
    if "type" in value and value["type"] != "object":  # a call's arguments are a JSON object
        given = json.dumps(value["type"], ensure_ascii=False)
        given = given if len(given) <= 64 else given[:61] + "..."
        raise ValueError(f'must be an object\'s schema (OpenAI\'s): its "type" is {given}, not "object"')
    other = sorted(NOT_OBJECT_KEYWORDS & set(value))
    if other:
        raise ValueError(f"must be an object's schema (OpenAI's: the root is an object, not {other[0]!r}); "
                         "put the alternatives inside its properties")
    return value


def _name(tool: dict[str, Any]) -> str:
    return str(tool["function"]["name"])


def check_tools(tools: Sequence[dict[str, Any]]) -> int:
    """The characters of ``tools`` as compact JSON. Raises ValueError (worded for ``tools``):
    none, a name listed twice, or more than ``MAX_TOOLS_CHARS`` characters."""
    if not tools:
        raise ValueError("must hold at least one tool (leave it out for none)")
    names = [_name(t) for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ValueError(f"names the function {twice!r} twice; names must be unique")
    chars = len(json.dumps(list(tools), ensure_ascii=False, separators=(",", ":")))
    if chars > MAX_TOOLS_CHARS:
        raise ValueError(f"hold {chars} characters as JSON; at most {MAX_TOOLS_CHARS} are allowed")
    return chars


def choice_mode(tool_choice: str | None, named: str | None, tools: Sequence[dict[str, Any]] | None) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or ``"named"`` for a tool choice (``tool_choice``
    one of ``TOOL_CHOICE_MODES``, or ``named`` a function's name; both None: not given) and
    ``tools`` (no tools: "none"). Raises ValueError (worded ``tool_choice: ...``): a choice other
    than "none" without tools, or a named function that is not one of them."""
    if not tools:
        if named is not None or tool_choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools (when using tool_choice other than \"none\", tools must "
                             "be set)")
        return "none"
    if named is not None:
        if all(_name(t) != named for t in tools):
            raise ValueError(f"tool_choice: names the function {named!r}, which is not in tools (they are "
                             f"{', '.join(repr(_name(t)) for t in tools[:8])}{', ...' if len(tools) > 8 else ''})")
        return "named"
    return tool_choice or "auto"


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters' schema (none given: any JSON object)."""
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object"}


def tool_constraint(mode: str, tools: Sequence[dict[str, Any]], named: str | None,
                    parallel: bool) -> StructuredOutputSpec | None:
    """The output constraint of a ``named`` or ``required`` choice (None for the others):
    the named tool's parameters' schema, or vLLM's array of ``{"name", "parameters"}`` objects
    (at most one with ``parallel`` false), the tools' ``$defs`` lifted to its top. Raises
    ValueError (``tool_choice: ...``): the schema is refused (too deep, too long, two tools
    defining one ``$defs`` name differently)."""
    if mode == "named":
        schema = next(_params_schema(t) for t in tools if _name(t) == named)
    elif mode == "required":
        defs: dict[str, Any] = {}
        options = []
        for tool in tools:
            params = dict(_params_schema(tool))
            for key, value in (params.pop("$defs", None) or {}).items():
                if key in defs and defs[key] != value:
                    raise ValueError(f"tool_choice: tools define $defs {key!r} differently; a \"required\" "
                                     "choice needs one definition of each")
                defs[key] = value
            options.append({"properties": {"name": {"type": "string", "enum": [_name(tool)]},
                                           "parameters": params}, "required": ["name", "parameters"]})
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
        if not parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
    else:
        return None
    try:
        return spec_of("json_schema", schema)
    except ValueError as exc:
        raise ValueError(f"tool_choice: the {mode} tool call's schema is refused: {exc}") from None


def check_one_constraint(mode: str, others: Sequence[str]) -> None:
    """A ``named`` or ``required`` choice constrains the output: it cannot go with another
    constraint (``others``: the fields that give one). Raises ValueError naming ``tool_choice``."""
    if mode in ("named", "required") and others:
        raise ValueError(f"tool_choice: a {mode} tool choice constrains the output; it cannot go "
                         f"with {' or '.join(others)}")


def auto_refusal(mode: str, tool_call_parser: str) -> str | None:
    """The refusal of ``mode`` "auto" (the default when tools are given) while the server reads
    no tool calls (``tool_call_parser`` ""), as vLLM refuses it without
    ``--enable-auto-tool-choice --tool-call-parser``; None when it is served."""
    if mode != "auto" or tool_call_parser:
        return None
    return ("tool_choice: \"auto\" (the default when tools are given) needs the server's tool call parser, "
            "which is off: set tool_call_parser: hermes in the kvstrata config (vLLM's --enable-auto-tool-choice "
            "--tool-call-parser); or send tool_choice \"none\", \"required\" or a named function")
