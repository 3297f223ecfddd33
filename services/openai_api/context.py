"""The HTTP side of the gateway's shared call path: a call context shaped like gRPC's
``ServicerContext`` (what ``services.auth.Authenticator`` and ``InferenceServicer.generate``
use of it), and the mapping of gRPC statuses to OpenAI's HTTP errors.

``abort`` raises ``CallAborted`` carrying the gRPC status, its message and the
``retry-after-ms`` trailer when one was set, so the HTTP API answers every refusal the gRPC
API makes, in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``, its
``code`` OpenAI's where OpenAI has one (``invalid_api_key`` for UNAUTHENTICATED,
``model_not_found``, ``context_length_exceeded``: ``CallAborted.about_context``), else the
gRPC status in lower case (other 400s are ``invalid_argument``; ``param`` names the body field
a 400 is about, ``CallAborted.param``). Every 409 is ``invalid_request_error``, OpenAI's type for
a client's error (it has none for a conflict: its client tells a 409 by status), its code saying
which conflict (``already_exists``: a request id in flight; ``aborted``: a session busy or its
history gone, a deleted tenant's request):

=====================  ====  ==========================
gRPC status            HTTP  OpenAI ``error.type``
=====================  ====  ==========================
INVALID_ARGUMENT       400   invalid_request_error
FAILED_PRECONDITION    400   invalid_request_error (a session turn under another namespace than its session's)
ALREADY_EXISTS         409   invalid_request_error
UNAUTHENTICATED        401   authentication_error
PERMISSION_DENIED      403   permission_error
NOT_FOUND              404   not_found_error
ABORTED                409   invalid_request_error (a session turn whose history is gone, or whose session is busy)
RESOURCE_EXHAUSTED     429   rate_limit_error (+ ``Retry-After`` seconds, rounded up)
UNAVAILABLE            503   service_unavailable
DEADLINE_EXCEEDED      504   timeout
DATA_LOSS              500   internal_error (the tenant store corrupt: ``services.store_failures``)
others                 500   internal_error
=====================  ====  ==========================

A key check the tenant store fails is the server's trouble, never a 4xx: 503 with
``Retry-After`` while a retry may help (busy, locked, its disk full or failing), 500 when it
cannot (corrupt), as the gRPC API's status and ``retry-after-ms`` (``services.store_failures``).

A refusal that retrying cannot fix (``CallAborted.retryable`` false: a session cap, a lost
session's history, a session turn under another namespace, a deleted tenant's request, a failed
step, a corrupt tenant store) carries ``x-should-retry: false``, which the official
``openai`` client obeys instead of retrying its 409s, 429s and 5xx; a 429 or 503 with
``Retry-After`` stays retryable.

Also the bound on request-body bytes being read, per tenant and in all (``BodyBudget``), and
the limits of whole-response bytes being written (``BodyLimits``; ``response_budget``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse

from services.peers import grpc_peer

_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ABORTED: (409, "invalid_request_error"),  # as ALREADY_EXISTS's: OpenAI has no conflict type
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.DATA_LOSS: (500, "internal_error"),
}


_OPENAI_CODES = {grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key"}
"""OpenAI's ``error.code`` for a gRPC status, where it has one of its own."""

_CONTEXT_OVERFLOW = re.compile(
    r"This model's maximum context length is"
    r"|prompt has \d+ tokens; the (?:model context is|KV pool holds)"
    r"|prompt \(\d+(?: tokens)?\) \+ max_tokens \(\d+\) (?:exceeds the tenant's max_context_tokens|needs \d+ tokens)"
    r"|the request can never fit this node's KV pool"
    r"|[^:'\"]{1,80}: \d+ characters can never fit in \d+ tokens")
"""How the gateway's and the nodes' INVALID_ARGUMENT refusals for size start (prompt, or prompt
+ max_tokens, past the context limit or a node's KV pool; text that can never fit), matched at
the start only: a refusal of another kind that quotes the client's text (a policy spec, a
session id) never reads as one (review of 6b09071, L1: a policy named "KV pool" was refused
``context_length_exceeded`` with param "messages")."""

_ABOUT_COMPLETION = re.compile(r"max_tokens|max_completion_tokens|completion", re.IGNORECASE)
"""A size refusal that counts the tokens asked for (not the prompt's alone)."""

_PERMANENT = re.compile(r"CloseSession|max_sessions_per_tenant|max_session_text_chars_per_tenant|history was lost"
                        r"|tenant was deleted")
"""Refusals (429, 409) only closing sessions can end: the tenant's session cap
(``too_many_sessions``), its kept session text on a node, a session whose history was lost
with its node (``session_lost``); and a request ended because its tenant was deleted (409,
ABORTED: a retry gets 401)."""

_GATEWAY_GONE = "the gateway that sent this request is gone"
"""The scheduler's ``gateway_gone`` refusal (503): it stands while this gateway runs."""

