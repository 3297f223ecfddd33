"""Tool calling on ``POST /v1/chat/completions``, as vLLM serves it: OpenAI's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (``ToolFields``, the chat body's base), and
assistant messages' ``tool_calls`` in the history (``ToolCall``); the request side, the
response side is ``services.openai_api.tool_calls``.

- ``tools``: 1 to ``MAX_TOOLS`` ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``, each name OpenAI's pattern ``^[a-zA-Z0-9_-]{1,64}$`` and unique,
  each ``parameters`` a JSON schema object at most ``MAX_SCHEMA_DEPTH`` deep whose top-level
  ``"type"``, when given, is ``"object"`` and that uses none of ``NOT_OBJECT_KEYWORDS`` at its
  root (``enum``, ``anyOf``, ...: a call's arguments are an object), all of them at most
  ``MAX_TOOLS_CHARS`` characters as JSON. They go to the chat template
  (``apply_chat_template(tools=...)``, rendered on the gateway's worker thread): a template that
  renders tools shows them to the model, one that does not (SmolLM2's) leaves them out, as
  vLLM does; they count against the prompt's ``MAX_PROMPT_CHARS``.
- ``tool_choice``: ``"none"`` (tools rendered, no calls parsed), ``"auto"`` (the default when
  tools are given; needs the server's ``tool_call_parser``, ``hermes``: else a 400 naming it, as
  vLLM needs ``--enable-auto-tool-choice --tool-call-parser``; the output is free text read
  afterwards, as vLLM's, a block that is no call of a declared tool making the whole reply its
  content, ``services.tool_calls``; when every tool is ``strict`` its ``<tool_call>`` blocks are
  constrained to calls of the tools with arguments matching their parameters' schemas,
  ``chat_tools.auto_constraint``, unless another field gives the body's constraint, which is
  then the only one), ``"required"`` (the output is
  constrained to a JSON array of 1+ ``{"name", "parameters"}`` objects, each one tool's name and
  its parameters' schema: vLLM's schema), or ``{"type": "function", "function": {"name"}}``
  (the output is constrained to that tool's parameters' schema). A constraint is a
  ``StructuredOutputSpec`` like ``response_format``'s, so it cannot go with one (400).
- ``parallel_tool_calls`` false: at most one call (``required``: an array of one).
- An assistant message's ``tool_calls`` (``[{"id", "type": "function", "function": {"name",
  "arguments"}}]``, at most ``MAX_TOOL_CALLS``; its ``content`` may then be null) reach the
  template with ``arguments`` as an object when they are a JSON object's text (vLLM's way:
  templates write ``arguments | tojson``); a tool message's ``tool_call_id`` as before.

With a ``session_id`` the turn's tools, and its messages' tool calls, go to the session's cache
node (JSON text, checked there: ``services.chat_tools``), which renders the turn with them as
the template renders the whole conversation, and keeps a reply read as tool calls as those calls
(their ids derived from one seed at the edge and the node: ``ToolOutput.spec``); a later turn
whose tools differ from the history's renders the whole conversation anew
(``ChatTemplater.continue_session``). A ``prefix_messages`` prefix renders with the tools, as
the whole chat does (``node_request.resolve_prefix_tokens``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from cache_node.structured_output import StructuredOutputSpec
from services import tool_requests
from services.chat_tools import (  # noqa: F401 (re-exported)
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    auto_constraint,
    check_arguments,
    strict_tools,
    template_call,
)
from services.convert import MAX_MESSAGE_ID_CHARS, MAX_PROMPT_CHARS
from services.openai_api.strict import Strict, bounded_list
from services.openai_api.structured import StructuredFields
from services.openai_api.tool_calls import ToolOutput
from services.tool_requests import NOT_OBJECT_KEYWORDS, TOOL_PARSERS  # noqa: F401 (re-exported)

# MAX_TOOLS, MAX_TOOLS_CHARS, MAX_TOOL_CALLS: bounds shared with the cache node's checks of the
# wire (``services.chat_tools``)
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""OpenAI's pattern for a function's name."""

# TOOL_PARSERS, NOT_OBJECT_KEYWORDS and the checks of tools and tool choices below are the gRPC
# API's too: ``services.tool_requests`` (one copy; these wrap it for the pydantic bodies)


class FunctionDef(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # named / required are constrained either way; auto when every tool is strict

    @field_validator("parameters")
    @classmethod
    def _shallow(cls, value: dict[str, Any]) -> dict[str, Any]:
        return tool_requests.check_parameters(value)

    def params_schema(self) -> dict[str, Any]:
        """The parameters' schema (none given: any JSON object)."""
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)  # (the prompt's bound; the request's: ``schemas``)

    # its lone surrogate check (review 30j F1) parses it: ``schemas.template_messages`` makes it,
    # once the request's calls' JSON values together are bounded (review s33)


