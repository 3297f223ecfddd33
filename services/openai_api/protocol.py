"""The uvicorn HTTP protocol under ``services.openai_api.connections``' bounds: a mixin over
uvicorn's ``HttpToolsProtocol`` / ``H11Protocol`` (``protocol_parsers.guarded_protocol``) that
sees each connection from its accept, counts it with the ``ConnectionGuard``, arms the head and
body deadlines and the reader's minimum rate (the send-stall rule), and with HTTPS terminates TLS itself on the accepted
TCP connection (``loop.start_tls``), so the handshake runs counted and under the head deadline
(see ``connections``' module docstring for the regressions these bounds fix). The app reaches a
request's connection through its ASGI scope (``scope_hooks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import struct
from typing import Any, cast

from services.openai_api.connections import ConnectionGuard
from services.openai_api.lingering import Lingering, kernel_unsent
from services.openai_api.scope_hooks import (
    authenticated,  # noqa: F401 - re-exported
    end_unfinished,  # noqa: F401 - re-exported
    marking,
)


def connection_refusal(status: str, message: str, kind: str, code: str, headers: bytes = b"") -> bytes:
    """The bytes of a refusal the connection's protocol writes itself, before (or instead of)
    the app: ``status`` (``"400 Bad Request"``), OpenAI's error JSON (``message``, ``type``
    ``kind``, ``param`` null, ``code``), ``headers`` (``name: value\\r\\n`` lines) and
    ``connection: close``.

    Regression (s41 HTTP fuzz): these were a plain-text "Invalid HTTP request received." (a
    header holding CR, LF, NUL or DEL, a bad chunk size: uvicorn's own 400) and empty 408 /
    431 / 503 bodies, where a client library reads OpenAI's JSON."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n".encode()
            + headers + b"connection: close\r\n\r\n" + body)


_REFUSED = connection_refusal("503 Service Unavailable", "the server holds as many connections as it takes "
                              "(from this client's network, or without a valid API key); retry later",
                              "service_unavailable", "unavailable", b"retry-after: 1\r\n")
_TIMED_OUT = connection_refusal("408 Request Timeout", "the request's head did not arrive in time",
                                "invalid_request_error", "request_timeout")
_TOO_LARGE = connection_refusal("431 Request Header Fields Too Large", "the request's head (its line and "
                                "headers) is larger than the server takes", "invalid_request_error",
                                "request_header_fields_too_large")
_MALFORMED = connection_refusal("400 Bad Request", "malformed HTTP request: its request line, a header (a "
                                "control character such as CR, LF or NUL in a name or value) or its body's framing "
                                "(Content-Length, chunked encoding) is not valid HTTP/1.1", "invalid_request_error",
                                "invalid_argument")


def _set_send_buffer(tcp: asyncio.Transport, size: int) -> None:
    """Give ``tcp``'s socket a kernel send buffer of ``size`` bytes (``SO_SNDBUF``; 0: leave
    the kernel's own)."""
    sock = tcp.get_extra_info("socket")
    if size and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def _kernel_unsent(tcp: asyncio.Transport) -> int:
    """Bytes in ``tcp``'s kernel send queue that its peer has not acknowledged yet
    (``lingering.kernel_unsent``); 0 where it cannot be read."""
    sock = tcp.get_extra_info("socket")
    return 0 if sock is None else kernel_unsent(sock.fileno())


