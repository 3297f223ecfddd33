"""Every message type a served gRPC request reaches is bounded on the wire (``services.grpc_wire``).

Regression (review 30j F8, review 31 W1): the walk skipped whole, by its length, every message
type with no repeated field at any depth (``Tool``, ``ToolCall``, ``ToolChoice``, a logit_bias
map entry) and every request type with none (``CloseSessionRequest``, Health's
``HealthCheckRequest``, which needs no key, ``GetTenantRequest``, ``DrainRequest``, ...), so one
field sent 4.19M times there (protobuf keeps the last) passed it and 8 MiB were parsed whole on
the gateway's event loop (30-120 ms a call). Now each such type holds at most its occurrences in
a valid request x its declared fields + 64 fields on the wire, refused INVALID_ARGUMENT naming
the field; valid requests at every bound still pass, and any message within the repeated
fields' limits does (a property test over every served request type).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_node.sampling_params import MAX_LOGIT_BIAS_TOKENS
from kvstrata.v1 import admin_pb2, inference_pb2, tenant_pb2
from services.chat_tools import MAX_TOOL_CALLS, MAX_TOOLS, MAX_TOOLS_CHARS
from services.convert import MAX_CHAT_MESSAGES, MAX_REQUEST_TOOL_CALLS, chat_messages_to_pb
from services.gateway_inputs import input_from_pb
from services.grpc_wire import FIELD_SLACK, REPEATED_LIMITS, RequestDecoder, check_wire_shape
from tests.test_grpc_connection_bounds import QUICK, Served, serve
from tests.test_grpc_message_size import largest_valid_request
from tests.test_grpc_request_decoding import _raw_generate, _raw_unary

pb = inference_pb2
EIGHT_MIB = (8 << 20) - 64
SERVICES = [*(module.DESCRIPTOR.services_by_name[name] for module, name in (
    (inference_pb2, "InferenceService"), (tenant_pb2, "TenantService"), (admin_pb2, "AdminService"))),
    health_pb2.DESCRIPTOR.services_by_name["Health"]]
"""The services the gateway serves (``services.gateway_server.create_server``)."""
REQUEST_TYPES = list({m.input_type.full_name: m.input_type for s in SERVICES for m in s.methods}.values())


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _varint(value: int) -> bytes:
    out = b""
    while value >= 0x80:
        out += bytes([value & 0x7F | 0x80])
        value >>= 7
    return out + bytes([value])


def _delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


def _fill(element: bytes, room: int = EIGHT_MIB) -> bytes:
    """``element`` repeated to fill ``room`` bytes."""
    return element * (room // len(element))


TOOLS_FIELDS = MAX_TOOLS * 4 + FIELD_SLACK  # Tool: name, description, parameters, strict
SAMPLING = _delimited(3, pb.SamplingParams(max_tokens=4).SerializeToString())
USER = _delimited(1, pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]).SerializeToString())
GENERATE_SHAPES = {  # a GenerateRequest of one field sent ~4.19M times, and its refusal
    "Tool.name": (USER + SAMPLING + _delimited(10, _fill(b"\x0a\x00")),
                  f"tools holds more than {TOOLS_FIELDS} fields on the wire (all its messages together)"),
    "ToolCall.id": (SAMPLING + _delimited(1, _delimited(1, b"\x0a\x09assistant" + _delimited(5, _fill(b"\x0a\x00")))),
                    f"chat.messages.tool_calls holds more than {MAX_REQUEST_TOOL_CALLS * 3 + FIELD_SLACK} fields"),
    "ToolChoice.mode": (USER + SAMPLING + _delimited(11, _fill(b"\x08\x01")),
                        f"tool_choice holds more than {2 + FIELD_SLACK} fields on the wire"),
    "a logit_bias entry's key": (USER + _delimited(3, b"\x08\x04" + _delimited(15, _fill(b"\x08\x01"))),
                                 f"sampling.logit_bias holds more than {MAX_LOGIT_BIAS_TOKENS * 2 + FIELD_SLACK} fields"),
    "an unknown field in a Tool": (USER + SAMPLING + _delimited(10, b"\x0a\x01f" + _fill(_key(99, 0) + b"\x00")),
                                   f"tools holds more than {TOOLS_FIELDS} fields on the wire"),
}
ROOT_SHAPES = {  # request types with no repeated field: the request itself, refused as a whole
    "CloseSession": ("/kvstrata.v1.InferenceService/CloseSession", pb.CloseSessionRequest, _fill(b"\x0a\x00"), "key"),
    "Health Check (no key)": ("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, _fill(b"\x0a\x00"), ""),
    "GetTenant": ("/kvstrata.v1.TenantService/GetTenant", tenant_pb2.GetTenantRequest, _fill(b"\x0a\x01t"), "key"),
    "Drain": ("/kvstrata.v1.AdminService/Drain", admin_pb2.DrainRequest, _fill(b"\x09" + bytes(8)), "admin_key"),
}


def root_refusal(message_class: Any) -> str:
    """The refusal of a request type with no repeated field: its declared fields + the slack
    (``CloseSessionRequest`` has 2 since it names a ``cache_salt``, the others 1)."""
    return f"the request holds more than {len(message_class.DESCRIPTOR.fields) + FIELD_SLACK} fields on the wire"


def _walk_ms(data: bytes, descriptor: Descriptor, refusal: str) -> float:
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        check_wire_shape(data, descriptor)
    walk_s = time.perf_counter() - start
    assert str(refused.value).startswith(refusal), str(refused.value)
    return walk_s * 1e3


@pytest.mark.parametrize("shape", GENERATE_SHAPES)
def test_a_field_sent_millions_of_times_in_a_message_with_no_repeated_field_is_refused(shape: str) -> None:
    """Each 8 MiB request parses (protobuf keeps the last), and was passed by the walk whole;
    now it is refused naming the field, after at most the type's bound of fields."""
    data, refusal = GENERATE_SHAPES[shape]
    assert (8 << 20) - 256 < len(data) <= 8 << 20
    start = time.perf_counter()
    pb.GenerateRequest.FromString(data)
    parse_ms = (time.perf_counter() - start) * 1e3
    walk_ms = _walk_ms(data, pb.GenerateRequest.DESCRIPTOR, refusal)
    print(f"{shape}: protobuf parse {parse_ms:.1f} ms, walk refuses in {walk_ms:.2f} ms")


