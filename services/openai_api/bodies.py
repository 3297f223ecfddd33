"""Reading and parsing a request body at the OpenAI-compatible edge, within bounds: its bytes
(``read_body``: 413 past ``MAX_BODY_BYTES``, its tenant's ``BodyHold`` grown as it arrives),
its JSON structure before it is parsed (``check_body_shape``, ``body_shape``:
``MAX_BODY_VALUES``, ``MAX_BODY_STRINGS``, ``MAX_BODY_DEPTH``), and the JSON itself
(``load_json``: UTF-8 text, no lone surrogates). Bodies past ``OFF_LOOP_BYTES`` bytes or
``OFF_LOOP_VALUES`` values are parsed on a worker thread, every body on its tenant's one turn
(``OpenAIEdge.parse``).

Part of ``services.openai_api.app`` (which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import grpc
from fastapi import Request
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from services.chat_tools import MAX_TOOL_DEPTH
from services.convert import MAX_PROMPT_TOKEN_IDS
from services.openai_api.context import BodyHold, CallAborted
from services.openai_api.errors import ClientGone

MAX_BODY_BYTES = 8 << 20
"""Largest request body read (bytes): the largest valid request, ``MAX_PROMPT_CHARS`` of text
each JSON-escaped to ``\\uXXXX``, is ~6 MiB. Regression: bodies were read and parsed whole,
whatever their size: a 48 MB body held the gateway's event loop, which serves every tenant's
gRPC and HTTP calls, for 3.9 s, at ~10x its size in memory."""

OFF_LOOP_BYTES = 256 << 10
"""Bodies above this many bytes are checked, parsed and validated on a worker thread, one at a
time per tenant (``OpenAIEdge.turn``, ``InferenceServicer.off_loop``); so are smaller ones
past ``OFF_LOOP_VALUES``."""

MAX_BODY_VALUES = MAX_PROMPT_TOKEN_IDS + (1 << 16)
"""Most JSON values (array elements, object members) and containers (arrays, objects) outside
strings a body may hold together: the longest token-id prompt and room for every other field."""

MAX_BODY_STRINGS = 1 << 16
"""Most JSON strings a body may hold (keys included): 1,024 messages of a few parts each."""

MAX_BODY_DEPTH = MAX_TOOL_DEPTH + 8
"""Deepest nesting of arrays and objects a body may hold (72 levels, the body's own object the
first); a deeper one is refused before ``json.loads`` (``check_body_shape``). The deepest JSON
of a valid request is a JSON schema (a tool's ``parameters``, ``response_format``'s,
``structured_outputs``' or ``guided_json``'s schema), at most ``MAX_SCHEMA_DEPTH`` (32) levels
deep, under at most 4 levels of the body's (the body, ``tools``, a tool, its ``function``):
36. The bound is that of the gateway's wire on a request's tools JSON (``MAX_TOOL_DEPTH``, 64)
and the body's envelope, so nothing is refused for depth here that a schema check would take.
Regression (review s35 E F1): bodies ~900 deep (``json.loads`` refused only past ~1,000) were
parsed."""

OFF_LOOP_VALUES = 1024
"""Bodies counted (``check_body_shape``) past this many JSON values and containers are parsed
and validated on a worker thread, however few their bytes (``OpenAIEdge.parsed``): ~0.5-3 us
each with the GIL held (floats, nested empty arrays and their garbage collection the dearest),
so a parse on the event loop costs at most a few ms. Regression (review s35 E F2): bodies of
at most ``OFF_LOOP_BYTES`` were parsed on the loop whatever they held, 50-120 ms each for
255 KiB of ``[[]]`` or floats."""

_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


@dataclasses.dataclass(frozen=True)
class BodyShape:
    """A JSON text's structure counted before it is parsed (``body_shape``): its strings (keys
    included), value separators ``,`` and containers (``[`` ``{``) outside the strings, and the
    deepest nesting of its containers (past the bound it was counted to, that bound + 1)."""

    strings: int
    separators: int
    containers: int
    depth: int

    @property
    def values(self) -> int:
        """Separators and containers: what ``MAX_BODY_VALUES`` bounds (an upper bound of the
        values less one, plus one per array or object ``json.loads`` builds)."""
        return self.separators + self.containers


def check_body_shape(data: bytes) -> int:
    """Refuse (400, ``CallAborted`` INVALID_ARGUMENT naming the bound) a body holding more JSON
    strings than ``MAX_BODY_STRINGS``, more values and containers together than
    ``MAX_BODY_VALUES`` or nesting deeper than ``MAX_BODY_DEPTH``, before ``json.loads`` builds
    them: byte scans at memcpy speed (``body_shape``), a few ms for 8 MiB. Long text costs
    nothing here: only structure counts. Returns the body's values and containers, at most
    (an upper bound: commas and brackets in strings may be counted), which decides where it is
    parsed (``OFF_LOOP_VALUES``).

    Regressions (security reviews): parsing "off the loop" on a thread still held the GIL
    (``json.loads`` and pydantic never release it), so one 8 MiB body of 4.2M token ids froze
    the gateway's event loop (every tenant's streams) ~0.3-0.9 s, four at once 1.6 s, before
    the prompt's 131,072-id bound refused it. Containers were not counted (review s35 E F1):
    an 8 MiB body of 4.2M nested empty arrays (``[[[...]]]``, 4,657 commas) passed, and its
    ``json.loads`` held the GIL 2.4-3.8 s and took ~420 MB."""
    brackets = data.count(b"[") + data.count(b"{")
    upper = data.count(b",") + brackets
    if upper < MAX_BODY_VALUES and data.count(b'"') <= 2 * MAX_BODY_STRINGS and brackets <= MAX_BODY_DEPTH:
        return upper  # upper bounds (commas, quotes and brackets in strings included) are within
    shape = body_shape(data, 2 * MAX_BODY_STRINGS, MAX_BODY_DEPTH)
    if shape.strings > MAX_BODY_STRINGS:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_STRINGS} JSON strings; no valid request does")
    if shape.values >= MAX_BODY_VALUES:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_VALUES} JSON values and containers (array elements, "
                          "object members, arrays, objects); no valid request does")
    if shape.depth > MAX_BODY_DEPTH:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: nests arrays and objects more than {MAX_BODY_DEPTH} levels deep; no valid "
                          "request does")
    return shape.values


def body_shape(data: bytes, max_quotes: int, max_depth: int = MAX_BODY_DEPTH) -> BodyShape:
    """The structure of a JSON text (``BodyShape``), counted as ``chat_tools.json_shape`` counts
    it (which bounds tool calls' arguments too), and its depth. Past ``max_quotes`` quotes only
    the strings are counted (the rest 0), so the cost stays linear in the text; past
    ``MAX_BODY_VALUES`` containers the depth is not measured (0); past ``max_depth`` it is
    ``max_depth`` + 1. For JSON, the separators are
    the sum over arrays and objects of their length less one. Text that is no JSON gets counts
    of the same characters (no error; unbalanced brackets: the depth of what balances).

    The depth: the brackets outside strings (``{`` ``}`` as ``[`` ``]``), each pass dropping
    every innermost pair ``[]`` (every array or object holding none), which makes a balanced
    text exactly one level shallower; at most ``max_depth`` + 1 passes, each a scan."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    quotes = plain.count(b'"')
    if quotes > max_quotes:
        return BodyShape(quotes // 2, 0, 0, 0)
    outside = b"".join(plain.split(b'"')[::2]) if quotes else plain
    brackets = outside.translate(_BRACKETS, _NOT_BRACKETS)
    containers = brackets.count(b"[")
    if containers >= MAX_BODY_VALUES:
        return BodyShape(quotes // 2, outside.count(b","), containers, 0)
    depth = 0
    while brackets and depth <= max_depth:
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):
            break  # unbalanced: not JSON (json.loads refuses it)
        brackets, depth = inner, depth + 1
    return BodyShape(quotes // 2, outside.count(b","), containers, depth)

_LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_body(request: Request, limit: int, hold: BodyHold | None = None) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed ``limit`` bytes
    (its ``Content-Length``, else the bytes received so far): nothing larger is buffered.

    Raises ``ClientGone`` (answered 499, counted CANCELLED) when the client goes before its body
    is whole: a ``Content-Length`` or chunked body ending early. Regression (s41 HTTP fuzz):
    starlette's ``ClientDisconnect`` reached the app's catch-all, logged with its traceback as
    an internal error (an incident, counted INTERNAL) for a client's fault.

    ``hold`` (its tenant's ``BodyBudget``) is grown to the ``Content-Length`` before a byte is
    read, and to the bytes received when more arrive (a chunked body); past the budget
    ``BodyHold.grow_to`` raises ``CallAborted`` (429/503), and the caller releases the hold."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the request body has {int(declared)} bytes; at most {limit} are accepted")
    if hold is not None and declared.isdigit():
        hold.grow_to(int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"the request body exceeds {limit} bytes")
            if hold is not None:
                hold.grow_to(size)
            chunks.append(chunk)
    except ClientDisconnect:  # the body ended early: the client closed its side (or the connection)
        raise ClientGone from None
    return b"".join(chunks)


def load_json(data: bytes) -> Any:
    """A body as JSON; a 400 (``CallAborted``) when it is not UTF-8 JSON (too deeply nested
    included), or when a string in it holds a lone UTF-16 surrogate (``"\\ud800"``: valid JSON,
    but no UTF-8 text; regression: it reached msgpack and the block hashes and raised there,
    a plain-text 500)."""
    try:
        text = data.decode("utf-8")
        raw = json.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT, "body: not valid JSON (UTF-8)") from None
    if _LONE_SURROGATE.search(text):
        try:
            json.dumps(raw, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                              "body: a string holds a lone UTF-16 surrogate escape (not UTF-8 text)") from None
    return raw

