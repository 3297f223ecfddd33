"""The gateway decodes gRPC request messages itself (``services.grpc_wire`` behind ``CallGate``).

Review 24h G1: a message that is not valid protobuf (invalid UTF-8 in a string field, truncated,
garbage) ended UNKNOWN with "Unexpected <class '...DecodeError'>: ..." on every service, and a
known key id with a wrong secret got that too, not UNAUTHENTICATED. G2: an 8 MiB
``GenerateRequest`` of 4.19M empty chat messages was parsed whole on the gateway's event loop
before ``convert`` counted them. The server tests run the real ``gateway_server.create_server``
(``tests.test_grpc_connection_bounds.serve``: real ``Authenticator`` and scheduler service).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from kvstrata.v1 import inference_pb2 as pb
from services.grpc_wire import RequestDecoder, check_wire_shape
from tests.test_grpc_connection_bounds import QUICK, Served, serve

TRUNCATED = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
                               ).SerializeToString()[:-3]
GARBAGE = b"\xff\xff\xff\xff"
SAMPLING = pb.SamplingParams(max_tokens=4).SerializeToString()
LEAKS = ("Unexpected", "DecodeError", "Error parsing", "google.", "class")


def _delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` (< 16), wire type 2, holding ``payload``."""
    length, prefix = len(payload), b""
    while length >= 0x80:
        prefix += bytes([length & 0x7F | 0x80])
        length >>= 7
    return bytes([number << 3 | 2]) + prefix + bytes([length]) + payload


BAD_UTF8 = _delimited(1, _delimited(1, _delimited(1, b"us\xffr")))  # a chat message's role


def _eight_mib(element: bytes) -> int:
    return ((8 << 20) - 64) // len(element)


SHAPES = {  # G2's 8 MiB messages of tiny repeated elements, and the field each is refused for
    "empty chat messages": (_delimited(1, b"\x0a\x00" * _eight_mib(b"\x0a\x00")) + _delimited(3, SAMPLING),
                            "chat.messages holds more than 1024 elements"),
    "empty stop strings": (_delimited(3, SAMPLING + b"\x3a\x00" * _eight_mib(b"\x3a\x00")),
                           "sampling.stop holds more than 4 elements"),
    "packed 1-byte token ids": (_delimited(2, _delimited(1, b"\x01" * _eight_mib(b"\x01"))) + _delimited(3, SAMPLING),
                                "tokens.ids holds more than 131072 elements"),
    "unpacked 1-byte token ids": (_delimited(2, b"\x08\x01" * _eight_mib(b"\x08\x01")) + _delimited(3, SAMPLING),
                                  "tokens.ids holds more than 131072 elements"),
    "packed stop_token_ids": (_delimited(3, SAMPLING + _delimited(5, b"\x01" * 65)),
                              "sampling.stop_token_ids holds more than 64 elements"),
    "a repeated singular field": (b"\x38\x00" * _eight_mib(b"\x38\x00") + _delimited(3, SAMPLING),
                                  "the request holds more than"),
}


async def _raw_unary(served: Served, method: str, data: bytes, key: str = "") -> tuple[grpc.StatusCode, str]:
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    async with served.channel() as channel:
        call = channel.unary_unary(method)(data, metadata=metadata, timeout=10)
        try:
            await call
        except grpc.aio.AioRpcError:
            pass
        return await call.code(), await call.details() or ""


