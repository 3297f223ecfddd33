"""The uvicorn HTTP protocol under ``services.openai_api.connections``' bounds: a mixin over
uvicorn's ``HttpToolsProtocol`` / ``H11Protocol`` (``guarded_protocol``) that sees each connection
from its accept, counts it with the ``ConnectionGuard``, arms the head and body deadlines, and
with HTTPS terminates TLS itself on the accepted TCP connection (``loop.start_tls``), so the
handshake runs counted and under the head deadline (see ``connections``' module docstring for
the regressions these bounds fix). The app marks a request's connection as authenticated
(``authenticated``) or ends a response unfinished on purpose (``end_unfinished``) through its
ASGI scope.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any, cast

import h11

from services.openai_api.connections import ConnectionGuard

_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\n"
            b"connection: close\r\n\r\n")
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")


class Guarded:
    """Mixin over a uvicorn HTTP protocol: the caps at ``connection_made`` and the receive
    deadlines. Subclasses report a request's head and its end (``_head_received``,
    ``_request_received``).

    With ``tls_context`` the protocol is given the accepted TCP connection and terminates TLS on
    it (``_handshake``): the connection is counted from its accept, and the head deadline, armed
    there, bounds the handshake and then the head (phase ``"handshake"``, then ``"head"``).
    uvicorn sees the connection only once the handshake is done, on the TLS transport."""

    guard: ConnectionGuard  # set on the class by ``guarded_protocol``
    tls_context: ssl.SSLContext | None = None  # set on the class by ``guarded_protocol``: HTTPS
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._accepted = transport  # the TCP connection (beneath the TLS transport with HTTPS)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "handshake", "head", "body", or None: not receiving a request
        self._head_bytes = 0
        self._early = bytearray()  # bytes decrypted before uvicorn saw the connection
        self._started = False  # the uvicorn protocol saw the connection
        self._admitted = self.guard.admit(self, self._peer)  # counted by the guard
        if not self._admitted:
            if self.tls_context is None:  # (a TLS client could not read it)
                transport.write(_REFUSED)
            transport.abort() if transport.get_write_buffer_size() else transport.close()
            return
        if self.tls_context is None:
            self._serve(transport)
            return
        self._await("handshake")
        transport.pause_reading()  # no byte reaches this protocol before start_tls takes it
        self._handshaking = self.loop.create_task(self._handshake(transport, self.tls_context))

    def _serve(self, transport: asyncio.Transport) -> None:
        """HTTP on ``transport`` (under TLS, the handshake's deadline runs on for the head)."""
        super().connection_made(transport)  # type: ignore[misc]
        self._started = True
        self.app = _marking(self.app, self._authenticated, self._end_unfinished)  # type: ignore[has-type]
        if self._phase == "handshake":
            self._phase = "head"
        else:
            self._await("head")
        if self._early:
            early, self._early = bytes(self._early), bytearray()
            self.data_received(early)

    async def _handshake(self, tcp: asyncio.Transport, context: ssl.SSLContext) -> None:
        """TLS with ``context`` on the accepted ``tcp`` (server side), then ``_serve``.

        A failed handshake closes the connection; asyncio (CPython 3.11 ``sslproto``) then calls
        this protocol's ``connection_lost`` for a handshake error, but not for a connection cut
        while the handshake is under way (the deadline, a shed, a reset), so the count is
        released here too (``_uncount`` runs once). ``ssl_handshake_timeout`` is the head
        deadline: asyncio's own bound, behind the guard's. ``ssl_shutdown_timeout`` too: a
        closed connection (a deadline's 408, a shed) waits that long at most for the peer's
        close_notify (asyncio's default: 30 s, the socket held all along)."""
        tls: asyncio.Transport | None = None
        try:
            timeout_s = self.guard.limits.head_timeout_s
            tls = await self.loop.start_tls(tcp, cast(asyncio.Protocol, self), context, server_side=True,
                                            ssl_handshake_timeout=timeout_s, ssl_shutdown_timeout=timeout_s)
        except OSError:  # ssl.SSLError, a reset, asyncio's own timeout; the connection is closed
            if self._phase == "handshake":
                self.guard.stats["handshake_failed"] += 1
        finally:
            if tls is None or self._phase != "handshake":  # failed, cancelled, or closed meanwhile
                self._phase = None
                self._disarm()
                self._uncount()
                (tls or tcp).abort()
        if self._phase == "handshake" and tls is not None:
            self._serve(tls)

    def end_handshake(self) -> None:
        """Close the connection if its TLS handshake is still under way."""
        if self._phase == "handshake":
            self._close("handshake_ended", b"")

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        self._disarm()
        if self._started:
            self._started = False
            super().connection_lost(exc)  # type: ignore[misc]

    @property
    def _current(self) -> asyncio.Transport:
        """The transport HTTP runs on, or before that (a TLS handshake) the accepted one."""
        return self.transport if self._started else self._accepted

    def _uncount(self) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self, self._peer)

    def _authenticated(self) -> None:
        if self._admitted:
            self.guard.authenticated(self)

    def _end_unfinished(self) -> None:
        """``end_unfinished``: the response under way stays unfinished; uvicorn's request cycle
        counts its client as gone (so it neither logs the response as broken nor writes more) and
        the connection closes once its held bytes are written."""
        cycle = getattr(self, "cycle", None)
        if cycle is not None:
            cycle.disconnected = True
        self.transport.close()

    def sheddable(self) -> bool:
        """Receiving a request (its head or body), or idle between requests (kept alive), with
        no response under way and no request in the app: what the guard may close to make room
        (for a connection without a valid API key).

        Regression (review of f7a24d1, R2): a keyless connection idle between requests could
        not be shed; 8 of them (re-sending ``GET /health`` within the keep-alive) held the
        keyless share, and every new connection, a keyed client's too, was refused 503."""
        if self._current.is_closing() or self._answering():
            return False
        if self._phase is not None:
            return True
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def shed(self) -> None:
        """Closed to make room for a new connection: uncounted now, not when the close lands."""
        self._close("shed", _REFUSED if self._phase == "head" else b"")
        self._uncount()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if not self._started:  # decrypted with the handshake's last bytes, before ``_serve``
            self._early += data
            return
        if self._phase is None:  # the first bytes of the connection's next request
            self._await("head")
        if self._phase == "head":
            self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        # counted before parsing, judged after: a head that ended in these bytes is never refused
        if self._phase == "head" and self._head_bytes > self.guard.limits.max_head_bytes:
            self._close("head_too_large", _TOO_LARGE)

    def _head_received(self) -> None:
        self._await("body")

    def _request_received(self) -> None:
        self._phase = None
        self._disarm()

    def _await(self, phase: str) -> None:
        self._disarm()
        self._phase = phase
        if phase == "head":
            self._head_bytes = 0
        limits = self.guard.limits
        timeout_s = limits.body_timeout_s if phase == "body" else limits.head_timeout_s  # "handshake" too
        self._deadline = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _answering(self) -> bool:
        """A response is being sent, or a request waits behind one (pipelined: the server, not
        the client, holds up its bytes)."""
        cycle = self.cycle
        sending = cycle is not None and cycle.response_started and not cycle.response_complete
        return sending or bool(getattr(self, "pipeline", None))

    def _expired(self) -> None:
        self._deadline = None
        if self._phase is None or self._current.is_closing():
            return
        if self._answering():  # never cut a response; look again once it may have ended
            self._deadline = self.loop.call_later(self.guard.limits.head_timeout_s, self._expired)
            return
        self._close(f"{self._phase}_timeout", _TIMED_OUT if self._phase == "head" else b"")

    def _close(self, reason: str, reply: bytes) -> None:
        transport = self._current
        if transport.is_closing():
            return
        self.guard.stats[reason] += 1
        self._phase = None
        self._disarm()
        if reply:
            transport.write(reply)
        # a peer that reads nothing must not keep the socket open through close()'s flush
        transport.abort() if transport.get_write_buffer_size() else transport.close()


