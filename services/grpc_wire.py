"""A gRPC request's raw bytes -> its message, refusing bad input before protobuf builds it.

``CallGate`` (``services.grpc_call_gate``) gives grpc.aio no request deserializer, so its handlers
receive the message's raw bytes, and decodes them with ``RequestDecoder``:

1. ``check_wire_shape`` walks the protobuf wire format (tags, varints, lengths) of the message
   and of the sub-messages that hold repeated fields, skipping every other field by its
   length. It counts the elements of each repeated field over all its occurrences (a packed
   run's varints in C: ``bytes.translate``) and stops at the first count past the field's limit
   (``REPEATED_LIMITS``, else ``DEFAULT_REPEATED_LIMIT``), or at the first message type with
   more fields on the wire than a valid request needs (``_Plan.max_fields``). Each is a
   ``ValueError`` naming the field. The walk reads at most those bounds' fields (O(bounds),
   not O(bytes)) and allocates nothing per element.
2. Then the message type's ``FromString``; any error there (invalid UTF-8 in a string field,
   a truncated or corrupt message) is a plain ``ValueError``: "the request is not a valid
   <type> message", naming no exception or library.

Regression (review 24h G1): grpc's own deserializer raised protobuf's ``DecodeError`` inside the
gate, and the call ended UNKNOWN with "Unexpected <class '...DecodeError'>: ..." on every
service, before the key was fully checked. Regression (review 24h G2): an 8 MiB
``GenerateRequest`` of 4.19M empty chat messages was parsed whole on the gateway's event loop
before ``convert`` counted them (0.15-0.8 s a call; 8 senders slowed another tenant's stream
~10x); the HTTP API counts a body's JSON structure first (``openai_api.bodies.check_body_shape``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from cache_node.structured_output import MAX_CHOICES
from services.chat_tools import MAX_TOOLS
from services.convert import MAX_CHAT_MESSAGES, MAX_PROMPT_TOKEN_IDS, MAX_REQUEST_TOOL_CALLS
from tenants.model import MAX_ALLOWED_POLICIES

REPEATED_LIMITS: dict[str, int] = {
    "kvstrata.v1.ChatMessages.messages": MAX_CHAT_MESSAGES,
    "kvstrata.v1.ChatMessage.tool_calls": MAX_REQUEST_TOOL_CALLS,  # all messages' together
    "kvstrata.v1.GenerateRequest.tools": MAX_TOOLS,
    "kvstrata.v1.TokenIds.ids": MAX_PROMPT_TOKEN_IDS,
    "kvstrata.v1.SamplingParams.stop_token_ids": MAX_STOP_TOKEN_IDS,
    "kvstrata.v1.SamplingParams.stop": MAX_STOP_STRINGS,
    "kvstrata.v1.SamplingParams.logit_bias": MAX_LOGIT_BIAS_TOKENS,  # a map: an entry message each
    "kvstrata.v1.SamplingParams.allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
    "kvstrata.v1.ChoiceList.choices": MAX_CHOICES,  # SamplingParams.structured_output.choice
    "kvstrata.v1.TenantSpec.allowed_policies": MAX_ALLOWED_POLICIES,
}
"""Elements a repeated request field may hold (full field name -> count): the limits ``convert``
and ``TenantSpec`` check after parsing (docs/architecture.md, 'Tenancy and security')."""

DEFAULT_REPEATED_LIMIT = 1024
"""Elements of a repeated request field with no limit of its own."""

FIELD_SLACK = 64
"""Fields on the wire a message may hold beyond one per declared field and its repeated
fields' elements (a client may send a field more than once: the last or the merge counts)."""

_MAX_DEPTH = 32
_HIGH_BYTES = bytes(range(0x80, 0x100))  # a varint's continuation bytes
_FIXED_WIDTH = {FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4, FieldDescriptor.TYPE_FLOAT: 4,
                FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8, FieldDescriptor.TYPE_DOUBLE: 8}
_LENGTH_DELIMITED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE)


class _Malformed(Exception):
    """The bytes are not protobuf wire format."""