class ToolCall(Strict):
    """One call of an assistant message in the history."""

    id: str = Field(min_length=1, max_length=MAX_MESSAGE_ID_CHARS)
    type: Literal["function"]
    function: FunctionCall

    def chars(self) -> int:
        return len(self.id) + len(self.function.name) + len(self.function.arguments)

    def as_template(self) -> dict[str, Any]:
        """As chat templates take it: ``arguments`` an object when it is a JSON object's text
        (``chat_tools.template_call``, as the cache node keeps a session's generated calls)."""
        return template_call(self.id, self.function.name, self.function.arguments)


def check_tools(tools: list[Tool]) -> int:
    """The characters of ``tools`` as JSON. Raises ValueError (worded for ``tools``): none, a
    name listed twice, or more than ``MAX_TOOLS_CHARS`` characters (``tool_requests.check_tools``)."""
    return tool_requests.check_tools(template_tools(tools))


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """``tools`` as ``apply_chat_template(tools=...)`` takes them (OpenAI's shape, nulls left out)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def choice_mode(tool_choice: str | NamedToolChoice | None, tools: list[Tool] | None) -> str:
    """``"none"``, ``"auto"``, ``"required"`` or ``"named"`` for a body's ``tool_choice`` and
    ``tools`` (``tool_requests.choice_mode``). Raises ValueError (worded ``tool_choice: ...``): a
    choice other than "none" without tools, or a named function that is not one of them."""
    named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    names = [{"function": {"name": t.function.name}} for t in tools or ()]  # (all it reads)
    return tool_requests.choice_mode(None if named else tool_choice, named, names)  # type: ignore[arg-type]


def tool_constraint(mode: str, tools: list[Tool], named: str | None, parallel: bool) -> StructuredOutputSpec | None:
    """The output constraint of a ``named`` or ``required`` choice (None for the others:
    ``tool_requests.tool_constraint``). Raises ValueError (``tool_choice: ...``)."""
    return tool_requests.tool_constraint(mode, template_tools(tools), named, parallel)


def auto_tool_constraint(tools: list[Tool], parallel: bool) -> StructuredOutputSpec | None:
    """The output constraint of an ``auto`` choice (``chat_tools.auto_constraint``: None unless
    every tool is ``strict``). Raises
    ValueError (``tool_choice: ...``): the spec is refused (not reachable from checked tools)."""
    try:
        return auto_constraint(template_tools(tools), parallel)
    except ValueError as exc:
        raise ValueError(f"tool_choice: the auto tool calls' constraint is refused: {exc}") from None


class ToolFields(StructuredFields):
    """A chat body's tool-calling fields (``ChatCompletionRequest``'s base, before the
    sampling fields): what they ask for, the constraint they give, how the text is read."""

    tools: bounded_list(Tool, MAX_TOOLS) | None = None  # type: ignore[valid-type]
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[Tool]) -> list[Tool]:
        check_tools(value)
        return value

    def tool_mode(self) -> str:
        """``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (``tools.choice_mode``).
        Raises ValueError naming ``tool_choice``."""
        return choice_mode(self.tool_choice, self.tools)

    def _named(self) -> str | None:
        choice = self.tool_choice
        return None if isinstance(choice, str) or choice is None else choice.function.name

    def template_tools(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools) if self.tools else None

    def tool_output(self, seed: str = "") -> ToolOutput | None:
        """How a choice's text is read as tool calls (None: it is the content), with the body's
        tools' names (an "auto" reply calling another function is content); ``seed``: the
        calls' ids come from it (a session turn's: ``tool_calls.ToolOutput.spec``)."""
        mode = self.tool_mode()
        names = [tool.function.name for tool in self.tools or []]
        return None if mode == "none" else ToolOutput(mode, self._named(), self.parallel_tool_calls is not False, seed,
                                                      names)

    def constraint_fields(self) -> list[str]:
        fields = super().constraint_fields()
        try:
            mode = self.tool_mode() if self.tools else "none"
        except ValueError:  # (refused by to_input: this names no constraint)
            mode = "none"
        # "auto" is constrained only when no other field is and its tools are all strict
        # (``chat_tools.auto_constraint``)
        constrains = mode in ("named", "required") or (mode == "auto" and not fields
                                                        and strict_tools(template_tools(self.tools or [])))
        return ["tool_choice", *fields] if constrains else fields

    def structured_output(self) -> Any:
        """A ``named`` or ``required`` tool choice's constraint (``tools.tool_constraint``), an
        ``auto`` one's when no other field gives one and every tool is ``strict``
        (``chat_tools.auto_constraint``: only the declared tools, with arguments matching their
        parameters, can be called), or the
        structured-output fields' (two: a 400 naming the first). "auto" with
        ``response_format`` (or another constraint field) is constrained by that field alone,
        as before."""
        given = self.constraint_fields()
        if given[:1] != ["tool_choice"]:
            return super().structured_output()
        mode, parallel = self.tool_mode(), self.parallel_tool_calls is not False
        if mode == "auto":
            return auto_tool_constraint(self.tools or [], parallel)
        tool_requests.check_one_constraint(mode, given[1:])
        return tool_constraint(mode, self.tools or [], self._named(), parallel)
