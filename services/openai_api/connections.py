"""Bounds on the HTTP API's connections, whoever opens them: how many are open (in all, per
client network, and those without a valid API key; ``ConnectionGuard``), how long one may take to
deliver a request (its head, then its body), and how often a failing accept is logged.

uvicorn has none of these: ``timeout_keep_alive`` runs only between requests (and is cancelled by
a request's first byte), ``limit_concurrency`` answers 503 only once a request's head is parsed,
so a client that sends a partial request and nothing more holds its connection (a file
descriptor of the gateway process, shared with gRPC, ZeroMQ and Ray) forever. The bounds live in a
uvicorn protocol subclass (``guarded_protocol``), which sees every connection from
``connection_made`` on, before any byte or ASGI app. With HTTPS it terminates TLS itself
(``loop.start_tls`` on the accepted TCP connection), so a connection is counted from its accept
and its handshake runs under the head deadline.

Regression (secrev18 fault F): with none of them, one unauthenticated client holding partial
requests open exhausted the gateway's file descriptors: under a NOFILE limit of 300, 297 such
connections were still held after 35 s, another client's request timed out, and asyncio logged
75,680 EMFILE accept errors, each with a traceback, in the ~70 s run. Now 150 are admitted
(half the limit), the rest answered 503 at accept, all closed 10 s after they opened (408), the
other client served (200), and the failed accept logged once.

Regression (HTTPS handshakes escaped these bounds): uvicorn served HTTPS through
``loop.create_server(ssl=...)``, whose SSL layer runs the handshake before the protocol's
``connection_made`` (and calls no ``connection_lost`` for a failed one), so a connection still
in its handshake was not counted and lived until asyncio's 60 s ``ssl_handshake_timeout``: any
number of TCP connections that never finished it held file descriptors uncounted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import h11
from uvicorn.middleware.proxy_headers import _TrustedHosts

log = logging.getLogger(__name__)

_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (base_events)
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\n"
            b"connection: close\r\n\r\n")
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n"
              b"connection: close\r\n\r\n")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection, and all of them, may hold (``ServiceConfig``'s ``http_*`` settings).

    Attributes:
        head_timeout_s: from a connection's opening (its accept: an HTTPS connection's TLS
            handshake runs within it), or from the first byte of its next request, until the
            request's whole head (request line and headers) has arrived.
        body_timeout_s: from a request's head until its whole body has arrived. Neither deadline
            covers sending the response: a streamed (SSE) response runs as long as it needs.
        max_connections: open connections in all (clamped to half the process's NOFILE soft
            limit, which gRPC, ZeroMQ and Ray share).
        max_connections_per_address: open connections from one client network: an IPv4
            address, or an IPv6 /64 (one host's share: SLAAC gives each host a /64). The trusted
            proxies (``forwarded_allow_ips``) are exempt: their connections carry many clients.
        backlog: connections the kernel may queue before they are accepted.
        max_head_bytes: bytes a connection may send while its request's head is incomplete
            (httptools alone let tens of MB through).
        max_connections_per_network: open connections from one wider network: an IPv4 /24 or an
            IPv6 /48 (one site's allocation); the trusted proxies are exempt.
        unauthenticated_share: the fraction of ``max_connections`` that connections which have
            not yet presented a valid API key may hold; the rest is kept for those that have.
    """

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_address: int = 256
    backlog: int = 1024
    max_head_bytes: int = 64 * 1024
    max_connections_per_network: int = 1024
    unauthenticated_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_address",
                     "backlog", "max_head_bytes", "max_connections_per_network", "unauthenticated_share"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ConnectionLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.unauthenticated_share > 1:
            raise ValueError(f"ConnectionLimits.unauthenticated_share must be <= 1, got {self.unauthenticated_share!r}")

    @classmethod
    def of(cls, config: Any) -> ConnectionLimits:
        """The limits a ``ServiceConfig`` sets (its ``http_*`` fields)."""
        return cls(config.http_head_timeout_s, config.http_body_timeout_s,
                   config.http_max_connections, config.http_max_connections_per_address,
                   max_connections_per_network=config.http_max_connections_per_network,
                   unauthenticated_share=config.http_unauthenticated_share)