@pytest.mark.parametrize("shape", ROOT_SHAPES)
def test_a_request_type_with_no_repeated_field_is_bounded(shape: str) -> None:
    _, message_class, data, _ = ROOT_SHAPES[shape]
    message_class.FromString(data)
    _walk_ms(data, message_class.DESCRIPTOR, root_refusal(message_class))


def _paths(root: Descriptor) -> Iterator[tuple[Descriptor, list[FieldDescriptor]]]:
    """Each message type ``root`` reaches, with the message fields leading to it (first found)."""
    seen, todo = {root.full_name}, [(root, [])]
    while todo:
        descriptor, path = todo.pop()
        yield descriptor, path
        for fd in descriptor.fields:
            if fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.full_name not in seen:
                seen.add(fd.message_type.full_name)
                todo.append((fd.message_type, [*path, fd]))


REACHED = [(root, descriptor, path) for root in REQUEST_TYPES for descriptor, path in _paths(root)]


@pytest.mark.parametrize(("root", "descriptor", "path"), REACHED,
                         ids=[f"{r.name}:{'.'.join(f.name for f in p) or '-'}" for r, _, p in REACHED])
def test_every_message_type_a_served_request_reaches_is_bounded(
        root: Descriptor, descriptor: Descriptor, path: list[FieldDescriptor]) -> None:
    """For every served request type and every message type it reaches, at any depth: bytes of
    one singular field of that type (or of an unknown field, where it has none) sent over and
    over, at its place in the request, parse and are refused by the walk, naming the place
    (1 MiB: more fields than any type's bound)."""
    singular = [fd for fd in descriptor.fields if not fd.is_repeated and fd.type != FieldDescriptor.TYPE_MESSAGE]
    if singular and singular[0].type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        element = _delimited(singular[0].number, b"")
    elif singular and singular[0].type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64,
                                           FieldDescriptor.TYPE_SFIXED64):
        element = _key(singular[0].number, 1) + bytes(8)
    elif singular and singular[0].type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32,
                                           FieldDescriptor.TYPE_SFIXED32):
        element = _key(singular[0].number, 5) + bytes(4)
    elif singular:
        element = _key(singular[0].number, 0) + b"\x01"
    else:
        element = _key(99, 0) + b"\x00"
    data = _fill(element, 1 << 20)  # past any type's bound: 131,137 fields (TokenIds)
    for fd in reversed(path):
        data = _delimited(fd.number, data)
    GetMessageClass(root).FromString(data)  # protobuf parses it whole
    place = ".".join(fd.name for fd in path) or "the request"
    with pytest.raises(ValueError, match=rf"^{place} holds more than \d+ fields"):
        check_wire_shape(data, root)


