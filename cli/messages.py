"""``kvstrata generate --messages`` / ``--tool-result``: the chat a ``generate`` call sends, so
that a tool call's result can be sent back and the tool-calling loop completed from the CLI.

A call's messages are, in this order: those of ``--messages`` (an OpenAI-style messages list,
e.g. the conversation so far with the assistant message holding ``tool_calls``), one ``tool``
message per ``--tool-result ID=TEXT`` (``{"role": "tool", "tool_call_id": ID, "content": TEXT}``),
and the PROMPT as a ``user`` message. In a ``--session`` the node keeps the history, the
model's tool calls included (with the ids ``generate`` printed), so the next turn needs only the
results: ``kvstrata generate --session S --tools ... --tool-result ID=TEXT``.

Everything is checked here as the gateway checks it (``services.convert.chat_messages_to_pb``;
a ``--session`` turn's with ``in_session``, as the gateway converts a turn with a
``session_id``), and a refusal names the option that gave the message (``--messages``,
``--tool-result``, PROMPT), not its index in the wire's ``chat.messages``; so does a refusal of
the gateway (``ChatSources.reword``). A session turn's tool results may answer calls of the
session's earlier turns, which only its node holds: they are matched there, against those and
the turn's own (``services.cache_node_requests.check_turn_tool_answers``), and an id no call
had comes back as the node's INVALID_ARGUMENT naming the ``--tool-result`` (or ``--messages[i]``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import typer

from cli.constraints import FILE_PREFIX, spec_text
from kvstrata.v1 import inference_pb2
from services.convert import MAX_PROMPT_CHARS, chat_messages_to_pb
from services.grpc_messages import DEFAULT_MAX_MESSAGE_BYTES

MAX_MESSAGES_BYTES = DEFAULT_MAX_MESSAGE_BYTES
"""Most bytes of a ``--messages`` file (8 MiB): a gateway's default gRPC message bound, past
which it could not take the request anyway (the messages' text is bounded by
``MAX_PROMPT_CHARS`` characters, checked after reading)."""

MAX_TOOL_RESULT_BYTES = 4 * MAX_PROMPT_CHARS
"""Most bytes of a ``--tool-result ID=@FILE`` file: ``MAX_PROMPT_CHARS`` characters of UTF-8 at
most 4 bytes each (the whole chat's characters are bounded by that too)."""

_MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")
_WIRE_INDEX = re.compile(r"\bchat\.messages\[(\d+)\](\.tool_call_id|\.content)?")


def _bad(message: str, option: str = "--messages") -> typer.BadParameter:
    """A usage error (exit 2) naming ``option``, as click names its own: ``Invalid value for
    '--messages': ...``."""
    return typer.BadParameter(message, param_hint=f"'{option}'")


def _content(where: str, content: Any) -> str | None:
    """A message's ``content`` as text: a string, null (an assistant message holding
    ``tool_calls``), or a list of ``{"type": "text", "text": ...}`` parts joined with newlines
    (as the HTTP API and vLLM join them)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise _bad(f"{where}.content must be text, null, or a list of {{\"type\": \"text\", \"text\": ...}} parts")


def messages_from_text(value: str) -> list[dict[str, Any]]:
    """``--messages``' value (its JSON text, or ``@FILE``, at most ``MAX_MESSAGES_BYTES``): an
    OpenAI messages list, ``[{"role", "content", "name"?, "tool_call_id"?, "tool_calls"?}, ...]``,
    ``tool_calls`` in OpenAI's shape (``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``). Only the shape is read here; ``chat`` checks the rest.

    Raises:
        typer.BadParameter: a file that cannot be read or is too large, not JSON (a file's name
            given without ``@`` is told so), not a list, or a message that is no object, has a
            key OpenAI's messages have not, or a ``content`` of another type.
    """
    text = spec_text("'--messages'", value, MAX_MESSAGES_BYTES)
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = f" (a file is given as {FILE_PREFIX}FILE)" if not value.startswith(FILE_PREFIX) else ""
        raise _bad(f"not JSON{hint}: {exc}") from None
    if not isinstance(messages, list):
        raise _bad("must be a JSON list of messages ([{\"role\": \"user\", \"content\": ...}, ...])")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object with a \"role\" and a \"content\"")
        unknown = sorted(set(message) - set(_MESSAGE_KEYS))
        if unknown:
            raise _bad(f"{where} has unknown keys {', '.join(map(repr, unknown))} (it may have "
                       f"{', '.join(_MESSAGE_KEYS)})")
        for key in ("role", "name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise _bad(f"{where}.{key} must be text")
        if not isinstance(message.get("role"), str):
            raise _bad(f"{where} has no \"role\" (system, user, assistant or tool)")
        if "content" not in message and not message.get("tool_calls"):
            raise _bad(f"{where} has no \"content\" (only an assistant message with tool_calls may leave it out)")
        if not isinstance(message.get("tool_calls") or [], list):
            raise _bad(f"{where}.tool_calls must be a list of tool calls")
        named = {k: v for k, v in message.items() if v is not None or k == "content"}  # null name: none given
        out.append({**named, "content": _content(where, message.get("content"))})
    return out


def tool_results(values: list[str]) -> list[dict[str, Any]]:
    """``--tool-result ID=TEXT`` values (``ID=@FILE``: the result is the file's text) as OpenAI
    ``tool`` messages, ``{"role": "tool", "tool_call_id": ID, "content": TEXT}``, in order.

    Raises:
        typer.BadParameter: a value without ``=`` or with an empty ID, an ID given twice, or a
            file that cannot be read or is too large.
    """
    out: list[dict[str, Any]] = []
    for value in values:
        call_id, sep, result = value.partition("=")
        if not sep or not call_id:
            raise _bad(f"expected ID=TEXT (ID: a `tool call ID:` line's id), got {value!r:.80}", "--tool-result")
        if any(m["tool_call_id"] == call_id for m in out):
            raise _bad(f"{call_id!r:.80} is given twice", "--tool-result")
        out.append({"role": "tool", "tool_call_id": call_id,
                    "content": spec_text("'--tool-result'", result, MAX_TOOL_RESULT_BYTES)})
    return out


@dataclass(frozen=True)
class ChatSources:
    """Which option gave each message of a request's ``chat.messages`` (by index), to word a
    refusal about one of them in the command's terms."""

    names: tuple[tuple[str, str], ...]
    """(option, its message's name) per wire message: ``("--messages", "--messages[2]")``,
    ``("--tool-result", "--tool-result call_1")``, ``("PROMPT", "PROMPT")``."""

    def reword(self, text: str) -> tuple[str, str | None]:
        """(``text`` with its first ``chat.messages[i]`` written as the option's message, the
        option), or (``text``, None) when it names no message of the request. A tool result's
        ``tool_call_id`` is its ``ID``, its ``content`` its ``TEXT``; PROMPT's content is PROMPT."""
        match = _WIRE_INDEX.search(text)
        if match is None or int(match[1]) >= len(self.names):
            return text, None
        option, name = self.names[int(match[1])]
        field = match[2] or ""
        if option == "--tool-result":
            field = {".tool_call_id": " (its ID)", ".content": " (its TEXT)"}.get(field, field)
        elif option == "PROMPT" and field == ".content":
            field = ""
        return f"{text[:match.start()]}{name}{field}{text[match.end():]}", option


def chat(prompt: str | None, messages: list[dict[str, Any]], results: list[dict[str, Any]],
         session: str) -> tuple[inference_pb2.ChatMessages, ChatSources]:
    """The request's chat: ``messages`` (``--messages``), ``results`` (``--tool-result``), then
    ``prompt`` as a user message (None: none), checked as the gateway checks a chat
    (``chat_messages_to_pb``; ``session`` non-empty: as a session turn, ``in_session``), with
    which option gave each message.

    In a ``session`` the tool messages' ids are not matched here: a turn may answer a call of
    an earlier turn, which only the session's node holds, and add calls of its own (regression:
    such a turn, a valid conversation the gateway serves, was refused here, its ID "no tool
    call of --messages"). The node matches them against the session's kept calls and the
    turn's (a first turn's against its own) and refuses an unknown one INVALID_ARGUMENT, which
    ``generate`` words with ``ChatSources.reword`` (exit 1).

    Raises:
        typer.BadParameter: nothing to send (no PROMPT, ``--messages`` or ``--tool-result``);
            ``--tool-result`` with neither ``--session`` nor ``--messages`` (no call it could
            answer: the model would read a result of nothing); without a ``session``, a result
            whose ID is no call of ``--messages``' assistant messages when they hold any; or a
            message the gateway would refuse (a bad role, name, id or tool call, too many
            messages or characters), each naming its option.
    """
    if prompt is None and not messages and not results:
        raise _bad("give a PROMPT, or --messages or --tool-result to continue a conversation", "PROMPT")
    if results and not messages and not session:
        raise _bad("a tool result answers a call of the conversation: give the --session whose reply made "
                   "the call, or --messages holding the assistant message with its tool_calls", "--tool-result")
    calls = set() if session else {  # (a session turn's results: its node matches them, against all its calls)
        str(c.get("id")) for m in messages for c in (m.get("tool_calls") or ())
        if isinstance(m.get("tool_calls"), list) and isinstance(c, dict)}
    for result in results:
        if calls and result["tool_call_id"] not in calls:
            raise _bad(f"{result['tool_call_id']!r:.80} is no tool call of --messages (their ids: "
                       f"{', '.join(sorted(calls))[:400]})", "--tool-result")
    names = [("--messages", f"--messages[{i}]") for i in range(len(messages))]
    names += [("--tool-result", f"--tool-result {r['tool_call_id']:.80}") for r in results]
    turn = [*messages, *results]
    if prompt is not None:
        turn.append({"role": "user", "content": prompt})
        names.append(("PROMPT", "PROMPT"))
    sources = ChatSources(tuple(names))
    try:
        return chat_messages_to_pb(turn, in_session=bool(session)), sources
    except (ValueError, TypeError) as exc:  # TypeError: a field of the wrong type (protobuf's)
        text, option = sources.reword(str(exc))
        raise _bad(text.replace("chat.messages", "the messages"), option or "--messages, --tool-result, PROMPT") from None