CONTEXT_LENGTH_PHRASE = "This model's maximum context length is"
"""How OpenAI and vLLM start a context-overflow message; clients such as LiteLLM look for it."""


class CallAborted(Exception):
    """A refusal of one HTTP call, with the gRPC status the gRPC API would have given it.

    Attributes:
        code: the gRPC status.
        message: what went wrong, for the client.
        retry_after_ms: the ``retry-after-ms`` trailer (RESOURCE_EXHAUSTED), None without one.
        param: the request field the error is about (OpenAI's ``error.param``), None: none.
        close: the response closes the connection (``Connection: close``): a refusal sent before
            the request's body was read, whose bytes the connection would otherwise still carry.
        error_code: OpenAI's ``error.code`` when it is not the status's (``model_not_found``,
            ``context_length_exceeded``), None: the status's.
        kind: OpenAI's ``error.type`` when it is not the status's, None: the status's.
    """

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                 param: str | None = None, close: bool = False, error_code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_ms, self.param = code, message, retry_after_ms, param
        self.close, self.error_code, self.kind = close, error_code, kind

    @property
    def retryable(self) -> bool:
        """A retry of the same request may succeed: false for a session cap or a lost session's
        history (only a CloseSession helps), for a session turn after its tenant moved to another
        namespace (FAILED_PRECONDITION: the same), for a request its tenant's deletion ended,
        for a step that failed on the node (INTERNAL: a retry runs it again), for data lost
        (DATA_LOSS: a corrupt tenant store, which only its restore mends) and for a gateway
        the scheduler counts as gone (``gateway_gone``); true for any refusal with
        ``retry_after_ms``. Regression (s41): a corrupt store's 500 was retried by the ``openai``
        client (twice, by default)."""
        if self.retry_after_ms is not None:
            return True
        if self.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS) or (
                self.code == grpc.StatusCode.UNAVAILABLE and self.message.startswith(_GATEWAY_GONE)):
            return False
        return not (self.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED)
                    and _PERMANENT.search(self.message))

    def about_context(self, prompt_field: str, tokens_field: str | None) -> bool:
        """Mark an INVALID_ARGUMENT refusal for size (``_CONTEXT_OVERFLOW``) as OpenAI marks
        context overflow: code ``context_length_exceeded``, the message starting "This model's
        maximum context length is" when it does not say so already, and ``param`` the field
        at fault: ``tokens_field`` (the ``max_tokens`` or ``max_completion_tokens`` the client
        sent, None: it sent none) when the refusal counts the tokens asked for, else
        ``prompt_field`` ("messages" or "prompt"). True when it was such a refusal.

        Regression (oairev20 O4): these were ``invalid_argument`` with ``param`` null and the
        gateway's wording, so LiteLLM's context-window handling (and code checking
        ``context_length_exceeded``) never recognised them."""
        if self.code != grpc.StatusCode.INVALID_ARGUMENT or not _CONTEXT_OVERFLOW.match(self.message):
            return False
        self.error_code = "context_length_exceeded"
        if "maximum context length" not in self.message:
            self.message = f"{CONTEXT_LENGTH_PHRASE} exceeded: {self.message}"
        counts_completion = tokens_field is not None and _ABOUT_COMPLETION.search(self.message)
        self.param = tokens_field if counts_completion else prompt_field
        return True

    def naming(self, fields: Collection[str]) -> CallAborted:
        """This refusal with ``param`` set, when it is INVALID_ARGUMENT and its message starts
        with the name of one of ``fields`` (``named_field``)."""
        if self.param is None and self.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.param = named_field(self.message, fields)
        return self

    def response(self) -> JSONResponse:
        """The OpenAI-shaped error response (``Retry-After`` in whole seconds, rounded up;
        ``x-should-retry: false`` when not ``retryable``)."""
        status, kind = _HTTP.get(self.code, (500, "internal_error"))
        headers = {} if self.retryable else {"x-should-retry": "false"}
        if self.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
            headers["retry-after-ms"] = str(self.retry_after_ms)
        if self.close:
            headers["Connection"] = "close"
        code = self.error_code or _OPENAI_CODES.get(self.code) or self.code.name.lower()
        return error_response(status, self.message, self.kind or kind, code, headers, self.param)


_LEADING_FIELD = re.compile(r"([a-z_][a-z0-9_]*)((?:\.[A-Za-z0-9_]+)*)(?::|=|\s+(?:must|is|applies|needs)\b)")
"""A message about a field starts with its name or its path: ``n: only 1 ...`` (the edge's
own), ``priority must be in ...``, ``prefix_tokens applies to ...`` (the gateway's),
``messages.0.tool_call_id: ...`` (the node's check of a session turn, trial 29k P2)."""