def test_each_types_bound_is_its_valid_occurrences_fields_plus_slack() -> None:
    """``GenerateRequest.tools``: 128 tools of 4 fields each and 64 more fields (a name sent 65
    times) pass, one more field is refused; a 129th tool is refused for its count."""
    tool = _delimited(1, b"t") + _delimited(2, b"d") + _delimited(3, b"{}") + _key(4, 0) + b"\x01"

    def request(extra: int, tools: int = MAX_TOOLS) -> bytes:
        first = _delimited(10, tool + _delimited(1, b"t") * extra)
        return USER + SAMPLING + first + _delimited(10, tool) * (tools - 1)

    check_wire_shape(request(FIELD_SLACK), pb.GenerateRequest.DESCRIPTOR)
    assert len(pb.GenerateRequest.FromString(request(FIELD_SLACK)).tools) == MAX_TOOLS
    with pytest.raises(ValueError, match=rf"^tools holds more than {TOOLS_FIELDS} fields on the wire"):
        check_wire_shape(request(FIELD_SLACK + 1), pb.GenerateRequest.DESCRIPTOR)
    with pytest.raises(ValueError, match=rf"^tools holds more than {MAX_TOOLS} elements"):
        check_wire_shape(request(0, MAX_TOOLS + 1), pb.GenerateRequest.DESCRIPTOR)


def _big_tools() -> list[pb.Tool]:
    """``MAX_TOOLS`` tools whose schemas take ``MAX_TOOLS_CHARS`` as compact JSON, less room."""
    per_tool = MAX_TOOLS_CHARS // MAX_TOOLS - 200
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(per_tool // 24)}}
    return [pb.Tool(name=f"tool_{i}", description="d", parameters=json.dumps(schema)) for i in range(MAX_TOOLS)]


def _many_calls_chat() -> list[dict[str, Any]]:
    """``MAX_CHAT_MESSAGES`` messages: ``MAX_REQUEST_TOOL_CALLS`` calls in 8 assistant messages,
    and tool messages with a name and a tool_call_id answering them."""
    callers = MAX_REQUEST_TOOL_CALLS // MAX_TOOL_CALLS
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go", "name": "u"}]
    for i in range(callers):
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}_{j}", "type": "function", "function": {"name": "tool_1", "arguments": '{"p1": "x"}'}}
            for j in range(MAX_TOOL_CALLS)]})
    answers = MAX_CHAT_MESSAGES - len(messages)
    messages += [{"role": "tool", "content": "ok", "name": "tool_1", "tool_call_id": f"call_{callers - 1}_{k % 128}"}
                 for k in range(answers)]
    return messages


def test_large_valid_requests_pass_the_walk_and_decode_whole() -> None:
    """The largest valid request (``largest_valid_request``: 1,024 messages, 1,024 tool calls,
    4,096 logit_bias entries, ...) and a request of ``MAX_TOOLS`` tools with big JSON schemas
    with ``MAX_CHAT_MESSAGES`` messages holding ``MAX_REQUEST_TOOL_CALLS`` tool calls, each
    message with a name or a tool_call_id, are served (``input_from_pb``) and decode to
    themselves through the walk; their walks are timed."""
    tools = pb.GenerateRequest(chat=chat_messages_to_pb(_many_calls_chat()), tools=_big_tools(),
                               sampling=pb.SamplingParams(max_tokens=4),
                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE))
    assert len(tools.chat.messages) == MAX_CHAT_MESSAGES and len(tools.tools) == MAX_TOOLS
    assert sum(len(m.tool_calls) for m in tools.chat.messages) == MAX_REQUEST_TOOL_CALLS
    assert input_from_pb(tools).tools
    decode = RequestDecoder(pb.GenerateRequest.FromString)
    for request in (largest_valid_request(), tools):
        data = request.SerializeToString()
        start = time.perf_counter()
        check_wire_shape(data, pb.GenerateRequest.DESCRIPTOR)
        print(f"{len(data) / 2**20:.2f} MiB: walk {(time.perf_counter() - start) * 1e3:.1f} ms")
        assert decode(data) == request


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=False),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=False),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_ENUM: st.integers(-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.text(max_size=6),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=6),
}