@dataclass
class _Field:
    """A field the walk looks at: a repeated one (``limit`` elements at most; ``width`` of a
    packed element: 0 a varint, 4 or 8 fixed, None not packable) and/or a message whose own
    fields hold repeated ones (``child``). ``run``: for a repeated varint field of a one-byte
    key, a pattern matching up to ``limit + 1`` of its unpacked elements in a row (counted in
    C: each is its key and one varint, two bytes under 0x80)."""

    name: str
    full_name: str
    limit: int | None
    width: int | None
    child: _Plan | None
    run: re.Pattern[bytes] | None = None


@dataclass
class _Plan:
    """What to walk in one message type: its fields by number, and ``max_fields``, the fields
    on the wire all its occurrences together may hold."""

    name: str
    fields: dict[int, _Field] = field(default_factory=dict)
    max_fields: int = FIELD_SLACK


_PLANS: dict[str, _Plan | None] = {}


def _plan(descriptor: Descriptor) -> _Plan | None:
    """The walk of ``descriptor``'s messages; None when none of its fields, at any depth, is
    repeated (nothing to count: skipped whole by its length)."""
    name = descriptor.full_name
    if name in _PLANS:
        return _PLANS[name]
    _PLANS[name] = None  # a recursive type is not walked into again
    plan = _Plan(name)
    for fd in descriptor.fields:
        repeated = fd.is_repeated
        child = _plan(fd.message_type) if fd.type == FieldDescriptor.TYPE_MESSAGE else None
        if not repeated and child is None:
            continue
        limit = REPEATED_LIMITS.get(fd.full_name, DEFAULT_REPEATED_LIMIT) if repeated else None
        width = None if fd.type in _LENGTH_DELIMITED else _FIXED_WIDTH.get(fd.type, 0)
        run = None
        if repeated and width == 0 and fd.number < 16:
            key = re.escape(bytes([fd.number << 3]))
            run = re.compile(rb"(?:%s[\x80-\xff]{0,9}[\x00-\x7f]){1,%d}+" % (key, limit + 1))
        plan.fields[fd.number] = _Field(fd.name, fd.full_name, limit, width, child, run)
        if repeated and child is not None and limit:  # up to ``limit`` of its messages: each its fields
            # (regression: ChatMessage, walked for its tool_calls, was allowed 1,093 fields in all, so
            # a chat of ~270 messages with a name and a tool_call_id each was refused)
            child.max_fields = max(child.max_fields, limit * len(fd.message_type.fields) + FIELD_SLACK
                                   + sum(f.limit or 0 for f in child.fields.values()))
    plan.max_fields = max(plan.max_fields, len(descriptor.fields) + FIELD_SLACK
                          + sum(f.limit or 0 for f in plan.fields.values()))
    result = plan if plan.fields else None
    _PLANS[name] = result
    return result


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 70:
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return result, pos
        shift += 7
    raise _Malformed


