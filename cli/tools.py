"""``kvstrata generate --tools`` / ``--tool-choice``: tools in OpenAI's shape, sent as the gRPC
API's ``Tool`` and ``ToolChoice`` (``proto/kvstrata/v1/inference.proto``), and a reply's tool
calls printed. The gateway checks the tools as the HTTP API does (``services.tool_requests``);
here only their shape is read, so that a typo is named before anything is sent."""

from __future__ import annotations

import json

import typer

from cli.constraints import spec_text
from kvstrata.v1 import inference_pb2

TOOL_CHOICE_MODES = {
    "none": inference_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
"""``--tool-choice`` words; any other value names a function of ``--tools``."""


def _bad(message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint="--tools")


_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _unknown(where: str, given: dict, known: frozenset) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise _bad(f"{where} has unknown keys {', '.join(map(repr, unknown))} (it may have "
                   f"{', '.join(sorted(known))})")


def tools_from_text(value: str) -> list[inference_pb2.Tool]:
    """``--tools``' value (its JSON text, or ``@FILE``): a list of OpenAI tools,
    ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`` each
    (the ``function`` object alone is taken too); a ``description`` or ``parameters`` null is
    not given (as the HTTP API takes it). ``parameters`` is sent as compact JSON text
    (``ensure_ascii=False``), as the gateway counts it (``convert.tools_from_pb``).

    Raises:
        typer.BadParameter: not JSON, not a list, a tool or function object with a key OpenAI's
            shape does not have (a misspelled ``parametrs`` is named, not dropped: review 30j
            F6), a tool without a text ``name``, or a ``description`` / ``parameters`` of the
            wrong type (the tool is named by index).
    """
    try:
        tools = json.loads(spec_text("--tools", value))
    except json.JSONDecodeError as exc:
        raise _bad(f"not JSON: {exc}") from None
    if not isinstance(tools, list):
        raise _bad("must be a JSON list of tools ([{\"type\": \"function\", \"function\": {...}}, ...])")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}] must be an object with a function's \"name\"")
        if "function" in tool:
            _unknown(f"tools[{i}]", tool, _TOOL_KEYS)
            if tool.get("type", "function") != "function":
                raise _bad(f"tools[{i}].type must be \"function\", got {tool.get('type')!r}")
            function, where = tool["function"], f"tools[{i}].function"
        elif "type" in tool and "name" in tool and set(tool) <= _FUNCTION_KEYS | {"type"}:  # the Responses API's flat shape (trial 30n P6: told "unknown keys 'type'")
            raise _bad(f"tools[{i}]: a tool's name, description and parameters go in its \"function\" object: "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}} (Chat Completions' shape)")
        else:  # the function object alone
            function, where = tool, f"tools[{i}]"
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where} must be an object with a function's \"name\"")
        _unknown(where, function, _FUNCTION_KEYS)
        description, parameters = function.get("description"), function.get("parameters")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.description must be text")
        if parameters is not None and not isinstance(parameters, dict):
            raise _bad(f"{where}.parameters must be a JSON schema object")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise _bad(f"{where}.strict must be true or false")
        out.append(inference_pb2.Tool(
            name=function["name"], description=description or "",
            parameters="" if parameters is None else json.dumps(parameters, ensure_ascii=False,
                                                                separators=(",", ":")),
            strict=function.get("strict") is True))
    return out


def apply_tools(req: inference_pb2.GenerateRequest, tools: str | None, tool_choice: str | None) -> None:
    """Set ``req``'s ``tools`` and ``tool_choice`` from ``--tools`` / ``--tool-choice`` (None:
    not given; the server's default choice with tools is "auto", which needs its tool call
    parser). Raises ``typer.BadParameter`` as ``tools_from_text``, or for a choice without tools."""
    if tools is not None:
        req.tools.extend(tools_from_text(tools))
    if tool_choice is None:
        return
    if tools is None:
        raise typer.BadParameter("needs --tools", param_hint="--tool-choice")
    if tool_choice in TOOL_CHOICE_MODES:
        req.tool_choice.mode = TOOL_CHOICE_MODES[tool_choice]
    else:
        req.tool_choice.function = tool_choice


def tool_call_lines(finished: inference_pb2.GenerateFinished) -> list[str]:
    """One line per tool call of a finished reply: ``tool call <id>: <name>(<arguments>)``, the
    arguments as compact JSON (a model's multi-line JSON on one line: trial 30n P7)."""
    return [f"tool call {call.id}: {call.name}({_one_line(call.arguments)})" for call in finished.tool_calls]


def _one_line(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(", ", ": "))
    except ValueError:  # (a generated call's arguments always parse; anything else as given, on one line)
        return " ".join(arguments.split())