def _fill_message(draw: Any, message: Message, left: dict[str, int], copies: int) -> None:
    """Set a drawn subset of ``message``'s fields. ``copies``: how many times the message will
    appear in the request; each repeated field takes at most ``left[its name] // copies``
    elements (its limit over the whole request), drawn as a few distinct ones cycled."""
    for fd in message.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if fd.is_repeated:
            most = left.get(fd.full_name, REPEATED_LIMITS.get(fd.full_name, 1024)) // copies
            count = draw(st.one_of(st.just(most), st.integers(0, most)))
            left[fd.full_name] = left.get(fd.full_name, REPEATED_LIMITS.get(fd.full_name, 1024)) - count * copies
            if count == 0:
                continue
            distinct = draw(st.integers(1, min(3, count)))
            each = copies * math.ceil(count / distinct)  # a distinct element's copies in the request
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
                keys = draw(st.lists(_SCALARS[key_fd.type], min_size=count, max_size=count, unique=True))
                for key in keys:
                    getattr(message, fd.name)[key] = draw(_SCALARS[value_fd.type])
            elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                pool = []
                for _ in range(distinct):
                    element = GetMessageClass(fd.message_type)()
                    _fill_message(draw, element, left, each)
                    pool.append(element)
                getattr(message, fd.name).extend(pool[i % distinct] for i in range(count))
            else:
                pool = [draw(_SCALARS[fd.type]) for _ in range(distinct)]
                getattr(message, fd.name).extend(pool[i % distinct] for i in range(count))
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            _fill_message(draw, getattr(message, fd.name), left, copies)
            getattr(message, fd.name).SetInParent()
        else:
            setattr(message, fd.name, draw(_SCALARS[fd.type]))


@st.composite
def _requests(draw: Any) -> tuple[Descriptor, Message]:
    """A message of a served request type, every repeated field within its limit."""
    root = draw(st.sampled_from(REQUEST_TYPES))
    message = GetMessageClass(root)()
    _fill_message(draw, message, {}, 1)
    return root, message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_requests())
def test_any_message_within_the_limits_passes_the_walk(drawn: tuple[Descriptor, Message]) -> None:
    """Property: whatever protobuf serializes of a served request type, with each repeated
    field within its limit over the whole request (up to the limit: 1,024 chat messages, 1,024
    tool calls, 128 tools, 131,072 ids, 4,096 logit_bias entries), passes the walk and
    decodes to itself."""
    root, message = drawn
    data = message.SerializeToString()
    assert len(data) <= 8 << 20
    assert RequestDecoder(GetMessageClass(root).FromString)(data) == message


async def _refusals(served: Served) -> list[tuple[str, grpc.StatusCode, str]]:
    calls = [_raw_generate(served, data, served.key) for data, _ in GENERATE_SHAPES.values()]
    calls += [_raw_unary(served, method, data, getattr(served, key) if key else "")
              for method, _, data, key in ROOT_SHAPES.values()]
    results = await asyncio.gather(*calls)
    names = [*GENERATE_SHAPES, *ROOT_SHAPES]
    return [(name, code, details) for name, (code, details) in zip(names, results, strict=True)]


def test_the_gateway_refuses_each_shape_invalid_argument_and_serves_other_calls(tmp_path: Path) -> None:
    """On the real server (``create_server``), each shape ends INVALID_ARGUMENT naming the field
    (Health's with no key), while a valid call made at the same time, and one after, succeed."""
    refusals = [refusal for _, refusal in GENERATE_SHAPES.values()] + [root_refusal(message_class) for _, message_class, _, _ in ROOT_SHAPES.values()]

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served:
            valid = _raw_unary(served, "/kvstrata.v1.TenantService/GetTenant", b"\x0a\x01t", served.key)
            results, (code, details) = await asyncio.gather(_refusals(served), valid)
            assert code == grpc.StatusCode.OK, details
            for (name, code, details), refusal in zip(results, refusals, strict=True):
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(refusal), (name, code, details)
            code, details = await _raw_unary(served, "/kvstrata.v1.TenantService/GetTenant", b"\x0a\x01t", served.key)
            assert code == grpc.StatusCode.OK, details

    asyncio.run(run())


def test_a_recursive_type_is_bounded_and_its_valid_nesting_passes() -> None:
    """No served type holds itself, but the walk's bounds take one (``google.protobuf.Value``):
    a nested valid value passes; 100,000 fields in its nested messages are refused."""
    from google.protobuf import struct_pb2

    value = struct_pb2.Value()
    value.struct_value.update({"a": {"b": [1, 2, {"c": "d"}]}, "e": list(range(1000))})
    assert RequestDecoder(struct_pb2.Value.FromString)(value.SerializeToString()) == value
    data = _delimited(6, _delimited(1, b"\x08\x00" * 100_000))  # list_value.values[0].null_value, sent over and over
    struct_pb2.Value.FromString(data)
    with pytest.raises(ValueError, match=r"^list_value.values holds more than 12358 fields on the wire"):
        check_wire_shape(data, struct_pb2.Value.DESCRIPTOR)
