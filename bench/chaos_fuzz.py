"""Fuzzing the public API and the data plane: hypothesis messages for every RPC, garbage bytes
into every ZeroMQ socket.

- ``message_strategy(cls)``: any message of a protobuf class, built from its descriptor:
  every scalar type over its whole range (NaN and infinities, unicode text, binary), unknown
  enum values, nested messages, ``oneof`` and ``optional`` fields, and repeated fields from
  empty to huge (up to 300,000 scalars or 5,000 messages; strings of up to 5 MB, past gRPC's
  4 MB limit), huge only in the top-level message;
- ``rpc_methods()``: every method of every kvstrata service with its request class;
- ``call_rpc``: one call over a real channel with a deadline; a stream is read to its first
  message and then cancelled. Returns the status code's name;
- ``garbage_frames`` / ``send_garbage``: random bytes and wrong-shape msgpack objects, sent as
  ZeroMQ messages and as raw TCP bytes to an address.

A reply is *defined* when its code is one of ``DEFINED_CODES``; UNKNOWN, INTERNAL,
UNAVAILABLE and DEADLINE_EXCEEDED (a hang) are faults.
"""

from __future__ import annotations

import socket
import string
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack
import zmq
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import strategies as st

from kvstrata.v1 import admin_pb2, inference_pb2, tenant_pb2

DEFINED_CODES = frozenset({
    "OK", "INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "NOT_FOUND", "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "OUT_OF_RANGE",
})

FUZZ_TENANT = "fuzz-target"
"""The tenant fuzzed calls authenticate as (never named in a message, so never deleted)."""
FUZZ_NAMED = "fuzz-named"
"""The tenant fuzzed messages name (other tenants are never named)."""

_INTS = {
    FD.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), FD.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FD.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), FD.TYPE_UINT32: (0, (1 << 32) - 1),
    FD.TYPE_FIXED32: (0, (1 << 32) - 1), FD.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FD.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), FD.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FD.TYPE_UINT64: (0, (1 << 64) - 1), FD.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=64)
_HUGE_TEXT = st.integers(0, 5_000_000).map(lambda n: "é" * (n // 2))


def _is_repeated(field: FD) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6 drops ``label``
    return bool(repeated) if repeated is not None else field.label == FD.LABEL_REPEATED


def _scalar(field: FD, depth: int) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, 1]))
    if field.type == FD.TYPE_DOUBLE:
        return st.floats()
    if field.type == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if field.type == FD.TYPE_BOOL:
        return st.booleans()
    if field.type == FD.TYPE_STRING:
        named = st.one_of(_TEXT, st.sampled_from(["", FUZZ_NAMED, "default", "x" * 63]))
        return st.one_of(named, _HUGE_TEXT) if depth == 0 else named
    if field.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(1 << 31), (1 << 31) - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {field.type}")


def _repeated(field: FD, depth: int) -> st.SearchStrategy[list[Any]]:
    """Small lists anywhere; huge ones (one element repeated) only in the top-level message,
    whose nested elements are small: a huge list of huge elements would need gigabytes."""
    element = _value(field, depth) if field.type == FD.TYPE_MESSAGE else _scalar(field, depth + 1)
    small = st.lists(element, max_size=8)
    if depth > 0:
        return small
    most = 5_000 if field.type == FD.TYPE_MESSAGE else 300_000
    return st.one_of(small, st.tuples(element, st.integers(0, most)).map(lambda t: [t[0]] * t[1]))


def _is_map(field: FD) -> bool:
    return field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _map(field: FD, depth: int) -> st.SearchStrategy[dict[Any, Any]]:
    """A map field (``map<K, V>``, e.g. ``SamplingParams.logit_bias``): small dicts of any keys
    and values anywhere; in the top-level message also one with many distinct integer keys."""
    key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
    small = st.dictionaries(_scalar(key, depth + 1), _value(value, depth + 1), max_size=8)
    if depth > 0 or key.type not in _INTS or value.type == FD.TYPE_MESSAGE:
        return small
    many = st.tuples(_scalar(value, depth + 1), st.integers(0, 20_000)).map(lambda t: dict.fromkeys(range(t[1]), t[0]))
    return st.one_of(small, many)


