"""The gateway's gRPC message cap admits the largest valid request (``services.grpc_messages``).

Regression (new-user report): the server and our clients kept grpc's default 4 MiB receive cap,
undocumented, while ``services.convert`` admits a chat of 1 Mi characters (up to 4 UTF-8 bytes
each) plus its framing: such a valid request was refused RESOURCE_EXHAUSTED "received message
larger than max" before any handler ran. Now ``grpc_max_message_bytes`` (8 MiB, never below the
largest valid request) caps both directions on the server and on every channel our clients open.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import grpc
import pydantic
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from cache_node.structured_output import MAX_CHOICES, MAX_STRUCTURED_SPEC_BYTES
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services import gateway
from services.chat_tools import MAX_TOOL_CALLS
from services.config import ServiceConfig
from services.convert import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_REQUEST_TOOL_CALLS,
    MAX_TOOLS_TEXT_CHARS,
    prompt_from_pb,
    sampling_params_from_pb,
)
from services.gateway_inputs import input_from_pb
from services.grpc_bounds import GrpcLimits
from services.grpc_messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_GENERATE_REQUEST_BYTES,
    channel_options,
)
from tests.test_grpc_connection_bounds import QUICK, serve

REPO = Path(__file__).resolve().parents[1]
WIDE = "\U0001f600"  # 4 bytes in UTF-8

# the JSON array's framing is 4 bytes a string (quotes, ", ") less 2: 63 4-byte characters each
CHOICES = [WIDE * 62 + chr(0x1F600 + i) for i in range(MAX_CHOICES)]
assert len(json.dumps(CHOICES, ensure_ascii=False).encode()) == MAX_STRUCTURED_SPEC_BYTES


def largest_valid_request(policy: str = "p" * 63) -> inference_pb2.GenerateRequest:
    """A GenerateRequest at every bound ``services.convert`` checks, each string of 4-byte
    characters: 1,024 chat messages holding 1 Mi characters with the tools' JSON (8 assistant
    messages of 128 tool calls, the rest but one tool results, each with a ``name`` and a
    ``tool_call_id``: review 25b N3), a tool of a 64-character name whose parameters take the rest of
    ``MAX_TOOLS_TEXT_CHARS`` as given (whitespace, which its JSON drops: the text that counts least), 4 stop strings of 256, 64 stop ids,
    every numeric sampling field set (top_k -1 a 10-byte varint, logprobs, min_p), 4,096
    logit_bias entries and 4,096 allowed_token_ids, all ids of 5-byte varints, a structured
    output's 256 choices whose JSON array is 64 KiB (its largest member on the wire), 256-character request and session ids, a policy of the pattern's 63 characters (no real
    policy's spec is longer), priority -1000."""
    tools = [inference_pb2.Tool(name="t" * 64, parameters="{" + " " * (MAX_TOOLS_TEXT_CHARS - 66) + "}")]
    tools_chars = len(json.dumps([{"type": "function", "function": {"name": t.name, "parameters": {}}} for t in tools],
                                 separators=(",", ":")))
    callers = MAX_REQUEST_TOOL_CALLS // MAX_TOOL_CALLS
    results = MAX_CHAT_MESSAGES - 1 - callers
    chat = inference_pb2.ChatMessages()
    chat.messages.add(role="assistant", content=WIDE * (MAX_PROMPT_CHARS - 3 * results - 3 * MAX_REQUEST_TOOL_CALLS
                                                         - tools_chars))
    for _ in range(callers):
        chat.messages.add(role="assistant", tool_calls=[inference_pb2.ToolCall(id=WIDE, name="f", arguments=WIDE)]
                          * MAX_TOOL_CALLS)
    for _ in range(results):
        chat.messages.add(role="tool", content=WIDE, name=WIDE, tool_call_id=WIDE)
    sampling = inference_pb2.SamplingParams(
        max_tokens=(1 << 32) - 1, temperature=1.5, top_p=0.5, seed=(1 << 64) - 1,
        stop_token_ids=[(1 << 32) - 1] * MAX_STOP_TOKEN_IDS, ignore_eos=True,
        stop=[WIDE * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, top_k=-1, min_tokens=(1 << 32) - 1,
        presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=2.0, logprobs=MAX_LOGPROBS, min_p=0.5,
        logit_bias={(1 << 31) - 1 - i: -99.5 for i in range(MAX_LOGIT_BIAS_TOKENS)},
        allowed_token_ids=range((1 << 31) - MAX_ALLOWED_TOKEN_IDS, 1 << 31),
        structured_output=inference_pb2.StructuredOutput(choice=inference_pb2.ChoiceList(choices=CHOICES)))
    return inference_pb2.GenerateRequest(
        chat=chat, sampling=sampling, session_id=WIDE * MAX_REQUEST_ID_CHARS,
        request_id=WIDE * MAX_REQUEST_ID_CHARS, policy=policy, priority=-1000, tools=tools,
        tool_choice=inference_pb2.ToolChoice(mode=inference_pb2.TOOL_CHOICE_MODE_NONE), parallel_tool_calls=False)


def test_the_largest_valid_request_is_over_grpcs_default_and_under_the_bound() -> None:
    """The request at every bound passes the gateway's checks, is larger than grpc's default
    4 MiB cap (what refused it) and at most ``MAX_GENERATE_REQUEST_BYTES``, which is within 1%
    of it, and the default cap takes it."""
    request = largest_valid_request()
    assert len(prompt_from_pb(request)) == MAX_CHAT_MESSAGES
    assert input_from_pb(request).tools  # the tools' checks too
    assert isinstance(sampling_params_from_pb(request.sampling), SamplingParams)
    assert MAX_REQUEST_ID_CHARS == gateway.MAX_ID_CHARS
    size = request.ByteSize()
    assert 4 << 20 < size <= MAX_GENERATE_REQUEST_BYTES < size * 1.01
    assert MAX_GENERATE_REQUEST_BYTES < DEFAULT_MAX_MESSAGE_BYTES == 8 << 20


def test_the_message_cap_is_a_bounded_setting_set_both_ways() -> None:
    """``grpc_max_message_bytes`` defaults to 8 MiB, is refused below the largest valid request
    or over 256 MiB naming the field, and reaches grpc core as both the receive and send cap."""
    assert ServiceConfig().grpc_max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    for value in (4 << 20, MAX_GENERATE_REQUEST_BYTES - 1, (256 << 20) + 1):
        with pytest.raises(pydantic.ValidationError, match="grpc_max_message_bytes"):
            ServiceConfig(grpc_max_message_bytes=value)
    limits = GrpcLimits.of(ServiceConfig(grpc_max_message_bytes=16 << 20))
    options = dict(limits.server_options(256, nofile=65536))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 16 << 20
    with pytest.raises(ValueError, match="max_message_bytes"):
        GrpcLimits(max_message_bytes=4 << 20)


def test_every_client_channel_to_the_gateway_carries_the_cap() -> None:
    """Every channel ``cli/``, ``workloads/`` and ``bench/`` open passes ``channel_options``
    (or is ``cli.state.gateway_channel``, which does): with grpc's defaults a client could not
    take a response over 4 MiB."""
    bare = []
    for path in [*REPO.glob("cli/*.py"), *REPO.glob("workloads/**/*.py"), *REPO.glob("bench/*.py")]:
        for match in re.finditer(r"insecure_channel\(([^()]*(?:\([^()]*\))?[^()]*)\)", path.read_text()):
            if "channel_options(" not in match.group(1):
                bare.append(f"{path.relative_to(REPO)}: {match.group(0)}")
    assert [b for b in bare if "chaos_kills.py" not in b] == []  # chaos_kills: a Health probe only


def test_the_largest_valid_request_reaches_the_handler_and_a_larger_one_is_refused_alone(tmp_path: Path) -> None:
    """On the real server (``create_server``) with its defaults, the largest valid request
    reaches the handler, which refuses it only for the test node's context (before:
    RESOURCE_EXHAUSTED "received message larger than max (4216268 vs. 4194304)"); with
    the cap at its minimum, a request over it is refused RESOURCE_EXHAUSTED while the
    same channel's Health and GetTenant calls are served."""

    async def run() -> None:
        async with (serve(tmp_path, QUICK) as served,
                    grpc.aio.insecure_channel(served.address, options=channel_options()) as channel):
            request = largest_valid_request(policy="full")
            assert request.ByteSize() > 4 << 20
            call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            # parsed and checked to the end: only the harness's 2,048-token context refuses it
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert (err.value.details() or "").startswith("This model's maximum context length is 2048 tokens. "
                                                          "However, you requested ")

        tight = GrpcLimits(**{**QUICK.__dict__, "max_message_bytes": MAX_GENERATE_REQUEST_BYTES})
        async with (serve(tmp_path / "tight", tight) as served,
                    grpc.aio.insecure_channel(served.address,
                                              options=channel_options(2 * MAX_GENERATE_REQUEST_BYTES)) as channel):
            huge = inference_pb2.GenerateRequest(
                chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(
                    role="user", content="x" * (MAX_GENERATE_REQUEST_BYTES + 1))]))
            call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
                huge, metadata=(("authorization", f"Bearer {served.key}"),), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in (err.value.details() or "")
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            tenant = await tenant_pb2_grpc.TenantServiceStub(channel).GetTenant(
                tenant_pb2.GetTenantRequest(name="t"), metadata=(("authorization", f"Bearer {served.key}"),))
            assert tenant.tenant.spec.name == "t"

    asyncio.run(run())