def _reset_on_close(tcp: asyncio.Transport) -> None:
    """Closing ``tcp``'s socket resets the connection (``SO_LINGER`` 0): the kernel drops what it
    still holds to send, instead of keeping the socket, orphaned, while it tries to deliver it
    to a peer that reads nothing (megabytes of send queue, for minutes)."""
    sock = tcp.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Guarded:
    """Mixin over a uvicorn HTTP protocol: the caps at ``connection_made``, the receive
    deadlines and the reader's minimum rate (``_send_stalled``). Subclasses report a request's
    head and its end (``_head_received``, ``_request_received``).

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
        self._stall: asyncio.TimerHandle | None = None  # armed while the client holds writes up
        self._stall_mark = 0  # bytes not yet sent at the last account (``_unsent``, ``_account``)
        self._stall_since = 0.0  # the loop's time of the last account
        self._stall_due = 0.0  # when ``_stall`` is due
        self._behind_s = 0.0  # how far the client has fallen behind the minimum rate, s (>= 0)
        self._reset = False  # closed by ``_close``'s reset: nothing lingers
        self._lingering: Lingering | None = None  # its kernel-held tail once closed (``_linger``)
        self._admitted = self.guard.admit(self, self._peer)  # counted by the guard
        if not self._admitted:
            if self.tls_context is None:  # (a TLS client could not read it)
                transport.write(_REFUSED)
            transport.abort() if transport.get_write_buffer_size() else transport.close()
            return
        _set_send_buffer(transport, self.guard.limits.send_buffer_bytes)
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
        self._serving()
        self.app = marking(self.app, self._authenticated, self._end_unfinished,  # type: ignore[has-type]
                            self._written)
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
        if not self._linger(exc):
            self._uncount()
        self._disarm()
        self._unstall()
        if self._started:
            self._started = False
            super().connection_lost(exc)  # type: ignore[misc]

    def _linger(self, exc: Exception | None) -> bool:
        """Closed cleanly (uvicorn's close, its keep-alive timeout, ``Connection: close``) with
        bytes its client has not taken still in the kernel's send queue: keep the kernel socket
        (a duplicate descriptor), counted, under the minimum read rate, until they are taken
        (``lingering.Lingering``); True when it does. Not for HTTPS (asyncio's SSL layer has
        closed the socket by now) nor a connection ``_close`` reset.

        Regression: a whole response small enough for the kernel's send buffer (~2-4 MB) left
        every count once uvicorn closed its connection, while the kernel held the socket and
        the response for as long as its client trickled."""
        if exc is not None or self._reset or not self._admitted or self.tls_context is not None:
            return False
        sock = self._accepted.get_extra_info("socket")
        unsent = 0 if sock is None else kernel_unsent(sock.fileno())
        if not unsent:
            return False
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return False
        limits = self.guard.limits
        self.guard.lingering[self] = None
        self._lingering = Lingering(dup, unsent, self._behind_s, limits.send_stall_timeout_s,
                                    limits.min_send_rate_bytes_per_s, self._lingered)
        return True

    def _lingered(self, reason: str | None) -> None:
        """Its lingering tail ended (``reason``: "send_stalled" when reset for its client's
        rate): counted, and the connection uncounted."""
        self._lingering = None
        self.guard.lingering.pop(self, None)
        if reason is not None:
            self.guard.stats[reason] += 1
        self._uncount()

    def end_lingering(self) -> None:
        """Release its kernel-held tail now, if it has one (the server stops): uncounted, its
        descriptor closed normally so the kernel goes on delivering it (``Lingering.release``),
        not reset."""
        if self._lingering is not None:
            self._lingering.release()

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
        no response under way and no request in the app, or with its writes held up by its
        client: what the guard may close to make room (for a connection without a valid API
        key).

        Regression (review of f7a24d1, R2): a keyless connection idle between requests could
        not be shed; 8 of them (re-sending ``GET /health`` within the keep-alive) held the
        keyless share, and every new connection, a keyed client's too, was refused 503.

        Regression (review 27a, F2): a keyless connection answering requests it pipelined and
        never read could not be shed either (it was "answering"); 8 of them held the keyless
        share for good."""
        if self._stall is not None or self._lingering is not None:  # its client holds it up
            return True
        if self._current.is_closing() or self._answering():
            return False
        if self._phase is not None:
            return True
        cycle = self.cycle
        return cycle is None or cycle.response_complete

    def shed(self) -> None:
        """Closed to make room for a new connection: uncounted now, not when the close lands."""
        if self._lingering is not None:
            self.guard.stats["shed"] += 1
            self._lingering.end()
            return
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
        elif self._unserved_bytes() > self.guard.limits.max_head_bytes:
            self._close("pipeline_too_large", b"")

    def _unserved_bytes(self) -> int:
        """Bytes of requests received and waiting behind the response under way (pipelined)."""
        return 0

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
        """A response is being sent, or a request waits behind one (pipelined; at most
        ``max_pipelined_requests``)."""
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

    def pause_writing(self) -> None:
        """The transport buffers past its high-water mark: the client holds the server's writes
        up. Its minimum rate is judged from now until ``resume_writing`` (``_send_stalled``)."""
        if self._started:
            super().pause_writing()  # type: ignore[misc]
        if self._stall is None and not self._current.is_closing():
            self._stall_since = self.loop.time()
            self._stall_mark = self._unsent()
            self._arm_stall()

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._account()
        self._unstall()
        if self._started:
            super().resume_writing()  # type: ignore[misc]

    def _arm_stall(self) -> None:
        """Check the client again when, taking nothing more, it would be
        ``send_stall_timeout_s`` behind the minimum rate."""
        wait_s = max(self.guard.limits.send_stall_timeout_s - self._behind_s, 0.01)
        self._stall_due = self._stall_since + wait_s
        self._stall = self.loop.call_at(self._stall_due, self._send_stalled)

    def _unsent(self) -> int:
        """Bytes written and not yet taken by the client: those the transport buffers and those
        in the kernel's send queue (``_kernel_unsent``). The kernel's part matters: it holds up
        to megabytes, and tells the transport it may write again only once about a third of
        it is free, so the transport's buffer alone moves in bursts far apart for a slow
        reader (a client taking 4 KiB/s of a 4 MiB queue would move it once in minutes)."""
        return self._current.get_write_buffer_size() + _kernel_unsent(self._accepted)

    def _account(self) -> None:
        """Add the time held up since the last account to ``_behind_s``, less the bytes the
        client took meanwhile (``_unsent`` shrank: nothing is written while the writes are held
        up) at ``min_send_rate_bytes_per_s``; never below 0. Time past the check's due time
        is not counted: a check that runs late because the gateway's own loop stalled blames
        the client for no more than the deadline."""
        now = self.loop.time()
        size = self._unsent()
        held_s = max(0.0, min(now, self._stall_due) - self._stall_since)
        taken = max(0, self._stall_mark - size)
        self._behind_s = max(0.0, self._behind_s + held_s - taken / self.guard.limits.min_send_rate_bytes_per_s)
        self._stall_since, self._stall_mark = now, size

    def _unstall(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _send_stalled(self) -> None:
        """The client may have fallen ``send_stall_timeout_s`` behind the minimum rate
        (``min_send_rate_bytes_per_s``) of taking the writes it holds up: abort the connection
        if it has (what its transport and its requests hold is freed, a stream's request
        aborted on its node as for any client gone), else look again when it would have,
        taking nothing more. Streamed responses alike: a stream is held up only when its
        client reads slower than the model writes.

        Regression (review 27a, F2 and F3): sending had no deadline; a whole response, or
        pipelined requests' responses, that the client never read held the connection, its
        transport's bytes and the response forever (uvicorn waits in ``drain()``, or, once it
        has closed the connection at its keep-alive timeout, asyncio waits to write them).

        Regression (a trickle reader): the deadline only asked for 64 KiB taken in each
        ``send_stall_timeout_s``, restarted at each pause, and a stream was left to its
        ``stream_idle_timeout_s`` (one event taken per 300 s): a client reading ~1 KiB/s, or
        taking a few bytes at a time, held its connection, its tenant's stream and megabytes of
        buffers for hours."""
        self._stall = None
        transport = self._current
        if not transport.get_write_buffer_size() and transport.is_closing():
            return
        self._account()
        if self._behind_s < self.guard.limits.send_stall_timeout_s - 0.001:
            self._arm_stall()
            return
        self._close("send_stalled", b"")

    async def _written(self) -> None:
        """Return once the transport holds at most its low-water mark of unsent bytes (uvicorn's
        ``FlowControl``), or the connection is gone."""
        flow = getattr(self, "flow", None)
        if flow is not None:
            await flow.drain()

    def _serving(self) -> None:
        """The uvicorn protocol has seen the connection (its ``flow`` exists)."""

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses (``msg``, its generic words, is logged
        by uvicorn): OpenAI's error JSON (``_MALFORMED``), then the connection closes. No reply
        while a response is under way on the connection (it would land inside that one), nor
        while a whole request before the refused bytes is still being answered: its client
        pairs the first response with its first request, so a 400 written then answers that
        valid request as malformed.

        Regression (s41 review r7 of dadad26): httptools parses bytes pipelined behind a request
        the app still serves; a valid request followed by a malformed one got the 400."""
        cycle = self.cycle
        before = cycle is not None and not cycle.response_complete and not cycle.more_body
        if not (before or self._answering()):
            self.transport.write(_MALFORMED)
        self.transport.close()

    def _close(self, reason: str, reply: bytes) -> None:
        """Close the connection with ``reply``, counted as ``reason``; one already closing is
        aborted if its transport still holds bytes (``close`` waits for them to be written, for
        as long as the client takes: uvicorn closes a connection that way at its keep-alive
        timeout, or after a response to ``Connection: close``)."""
        transport = self._current
        closing = transport.is_closing()
        if closing and not transport.get_write_buffer_size():
            return
        self.guard.stats[reason] += 1
        self._phase = None
        self._disarm()
        self._unstall()
        if reply and not closing:
            transport.write(reply)
        if transport.get_write_buffer_size():  # a peer that reads nothing: no flush, a reset
            _reset_on_close(self._accepted)
            self._reset = True
            transport.abort()
        else:
            transport.close()