class _Walk:
    """One request's walk: elements counted per repeated field, fields per message type."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.elements: dict[str, int] = {}
        self.fields: dict[str, int] = {}

    def count(self, spec: _Field, path: str, n: int) -> None:
        total = self.elements.get(spec.full_name, 0) + n
        self.elements[spec.full_name] = total
        if spec.limit is not None and total > spec.limit:
            raise ValueError(f"{path} holds more than {spec.limit} elements; at most {spec.limit} are allowed")

    def message(self, plan: _Plan, pos: int, end: int, prefix: str, depth: int) -> None:
        """Walk the fields in ``data[pos:end]``, a message of ``plan``'s type at ``prefix``."""
        data, seen = self.data, self.fields.get(plan.name, 0)
        while pos < end:
            seen += 1
            if seen > plan.max_fields:
                raise ValueError(f"{prefix or 'the request'} holds more than {plan.max_fields} fields")
            key, pos = _varint(data, pos, end)
            number, wire = key >> 3, key & 7
            spec = plan.fields.get(number)
            if wire == 2:
                length, pos = _varint(data, pos, end)
                stop = pos + length
                if stop > end:
                    raise _Malformed
                if spec is not None:
                    self._delimited(spec, pos, stop, f"{prefix}.{spec.name}" if prefix else spec.name, depth)
                pos = stop
                continue
            if wire == 0 and spec is not None and spec.run is not None:
                run = spec.run.match(data, pos - 1, end)  # from its one-byte key
                if run is not None:
                    elements = len(data[run.start():run.end()].translate(None, _HIGH_BYTES)) // 2
                    self.count(spec, f"{prefix}.{spec.name}" if prefix else spec.name, elements)
                    seen, pos = seen + elements - 1, run.end()
                    continue
            if wire == 0:
                _, pos = _varint(data, pos, end)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 3:
                pos = self._group(pos, end, number, depth)
            else:
                raise _Malformed
            if spec is not None and spec.limit is not None:
                self.count(spec, f"{prefix}.{spec.name}" if prefix else spec.name, 1)
        if pos != end:
            raise _Malformed
        self.fields[plan.name] = seen

    def _delimited(self, spec: _Field, pos: int, stop: int, path: str, depth: int) -> None:
        if spec.limit is not None:
            if spec.width is None:
                self.count(spec, path, 1)
            elif spec.width:
                self.count(spec, path, (stop - pos) // spec.width)
            else:  # a packed run of varints: one ends at each byte under 0x80
                self.count(spec, path, len(self.data[pos:stop].translate(None, _HIGH_BYTES)))
        if spec.child is not None and spec.width is None:
            if depth >= _MAX_DEPTH:
                raise _Malformed
            self.message(spec.child, pos, stop, path, depth + 1)

    def _group(self, pos: int, end: int, number: int, depth: int) -> int:
        """Skip a group (wire types 3..4, an unknown field to proto3); its fields count
        against the enclosing type's as the walk goes (``_MAX_DEPTH`` nested at most)."""
        if depth >= _MAX_DEPTH:
            raise _Malformed
        data = self.data
        while pos < end:
            key, pos = _varint(data, pos, end)
            if key & 7 == 4:
                if key >> 3 != number:
                    raise _Malformed
                return pos
            if key & 7 == 2:
                length, pos = _varint(data, pos, end)
                pos += length
            elif key & 7 == 0:
                _, pos = _varint(data, pos, end)
            elif key & 7 in (1, 5):
                pos += 8 if key & 7 == 1 else 4
            elif key & 7 == 3:
                pos = self._group(pos, end, key >> 3, depth + 1)
            else:
                raise _Malformed
            seen = self.fields.get("", 0) + 1  # "": every group's fields together
            if seen > FIELD_SLACK:
                raise ValueError(f"the request's unknown group fields hold more than {FIELD_SLACK} fields")
            self.fields[""] = seen
        raise _Malformed


def check_wire_shape(data: bytes, descriptor: Descriptor) -> None:
    """Refuse ``data`` (a ``descriptor`` message's encoding) if a repeated field holds more
    elements than its limit or a message type more fields than a valid request needs.

    Raises:
        ValueError: naming the field: ``"chat.messages holds more than 1024 elements; at
            most 1024 are allowed"``, or "the request is not a valid <type> message" when the
            bytes are not wire format.
    """
    plan = _plan(descriptor)
    if plan is None:
        return
    try:
        _Walk(data).message(plan, 0, len(data), "", 0)
    except (_Malformed, IndexError):
        raise ValueError(_not_valid(descriptor)) from None


def _not_valid(descriptor: Descriptor | None) -> str:
    name = descriptor.full_name if descriptor is not None else "request"
    return f"the request is not a valid {name} message (protobuf, UTF-8 strings)"


class RequestDecoder:
    """A request deserializer (``Message.FromString``) made safe for bytes from anyone: the
    wire shape checked first (``check_wire_shape``), every failure a plain ``ValueError``.

    Args:
        deserializer: the method handler's ``request_deserializer`` (a generated message
            class's ``FromString``), or None (the bytes are handed on as they are).
    """

    def __init__(self, deserializer: Callable[[bytes], Any] | None) -> None:
        self.deserializer = deserializer
        message_class = getattr(deserializer, "__self__", None)
        self.descriptor: Descriptor | None = getattr(message_class, "DESCRIPTOR", None)

    def __call__(self, data: Any) -> Any:
        """The message ``data`` encodes. Raises ``ValueError`` (see ``check_wire_shape``)."""
        if self.deserializer is None:
            return data
        if self.descriptor is not None:
            check_wire_shape(data, self.descriptor)
        try:
            return self.deserializer(data)
        except Exception:  # noqa: BLE001 - whatever protobuf raises, the bytes are bad input
            raise ValueError(_not_valid(self.descriptor)) from None
