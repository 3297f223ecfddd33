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
socket binds a random port on loopback (a cluster on one machine) or on its Ray node's IP; Ray
nodes must then reach each other on those ports as they already must on Ray's worker ports.
Every socket is CURVE-authenticated and encrypted, and serves only the roles that send to it
(``services.data_plane_auth``).

Every byte that arrives is untrusted, our own processes' too: each reader checks a message's
shape, types and values (``request_from_wire``, ``event_items``, ``admission_reply``) and drops
and counts a bad one (``bad_messages`` in the owner's stats), never ending its loop on it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Collection
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from cache_node.sampling_params import SamplingParams
from services.node_request import NodeRequest, check_priority, resolve_prefix_tokens
from tenants.model import POLICY_PATTERN

log = logging.getLogger(__name__)

SEND_HWM = 1 << 20
"""Messages a PUSH socket queues for a slow peer before dropping (see ``PushSockets``)."""

MAX_MESSAGE_BYTES = 64 << 20
"""Largest message a serving socket accepts (ZeroMQ drops the connection of a peer sending more)."""

MAX_TOKEN_ID = (1 << 31) - 1
MAX_COUNT = (1 << 31) - 1
"""Largest token count (or block count) a message may carry."""
MAX_RETRY_AFTER_S = 86400.0
"""Longest ``retry_after_s`` an admission reply may carry."""
MAX_TEXT_CHARS = 4096
"""Free text (an admission's or an error event's ``message``, a scheduler's error) past this is
cut: it becomes a gRPC status' details, which the client's metadata limit bounds."""
MAX_NAME_CHARS = 64
"""Longest ``finish_reason``, admission ``reason`` or tier name in ``cached_tokens``."""
MAX_ID_CHARS = 1024
"""Longest request id or tenant id on the wire (the gateway's scoped ids are far shorter)."""

_REQUEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "request_id": str, "tenant": str, "cache_namespace": str, "sampling": dict, "messages": (list, tuple),
    "token_ids": (list, tuple), "session_id": str, "policy": str, "max_context_tokens": int,
    "arrival_time_s": (int, float), "extra": dict, "prefetch": (bool, type(None)), "priority": int,
    "prefix_tokens": int, "continues_session": bool,
}
_REQUIRED = ("request_id", "tenant", "cache_namespace", "sampling")
_SAMPLING_FIELDS: dict[str, type | tuple[type, ...]] = {  # ``SamplingParams``' fields
    "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": (int, type(None)),
    "stop_token_ids": (list, tuple), "ignore_eos": bool, "stop": (list, tuple),
}

_NUMBER = (int, float)
_EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {  # all required
    "started": {"request_id": str, "node_id": str, "prompt_tokens": int},
    "delta": {"token_ids": list, "text": str},
    "finished": {"finish_reason": (str, type(None)), "prompt_tokens": int, "completion_tokens": int},
    "error": {"code": str, "message": str},
}
_EVENT_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "cached_tokens": dict, "queue_ms": _NUMBER, "ttft_ms": _NUMBER, "tpot_ms": _NUMBER,
    "preempted": bool, "prefill_tokens_per_s": _NUMBER, "step_s": _NUMBER, "priority": int,
    "policy_stats": dict,
}

_ADMISSION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "node_id": str, "code": str, "message": str, "retry_after_s": (int, float), "spill_blocks": int,
    "reason": str, "continues_session": bool,
}


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