async def _raw_generate(served: Served, data: bytes, key: str) -> tuple[grpc.StatusCode, str]:
    async with served.channel() as channel:
        call = channel.unary_stream("/kvstrata.v1.InferenceService/Generate")(
            data, metadata=(("authorization", f"Bearer {key}"),), timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError:
            pass
        return await call.code(), await call.details() or ""


def _wrong_secret(key: str) -> str:
    return key[:-1] + ("A" if key[-1] != "A" else "B")


def test_undecodable_messages_end_invalid_argument_on_every_service(tmp_path: Path) -> None:
    """Regression (review 24h G1): bytes that are not a valid message of the method's request
    type end INVALID_ARGUMENT "the request is not a valid <type> message ..." on Inference,
    Tenant, Admin and Health, with no exception or library text; the connection serves a
    valid call afterwards."""

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served:
            cases = [
                ("/kvstrata.v1.InferenceService/CloseSession", b"\x0a\x02\xff\xfe", served.key),
                ("/kvstrata.v1.TenantService/RegisterTenant", b"\x0a\x03\x0a\x01\xff", served.admin_key),
                ("/kvstrata.v1.TenantService/GetTenant", GARBAGE, served.key),
                ("/kvstrata.v1.AdminService/Stats", GARBAGE, served.admin_key),
                ("/grpc.health.v1.Health/Check", b"\x0a\x02\xff\xfe", ""),
                ("/grpc.health.v1.Health/Check", GARBAGE, ""),
            ]
            for method, data, key in cases:
                code, details = await _raw_unary(served, method, data, key)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
                assert details.startswith("the request is not a valid "), (method, details)
                assert not any(word in details for word in LEAKS), details
            for data in (BAD_UTF8, TRUNCATED, GARBAGE):
                code, details = await _raw_generate(served, data, served.key)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert details == "the request is not a valid kvstrata.v1.GenerateRequest message (protobuf, UTF-8 strings)"
            code, details = await _raw_unary(served, "/kvstrata.v1.TenantService/GetTenant",
                                             b"\x0a\x01t", served.key)  # GetTenantRequest(name="t")
            assert code == grpc.StatusCode.OK, details

    asyncio.run(run())


def test_a_bad_key_is_unauthenticated_before_a_bad_message(tmp_path: Path) -> None:
    """Regression (review 24h G1): a known key id with a wrong secret and an undecodable
    message got UNKNOWN; the key is checked fully first, as for a well-formed message:
    UNAUTHENTICATED for a wrong secret, PERMISSION_DENIED for a tenant's key on an admin
    method, and a well-formed message with the wrong secret gets the same."""

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served:
            wrong = _wrong_secret(served.key)
            for data in (BAD_UTF8, GARBAGE, SHAPES["empty stop strings"][0], SAMPLING):
                code, details = await _raw_generate(served, data, wrong)
                assert (code, details) == (grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
            code, _ = await _raw_unary(served, "/kvstrata.v1.AdminService/Stats", GARBAGE,
                                       _wrong_secret(served.admin_key))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            code, _ = await _raw_unary(served, "/kvstrata.v1.AdminService/Stats", GARBAGE, served.key)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            code, _ = await _raw_unary(served, "/kvstrata.v1.TenantService/GetTenant", GARBAGE, wrong)
            assert code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(run())


def test_messages_of_millions_of_tiny_elements_are_refused_before_parsing(tmp_path: Path) -> None:
    """Regression (review 24h G2): 8 MiB messages of millions of tiny repeated elements
    (4.19M empty chat messages, ...) were parsed whole before ``convert`` counted them. The
    gateway refuses each INVALID_ARGUMENT naming the field; the walk reads at most the field's
    limit of elements (its time and protobuf's parse of the same bytes are printed)."""
    for name, (data, refusal) in SHAPES.items():
        start = time.perf_counter()
        with pytest.raises(ValueError, match=refusal):
            check_wire_shape(data, pb.GenerateRequest.DESCRIPTOR)
        walk_s = time.perf_counter() - start
        start = time.perf_counter()
        pb.GenerateRequest.FromString(data)
        parse_s = time.perf_counter() - start
        print(f"{name}: {len(data) / 2**20:.2f} MiB, gate {walk_s * 1e3:.2f} ms, protobuf parse {parse_s * 1e3:.1f} ms")

    async def run() -> None:
        async with serve(tmp_path, QUICK) as served:
            for data, refusal in SHAPES.values():
                code, details = await _raw_generate(served, data, served.key)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(refusal), details

    asyncio.run(run())


def test_the_largest_valid_messages_pass_the_walk_whole() -> None:
    """The largest requests the bounds admit decode to the message protobuf gives: 1,024 chat
    messages of 1 Mi 4-byte characters with 4 stops and 64 stop ids, 131,072 token ids packed
    and unpacked (each a 5-byte varint), a tenant spec of 64 allowed policies; one element more
    of each is refused."""
    from kvstrata.v1 import tenant_pb2

    chat = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="assistant", content="\U0001f600" * 1024)] * 1024),
        sampling=pb.SamplingParams(max_tokens=4, stop=["s" * 256] * 4, stop_token_ids=range(64)),
        session_id="x" * 256, request_id="y" * 256, priority=-1000, prefix_messages=1024)
    tokens = pb.GenerateRequest(tokens=pb.TokenIds(ids=[2**32 - 1] * 131_072), sampling=pb.SamplingParams(max_tokens=1))
    unpacked = _delimited(2, b"\x08\xff\xff\xff\xff\x0f" * 131_072) + _delimited(3, SAMPLING)
    decode = RequestDecoder(pb.GenerateRequest.FromString)
    for message in (chat, tokens):
        assert decode(message.SerializeToString()) == message
    assert list(decode(unpacked).tokens.ids) == [2**32 - 1] * 131_072
    spec = tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="t", allowed_policies=["p"] * 64))
    assert RequestDecoder(tenant_pb2.RegisterTenantRequest.FromString)(spec.SerializeToString()) == spec

    over = [chat.SerializeToString() + _delimited(1, b"\x0a\x00"),
            _delimited(2, b"\x08\x01" * 131_073), _delimited(2, _delimited(1, b"\x01" * 131_073)),
            spec.SerializeToString() + _delimited(1, _delimited(11, b"p"))]
    decoders = [decode, decode, decode, RequestDecoder(tenant_pb2.RegisterTenantRequest.FromString)]
    for data, decoder in zip(over, decoders, strict=True):
        with pytest.raises(ValueError, match="holds more than"):
            decoder(data)