def _value(field: FD, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FD.TYPE_MESSAGE:
        return message_strategy(field.message_type._concrete_class, depth + 1)
    return _scalar(field, depth)


def _assign(msg: Any, field: FD, value: Any) -> None:
    if _is_map(field):
        target = getattr(msg, field.name)
        for k, v in value.items():
            if field.message_type.fields_by_name["value"].type == FD.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif _is_repeated(field):
        target = getattr(msg, field.name)
        if field.type == FD.TYPE_MESSAGE:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.type == FD.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def message_strategy(cls: type, depth: int = 0) -> st.SearchStrategy[Any]:
    """Any ``cls`` message (nested messages below depth 3 are left empty)."""

    @st.composite
    def build(draw: Any) -> Any:
        msg = cls()
        if depth >= 3:
            return msg
        for field in cls.DESCRIPTOR.fields:
            if field.containing_oneof is not None or not draw(st.booleans()):
                continue
            strat = (_map(field, depth) if _is_map(field) else _repeated(field, depth) if _is_repeated(field)
                     else _value(field, depth))
            _assign(msg, field, draw(strat))
        for oneof in cls.DESCRIPTOR.oneofs:
            field = draw(st.sampled_from([None, *oneof.fields]))
            if field is not None:
                _assign(msg, field, draw(_value(field, depth)))
        return msg

    return build()


def generate_requests(vocab_size: int) -> st.SearchStrategy[Any]:
    """GenerateRequests in and near the valid region (so they get past the first checks and
    run on a node): valid ones with every policy spec below, token ids around the
    vocabulary's edge, small and huge ``max_tokens``, odd sampling values."""
    ids = st.lists(st.one_of(st.integers(0, vocab_size + 10), st.just((1 << 32) - 1)), min_size=0, max_size=64)
    sampling = st.builds(
        inference_pb2.SamplingParams, max_tokens=st.sampled_from([0, 1, 4, 8, 2047, 1 << 20, (1 << 32) - 1]),
        temperature=st.floats(width=32), top_p=st.floats(width=32),
        seed=st.integers(0, (1 << 64) - 1), stop_token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=4),
        ignore_eos=st.booleans(),
    )
    chat = st.lists(st.builds(inference_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "tool", "", "rôle"]),
                              content=_TEXT), max_size=3).map(lambda m: inference_pb2.ChatMessages(messages=m))
    policy = st.sampled_from(["", "full", "h2o", "h2o-40", "quant-bits_8-window_tokens_0", "streaming-0",
                              "snapkv-x_1", "nope", "h2o--", "sentencekv-budget_bytes_0"])
    valid = st.builds(
        inference_pb2.GenerateRequest,
        tokens=st.builds(inference_pb2.TokenIds, ids=st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=48)),
        sampling=st.builds(inference_pb2.SamplingParams, max_tokens=st.integers(1, 8),
                           temperature=st.floats(0, 2, width=32), top_p=st.floats(0.0625, 1, width=32),
                           seed=st.integers(0, (1 << 64) - 1), ignore_eos=st.booleans()),
        session_id=st.sampled_from(["", "s1"]), policy=policy,
    )
    return st.one_of(
        valid,
        st.builds(inference_pb2.GenerateRequest, tokens=st.builds(inference_pb2.TokenIds, ids=ids),
                  sampling=sampling, session_id=st.sampled_from(["", "s1", "ü" * 3]), policy=policy,
                  request_id=st.sampled_from(["", "r1", "chaos-fixed-id"])),
        st.builds(inference_pb2.GenerateRequest, chat=chat, sampling=sampling, policy=policy),
    )


@dataclass(frozen=True)
class RpcMethod:
    service: str
    name: str
    request_cls: type
    response_cls: type
    streaming: bool

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"