def _check_type(what: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise TypeError(f"{what} must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be {kind}, got {type(value).__name__}")


def _check_fields(what: str, data: Any, schema: dict[str, Any], required: tuple[str, ...]) -> None:
    """``data`` is a dict whose known keys have the schema's types; no unknown key, no missing
    required one. Raises TypeError."""
    _check_type(what, data, dict)
    unknown = set(data) - set(schema)
    if unknown:
        raise TypeError(f"{what}: unknown fields {sorted(map(str, unknown))}")
    for name in required:
        if name not in data:
            raise TypeError(f"{what}: missing field {name!r}")
    for name, value in data.items():
        _check_type(f"{what}.{name}", value, schema[name])


def _check_str_map(what: str, value: dict[Any, Any]) -> None:
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError(f"{what} must map strings to strings")


def request_from_wire(data: Any) -> NodeRequest:
    """Inverse of ``request_to_wire`` (msgpack turns tuples into lists), checking every field's
    type: ``data`` comes off the network.

    Raises:
        ValueError: out-of-range values (token ids outside [0, 2**31), a priority outside
            [-1000, 1000], ``prefix_tokens`` outside [0, len(token_ids)], sampling parameters, ``SamplingParams``),
            a ``session_id`` over ``MAX_ID_CHARS`` or a ``policy`` off the policy pattern (63
            characters at most: the node parses it on its step thread; security review 19 H2);
            TypeError: unknown, missing or mistyped fields.
    """
    _check_fields("request", data, _REQUEST_FIELDS, _REQUIRED)
    fields = dict(data)
    for name in ("request_id", "tenant"):
        if not 0 < len(fields[name]) <= MAX_ID_CHARS:
            raise ValueError(f"request.{name} must have 1 to {MAX_ID_CHARS} characters")
    if len(fields.get("session_id", "")) > MAX_ID_CHARS:
        raise ValueError(f"request.session_id must have at most {MAX_ID_CHARS} characters")
    policy = fields.get("policy", "")
    if policy and POLICY_PATTERN.fullmatch(policy) is None:  # parsed on the node's step thread
        raise ValueError(f"request.policy must match {POLICY_PATTERN.pattern}, got {policy[:80]!r}")
    tokens = fields.get("token_ids", [])
    if not all(type(t) is int for t in tokens):
        raise TypeError("request.token_ids must be integers")
    if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
        raise ValueError(f"request.token_ids must lie in [0, {MAX_TOKEN_ID}]")
    for message in fields.get("messages", []):
        _check_type("request.messages[]", message, dict)
        _check_str_map("request.messages[]", message)
    _check_str_map("request.extra", fields.get("extra", {}))
    check_priority(fields.get("priority", 0))
    if fields.get("prefix_tokens", 0):  # of token_ids only (a node renders messages whole)
        resolve_prefix_tokens(fields["prefix_tokens"], 0, fields.get("messages") or tokens, tokens, None)
    sampling = fields["sampling"]  # each field its exact type (regression: "0.5" for top_p
    _check_fields("request.sampling", sampling, _SAMPLING_FIELDS, ())  # passed, and raised in
    for value in sampling.get("stop_token_ids", ()):  # the step for every request in it)
        _check_type("request.sampling.stop_token_ids[]", value, int)
    for value in sampling.get("stop", ()):
        _check_type("request.sampling.stop[]", value, str)
    if isinstance(sampling.get("seed"), bool):
        raise TypeError("request.sampling.seed must be an integer, got a bool")
    fields["sampling"] = SamplingParams(**sampling)
    fields["messages"] = tuple(dict(m) for m in fields.get("messages", ()))
    fields["token_ids"] = tuple(fields.get("token_ids", ()))
    return NodeRequest(**fields)


class BadReply(ValueError):
    """An admission reply whose envelope (its correlation id ``corr``) is sound and whose
    values are not: the admission it answers fails (``NodeStreams``)."""

    def __init__(self, corr: Any, message: str) -> None:
        super().__init__(message)
        self.corr = corr


def _check_range(what: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # NaN fails too
        raise ValueError(f"{what} must lie in [{low}, {high}], got {value!r}")


def _check_len(what: str, value: str, high: int, low: int = 0) -> None:
    if not low <= len(value) <= high:
        raise ValueError(f"{what} must have {low} to {high} characters, got {len(value)}")


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "\u2026"


_EVENT_COUNTS = ("prompt_tokens", "completion_tokens")
_EVENT_TIMES = ("queue_ms", "ttft_ms", "tpot_ms", "prefill_tokens_per_s", "step_s")


def check_event(event: Any) -> dict[str, Any]:
    """``event`` (a node event as in ``services.node_request``) checked: its type's fields
    with their types, and their values: counts, token ids and ``cached_tokens`` in
    [0, ``MAX_COUNT``], times finite and >= 0, ``priority`` in range, ids and names bounded,
    an error's ``code`` a gRPC status name other than OK. Returns it (an error's ``message``
    cut to ``MAX_TEXT_CHARS``).

    Raises:
        TypeError, ValueError: naming the bad field.

    Regression (security review D): only types were checked: a negative count or token id
    failed later, in the stream's protobuf (uint32) or metrics counter, and one bad event
    dropped its whole message, leaving every stream in it waiting for events that never came.
    """
    _check_type("event", event, dict)
    schema = _EVENT_FIELDS.get(event.get("type"))
    if schema is None:
        raise ValueError(f"unknown event type {event.get('type')!r}")
    for name, kind in schema.items():
        _check_type(f"event.{name}", event.get(name), kind)
    for name, kind in _EVENT_OPTIONAL.items():
        if name in event:
            _check_type(f"event.{name}", event[name], kind)
    tokens = event.get("token_ids", ())
    if not all(type(t) is int for t in tokens):
        raise TypeError("event.token_ids must be integers")
    if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
        raise ValueError(f"event.token_ids must lie in [0, {MAX_TOKEN_ID}]")
    cached = event.get("cached_tokens", {})
    if not all(isinstance(k, str) and type(v) is int for k, v in cached.items()):
        raise TypeError("event.cached_tokens must map tier names to integers")
    if len(cached) > 16 or not all(len(k) <= MAX_NAME_CHARS and 0 <= v <= MAX_COUNT for k, v in cached.items()):
        raise ValueError(f"event.cached_tokens must map at most 16 tier names to counts in [0, {MAX_COUNT}]")
    for name in _EVENT_COUNTS:
        if name in event:
            _check_range(f"event.{name}", event[name], 0, MAX_COUNT)
    for name in _EVENT_TIMES:
        if name in event:
            _check_range(f"event.{name}", event[name], 0, math.inf)
            if math.isinf(event[name]):
                raise ValueError(f"event.{name} must be finite")
    if "priority" in event:
        check_priority(event["priority"])
    for name in ("request_id", "node_id"):
        if name in event:
            _check_len(f"event.{name}", event[name], MAX_ID_CHARS)
    if isinstance(event.get("finish_reason"), str):
        _check_len("event.finish_reason", event["finish_reason"], MAX_NAME_CHARS)
    if event["type"] == "error":
        if event["code"] not in status_names() or event["code"] == "OK":
            raise ValueError(f"event.code must be a gRPC status name other than OK, got {event['code']!r}")
        if len(event["message"]) > MAX_TEXT_CHARS:
            event = {**event, "message": _cut(event["message"])}
    return event


def checked_event_items(data: Any) -> list[tuple[str, dict[str, Any] | TypeError | ValueError]]:
    """The non-empty ``[[request_id, event], ...]`` of a node's event message, in order, each
    event checked (``check_event``) and replaced by the error that refused it when bad: a bad
    event fails its own request alone.

    Raises:
        TypeError, ValueError: ``data`` is not such a list (the whole message is bad).
    """
    _check_type("events", data, list)
    if not data:
        raise ValueError("an event message holds at least one event")
    items: list[tuple[str, dict[str, Any] | TypeError | ValueError]] = []
    for item in data:
        if not isinstance(item, list) or len(item) != 2:
            raise TypeError("an event item must be [request_id, event]")
        request_id, event = item
        _check_type("request_id", request_id, str)
        try:
            items.append((request_id, check_event(event)))
        except (TypeError, ValueError) as exc:
            items.append((request_id, exc))
    return items


def event_items(data: Any) -> list[tuple[str, dict[str, Any]]]:
    """``checked_event_items`` of a message whose every event is good.

    Raises:
        TypeError, ValueError: ``data`` is not such a list, or an event in it is bad.
    """
    items = []
    for request_id, event in checked_event_items(data):
        if isinstance(event, Exception):
            raise event
        items.append((request_id, event))
    return items


def admission_reply(data: Any, nodes: Collection[str] | None = None) -> tuple[Any, dict[str, Any] | str]:
    """The correlation id and the admission fields (or the error text, cut to
    ``MAX_TEXT_CHARS``) of a scheduler reply, values checked: ``code`` a gRPC status name,
    ``node_id`` one of ``nodes`` when admitted (None: any), ``retry_after_s`` finite in
    [0, ``MAX_RETRY_AFTER_S``], ``spill_blocks`` in [0, ``MAX_COUNT``], ``reason`` "" or one
    of ``global_scheduler_checks.REJECT_REASONS`` (a metric label), ``node_id`` bounded (``message``
    cut to ``MAX_TEXT_CHARS``).

    Raises:
        BadReply: a sound envelope with bad admission fields (the admission ``corr`` fails);
        TypeError, ValueError: a malformed envelope.

    Regression (security review D): only types were checked, and the gateway trusted the
    values: ``retry_after_s`` inf or NaN raised there (an internal error instead of the
    RESOURCE_EXHAUSTED), a negative one went out as a negative ``retry-after-ms``, and an OK
    naming a node the gateway does not know left its stream waiting forever (its cancel then
    raised KeyError).
    """
    _check_fields("reply", data, {"id": (int, type(None)), "adm": dict, "error": str}, ("id",))
    if "error" in data:
        return data["id"], _cut(data["error"])
    if "adm" not in data:
        raise TypeError("reply: neither adm nor error")
    try:
        adm = _admission_fields(data["adm"], nodes)
    except (TypeError, ValueError) as exc:
        raise BadReply(data["id"], f"{type(exc).__name__}: {exc}") from exc
    return data["id"], adm


def _admission_fields(adm: Any, nodes: Collection[str] | None) -> dict[str, Any]:
    _check_fields("reply.adm", adm, _ADMISSION_FIELDS, tuple(_ADMISSION_FIELDS))
    if adm["code"] not in status_names():
        raise ValueError(f"unknown status {adm['code']!r}")
    if adm["code"] == "OK" and nodes is not None and adm["node_id"] not in nodes:
        raise ValueError(f"reply.adm.node_id {adm['node_id'][:MAX_NAME_CHARS]!r} is no node of this gateway")
    _check_len("reply.adm.node_id", adm["node_id"], MAX_ID_CHARS)
    _check_range("reply.adm.retry_after_s", adm["retry_after_s"], 0, MAX_RETRY_AFTER_S)
    _check_range("reply.adm.spill_blocks", adm["spill_blocks"], 0, MAX_COUNT)
    if adm["reason"] and adm["reason"] not in _reject_reasons():
        raise ValueError(f"reply.adm.reason {adm['reason'][:MAX_NAME_CHARS]!r} is none of REJECT_REASONS")
    return {**adm, "message": _cut(adm["message"])}


@functools.cache
def _reject_reasons() -> frozenset[str]:
    from services.global_scheduler_checks import REJECT_REASONS  # loaded when first needed

    return frozenset(REJECT_REASONS)


@functools.cache
def status_names() -> frozenset[str]:
    """gRPC status code names (what error events and admissions carry)."""
    import grpc

    return frozenset(c.name for c in grpc.StatusCode)


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
        sock = self._socks.get(address)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            if self.secure is not None:
                self.secure(sock)
            sock.connect(address)
            self._socks[address] = sock
        try:
            sock.send(pack(obj), flags=zmq.NOBLOCK, copy=False)
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
