"""Error responses of the OpenAI-compatible edge in OpenAI's shape: a 400 naming the first bad
field of a body (``invalid``, code ``INVALID``), the framework's own refusals (``framework_error``:
404 no such path, 405 wrong method, 413), a gateway refusal worded in a body's terms
(``refusal_about``: ``context_length_exceeded``, ``param``) and the 499 of a client gone
(``_gone``). Refusals of the gateway's path themselves are ``context.CallAborted``.

Part of ``services.openai_api.app`` (which re-exports these names and installs the handlers).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from services.openai_api.context import CallAborted, error_response
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest

_HTTP_ERRORS: dict[int, tuple[str, str]] = {
    404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}
"""The framework's own refusals (no route, wrong method) as OpenAI ``(type, code)``."""

_UNION_TAG = re.compile(r"(?:str|int|float|bool|list|dict|tuple|none|literal|function-\w+)(?:\[.*\])?|[A-Z]\w*")
"""How pydantic names a union's member in an error's location (``str``, ``list[TextPart]``)."""


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """An error location as the client's field path: without ``body`` and union member tags."""
    return tuple(p for p in loc if p != "body" and not (isinstance(p, str) and _UNION_TAG.fullmatch(p)))


INVALID = grpc.StatusCode.INVALID_ARGUMENT.name.lower()
"""Every 400's ``code`` (the schema's, the edge's and the gateway's alike): ``invalid_argument``."""


def invalid(exc: ValidationError | RequestValidationError) -> JSONResponse:
    """A 400 naming the first bad field (pydantic's location, without ``body`` and without a
    union's member tags: ``messages.0.content``, not ``messages.0.content.str``).

    The message is ours, not pydantic's: a validator's ``ValueError`` gives its own text
    (pydantic's "Value error, " prefix dropped), an undeclared field "unsupported field". A
    value no member of a union accepts names what each would take ("Input should be a valid
    string or a valid list"); when one member got further into it, that member's error."""
    errors = exc.errors()
    path = _field_path(errors[0].get("loc", ()))
    same = [e for e in errors if _field_path(e.get("loc", ()))[: len(path)] == path]
    first = max(same, key=lambda e: len(_field_path(e.get("loc", ()))))  # the deepest: the closest match
    field = ".".join(str(p) for p in _field_path(first.get("loc", ()))) or "body"
    kind, raised = first.get("type"), first.get("ctx", {}).get("error")
    if kind == "extra_forbidden":
        message = "unsupported field"
    elif kind in ("value_error", "assertion_error") and raised is not None:
        message = str(raised)
    else:
        message = first.get("msg", "invalid")
        alike = [e["msg"] for e in same if _field_path(e.get("loc", ())) == _field_path(first.get("loc", ()))]
        if len(alike) > 1 and all(m.startswith("Input should be ") for m in alike):
            message = "Input should be " + " or ".join(m.removeprefix("Input should be ") for m in alike)
    return error_response(400, f"{field}: {message}", "invalid_request_error", INVALID, param=field)


MAX_SHOWN_PATH = 256
"""Characters of a request's path that a 404 / 405 message echoes."""


def _shown(path: str) -> str:
    """``path`` as an error message shows it: its first ``MAX_SHOWN_PATH`` characters, and how
    long it was past them."""
    if len(path) <= MAX_SHOWN_PATH:
        return path
    return f"{path[:MAX_SHOWN_PATH]}... ({len(path)} characters)"


def framework_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own HTTP errors (404 no such path, 405 wrong method, ...) in OpenAI's shape,
    keeping their headers (405's ``Allow``). The path they echo is cut to ``MAX_SHOWN_PATH``
    characters (review 27a, F2: a 404 echoed up to 64 KiB of it, so a few unread pipelined
    requests filled the server's buffers)."""
    kind, code = _HTTP_ERRORS.get(exc.status_code, ("invalid_request_error", None))
    if exc.status_code == 404:
        message = f"no such endpoint: {_shown(request.url.path)}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {_shown(request.url.path)}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, kind, code, dict(exc.headers or {}))


def refusal_about(exc: CallAborted, body: ChatCompletionRequest | CompletionRequest) -> CallAborted:
    """``exc`` with what it is about in ``body``'s terms: a refusal for size as OpenAI's
    ``context_length_exceeded`` naming the field at fault (``CallAborted.about_context``: the
    ``max_tokens`` or ``max_completion_tokens`` the client sent, else "messages" / "prompt";
    a chat's saying "messages" where the gateway said "prompt"),
    another 400 naming the field its message starts with (``CallAborted.naming``); the node's
    refusal of a constraint that does not compile ("structured_output regex does not compile:
    ...") names the body's field that gave it (``StructuredFields.constraint_field``), first
    in its message too."""
    sent = [f for f in ("max_completion_tokens", "max_tokens") if f in body.model_fields_set]
    prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    if exc.about_context(prompt_field, sent[0] if sent else None):
        if prompt_field == "messages":  # a chat rendered once for its n choices went as a token
            # prompt (``OpenAIEdge.rendered``): its refusal names the messages, as n 1's does
            exc.message = exc.message.replace(" in the prompt", " in the messages").replace(
                " of the prompt", " of the messages")
    else:
        exc.naming(type(body).model_fields)
        field = body.constraint_path()
        if exc.param is None and field is not None and exc.message.startswith("structured_output"):
            # the node's words name its own field ("structured_output regex does not compile: ..."):
            # the body's path instead ("structured_outputs.regex: regex does not compile: ...")
            exc.param, exc.message = field, f"{field}: {exc.message.removeprefix('structured_output ')}"
    return exc


def field_refusal(exc: ValueError) -> CallAborted:
    """A 400 for ``exc``, a check's ``ValueError`` worded ``<field path>: ...``, with ``param``
    that path (``messages.2.tool_call_id``, ``tokens.5``)."""
    message = str(exc)
    path = message.split(":", 1)[0] if ":" in message else ""
    return CallAborted(grpc.StatusCode.INVALID_ARGUMENT, message,
                       param=path if path and re.fullmatch(r"[A-Za-z0-9_.]+", path) else None)


class ClientGone(Exception):
    """The HTTP client disconnected while its call was being served (answered 499)."""


def edge_status(exc: BaseException) -> str:
    """The gRPC status name of the refusal the HTTP edge answers ``exc`` with, as the gRPC API
    names the same refusal: a ``CallAborted``'s code; INVALID_ARGUMENT for a body the schema
    refuses (400); RESOURCE_EXHAUSTED for one too large (413, as gRPC refuses a message past
    its bound); CANCELLED for a client gone (499); else INTERNAL."""
    if isinstance(exc, CallAborted):
        return exc.code.name
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return grpc.StatusCode.INVALID_ARGUMENT.name
    if isinstance(exc, HTTPException) and exc.status_code == 413:
        return grpc.StatusCode.RESOURCE_EXHAUSTED.name
    if isinstance(exc, (ClientGone, asyncio.CancelledError)):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.INTERNAL.name


def _gone() -> JSONResponse:
    """The answer to a client that went away (nobody reads it): 499, code ``cancelled``."""
    return error_response(499, "the client closed the request", "invalid_request_error", "cancelled")