AUTHENTICATED = "kvstrata.authenticated"
"""The ASGI scope key of a callable that marks the request's connection as having presented a
valid API key (``authenticated``)."""


END_UNFINISHED = "kvstrata.end_unfinished"
"""A request scope's key for its connection's ``Guarded._end_unfinished``."""


def _marking(app: Any, mark: Callable[[], None], end_unfinished: Callable[[], None]) -> Any:
    """``app`` with ``mark`` (``AUTHENTICATED``) and ``end_unfinished`` (``END_UNFINISHED``) in
    each request's scope."""

    async def marked(scope: Any, receive: Any, send: Any) -> None:
        scope[AUTHENTICATED] = mark
        scope[END_UNFINISHED] = end_unfinished
        await app(scope, receive, send)
    return marked


def end_unfinished(scope: Any) -> None:
    """The app ends the response of ``scope`` unfinished, on purpose, and returns: its connection,
    when served by a guarded protocol, is closed after what its transport holds, as uvicorn closes
    it for an app that returns mid-response, but without uvicorn's ERROR log ("ASGI callable
    returned without completing response"), which is for a broken app."""
    end = scope.get(END_UNFINISHED)
    if end is not None:
        end()


def authenticated(scope: Any) -> None:
    """The request of ``scope`` presented a valid API key: its connection, when served by a
    guarded protocol, leaves the unauthenticated pool (``ConnectionGuard``)."""
    mark = scope.get(AUTHENTICATED)
    if mark is not None:
        mark()


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


class _GuardedHttpTools(Guarded):
    """httptools reports a request's parts by callback."""

    def on_message_begin(self) -> None:
        if self._phase is None:  # a pipelined request begun in the bytes of the one before
            self._await("head")
        super().on_message_begin()  # type: ignore[misc]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()  # type: ignore[misc]
        self._head_received()

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._request_received()


class _GuardedH11(Guarded):
    """h11 is asked its peer's state after each batch of events."""

    conn: Any

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
