"""Serving the OpenAI-compatible API with uvicorn on the gateway's own event loop (the Ray
actor's), beside the gRPC server: one process, one data plane, one admission path."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from fastapi import FastAPI

from services.openai_api.connections import AcceptErrorLog, ConnectionGuard, ConnectionLimits
from services.openai_api.protocol_parsers import guarded_protocol
from services.tls import ServerTls

log = logging.getLogger(__name__)


class HttpServer:
    """uvicorn's ``Server.serve`` as a task on the running loop, on a socket bound up front
    (so a taken port fails ``start`` at once, and port 0 tells the port it got).

    Args:
        app: the ASGI application (``services.openai_api.create_app``).
        forwarded_allow_ips: the proxies whose X-Forwarded-For / X-Forwarded-Proto headers set
            a request's client address (IPs or CIDR networks, or ``"*"``: any client); empty or
            ``None``: no one's (the address is the connection's).
        limits: the bounds on its connections (``services.openai_api.connections``): open ones
            in all, per client network (an IPv4 address or IPv6 /64, and an IPv4 /24 or IPv6
            /48; these proxies exempt) and without a valid API key (the oldest unfinished one
            shed for a new one), and the time a connection has to deliver a request's head and
            body.
        tls: serve HTTPS with this certificate (client certificates required when it names a
            client CA: ``services.tls.ServerTls``); None: plain HTTP. The guarded protocol
            terminates TLS on the accepted connection (``protocol.Guarded``), so the caps
            count it from its accept and ``head_timeout_s`` bounds its handshake; uvicorn itself
            is given no ``ssl``.
        http: uvicorn's HTTP/1.1 implementation (``"auto"``: httptools when installed, else h11;
            both are guarded alike, ``protocol_parsers``).

    Regression (secrev16 fault B): uvicorn's proxy headers were on by default, trusting
    127.0.0.1, so any client connecting over loopback chose its own address (the key of the
    gateway's auth failure limit, ``services.auth_limits``) with X-Forwarded-For.

    Regression (secrev18 fault F): uvicorn ran with no bound on connections and no deadline on
    a request whose head never completes, so a client without a key held any number of
    connections with a partial request until the gateway ran out of file descriptors (every
    tenant's HTTP and gRPC failed, and each accept retry logged a traceback).

    Regression (secrev19 H3): those caps counted exact peer addresses, first come, first served:
    16 source addresses held all 4,096 connections with partial requests and no key, and every
    other client got 503. They count client networks now, and keyless connections may hold only
    ``unauthenticated_share`` of the slots, the oldest unfinished one shed for a newcomer
    (``ConnectionGuard``).

    Regression (HTTPS handshakes escaped the connection caps): uvicorn's ``ssl_certfile`` made
    asyncio's SSL layer run each handshake before the guarded protocol saw the connection, for
    up to 60 s, uncounted.
    """

    def __init__(self, app: FastAPI, forwarded_allow_ips: str | list[str] | None = None,
                 limits: ConnectionLimits | None = None, tls: ServerTls | None = None,
                 http: str = "auto") -> None:
        self.app, self.tls, self.http = app, tls, http
        self.forwarded_allow_ips = forwarded_allow_ips or None
        self.limits = limits or ConnectionLimits()
        self.guard: ConnectionGuard | None = None
        self.accept_log: AcceptErrorLog | None = None
        self.server: uvicorn.Server | None = None
        self.task: asyncio.Task[None] | None = None
        self.host, self.port = "", 0

    @property
    def address(self) -> str:
        """``host:port`` it serves on ("" before ``start``)."""
        return f"{self.host}:{self.port}" if self.port else ""

    async def start(self, host: str, port: int, start_timeout_s: float = 10.0) -> int:
        """Serve on ``host:port`` (0: any free port); returns the bound port.

        Raises:
            OSError: the address cannot be bound.
            RuntimeError: uvicorn did not come up within ``start_timeout_s``.
            ValueError: a TLS file is no longer what ``ServerTls.check`` found (nothing is bound).
        """
        tls_context = self.tls.ssl_context() if self.tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        sock.listen(self.limits.backlog)
        sock.setblocking(False)
        # no ws: an upgraded connection would leave the guarded protocol uncounted
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1, ws="none", backlog=self.limits.backlog, http=self.http,
                                proxy_headers=self.forwarded_allow_ips is not None,
                                forwarded_allow_ips=self.forwarded_allow_ips)
        try:
            config.load()
        except BaseException:
            sock.close()
            raise
        self.host, self.port = host, sock.getsockname()[1]
        self.guard = ConnectionGuard(self.limits, self.forwarded_allow_ips)
        config.http_protocol_class = guarded_protocol(config.http_protocol_class, self.guard, tls_context)
        self.server = uvicorn.Server(config)
        self.accept_log = AcceptErrorLog(asyncio.get_running_loop(), sock.fileno(), guard=self.guard)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + start_timeout_s
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {start_timeout_s:g} s")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses end (1 s at most), release the connections
        lingering in the kernel's send queue (closed normally, not reset: the kernel goes on
        delivering to their clients; ``Lingering.release``), then return."""
        if self.server is None or self.task is None:
            return
        self.server.should_exit = True
        if self.guard is not None:
            self.guard.end_handshakes()
        try:
            await asyncio.wait_for(self.task, 5.0)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - stopping anyway
            log.warning("HTTP server stop: %s", exc)
        if self.guard is not None:
            self.guard.end_lingering()
        if self.accept_log is not None:
            self.accept_log.remove()
