"""A gRPC request's raw bytes -> its message, refusing bad input before protobuf builds it.

``CallGate`` (``services.grpc_call_gate``) gives grpc.aio no request deserializer, so its handlers
receive the message's raw bytes, and decodes them with ``RequestDecoder``:

1. ``check_wire_shape`` walks the protobuf wire format (tags, varints, lengths) of the message
   and of every sub-message, at any depth (a small one of a leaf type: ``LEAF_FIELDS``),
   skipping strings and unknown fields by their length. It counts the elements of each
   repeated field over all its occurrences (a packed run's varints in C: ``bytes.translate``)
   and stops at the first count past the field's limit (``REPEATED_LIMITS``, else
   ``DEFAULT_REPEATED_LIMIT``), or at the first message type with more fields on the wire, all
   its messages together, than a valid request needs (``_plan``: its occurrences x its
   declared fields + its repeated fields' limits + ``FIELD_SLACK``). Each is a ``ValueError``
   naming the field. The walk reads at most those bounds' fields (O(bounds), not O(bytes)) and
   allocates nothing per element.
2. Then the message type's ``FromString``; any error there (invalid UTF-8 in a string field,
   a truncated or corrupt message) is a plain ``ValueError``: "the request is not a valid
   <type> message", naming no exception or library.

Regression (review 24h G1): grpc's own deserializer raised protobuf's ``DecodeError`` inside the
gate, and the call ended UNKNOWN with "Unexpected <class '...DecodeError'>: ..." on every
service, before the key was fully checked. Regression (review 24h G2): an 8 MiB
``GenerateRequest`` of 4.19M empty chat messages was parsed whole on the gateway's event loop
before ``convert`` counted them (0.15-0.8 s a call; 8 senders slowed another tenant's stream
~10x); the HTTP API counts a body's JSON structure first (``openai_api.bodies.check_body_shape``).
Regression (review 30j F8, review 31 W1): message types with no repeated field at any depth
were skipped whole by their length, and request types with none were not walked at all, so
one field sent ~4.19M times in 8 MiB there passed the walk and protobuf parsed it all (it keeps
the last): a ``Tool``'s name (``FromString`` median 93 ms; 170-220 ms with the 2 cores loaded),
a ``ToolCall``'s id (121; 170-220 ms), ``ToolChoice.mode`` or a logit_bias entry's key (28-32;
60-95 ms), ``CloseSessionRequest.session_id`` or Health's ``HealthCheckRequest.service``, which
needs no key (69; 170-250 ms), ``DrainRequest.timeout_s`` (6 ms). Now every type is bounded
and each is refused naming the field in 0.03-1.3 ms (a logit_bias entry: 8,256 fields, 5-19
ms); the worst request of these shapes that passes (every such type at its bound, 4,096
entries of 8 fields: 79 KiB) parses in 0.5 ms. The largest valid request's walk is no slower
(``services.grpc_messages``: 14 -> 9 ms at best, interleaved runs). Tests:
``tests/test_grpc_wire_unrepeated.py``.
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

LEAF_FIELDS = 8
"""A message of a leaf type (no repeated or message field: a map entry, ``ToolCall``) of at most
``2 * LEAF_FIELDS + 1`` bytes holds at most ``LEAF_FIELDS`` fields (each takes 2 bytes or more):
it is charged its type's declared fields without being walked (the 4,096 logit_bias entries of
a valid request: ~6x less walk time), a larger one is walked. So protobuf parses at most
``LEAF_FIELDS`` fields in each such message; their number is bounded where they are held (an
element of a repeated field, or a field of the enclosing message)."""

_MAX_DEPTH = 32
_HIGH_BYTES = bytes(range(0x80, 0x100))  # a varint's continuation bytes
_FIXED_WIDTH = {FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4, FieldDescriptor.TYPE_FLOAT: 4,
                FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8, FieldDescriptor.TYPE_DOUBLE: 8}
_LENGTH_DELIMITED = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE)


class _Malformed(Exception):
    """The bytes are not protobuf wire format."""


@dataclass(eq=False)
class _Field:
    """A field the walk looks at: a repeated one (``limit`` elements at most; ``width`` of a
    packed element: 0 a varint, 4 or 8 fixed, None not packable) and/or a message (``child``,
    its type's walk). ``run``: for a repeated varint field of a one-byte key, a pattern
    matching up to ``limit + 1`` of its unpacked elements in a row (counted in C: each is its
    key and one varint, two bytes under 0x80)."""

    name: str
    full_name: str
    limit: int | None
    width: int | None
    child: _Plan | None
    run: re.Pattern[bytes] | None = None


@dataclass(eq=False)
class _Plan:
    """What to walk in one message type (within one request type's walk): its fields by
    number, and ``max_fields``, the fields on the wire all its occurrences in a request may
    hold together; ``index``: its counter's in ``_Walk.fields``."""

    name: str
    index: int
    fields: dict[int, _Field] = field(default_factory=dict)
    max_fields: int = FIELD_SLACK
    charged_bytes: int = -1  # a leaf type's: a message of at most these bytes is charged, not walked
    declared: int = 0  # the fields it declares: what such a message is charged


_PLANS: dict[str, tuple[_Plan, int]] = {}
"""Request type's full name -> the walk of its messages and the number of types it reaches
(built once, on first use)."""


def _limit(fd: FieldDescriptor) -> int:
    return REPEATED_LIMITS.get(fd.full_name, DEFAULT_REPEATED_LIMIT)


def _types(root: Descriptor) -> list[Descriptor]:
    """Every message type reachable from ``root`` (``root`` first)."""
    types, todo = {root.full_name: root}, [root]
    while todo:
        for fd in todo.pop().fields:
            if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.full_name not in types:
                types[fd.message_type.full_name] = fd.message_type
                todo.append(fd.message_type)
    return list(types.values())


def _occurrences(types: list[Descriptor]) -> dict[str, int]:
    """The messages of each type a valid request of ``types[0]``'s holds at most: 1 of the
    root, and for each field holding the type, its limit (repeated: its elements over the whole
    request) or its parent's occurrences (singular). Propagated ``_MAX_DEPTH`` times at most:
    exact where no type holds itself; a recursive type's, through a singular field, as deep as
    the walk goes."""
    counts = dict.fromkeys((d.full_name for d in types), 0)
    for _ in range(_MAX_DEPTH + 1):
        step = dict.fromkeys(counts, 0)
        step[types[0].full_name] = 1
        for descriptor in types:
            for fd in descriptor.fields:
                if fd.type == FieldDescriptor.TYPE_MESSAGE:
                    step[fd.message_type.full_name] += _limit(fd) if fd.is_repeated else counts[descriptor.full_name]
        if step == counts:
            break
        counts = step
    return counts


def _plan(root: Descriptor) -> tuple[_Plan, int]:
    """The walk of ``root``'s messages: every message type it reaches, at any depth, with
    ``max_fields`` = its occurrences (``_occurrences``) x its declared fields + its repeated
    fields' limits + ``FIELD_SLACK``. Returns the root's walk and the number of types."""
    name = root.full_name
    if name in _PLANS:
        return _PLANS[name]
    types = _types(root)
    occurrences = _occurrences(types)
    plans = {d.full_name: _Plan(d.full_name, i) for i, d in enumerate(types)}
    for descriptor in types:
        plan = plans[descriptor.full_name]
        repeated_limits = 0
        for fd in descriptor.fields:
            child = plans[fd.message_type.full_name] if fd.type == FieldDescriptor.TYPE_MESSAGE else None
            if not fd.is_repeated and child is None:
                continue
            limit = _limit(fd) if fd.is_repeated else None
            repeated_limits += limit or 0
            width = None if fd.type in _LENGTH_DELIMITED else _FIXED_WIDTH.get(fd.type, 0)
            run = None
            if limit is not None and width == 0 and fd.number < 16:
                key = re.escape(bytes([fd.number << 3]))
                run = re.compile(rb"(?:%s[\x80-\xff]{0,9}[\x00-\x7f]){1,%d}+" % (key, limit + 1))
            plan.fields[fd.number] = _Field(fd.name, fd.full_name, limit, width, child, run)
        # (regression: ChatMessage, walked for its tool_calls, was allowed 1,093 fields in all, so
        # a chat of ~270 messages with a name and a tool_call_id each was refused)
        plan.declared = len(descriptor.fields)
        if not plan.fields:  # a leaf
            plan.charged_bytes = 2 * LEAF_FIELDS + 1
        plan.max_fields = occurrences[descriptor.full_name] * plan.declared + repeated_limits + FIELD_SLACK
    _PLANS[name] = plans[name], len(plans)
    return _PLANS[name]


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
    """One request's walk: elements counted per repeated field, fields per message type
    (``_Plan.index``), and the names of the fields it is in (``trail``: for a refusal's text)."""

    def __init__(self, data: bytes, types: int) -> None:
        self.data = data
        self.elements: dict[str, int] = {}
        self.fields = [0] * types
        self.group_fields = 0
        self.trail: list[str] = []

    def path(self, name: str = "") -> str:
        return ".".join([*self.trail, name] if name else self.trail)

    def count(self, spec: _Field, n: int) -> None:
        total = self.elements.get(spec.full_name, 0) + n
        self.elements[spec.full_name] = total
        if spec.limit is not None and total > spec.limit:
            raise ValueError(f"{self.path(spec.name)} holds more than {spec.limit} elements; at most "
                             f"{spec.limit} are allowed")

    def too_many_fields(self, plan: _Plan, name: str = "") -> ValueError:
        path = self.path(name)
        return ValueError(f"{path or 'the request'} holds more than {plan.max_fields} fields on the wire"
                          + (" (all its messages together)" if path else ""))

    def message(self, plan: _Plan, pos: int, end: int, depth: int) -> None:
        """Walk the fields in ``data[pos:end]``, a message of ``plan``'s type at ``trail``."""
        data, fields, seen, most = self.data, plan.fields, self.fields[plan.index], plan.max_fields
        while pos < end:
            seen += 1
            if seen > most:
                raise self.too_many_fields(plan)
            key = data[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(data, pos, end)
            wire, spec = key & 7, fields.get(key >> 3)
            if wire == 2:
                length = data[pos] if pos < end else 0x80
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = _varint(data, pos, end)
                stop = pos + length
                if stop > end:
                    raise _Malformed
                if spec is not None:
                    if spec.child is None:
                        self._delimited(spec, pos, stop, depth)
                    else:  # its messages may be of this type (a recursive one): the count goes on there
                        self.fields[plan.index] = seen
                        self._delimited(spec, pos, stop, depth)
                        seen = self.fields[plan.index]
                pos = stop
                continue
            if wire == 0 and spec is not None and spec.run is not None:
                run = spec.run.match(data, pos - 1, end)  # from its one-byte key
                if run is not None:
                    elements = len(data[run.start():run.end()].translate(None, _HIGH_BYTES)) // 2
                    self.count(spec, elements)
                    seen, pos = seen + elements - 1, run.end()
                    continue
            if wire == 0:
                _, pos = _varint(data, pos, end)
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            elif wire == 3:
                pos = self._group(pos, end, key >> 3, depth)
            else:
                raise _Malformed
            if spec is not None and spec.limit is not None:
                self.count(spec, 1)
        if pos != end:
            raise _Malformed
        self.fields[plan.index] = seen

    def _delimited(self, spec: _Field, pos: int, stop: int, depth: int) -> None:
        if spec.limit is not None:
            if spec.width is None:
                self.count(spec, 1)
            elif spec.width:
                self.count(spec, (stop - pos) // spec.width)
            else:  # a packed run of varints: one ends at each byte under 0x80
                self.count(spec, len(self.data[pos:stop].translate(None, _HIGH_BYTES)))
        child = spec.child
        if child is not None and spec.width is None:
            if stop - pos <= child.charged_bytes:
                charged = self.fields[child.index] + child.declared
                if charged > child.max_fields:
                    raise self.too_many_fields(child, spec.name)
                self.fields[child.index] = charged
                return
            if depth >= _MAX_DEPTH:
                raise _Malformed
            self.trail.append(spec.name)
            self.message(child, pos, stop, depth + 1)
            self.trail.pop()

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
            self.group_fields += 1  # every group's fields together
            if self.group_fields > FIELD_SLACK:
                raise ValueError(f"the request's unknown group fields hold more than {FIELD_SLACK} fields")
        raise _Malformed


def check_wire_shape(data: bytes, descriptor: Descriptor) -> None:
    """Refuse ``data`` (a ``descriptor`` message's encoding) if a repeated field holds more
    elements than its limit or a message type, at any depth, more fields than a valid request
    needs (``_plan``).

    Raises:
        ValueError: naming the field: ``"chat.messages holds more than 1024 elements; at
            most 1024 are allowed"``, ``"tools holds more than 576 fields; ..."``, or "the
            request is not a valid <type> message" when the bytes are not wire format.
    """
    plan, types = _plan(descriptor)
    try:
        _Walk(data, types).message(plan, 0, len(data), 0)
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
