"""Reading and parsing a request body at the OpenAI-compatible edge, within bounds: its bytes
(``read_body``: 413 past ``MAX_BODY_BYTES``, its tenant's ``BodyHold`` grown as it arrives),
its JSON structure before it is parsed (``check_body_shape``, ``body_shape``:
``MAX_BODY_VALUES``, ``MAX_BODY_STRINGS``), and the JSON itself (``load_json``: UTF-8 text, no
lone surrogates). Bodies past ``OFF_LOOP_BYTES`` are parsed on a worker thread
(``OpenAIEdge.parse``).

Part of ``services.openai_api.app`` (which re-exports these names).
"""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
from fastapi import Request
from starlette.exceptions import HTTPException

from services.chat_tools import json_shape
from services.convert import MAX_PROMPT_TOKEN_IDS
from services.openai_api.context import BodyHold, CallAborted

MAX_BODY_BYTES = 8 << 20
"""Largest request body read (bytes): the largest valid request, ``MAX_PROMPT_CHARS`` of text
each JSON-escaped to ``\\uXXXX``, is ~6 MiB. Regression: bodies were read and parsed whole,
whatever their size: a 48 MB body held the gateway's event loop, which serves every tenant's
gRPC and HTTP calls, for 3.9 s, at ~10x its size in memory."""

OFF_LOOP_BYTES = 256 << 10
"""Bodies above this many bytes are parsed and validated on a worker thread, one at a time
per tenant (``InferenceServicer.off_loop``)."""

MAX_BODY_VALUES = MAX_PROMPT_TOKEN_IDS + (1 << 16)
"""Most JSON values (array elements, object members) outside strings a body may hold: the
longest token-id prompt and room for every other field."""

MAX_BODY_STRINGS = 1 << 16
"""Most JSON strings a body may hold (keys included): 1,024 messages of a few parts each."""


def check_body_shape(data: bytes) -> None:
    """Refuse (400) a body holding more JSON values or strings than ``MAX_BODY_VALUES`` /
    ``MAX_BODY_STRINGS``, before ``json.loads`` builds them: byte scans at memcpy speed
    (escaped backslashes and quotes dropped, quotes counted, separators counted outside the
    strings). Long text costs nothing here: only structure counts.

    Regression (security review): parsing "off the loop" on a thread still held the GIL
    (``json.loads`` and pydantic never release it), so one 8 MiB body of 4.2M token ids froze
    the gateway's event loop (every tenant's streams) ~0.3-0.9 s, four at once 1.6 s, before
    the prompt's 131,072-id bound refused it."""
    if data.count(b",") < MAX_BODY_VALUES and data.count(b'"') <= 2 * MAX_BODY_STRINGS:
        return  # upper bounds of both (commas and quotes in strings included) are within
    strings, separators = body_shape(data, 2 * MAX_BODY_STRINGS)
    if strings > MAX_BODY_STRINGS:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_STRINGS} JSON strings; no valid request does")
    if separators >= MAX_BODY_VALUES:
        raise CallAborted(grpc.StatusCode.INVALID_ARGUMENT,
                          f"body: holds more than {MAX_BODY_VALUES} JSON values; no valid request does")


def body_shape(data: bytes, max_quotes: int) -> tuple[int, int]:
    """(JSON strings, value separators ``,`` outside strings) of a JSON text; past
    ``max_quotes`` quotes the separators are not counted (0). For JSON, the separators are
    the sum over arrays and objects of their length less one (``chat_tools.json_shape``, which
    bounds tool calls' arguments too)."""
    strings, separators, _ = json_shape(data, max_quotes)
    return strings, separators

_LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_body(request: Request, limit: int, hold: BodyHold | None = None) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed ``limit`` bytes
    (its ``Content-Length``, else the bytes received so far): nothing larger is buffered.

    ``hold`` (its tenant's ``BodyBudget``) is grown to the ``Content-Length`` before a byte is
    read, and to the bytes received when more arrive (a chunked body); past the budget
    ``BodyHold.grow_to`` raises ``CallAborted`` (429/503), and the caller releases the hold."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"the request body has {int(declared)} bytes; at most {limit} are accepted")
    if hold is not None and declared.isdigit():
        hold.grow_to(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the request body exceeds {limit} bytes")
        if hold is not None:
            hold.grow_to(size)
        chunks.append(chunk)
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