def rpc_methods() -> list[RpcMethod]:
    """Every method of the Tenant, Inference and Admin services."""
    out = []
    for module in (tenant_pb2, inference_pb2, admin_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                out.append(RpcMethod(service.full_name, m.name, m.input_type._concrete_class,
                                     m.output_type._concrete_class, m.server_streaming))
    return out


_ASCII = st.text(alphabet=string.ascii_letters + string.digits + "-_.=+/ ", max_size=80)


def auth_metadata(keys: dict[str, str]) -> st.SearchStrategy[tuple[str, tuple[tuple[str, str], ...]]]:
    """(label, metadata): one of ``keys`` (label -> key) or, with no keys, no key, a garbage
    bearer or the wrong scheme."""
    if keys:
        return st.sampled_from([(label, (("authorization", f"Bearer {key}"),)) for label, key in keys.items()])
    return st.one_of(
        st.just(("none", ())),
        _ASCII.map(lambda k: ("garbage", (("authorization", f"Bearer {k}"),))),
        _ASCII.map(lambda k: ("scheme", (("authorization", k),))),
    )


def call_rpc(channel: grpc.Channel, method: RpcMethod, request: Any,
             metadata: tuple[tuple[str, str], ...], timeout_s: float = 15.0) -> str:
    """Send ``request``; the name of the status it ended with (a stream: "OK" once its first
    message arrives, then the call is cancelled)."""
    kind = channel.unary_stream if method.streaming else channel.unary_unary
    call = kind(method.path, request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=method.response_cls.FromString)
    try:
        if method.streaming:
            stream = call(request, metadata=metadata, timeout=timeout_s)
            try:
                next(stream, None)
            finally:
                stream.cancel()
        else:
            call(request, metadata=metadata, timeout=timeout_s)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def garbage_frames() -> st.SearchStrategy[list[bytes]]:
    """One ZeroMQ message: random bytes, or msgpack of shapes the peers read (``op``/``id``/
    ``req``/``sub`` dicts, lists of pairs) with wrong types and values, one or more frames."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                     _TEXT, st.binary(max_size=32))
    obj = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=12)
    shaped = st.one_of(
        st.fixed_dictionaries({"op": st.sampled_from(["submit", "abort", "x", 3]), "id": obj, "req": obj, "sub": obj}),
        st.fixed_dictionaries({"id": obj, "req": obj, "sub": obj, "hashes": obj}),
        st.fixed_dictionaries({"id": obj, "adm": obj}),
        st.lists(st.tuples(obj, obj), max_size=4),
        obj,
    )
    packed = shaped.map(lambda o: msgpack.packb(o, use_bin_type=True))
    return st.lists(st.one_of(st.binary(max_size=256), packed), min_size=1, max_size=3)


_PEER = {zmq.PULL: zmq.PUSH, zmq.ROUTER: zmq.DEALER}


def send_garbage(address: str, socket_type: int, messages: list[list[bytes]], raw: list[bytes],
                 secure: Any = None) -> bool:
    """Send ``messages`` as ZeroMQ messages from the matching peer socket type (PUSH to a PULL,
    DEALER to a ROUTER), then ``raw`` as plain TCP bytes on fresh connections.

    Args:
        secure: called with the socket before it connects (CURVE client keys,
            ``services.data_plane_auth``); None sends as a peer without keys.

    Returns:
        Whether the ZeroMQ messages were accepted (False: the handshake was refused, as it is
        for a peer without the deployment's keys, and nothing was sent).
    """
    ctx = zmq.Context()
    accepted = True
    try:
        sock = ctx.socket(_PEER[socket_type])
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.SNDTIMEO, 3000)
        if secure is not None:
            secure(sock)
        sock.connect(address)
        try:
            for frames in messages:
                sock.send_multipart(frames)
        except zmq.Again:  # no completed handshake: nowhere to send
            accepted = False
        sock.close(linger=2000 if accepted else 0)
    finally:
        # libzmq's term can block on a connect still in a refused CURVE handshake: bounded,
        # off this thread
        closer = threading.Thread(target=ctx.term, daemon=True)
        closer.start()
        closer.join(5)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    for data in raw:
        with socket.create_connection((host, int(port)), timeout=2.0) as conn:
            conn.sendall(data)

