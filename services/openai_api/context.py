"""The HTTP side of the gateway's shared call path: a call context shaped like gRPC's
``ServicerContext`` (what ``services.auth.Authenticator`` and ``InferenceServicer.generate``
use of it), and the mapping of gRPC statuses to OpenAI's HTTP errors.

``abort`` raises ``CallAborted`` carrying the gRPC status, its message and the
``retry-after-ms`` trailer when one was set, so the HTTP API answers every refusal the gRPC
API makes, in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, its
``code`` the gRPC status in lower case (every 400 is ``invalid_argument``; ``param`` names the
body field a 400 is about, ``CallAborted.param``):

=====================  ====  ==========================
gRPC status            HTTP  OpenAI ``error.type``
=====================  ====  ==========================
INVALID_ARGUMENT       400   invalid_request_error
ALREADY_EXISTS         409   invalid_request_error
UNAUTHENTICATED        401   authentication_error
PERMISSION_DENIED      403   permission_error
NOT_FOUND              404   not_found_error
ABORTED                409   conflict_error (a session turn whose history is gone)
RESOURCE_EXHAUSTED     429   rate_limit_error (+ ``Retry-After`` seconds, rounded up)
UNAVAILABLE            503   service_unavailable
DEADLINE_EXCEEDED      504   timeout
others                 500   internal_error
=====================  ====  ==========================
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class CallAborted(Exception):
    """A refusal of one HTTP call, with the gRPC status the gRPC API would have given it.

    Attributes:
        code: the gRPC status.
        message: what went wrong, for the client.
        retry_after_ms: the ``retry-after-ms`` trailer (RESOURCE_EXHAUSTED), None without one.
        param: the request field the error is about (OpenAI's ``error.param``), None: none.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_ms, self.param = code, message, retry_after_ms, param

    def naming(self, fields: Collection[str]) -> CallAborted:
        """This refusal with ``param`` set, when it is INVALID_ARGUMENT and its message starts
        with the name of one of ``fields`` (``named_field``)."""
        if self.param is None and self.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.param = named_field(self.message, fields)
        return self

    def response(self) -> JSONResponse:
        """The OpenAI-shaped error response (``Retry-After`` in whole seconds, rounded up)."""
        status, kind = _HTTP.get(self.code, (500, "internal_error"))
        headers = {}
        if self.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
            headers["retry-after-ms"] = str(self.retry_after_ms)
        return error_response(status, self.message, kind, self.code.name.lower(), headers, self.param)


_LEADING_FIELD = re.compile(r"([a-z_][a-z0-9_]*)(?::|=|\s+(?:must|is|applies|needs)\b)")
"""A message about a field starts with its name: ``n: only 1 ...`` (the edge's own),
``priority must be in ...``, ``prefix_tokens applies to ...`` (the gateway's)."""


def named_field(message: str, fields: Collection[str]) -> str | None:
    """The field among ``fields`` that ``message`` starts by naming, None when it names none."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match and match.group(1) in fields else None


def error_response(status: int, message: str, kind: str, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class HttpCallContext:
    """One HTTP request as the gateway's call path sees a gRPC call.

    ``invocation_metadata`` holds its ``authorization`` header; ``peer`` its client address in
    gRPC's form (``ipv4:10.0.0.1:53412``), which the authenticator's per-address failure limit
    keys on; ``abort`` raises ``CallAborted``.
    """

    def __init__(self, request: Request) -> None:
        self._authorization = request.headers.get("authorization", "")
        client = request.client
        self._peer = f"ipv4:{client.host}:{client.port}" if client is not None else ""
        self._retry_after_ms: int | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", self._authorization),)

    def peer(self) -> str:
        return self._peer

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        for key, value in metadata:
            if key == "retry-after-ms":
                self._retry_after_ms = int(value)

    async def send_initial_metadata(self, metadata: Any) -> None:
        """Nothing to send: HTTP headers go with the first event (``app``)."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAborted(code, details, self._retry_after_ms)