def client_networks(address: str) -> tuple[str, str]:
    """The networks a peer address is counted in: (an IPv4 address or its IPv6 /64, its IPv4
    /24 or IPv6 /48). An IPv4-mapped IPv6 address counts as its IPv4 address; anything that
    is not an IP address (a Unix socket's "") as itself, in both."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address, address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if isinstance(ip, ipaddress.IPv4Address):
        return str(ip), str(ipaddress.IPv4Network((ip, 24), strict=False))
    return (str(ipaddress.IPv6Network((ip, 64), strict=False)),
            str(ipaddress.IPv6Network((ip, 48), strict=False)))


class ConnectionGuard:
    """The counts every connection of one server shares, and what it refused, shed or closed.

    A new connection is refused (503 at accept) when its client network (``client_networks``)
    or its wider network holds its cap. When the connections without a valid API key hold
    their share of the slots (``unauthenticated_share``), or all slots are taken, the oldest
    such connection that is still receiving a request (head or body, no response under way) or
    idle between requests is shed (closed; 503 to a partial head) to make room; only when there
    is none is the new one refused.

    The per-network counts key on the socket peer, never on X-Forwarded-For: the header arrives
    after the connection is accepted, and only trusted proxies may set it (``HttpServer``).

    Regression (secrev19 H3): the caps counted each exact peer address and the total was first
    come, first served: 16 source addresses (one IPv6 host has 2^64) held all 4,096 slots with
    partial requests and no key, and every other client was answered 503. Now an IPv6 /64 is
    one client, an IPv4 /24 or IPv6 /48 holds 1,024 at most, keyless connections hold half of
    the slots at most, and a new client sheds the oldest unfinished keyless connection.
    """

    def __init__(self, limits: ConnectionLimits, forwarded_allow_ips: str | list[str] | None,
                 nofile: int | None = None) -> None:
        self.limits = limits
        self.trusted = _TrustedHosts(forwarded_allow_ips) if forwarded_allow_ips else None
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if nofile is None else nofile
        self.max_connections = limits.max_connections
        if nofile != resource.RLIM_INFINITY and limits.max_connections > nofile // 2:
            self.max_connections = max(1, nofile // 2)
            log.warning("HTTP API: %d connections allowed, but the process may open only %d files: "
                        "serving at most %d", limits.max_connections, nofile, self.max_connections)
        self.max_unauthenticated = max(1, int(self.max_connections * limits.unauthenticated_share))
        self.open = 0
        self.per_address: Counter[str] = Counter()  # by client network (an IPv4 address, an IPv6 /64)
        self.per_network: Counter[str] = Counter()  # by IPv4 /24, IPv6 /48
        self.unauthenticated: dict[_Guarded, None] = {}  # oldest first
        self.stats: Counter[str] = Counter()  # refused_total, refused_address, shed, head_timeout, ...

    def admit(self, conn: _Guarded, address: str) -> bool:
        """Count a new connection from ``address``, shedding another when the pool it joins is
        full (False: over a cap, not counted)."""
        narrow, wide = client_networks(address)
        exempt = self.trusted is not None and address in self.trusted
        if not exempt and self.per_address[narrow] >= self.limits.max_connections_per_address:
            self.stats["refused_address"] += 1
            return False
        if not exempt and self.per_network[wide] >= self.limits.max_connections_per_network:
            self.stats["refused_network"] += 1
            return False
        full = self.open >= self.max_connections
        if (full or len(self.unauthenticated) >= self.max_unauthenticated) and not self._shed_one():
            self.stats["refused_total" if full else "refused_unauthenticated"] += 1
            return False
        self.open += 1
        self.per_address[narrow] += 1
        self.per_network[wide] += 1
        self.unauthenticated[conn] = None
        return True

    def authenticated(self, conn: _Guarded) -> None:
        """``conn`` has presented a valid API key: it leaves the unauthenticated pool for good."""
        self.unauthenticated.pop(conn, None)

    def release(self, conn: _Guarded, address: str) -> None:
        """An admitted connection closed (or was shed)."""
        narrow, wide = client_networks(address)
        self.open -= 1
        self.unauthenticated.pop(conn, None)
        for counts, key in ((self.per_address, narrow), (self.per_network, wide)):
            counts[key] -= 1
            if counts[key] <= 0:
                del counts[key]

    def end_handshakes(self) -> None:
        """Close the connections whose TLS handshake is still under way (the server stops: they
        are no uvicorn connection yet, so its shutdown does not see them)."""
        for conn in list(self.unauthenticated):
            conn.end_handshake()

    def _shed_one(self) -> bool:
        """Close the oldest unauthenticated connection still receiving its request or idle
        (``_Guarded.sheddable``); False when there is none."""
        for conn in self.unauthenticated:
            if conn.sheddable():
                conn.shed()
                return True
        return False


class _Guarded:
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
"""A request scope's key for its connection's ``_Guarded._end_unfinished``."""


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


class _GuardedHttpTools(_Guarded):
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


class _GuardedH11(_Guarded):
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


class AcceptErrorLog:
    """asyncio logs a traceback for each failed accept (EMFILE: out of file descriptors) and retries
    every second; this loop exception handler logs those of one listening socket at most once per
    ``interval_s`` with a count, and passes every other context to the handler it replaced."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fileno: int, interval_s: float = 10.0) -> None:
        self.loop, self.fileno, self.interval_s = loop, fileno, interval_s
        self.previous = loop.get_exception_handler()
        self.suppressed, self.logged, self.last_log = 0, 0, float("-inf")
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        sock = context.get("socket")
        if context.get("message") != _ACCEPT_ERROR or sock is None or sock.fileno() != self.fileno:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - self.last_log < self.interval_s:
            self.suppressed += 1
            return
        self.last_log, self.logged = now, self.logged + 1
        log.error("HTTP API cannot accept connections: %s (%d more such failures not logged)",
                  context.get("exception"), self.suppressed)
        self.suppressed = 0

    def remove(self) -> None:
        """Put the replaced handler back (unless another has replaced this one since)."""
        if self.loop.get_exception_handler() is self:
            self.loop.set_exception_handler(self.previous)
