"""A chat body's messages (``ChatMessage``, its ``TextPart`` content parts), as the chat
template takes them (``services.openai_api.schemas``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from services.chat_tools import check_tool_answers as shared_check_tool_answers
from services.convert import MAX_MESSAGE_ID_CHARS, MAX_REQUEST_TOOL_CALLS, chat_message
from services.openai_api.strict import Strict, bounded_list
from services.openai_api.tools import MAX_TOOL_CALLS, ToolCall

MAX_CONTENT_PARTS = 1024
"""Most ``{"type": "text"}`` parts in one message's content."""


class TextPart(Strict):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    """One message; ``developer`` is OpenAI's newer name for ``system``. ``name`` (any role)
    and a tool message's ``tool_call_id`` (the call it answers: required, as OpenAI requires
    it; matched against the request's assistant calls by ``check_tool_answers``) reach the chat
    template as given; so do an assistant's ``tool_calls`` (``services.openai_api.tools``: its
    ``content`` may then be null, taken as ""). The deprecated ``function_call`` is refused
    naming it."""

    _unserved = frozenset({"refusal", "audio"})

    # declared first, so that its refusal is the one reported, whatever else is wrong with the
    # message (such a message usually has ``content`` null)
    function_call: Any = None
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: bounded_list(ToolCall, MAX_TOOL_CALLS) | None = None  # type: ignore[valid-type]  # after role
    content: str | bounded_list(TextPart, MAX_CONTENT_PARTS)  # type: ignore[valid-type]
    name: str | None = Field(None, max_length=MAX_MESSAGE_ID_CHARS)
    tool_call_id: str | None = Field(None, max_length=MAX_MESSAGE_ID_CHARS, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _calls_without_content(cls, data: Any) -> Any:
        """An assistant message with tool calls may have ``content`` null or left out ("")."""
        if isinstance(data, dict) and data.get("content") is None and data.get("tool_calls"):
            return {**data, "content": ""}
        return data

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value is not None:  # (null is dropped before: not given)
            raise ValueError("the deprecated function_call is not served; send the call in tool_calls")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        role = info.data.get("role")
        if value is not None and role not in (None, "assistant"):
            raise ValueError(f"applies to assistant messages, not to role {role!r}")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _on_tool_messages_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        """Only on a tool message, and required there, as OpenAI requires it (a 400 naming
        ``messages.N.tool_call_id``). Regression: a tool message without one was accepted and
        rendered as an answer to no call."""
        role = info.data.get("role")  # (declared before: absent when it was bad)
        if value is not None and role not in (None, "tool"):  # as the gRPC API's check_message_ids
            raise ValueError(f"applies to tool messages (role \"tool\"), not to role {role!r}")
        if value is None and role == "tool":
            raise ValueError("required on a tool message (role \"tool\"): the id of the assistant's tool call it "
                             "answers, as OpenAI requires it")
        return value

    def chars(self) -> int:
        """Characters of the message as ``services.chat.content_chars`` counts them, read off the
        model before anything is converted: its content (parts joined with "\n", as ``as_dict``
        joins them), ``name``, ``tool_call_id`` and its calls' ids, names and ``arguments`` as
        given (``ToolCall.chars``; as the gRPC API counts them)."""
        content = len(self.content) if isinstance(self.content, str) else \
            sum(len(p.text) for p in self.content) + max(len(self.content) - 1, 0)
        return content + len(self.name or "") + len(self.tool_call_id or "") + \
            sum(call.chars() for call in self.tool_calls or ())

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it (``convert.chat_message``: ``name`` and
        ``tool_call_id`` when given, as vLLM passes them): a list of text parts is their texts
        joined with "\n", as vLLM joins them (``vllm.entrypoints.chat_utils``,
        ``_parse_chat_message_content_parts``: ``"\n".join(texts)``).

        Regression (oairev20 O1): parts were joined with nothing, so words at part boundaries
        merged ("Hello" + "World" reached the model as "HelloWorld"): another prompt, other
        tokens and other prefix-cache keys than on vLLM.

        Regression (review 25b N3): ``tool_call_id`` was an unsupported field (400) and
        ``name`` was dropped."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message: dict[str, Any] = chat_message(self.role, content, self.name or "", self.tool_call_id or "")
        if self.tool_calls:
            message["tool_calls"] = [call.as_template() for call in self.tool_calls]
        return message


def check_tool_answers(messages: Sequence[ChatMessage], in_session: bool = False) -> None:
    """Each tool message answers a call of an earlier assistant message of ``messages``, when
    any assistant message of them carries ``tool_calls``: the rule both APIs apply to a whole
    request (``services.chat_tools.check_tool_answers``, where it is told), here on a body's
    messages (their roles, call ids and ``tool_call_id`` only: nothing else is converted).
    ``in_session``: the messages are a session turn's (``session_id``), whose tool messages may
    answer calls of the session's earlier turns, which the edge cannot see: its cache node
    checks them against those and the turn's (``services.cache_node_requests``), and this
    checks only the bound below. Regression (F9): a session turn adding assistant calls and
    answering an earlier turn's call, a valid conversation, was a 400.

    The messages' ``tool_calls`` together are at most ``MAX_REQUEST_TOOL_CALLS`` (1,024), the
    gRPC API's bound (review 30j F5: it was gRPC's alone).

    Raises:
        ValueError: worded ``messages.N.tool_call_id: ...`` (``N`` the first such message), or
            ``messages: ...`` for more than ``MAX_REQUEST_TOOL_CALLS`` calls.
    """
    if not any(m.tool_calls for m in messages):
        return
    calls = sum(len(m.tool_calls or ()) for m in messages)
    if calls > MAX_REQUEST_TOOL_CALLS:
        raise ValueError(f"messages: hold {calls} tool calls together; at most {MAX_REQUEST_TOOL_CALLS} are allowed "
                         "in one request")
    if in_session:
        return
    shared_check_tool_answers([{"role": m.role, "tool_call_id": m.tool_call_id,
                                "tool_calls": [{"id": c.id} for c in m.tool_calls or ()]} for m in messages])
