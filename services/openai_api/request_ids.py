"""The HTTP API's request ids: a client's ``X-Request-Id`` header, when valid, is its request's
id (else one is made), as vLLM takes it (``OpenAIServing._base_request_id``): the gateway,
the scheduler and the nodes know the request by it (scoped to its tenant), the response's
``id`` is built from it (``chatcmpl-<id>``, ``cmpl-<id>``), and every response carries it back
in ``X-Request-Id`` (errors included), as OpenAI's and vLLM's
(``--enable-request-id-headers``) do.

A valid id has 1 to ``MAX_REQUEST_ID_CHARS`` characters of ``[A-Za-z0-9._:-]`` (what trace
and proxy ids use; nothing that could end a header line or read as an id's separator, ``/``
or ``#``); another value is ignored and an id made. A request whose id is in flight already for
its tenant under the same ``cache_salt`` (or none) is refused 409 (the gateway's ALREADY_EXISTS),
as a gRPC call reusing one is; under another salt the id is another request's
(``services.gateway_inputs.request_scope``).

Regression (oairev20 O3): the header was neither read nor sent, and the response's ``id`` was a
fresh uuid that no log, metric or node ever saw.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from services.gateway import MAX_ID_CHARS

HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = min(MAX_ID_CHARS, 128)
_VALID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
SCOPE_KEY = "kvstrata.request_id"
"""Where the request's id is kept in its ASGI scope."""


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` when valid, else a new id (32 hex digits)."""
    for name, value in headers:
        if name.lower() == HEADER.encode():
            text = value.decode("latin-1")
            if _VALID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


def request_id(scope: Any) -> str:
    """The id of the request of ``scope`` (``RequestIds`` sets it; a new one without)."""
    return scope.get(SCOPE_KEY) or uuid.uuid4().hex


class RequestIds:
    """ASGI middleware: gives each HTTP request its id (``request_id_of``) and sends it back in
    the response's ``X-Request-Id`` header."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[SCOPE_KEY] = request_id_of(scope.get("headers", []))

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER.encode(), rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
