"""The guarded protocol over each of uvicorn's HTTP/1.1 parsers (``guarded_protocol``): how
each reports a request's head and end to ``protocol.Guarded``, and how each bounds the requests a
client pipelines behind the response under way.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl

from services.openai_api.connections import ConnectionGuard
from services.openai_api.protocol import Guarded


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard,
                     tls_context: ssl.SSLContext | None = None) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's ``HttpToolsProtocol`` or ``H11Protocol``) under ``guard``'s bounds;
    with ``tls_context`` it serves HTTPS on plain TCP connections (the server gets no ``ssl``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    attributes = {"guard": guard, "tls_context": tls_context}
    if issubclass(base, H11Protocol):
        return type("GuardedH11Protocol", (_GuardedH11, base), attributes)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    if issubclass(base, HttpToolsProtocol):
        return type("GuardedHttpToolsProtocol", (_GuardedHttpTools, base), attributes)
    raise ValueError(f"no connection guard for the HTTP protocol {base.__name__}")


class _PipelineTooDeep(Exception):
    """Raised in the parser's callback to stop it: one more request than
    ``max_pipelined_requests`` would wait behind the response under way."""


class _PipelineFlow(FlowControl):
    """uvicorn's flow control, reading kept paused while pipelined requests wait: uvicorn resumes
    it whenever a request's app awaits ``receive`` or a response completes, so a client's
    pipelined requests were read and queued without end; here only an empty pipeline resumes
    it (``_GuardedHttpTools.on_response_complete``)."""

    def __init__(self, transport: asyncio.Transport, pipeline: deque[Any]) -> None:
        super().__init__(transport)
        self.pipeline = pipeline

    def resume_reading(self) -> None:
        if not self.pipeline:
            super().resume_reading()


class _GuardedHttpTools(Guarded):
    """httptools reports a request's parts by callback; it parses every request a chunk of bytes
    holds, and uvicorn queues those that arrive while a response is under way (``pipeline``).

    Regression (review 27a, F1): that queue had no bound and uvicorn resumed reading while it
    held requests, and each pipelined request restarted the head's byte count: one keyless
    connection sending 7.6 MiB of ``GET /health`` queued 320,000 requests and grew the process
    by 700 MiB, stalling the loop gRPC shares. Now reading stays paused while a request waits
    (``_PipelineFlow``), and a connection queuing more than ``max_pipelined_requests``, or more
    than ``max_head_bytes`` of them, is closed."""

    pipeline: deque[Any]
    flow: FlowControl
    _too_deep = False

    def _serving(self) -> None:
        self.flow = _PipelineFlow(self.transport, self.pipeline)

    def on_message_begin(self) -> None:
        cycle = self.cycle  # a request beginning now waits unless that one's response is complete
        if cycle is not None and not cycle.response_complete \
                and len(self.pipeline) >= self.guard.limits.max_pipelined_requests:
            self._too_deep = True
            raise _PipelineTooDeep  # the parser stops here and uvicorn calls send_400_response
        if self._phase is None:  # a pipelined request begun in the bytes of the one before
            self._await("head")
        super().on_message_begin()  # type: ignore[misc]

    def send_400_response(self, msg: str) -> None:
        if self._too_deep:  # (a 400 would land inside the response under way)
            self._close("pipeline_too_deep", b"")
            return
        super().send_400_response(msg)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self.flow.resume_reading()  # once the last request waiting has started

    def _unserved_bytes(self) -> int:
        return sum(_request_bytes(cycle) for cycle, _ in self.pipeline)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._head_received()

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._request_received()


def _request_bytes(cycle: Any) -> int:
    """About the bytes a request received and not yet served holds: its target, headers and
    body so far."""
    scope = cycle.scope
    head = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
    return head + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + len(cycle.body)


class _GuardedH11(Guarded):
    """h11 is asked its peer's state after each batch of events. It handles one request at a
    time and keeps the bytes of those pipelined behind it in its buffer, counted here
    (``_unserved_bytes``)."""

    conn: Any

    def _unserved_bytes(self) -> int:
        return len(self.conn.trailing_data[0]) if self.conn.their_state is h11.DONE else 0

    def handle_events(self) -> None:
        super().handle_events()  # type: ignore[misc]
        state = self.conn.their_state
        if state is h11.IDLE:  # bytes of a next request buffered (pipelined): its head is due
            if self.conn.trailing_data[0] and self._phase != "head":
                self._await("head")
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self._head_received()
        elif self._phase is not None:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing more to receive
            self._request_received()
