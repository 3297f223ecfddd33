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
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uvicorn.middleware.proxy_headers import _TrustedHosts

if TYPE_CHECKING:
    from services.openai_api.protocol import Guarded

log = logging.getLogger(__name__)

_ACCEPT_ERROR = "socket.accept() out of system resource"  # asyncio's message (base_events)

CLOSE_REASONS = ("refused_address", "refused_network", "refused_total", "refused_unauthenticated", "shed",
                 "handshake_failed", "handshake_ended", "handshake_timeout", "head_timeout", "body_timeout",
                 "head_too_large", "pipeline_too_large", "pipeline_too_deep", "send_stalled")
"""Every reason ``ConnectionGuard.stats`` counts a connection under: refused at accept (a client
network's cap, its wider network's, every slot taken, the keyless share), shed for a newcomer,
its TLS handshake failed or cut, a receive deadline passed, a head or pipeline too large or too
deep, or its client held its writes up past the minimum read rate (``Guarded._send_stalled``)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection, and all of them, may hold (``ServiceConfig``'s ``http_*`` settings).

    Attributes:
        head_timeout_s: from a connection's opening (its accept: an HTTPS connection's TLS
            handshake runs within it), or from the first byte of its next request, until the
            request's whole head (request line and headers) has arrived.
        body_timeout_s: from a request's head until its whole body has arrived. Neither deadline
            covers sending the response (``send_stall_timeout_s`` does).
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
        send_stall_timeout_s: how far, in seconds, a client may fall behind
            ``min_send_rate_bytes_per_s`` while it holds the connection's writes up (the
            transport buffering past its high-water mark), in all over the connection's life,
            before the connection is aborted (``Guarded._send_stalled``): a client that takes
            nothing is cut after this long, one taking half the rate after twice this long.
            Streamed (SSE) responses too: time they are not held up (the model has nothing to
            send, the client keeps up) does not count.
        min_send_rate_bytes_per_s: the bytes per second a client must take, on average, of
            writes it holds up. Taking faster pays back what it fell behind, never more (no
            credit is saved for later).
        send_buffer_bytes: the kernel's send buffer of each connection (``SO_SNDBUF``; Linux
            doubles it), which, with the transport's 64 KiB high-water mark, bounds what a
            connection buffers before its writes are held up; 0: the kernel's own (autotuned,
            up to ``net.ipv4.tcp_wmem``'s maximum, 4 MiB by default).
        max_pipelined_requests: requests one connection may have queued behind the response
            under way (HTTP/1.1 pipelining); one more closes the connection, as do queued
            requests holding more than ``max_head_bytes`` in all.
    """

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    max_connections_per_address: int = 256
    backlog: int = 1024
    max_head_bytes: int = 64 * 1024
    max_connections_per_network: int = 1024
    unauthenticated_share: float = 0.5
    send_stall_timeout_s: float = 60.0
    max_pipelined_requests: int = 8
    min_send_rate_bytes_per_s: float = 4096.0
    send_buffer_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_address",
                     "backlog", "max_head_bytes", "max_connections_per_network", "unauthenticated_share",
                     "send_stall_timeout_s", "max_pipelined_requests", "min_send_rate_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ConnectionLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.send_buffer_bytes < 0:
            raise ValueError(f"ConnectionLimits.send_buffer_bytes must be >= 0, got {self.send_buffer_bytes!r}")
        if self.unauthenticated_share > 1:
            raise ValueError(f"ConnectionLimits.unauthenticated_share must be <= 1, got {self.unauthenticated_share!r}")

    @classmethod
    def of(cls, config: Any) -> ConnectionLimits:
        """The limits a ``ServiceConfig`` sets (its ``http_*`` fields)."""
        return cls(config.http_head_timeout_s, config.http_body_timeout_s,
                   config.http_max_connections, config.http_max_connections_per_address,
                   max_connections_per_network=config.http_max_connections_per_network,
                   unauthenticated_share=config.http_unauthenticated_share,
                   send_stall_timeout_s=config.http_send_stall_timeout_s,
                   min_send_rate_bytes_per_s=config.http_min_send_rate_bytes_per_s,
                   send_buffer_bytes=config.http_send_buffer_bytes)


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
    such connection that is still receiving a request (head or body, no response under way),
    idle between requests, or whose client holds up the server's writes (it reads nothing) is
    shed (closed; 503 to a partial head) to make room; only when there is none is the new one
    refused.

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
        self.unauthenticated: dict[Guarded, None] = {}  # oldest first
        self.lingering: dict[Guarded, None] = {}  # closed, their kernel-held tail counted (``Guarded._linger``)
        self.stats: Counter[str] = Counter()  # by ``CLOSE_REASONS``
        self.accept_failures = 0  # failed accept() calls on the listening socket (``AcceptErrorLog``)

    def admit(self, conn: Guarded, address: str) -> bool:
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

    def authenticated(self, conn: Guarded) -> None:
        """``conn`` has presented a valid API key: it leaves the unauthenticated pool for good."""
        self.unauthenticated.pop(conn, None)

    def release(self, conn: Guarded, address: str) -> None:
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

    def end_lingering(self) -> None:
        """Release the kernel-held tails of closed connections (the server stops): each is closed
        gracefully, the kernel delivering what it holds (``Lingering.release``)."""
        for conn in list(self.lingering):
            conn.end_lingering()

    def _shed_one(self) -> bool:
        """Close the oldest unauthenticated connection still receiving its request, idle, or
        held up by its client (``Guarded.sheddable``); False when there is none."""
        for conn in self.unauthenticated:
            if conn.sheddable():
                conn.shed()
                return True
        return False


class AcceptErrorLog:
    """asyncio logs a traceback for each failed accept (EMFILE: out of file descriptors) and retries
    every second; this loop exception handler logs those of one listening socket at most once per
    ``interval_s`` with a count, counts each in ``guard.accept_failures`` (exported as
    ``kvstrata:http_accept_failures_total``, ``services.metrics.http``), and passes every other
    context to the handler it replaced.

    Regression: a gateway out of file descriptors was seen only in its log (one line per
    ``interval_s``); no metric counted the failed accepts, so an alert on the scrape missed it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fileno: int, interval_s: float = 10.0,
                 guard: ConnectionGuard | None = None) -> None:
        self.loop, self.fileno, self.interval_s, self.guard = loop, fileno, interval_s, guard
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
        if self.guard is not None:
            self.guard.accept_failures += 1
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
