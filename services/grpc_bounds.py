"""Bounds on the gateway's gRPC connections: ``GrpcLimits`` (``ServiceConfig``'s ``grpc_*``
settings) becomes grpc core's server options (``server_options``): a handshake deadline, an idle
deadline, a maximum connection age with a grace for the calls still running, keepalive and its
enforcement, a cap on open connections and one on a message's size (``services.grpc_messages``).
(Calls before they are authenticated: ``services.grpc_call_gate``.)

Regression (secrev19 H4): the server set only ``grpc.so_reuseport`` and
``grpc.max_concurrent_streams``, so a client that completed the HTTP/2 handshake and sent nothing
more held its connection (one fd of the gateway process) forever, with no cap: at NOFILE another
client's call got DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Any

from services.grpc_messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_GENERATE_REQUEST_BYTES,
    channel_options,
)

log = logging.getLogger(__name__)

MAX_PING_STRIKES = 2
"""Client pings more often than ``min_ping_interval_s`` (with no data to send) a connection may
make before it is closed with GOAWAY ENHANCE_YOUR_CALM (grpc core's default)."""


@dataclass(frozen=True)
class GrpcLimits:
    """What the gateway's gRPC connections and not-yet-running calls may hold.

    Attributes:
        handshake_timeout_s: from a connection's accept until its HTTP/2 handshake is done.
        max_connection_idle_s: a connection with no call open this long is closed (GOAWAY; a
            client's channel reconnects on its next call).
        max_connection_age_s: a connection is told to go away (GOAWAY) at this age; its calls
            still running keep going for ``max_connection_age_grace_s`` more, then are cancelled.
            New calls go to a new connection, so a client with a channel sees no error.
        max_connection_age_grace_s: that grace; long enough for a long streamed Generate.
        keepalive_time_s: the server pings a connection silent this long, and closes it when
            no answer comes within ``keepalive_timeout_s`` (a vanished client's connection).
        keepalive_timeout_s: that wait.
        min_ping_interval_s: clients may ping at most this often while no data flows (with or
            without calls open); ``MAX_PING_STRIKES`` faster pings close the connection.
        max_connections: open connections in all; one past it is closed at accept (grpc core's
            ``grpc.max_allowed_incoming_connections``). Clamped to a quarter of the process's
            NOFILE soft limit: the HTTP API takes at most half, ZeroMQ and Ray the rest.
        message_timeout_s: from a call's headers until its request message; a call whose
            message has not come by then ends DEADLINE_EXCEEDED (``CallGate``).
        max_unverified_calls: calls whose key was not verified here lately that may wait for
            their request message at once, all clients together (``UNVERIFIED_CALLS_PER_ADDRESS``
            per client network); one past it is refused RESOURCE_EXHAUSTED.
        max_health_watchers: Health/Watch streams open at once, all clients together
            (``HEALTH_WATCHERS_PER_ADDRESS`` per client network); past it RESOURCE_EXHAUSTED.
        max_message_bytes: the largest message received or sent, in bytes; a call whose
            request is larger ends RESOURCE_EXHAUSTED (grpc core's), the connection's other
            calls unaffected. At least ``MAX_GENERATE_REQUEST_BYTES``, the largest valid request
            (``services.grpc_messages``).
    """

    handshake_timeout_s: float = 10.0
    max_connection_idle_s: float = 300.0
    max_connection_age_s: float = 7200.0
    max_connection_age_grace_s: float = 3600.0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 10.0
    max_connections: int = 4096
    message_timeout_s: float = 30.0
    max_unverified_calls: int = 1024
    max_health_watchers: int = 1024
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) > 0:
                raise ValueError(f"GrpcLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_message_bytes < MAX_GENERATE_REQUEST_BYTES:
            raise ValueError(f"GrpcLimits.max_message_bytes must be >= {MAX_GENERATE_REQUEST_BYTES} (the "
                             f"largest valid request), got {self.max_message_bytes}")

    @classmethod
    def of(cls, config: Any) -> GrpcLimits:
        """The limits a ``ServiceConfig`` sets (its ``grpc_*`` fields)."""
        return cls(config.grpc_handshake_timeout_s, config.grpc_max_connection_idle_s,
                   config.grpc_max_connection_age_s, config.grpc_max_connection_age_grace_s,
                   config.grpc_keepalive_time_s, config.grpc_keepalive_timeout_s,
                   config.grpc_min_ping_interval_s, config.grpc_max_connections,
                   config.grpc_message_timeout_s, config.grpc_max_unverified_calls,
                   config.grpc_max_health_watchers, config.grpc_max_message_bytes)

    def connection_cap(self, nofile: int | None = None) -> int:
        """``max_connections``, at most a quarter of ``nofile`` (the NOFILE soft limit)."""
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if nofile is None else nofile
        if nofile == resource.RLIM_INFINITY or self.max_connections <= nofile // 4:
            return self.max_connections
        log.warning("grpc_max_connections %d is over a quarter of NOFILE (%d): serving at most %d",
                    self.max_connections, nofile, max(1, nofile // 4))
        return max(1, nofile // 4)

    def server_options(self, max_concurrent_streams: int, nofile: int | None = None) -> list[tuple[str, int]]:
        """grpc core channel arguments for ``grpc.aio.server(options=...)``."""
        def ms(seconds: float) -> int:
            return max(1, round(seconds * 1000))
        return [
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            # what grpc core (1.85) waits for a ping's ack, its keepalive pings' too (60 s by
            # default). Regression (s38): without it, a vanished client's calls ran on for
            # keepalive_time_s + 60 s, whatever keepalive_timeout_s said
            ("grpc.http2.ping_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
            ("grpc.max_allowed_incoming_connections", self.connection_cap(nofile)),
            *channel_options(self.max_message_bytes),
        ]
