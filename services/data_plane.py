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
   ``[[request_id, event], ...]`` (event dicts as in ``services.node_request``), split into
   consecutive messages where it would not fit ``EVENT_LIMITS`` (``PushSockets.send_events``).

``sub`` (the subscriber) is the gateway's event inbox address. Messages are msgpack. Every
socket binds a random port on loopback (a cluster on one machine) or on its Ray node's IP; Ray
nodes must then reach each other on those ports as they already must on Ray's worker ports.
Every socket is CURVE-authenticated and encrypted, and serves only the roles that send to it
(``services.data_plane_auth``).

Every byte that arrives is untrusted, our own processes' too: each message is decoded within
its socket's limits (``unpack``, ``MessageLimits``: what it may expand to is bounded before it is
built), and each reader checks a message's shape, types and values (``request_from_wire``,
``event_items``, ``admission_reply``) and drops and counts a bad one (``bad_messages`` in the
owner's stats), never ending its loop on it.

Where its parts live: ``services.data_plane_wire`` (the wire's limits, ``MAX_*`` and
``MessageLimits``, and a request's wire form, ``request_to_wire``, ``request_from_wire``),
``services.data_plane_replies`` (node events and admission replies: ``check_event``, ``checked_event_items``, ``event_items``,
``admission_reply``, ``BadReply``, ``status_names``). This module keeps the sockets (``context``,
``bind_random``, ``serving_socket``, ``PushSockets``) and msgpack (``pack``, ``unpack``,
``event_messages``), and re-exports those names, so ``data_plane.request_to_wire`` and the like
keep working.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from cache_node.msgpack_bounds import unpackb_within
from services.data_plane_replies import (  # noqa: F401 - re-exported
    BadReply,
    admission_reply,
    check_event,
    check_logprobs_asked,
    checked_event_items,
    event_item_pairs,
    event_items,
    looks_like_event,
    status_names,
)
from services.data_plane_wire import (  # noqa: F401 - re-exported
    EVENT_LIMITS,
    FINISH_REASONS,
    MAX_COUNT,
    MAX_ID_CHARS,
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_RETRY_AFTER_S,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    REPLY_LIMITS,
    REQUEST_LIMITS,
    MessageLimits,
    request_from_wire,
    request_to_wire,
)

log = logging.getLogger(__name__)

SEND_HWM = 1 << 20
"""Messages a PUSH socket queues for a slow peer before dropping (see ``PushSockets``)."""


def host_ip() -> str:
    """The IP other Ray nodes reach this process on (loopback outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, limits: MessageLimits = REQUEST_LIMITS) -> Any:
    """The msgpack message ``data`` (str as str, bin as bytes), decoded within ``limits``
    (``MessageLimits``; the default is a request's or a node command's, the widest in elements).

    Raises:
        ValueError: ``data`` is larger or holds more than ``limits`` allow (caught before the
            objects past the bound are built), or an extension type;
        msgpack's errors (``ValueError`` subclasses, ``StackError``...): it is not msgpack.
    """
    if len(data) > limits.max_bytes:
        raise ValueError(f"a message of {len(data)} bytes (at most {limits.max_bytes})")
    return unpackb_within(data, limits, "any message of its kind")


def event_messages(items: list[Any], limits: MessageLimits = EVENT_LIMITS) -> Iterator[bytes]:
    """``items`` (a node's events for one gateway, ``[[request_id, event], ...]``) packed as
    consecutive messages, in their order, each of which ``unpack(message, limits)`` decodes:
    at most ``max_array_len`` items and ``max_bytes`` bytes, and within ``max_containers`` and
    ``max_elements`` as ``unpackb_within`` counts them. One message when it fits (a message of at
    most that many bytes does: every container and element takes a byte or more); else
    items are grouped by their exact cost, and a group over ``max_bytes`` is halved. An item
    too large on its own (a string past ``max_str_len``, a container past ``max_map_len``) is
    its sender's to bound: it goes alone.

    Regression (review 25c 1): a step's one message per gateway, or a failed node's
    UNAVAILABLE for every stream, past ``MAX_EVENTS_PER_MESSAGE`` events (16,385 streams
    ending in one step, which ``max_num_seqs`` allows) was refused whole at the gateway, and
    every stream in it waited for ever."""
    data = pack(items)
    if len(items) <= limits.max_array_len and len(data) <= min(limits.max_bytes, limits.max_containers,
                                                                limits.max_elements):
        yield data
        return
    chunk: list[Any] = []
    containers, elements = 1, 0  # the message's own array
    for item in items:
        item_containers, item_elements = _cost(item)
        if chunk and (len(chunk) == limits.max_array_len or containers + item_containers > limits.max_containers
                      or elements + 1 + item_elements > limits.max_elements):
            yield from _within_bytes(chunk, limits.max_bytes)
            chunk, containers, elements = [], 1, 0
        chunk.append(item)
        containers += item_containers
        elements += 1 + item_elements
    if chunk:
        yield from _within_bytes(chunk, limits.max_bytes)


def _cost(obj: Any) -> tuple[int, int]:
    """The arrays and maps ``obj`` is, or holds, and their elements, as ``unpackb_within`` counts
    them when it is decoded (map keys are strings in every event)."""
    if isinstance(obj, dict):
        containers, elements, values = 1, 2 * len(obj), obj.values()
    elif isinstance(obj, (list, tuple)):
        containers, elements, values = 1, len(obj), obj
    else:
        return 0, 0
    for value in values:
        if isinstance(value, (dict, list, tuple)):
            more_containers, more_elements = _cost(value)
            containers += more_containers
            elements += more_elements
    return containers, elements


def _within_bytes(items: list[Any], max_bytes: int) -> Iterator[bytes]:
    data = pack(items)
    if len(data) <= max_bytes or len(items) == 1:
        yield data
        return
    half = len(items) // 2
    yield from _within_bytes(items[:half], max_bytes)
    yield from _within_bytes(items[half:], max_bytes)


class _Context(zmq.Context):
    """A context the garbage collector never terminates (``destroy`` ends it; whoever makes
    one destroys it). pyzmq's ``Context.__del__`` calls ``destroy``, whose ``term`` waits
    until every socket is closed: a context collected in one cycle with its sockets waited
    forever on sockets whose own finalizers had not run yet, in the collecting thread (a
    test run hung in a JSON decode that happened to trigger that collection)."""

    def __del__(self) -> None:
        return None


class _AsyncContext(zmq.asyncio.Context):
    __doc__ = _Context.__doc__

    def __del__(self) -> None:
        return None


def context(asyncio_: bool = False) -> zmq.Context:
    """A fresh ZeroMQ context (asyncio sockets with ``asyncio_``) whose sockets never linger:
    closing one drops its unsent messages, so ending a context never waits on a dead peer;
    nor does the garbage collector ever wait on it (``_Context``)."""
    ctx = _AsyncContext() if asyncio_ else _Context()
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a free port in 49152-65535 (IANA's dynamic range, the one deploy/README
    tells firewalls to open) on ``host``; returns its ``tcp://host:port`` address. (pyzmq lets
    the OS pick any port when given its default range, so the range is passed as 49152-65534.)"""
    port = sock.bind_to_random_port(f"tcp://{host}", min_port=49152, max_port=65535, max_tries=1000)
    return f"tcp://{host}:{port}"


def serving_socket(ctx: zmq.Context, kind: int, security: Any) -> tuple[zmq.Socket, str]:
    """A socket of ``kind`` bound to a free port, accepting messages up to
    ``MAX_MESSAGE_BYTES``; returns it and its address.

    With ``security`` (a ``data_plane_auth.Security``) it is a CURVE server on
    ``security.host`` ("" = this Ray node's IP) admitting only the roles that send to it
    (the context's authenticator, ``Security.start_authenticator``, must be running). Without,
    plaintext on loopback: unit tests of the plain classes only, never a deployment.
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if security is None:
        return sock, bind_random(sock, "127.0.0.1")
    security.serve(sock)
    return sock, bind_random(sock, security.host or host_ip())


class PushSockets:
    """One connected ``PUSH`` socket per peer address, created on first use.

    Sends never block: a peer that is gone or ``SEND_HWM`` messages behind loses the message
    (logged). Use from one thread only (ZeroMQ sockets are not thread-safe).

    Args:
        secure: called with each new socket before it connects (CURVE client keys,
            ``data_plane_auth.secure_push``); None = plaintext.
    """

    def __init__(self, secure: Callable[[zmq.Socket], None] | None = None) -> None:
        self.context = context()
        self.secure = secure
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, address: str, obj: Any) -> bool:
        """Push ``obj`` (one message, as it is: a node command) to ``address``; False if it
        was dropped."""
        return self._send(address, pack(obj))

    def send_events(self, address: str, items: list[Any]) -> bool:
        """Push a node's events ``items`` (``[[request_id, event], ...]``) to the gateway event
        inbox ``address``, as many messages as ``EVENT_LIMITS`` needs (``event_messages``), in
        order on the one socket; False if any was dropped."""
        sent = True
        for data in event_messages(items):
            sent = self._send(address, data) and sent
        return sent

    def _send(self, address: str, data: bytes) -> bool:
        sock = self._socks.get(address)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            if self.secure is not None:
                self.secure(sock)
            sock.connect(address)
            self._socks[address] = sock
        try:
            sock.send(data, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.warning("data plane: %s is not reading; a message was dropped", address)
            return False

    def forget(self, address: str) -> None:
        """Close the socket to ``address`` (its peer is gone), dropping what it had not sent."""
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self, linger_s: float = 0.0) -> None:
        """Close every socket; messages not yet sent are dropped, or sent for up to ``linger_s``
        seconds first (this call blocks that long at most)."""
        self._socks.clear()
        self.context.destroy(linger=int(linger_s * 1000))