def named_field(message: str, fields: Collection[str]) -> str | None:
    """The field among ``fields`` that ``message`` starts by naming, None when it names none."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) + match.group(2) if match and match.group(1) in fields else None


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
        self._peer = grpc_peer(client.host, client.port) if client is not None else ""
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


@dataclass(frozen=True)
class BodyLimits:
    """Bytes of request bodies the HTTP API may hold while they are read and parsed, and of whole
    response bodies while they are written (``response_budget.ResponseBudget``).

    Attributes:
        per_tenant_bytes: of one tenant's requests (4 bodies of the largest size by default).
        total_bytes: of all tenants' requests at this gateway.
        retry_after_ms: the ``Retry-After`` of a refusal.
        response_bytes_per_tenant: of one tenant's whole (non-streamed) responses handed to
            their connections and not yet written out (3 of the largest with log
            probabilities, ~19 MB each, by default).
    """

    per_tenant_bytes: int = 32 << 20
    total_bytes: int = 256 << 20
    retry_after_ms: int = 1000
    response_bytes_per_tenant: int = 64 << 20

    @classmethod
    def of(cls, config: Any) -> BodyLimits:
        """The limits a ``ServiceConfig`` sets (``http_max_body_bytes_per_tenant``,
        ``http_max_body_bytes_total``, ``http_max_response_bytes_per_tenant``)."""
        return cls(config.http_max_body_bytes_per_tenant, config.http_max_body_bytes_total,
                   response_bytes_per_tenant=config.http_max_response_bytes_per_tenant)

    def __post_init__(self) -> None:
        for name in ("per_tenant_bytes", "total_bytes", "retry_after_ms", "response_bytes_per_tenant"):
            if not getattr(self, name) > 0:
                raise ValueError(f"BodyLimits.{name} must be > 0, got {getattr(self, name)!r}")


class BodyBudget:
    """The request-body bytes held by tenant and in all (``BodyLimits``): each request holds its
    ``Content-Length`` from the moment its API key passes, before a byte of its body is read (a
    chunked body: the bytes received so far), until its body has been parsed or the request
    ended any other way (``BodyHold.release``).

    Regression (secrev19 H1): bodies were read whole (up to 8 MiB each) after the key check with
    nothing counting them: one tenant's 64 connections each withholding its body's last byte
    grew the gateway's RSS by 514 MB (2 GiB per address at the 256-connection cap, 32 GiB at the
    global cap). Now a body that would take its tenant past ``per_tenant_bytes`` is refused 429,
    one that would take the gateway past ``total_bytes`` 503, both with ``Retry-After``, before
    it is read (the same 64 connections: +36 MB).
    """

    def __init__(self, limits: BodyLimits | None = None) -> None:
        self.limits = limits or BodyLimits()
        self.total = 0
        self.per_tenant: Counter[str] = Counter()

    def hold(self, tenant_id: str) -> BodyHold:
        """An empty hold of ``tenant_id``'s, to grow as its body's size becomes known."""
        return BodyHold(self, tenant_id)

    def check_integrity(self) -> None:
        """Holds add up: the total is the sum of the tenants' and none is negative."""
        if self.total != sum(self.per_tenant.values()) or any(n <= 0 for n in self.per_tenant.values()):
            raise AssertionError(f"body budget out of balance: total {self.total}, tenants {dict(self.per_tenant)}")


class BodyHold:
    """One request's bytes in a ``BodyBudget``."""

    def __init__(self, budget: BodyBudget, tenant_id: str) -> None:
        self.budget, self.tenant_id, self.held = budget, tenant_id, 0

    def grow_to(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all (no change when it holds as many already).

        Raises:
            CallAborted: RESOURCE_EXHAUSTED (429) past the tenant's bytes, UNAVAILABLE (503) past
                the gateway's, with ``retry_after_ms`` and ``close``; what it held stays held.
        """
        more = nbytes - self.held
        if more <= 0:
            return
        budget, limits = self.budget, self.budget.limits
        if budget.per_tenant[self.tenant_id] + more > limits.per_tenant_bytes:
            raise CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"body: this tenant's request bodies being read would pass "
                              f"{limits.per_tenant_bytes} bytes at this gateway; retry later",
                              limits.retry_after_ms, close=True)
        if budget.total + more > limits.total_bytes:
            raise CallAborted(grpc.StatusCode.UNAVAILABLE,
                              f"body: request bodies being read would pass {limits.total_bytes} bytes "
                              f"at this gateway; retry later", limits.retry_after_ms, close=True)
        budget.per_tenant[self.tenant_id] += more
        budget.total += more
        self.held = nbytes

    def release(self) -> None:
        """Give back what it holds (again: nothing)."""
        if self.held:
            budget = self.budget
            budget.per_tenant[self.tenant_id] -= self.held
            if budget.per_tenant[self.tenant_id] <= 0:
                del budget.per_tenant[self.tenant_id]
            budget.total -= self.held
            self.held = 0
