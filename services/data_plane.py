"""The request data plane: ZeroMQ sockets between the gateway, the GlobalScheduler and cache nodes.

Ray places the actors and carries the control calls (tenants, sessions, stats, block events).
A request's hot path does not go through Ray actor calls, which cost 1.5-3 ms per hop on a
2-core machine against ~0.4 ms for a ZeroMQ message (the same split as vLLM's API server and
engine core, or SGLang's tokenizer manager and scheduler):

1. gateway -> scheduler, ``DEALER`` -> ``ROUTER``: ``{"id", "req", "sub", "hashes"}``; the
   scheduler admits and routes the request and answers ``{"id", "adm"}``;
2. scheduler -> the chosen node's command inbox, ``PUSH`` -> ``PULL``: ``{"op": "submit",
   "req", "sub"}``; the gateway's aborts go to the same inbox as ``{"op": "abort", "id"}``;
3. node -> gateway event inbox, ``PUSH`` -> ``PULL``: one message per engine step and gateway,
   ``[[request_id, event], ...]`` (event dicts as in ``services.node_request``).

``sub`` (the subscriber) is the gateway's event inbox address. Messages are msgpack. Every
socket binds a random port on its Ray node's IP; Ray nodes must reach each other on those ports
as they already must on Ray's worker ports.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from cache_node.sampling_params import SamplingParams
from services.node_request import NodeRequest

log = logging.getLogger(__name__)

SEND_HWM = 1 << 20
"""Messages a PUSH socket queues for a slow peer before dropping (see ``PushSockets``)."""


def host_ip() -> str:
    """The IP other Ray nodes reach this process on (loopback outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def request_to_wire(req: NodeRequest) -> dict[str, Any]:
    """``req`` as msgpack-ready fields (shallow: ``dataclasses.asdict`` deep-copies every token
    id, ~1 ms for an 800-token prompt here)."""
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    fields["sampling"] = {f.name: getattr(req.sampling, f.name) for f in dataclasses.fields(req.sampling)}
    return fields


def request_from_wire(data: dict[str, Any]) -> NodeRequest:
    """Inverse of ``request_to_wire`` (msgpack turns tuples into lists).

    Raises:
        ValueError: out-of-range sampling parameters (``SamplingParams``); TypeError: unknown
            or missing fields.
    """
    fields = dict(data)
    fields["sampling"] = SamplingParams(**fields["sampling"])
    fields["messages"] = tuple(dict(m) for m in fields.get("messages", ()))
    fields["token_ids"] = tuple(fields.get("token_ids", ()))
    return NodeRequest(**fields)


def context(asyncio_: bool = False) -> zmq.Context:
    """A fresh ZeroMQ context (asyncio sockets with ``asyncio_``) whose sockets never linger:
    closing one drops its unsent messages, so ending a context never waits on a dead peer."""
    ctx = zmq.asyncio.Context() if asyncio_ else zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a free port on ``host``; returns its ``tcp://host:port`` address."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


class PushSockets:
    """One connected ``PUSH`` socket per peer address, created on first use.

    Sends never block: a peer that is gone or ``SEND_HWM`` messages behind loses the message
    (logged). Use from one thread only (ZeroMQ sockets are not thread-safe).
    """

    def __init__(self) -> None:
        self.context = context()
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, address: str, obj: Any) -> bool:
        sock = self._socks.get(address)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.connect(address)
            self._socks[address] = sock
        try:
            sock.send(pack(obj), flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.warning("data plane: %s is not reading; a message was dropped", address)
            return False

    def close(self, linger_s: float = 0.0) -> None:
        """Close every socket; messages not yet sent are dropped, or sent for up to ``linger_s``
        seconds first (this call blocks that long at most)."""
        self._socks.clear()
        self.context.destroy(linger=int(linger_s * 1000))
