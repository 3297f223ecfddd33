"""services.convert: the protobuf <-> domain mapping, with exact values and messages."""

from __future__ import annotations

import pytest

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import common_pb2, inference_pb2, tenant_pb2
from services import convert
from tenants.model import SloClass, Tenant, TenantSpec
from tenants.usage import TenantUsage, TierTokens

# ---------------------------------------------------------------- tenants


def test_empty_wire_spec_takes_class_defaults() -> None:
    spec = convert.tenant_spec_from_pb(tenant_pb2.TenantSpec(name="fresh"))

    assert spec == TenantSpec("fresh", SloClass.STANDARD)
    assert (spec.ttft_slo_ms, spec.min_tokens_per_s, spec.cache_namespace) == (
        5000.0,
        4.0,
        "",  # the tenant's own: Tenant.kv_namespace
    )


def test_wire_spec_with_class_only() -> None:
    msg = tenant_pb2.TenantSpec(name="chat", slo_class=common_pb2.SLO_CLASS_INTERACTIVE)
    assert convert.tenant_spec_from_pb(msg) == TenantSpec("chat", "interactive")


def test_spec_round_trip_keeps_every_field() -> None:
    spec = TenantSpec(
        "lead",
        SloClass.INTERACTIVE,
        ttft_slo_ms=750.0,
        tpot_slo_ms=60.0,
        min_tokens_per_s=0.0,
        weight=3.5,
        kv_quota_bytes=2**33,
        max_context_tokens=4096,
        cache_namespace="wiki-shared",
        policy="g-kv",
    )

    msg = convert.tenant_spec_to_pb(spec)

    assert msg == tenant_pb2.TenantSpec(
        name="lead",
        slo_class=common_pb2.SLO_CLASS_INTERACTIVE,
        ttft_slo_ms=750.0,
        tpot_slo_ms=60.0,
        min_tokens_per_s=0.0,
        weight=3.5,
        kv_quota_bytes=8589934592,
        max_context_tokens=4096,
        cache_namespace="wiki-shared",
        policy="g-kv",
    )
    assert msg.HasField("min_tokens_per_s")
    wire = tenant_pb2.TenantSpec.FromString(msg.SerializeToString())
    assert convert.tenant_spec_from_pb(wire) == spec


def test_explicit_zero_floor_is_not_replaced_by_the_class_default() -> None:
    """Guards against proto3 zero-means-unset turning "no floor" into the class floor."""
    explicit = tenant_pb2.TenantSpec(
        name="x", slo_class=common_pb2.SLO_CLASS_INTERACTIVE, min_tokens_per_s=0.0
    )
    unset = tenant_pb2.TenantSpec(name="x", slo_class=common_pb2.SLO_CLASS_INTERACTIVE)

    assert convert.tenant_spec_from_pb(explicit).min_tokens_per_s == 0.0
    assert convert.tenant_spec_from_pb(unset).min_tokens_per_s == 10.0


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (tenant_pb2.TenantSpec(name=""), "spec.name must match [a-z0-9][a-z0-9_-]{0,62}, got ''"),
        (
            tenant_pb2.TenantSpec(name="ok", weight=-1.0),
            "spec.weight must be a positive finite number, got -1.0",
        ),
        (
            tenant_pb2.TenantSpec(name="ok", ttft_slo_ms=-2.0),
            "spec.ttft_slo_ms must be a positive finite number, got -2.0",
        ),
        (
            tenant_pb2.TenantSpec(name="ok", min_tokens_per_s=-0.5),
            "spec.min_tokens_per_s must be a finite number >= 0, got -0.5",
        ),
        (
            tenant_pb2.TenantSpec(name="ok", cache_namespace="Shared Docs"),
            "spec.cache_namespace must match [a-z0-9][a-z0-9_-]{0,62}, got 'Shared Docs'",
        ),
        (
            tenant_pb2.TenantSpec(name="ok", slo_class=9),  # type: ignore[arg-type]
            "spec.slo_class 9 is not a known SloClass value",
        ),
    ],
)
def test_invalid_wire_spec(msg: tenant_pb2.TenantSpec, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        convert.tenant_spec_from_pb(msg)
    assert str(excinfo.value) == message


def test_slo_class_mapping() -> None:
    assert [convert.slo_class_to_pb(slo) for slo in SloClass] == [1, 2, 3]
    assert [convert.slo_class_from_pb(n) for n in (0, 1, 2, 3)] == [
        None,
        SloClass.INTERACTIVE,
        SloClass.STANDARD,
        SloClass.BATCH,
    ]


def test_tenant_round_trip() -> None:
    tenant = Tenant("0123abcd", TenantSpec("ops", "batch"), 1700000123.25)

    msg = convert.tenant_to_pb(tenant)

    assert (msg.tenant_id, msg.spec.name, msg.created_at_s) == ("0123abcd", "ops", 1700000123.25)
    assert msg.spec.slo_class == common_pb2.SLO_CLASS_BATCH
    assert convert.tenant_from_pb(msg) == tenant
    with pytest.raises(ValueError, match="^tenant.tenant_id must be a non-empty string, got ''$"):
        convert.tenant_from_pb(tenant_pb2.Tenant(spec=msg.spec))


# ---------------------------------------------------------------- usage


def test_tier_tokens_from_dict() -> None:
    msg = convert.tier_tokens_to_pb({"device": 48, "spill_ram": 16})

    assert msg == common_pb2.TierTokens(device=48, host=0, spill_ram=16, spill_disk=0)
    assert convert.tier_tokens_from_pb(msg) == TierTokens(device=48, spill_ram=16)
    assert convert.tier_tokens_to_pb(TierTokens(host=5)).host == 5
    with pytest.raises(ValueError) as excinfo:
        convert.tier_tokens_to_pb({"disk": 1})
    assert str(excinfo.value) == (
        "unknown tiers ['disk']; known tiers: ['device', 'host', 'spill_ram', 'spill_disk']"
    )
    with pytest.raises(ValueError, match="^device must be a non-negative integer, got -3$"):
        convert.tier_tokens_to_pb({"device": -3})


def test_usage_round_trip() -> None:
    usage = TenantUsage(
        tenant_id="t9",
        prompt_tokens=1200,
        completion_tokens=340,
        cached_tokens=TierTokens(device=512, host=128, spill_ram=64, spill_disk=32),
        blocks_held=21,
        requests=7,
        rejected=2,
        preempted=1,
    )

    msg = convert.usage_to_pb(usage)

    assert msg == tenant_pb2.Usage(
        tenant_id="t9",
        prompt_tokens=1200,
        completion_tokens=340,
        cached_tokens=common_pb2.TierTokens(device=512, host=128, spill_ram=64, spill_disk=32),
        blocks_held=21,
        requests=7,
        rejected=2,
        preempted=1,
    )
    assert convert.usage_from_pb(msg) == usage


# ---------------------------------------------------------------- sampling


def test_sampling_defaults_from_wire() -> None:
    params = convert.sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=16))
    assert params == SamplingParams(
        max_tokens=16, temperature=0.0, top_p=1.0, seed=None, stop_token_ids=(), ignore_eos=False
    )


def test_sampling_all_fields_and_float32_rounding() -> None:
    msg = inference_pb2.SamplingParams(
        max_tokens=64,
        temperature=0.7,
        top_p=0.95,
        seed=0,
        stop_token_ids=[2, 13],
        ignore_eos=True,
        stop=["END", "\n\n"],
    )
    assert msg.temperature != 0.7  # float32 on the wire

    params = convert.sampling_params_from_pb(msg)

    assert params == SamplingParams(
        max_tokens=64, temperature=0.7, top_p=0.95, seed=0, stop_token_ids=(2, 13), ignore_eos=True,
        stop=("END", "\n\n"),
    )
    assert convert.sampling_params_from_pb(convert.sampling_params_to_pb(params)) == params
    assert not convert.sampling_params_to_pb(SamplingParams(max_tokens=1)).HasField("seed")


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (
            inference_pb2.SamplingParams(),
            "sampling.max_tokens must be > 0 (it is required), got 0",
        ),
        (
            inference_pb2.SamplingParams(max_tokens=8, top_p=1.5),
            "sampling.top_p must be in (0, 1], got 1.5",
        ),
        (
            inference_pb2.SamplingParams(max_tokens=8, top_p=-0.25),
            "sampling.top_p must be in (0, 1], got -0.25",
        ),
        (
            inference_pb2.SamplingParams(max_tokens=8, temperature=-1.0),
            "sampling.temperature must be a number in [0, 2], got -1.0",
        ),
        (
            inference_pb2.SamplingParams(max_tokens=8, stop=["a"] * 5),
            "sampling.stop holds 5 strings; at most 4 are allowed",
        ),
        (
            inference_pb2.SamplingParams(max_tokens=8, stop=[""]),
            "sampling.stop strings must have 1 to 256 characters, got ''",
        ),
    ],
)
def test_invalid_sampling(msg: inference_pb2.SamplingParams, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        convert.sampling_params_from_pb(msg)
    assert str(excinfo.value) == message


def test_started_event_carries_the_priority_the_node_queued() -> None:
    started = {"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 3}
    assert convert.generate_event_to_pb({**started, "priority": -2}).started.priority == -2
    assert convert.generate_event_to_pb(started).started.priority == 0


# ---------------------------------------------------------------- chat and prompt


def test_chat_messages_from_wire() -> None:
    msg = inference_pb2.ChatMessages(
        messages=[
            inference_pb2.ChatMessage(role="system", content="Be brief."),
            inference_pb2.ChatMessage(role="user", content="Capital of France?"),
            inference_pb2.ChatMessage(role="assistant", content=""),
            inference_pb2.ChatMessage(role="tool", content='{"hits": 3}', tool_call_id="call_1"),
        ]
    )

    assert convert.chat_messages_from_pb(msg) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"hits": 3}', "tool_call_id": "call_1"},
    ]


def test_a_tool_message_without_its_call_id_is_refused() -> None:
    """Session 30: a gRPC tool message without ``tool_call_id`` was served as an answer to no
    call; the HTTP API (as OpenAI) refuses it, and both APIs now do."""
    msg = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi"),
                                               inference_pb2.ChatMessage(role="tool", content="3")])
    with pytest.raises(ValueError, match=r"^chat\.messages\[1\]\.tool_call_id is required on a tool message"):
        convert.chat_messages_from_pb(msg)


def test_chat_validation() -> None:
    with pytest.raises(ValueError, match=r"^chat.messages must hold at least one message$"):
        convert.chat_messages_from_pb(inference_pb2.ChatMessages())
    bad = inference_pb2.ChatMessages(
        messages=[
            inference_pb2.ChatMessage(role="user", content="hi"),
            inference_pb2.ChatMessage(role="User", content="again"),
        ]
    )
    with pytest.raises(ValueError) as excinfo:
        convert.chat_messages_from_pb(bad)
    assert str(excinfo.value) == (
        "chat.messages[1].role must be one of system, developer, user, assistant, tool, got 'User'"
    )


def test_chat_to_wire() -> None:
    messages = [{"role": "user", "content": "hello"}]
    msg = convert.chat_messages_to_pb(messages)

    assert msg == inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="user", content="hello")]
    )
    assert convert.chat_messages_from_pb(msg) == messages
    with pytest.raises(ValueError) as excinfo:
        convert.chat_messages_to_pb([{"role": "user"}])
    assert str(excinfo.value) == (
        "chat.messages[0] must have the keys role and content, and may have name, tool_call_id and tool_calls; "
        "got ['role']"
    )


def test_a_tool_result_carries_its_tool_call_id_to_the_chat_template() -> None:
    """Review 25b N3: a tool message could not say which call it answers (OpenAI's
    ``tool_call_id``; the HTTP API refused it as an unsupported field, gRPC had no field). Now
    ``name`` and a tool message's ``tool_call_id`` travel over gRPC and reach the chat template
    as transformers' ``apply_chat_template`` reads them (vLLM's way); both are bounded, and a
    ``tool_call_id`` on another role is refused naming it."""
    messages = [{"role": "user", "content": "2+2?", "name": "ann"},
                {"role": "assistant", "content": "add(2, 2)"},
                {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"}]
    msg = convert.chat_messages_to_pb(messages)
    assert msg.messages[2] == inference_pb2.ChatMessage(role="tool", content="4", name="add", tool_call_id="call_1")
    assert convert.chat_messages_from_pb(msg) == messages
    bad = [
        ([{"role": "user", "content": "hi", "tool_call_id": "call_1"}],
         "chat.messages[0].tool_call_id applies to tool messages (role \"tool\"), not to role 'user'"),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "4", "tool_call_id": "c" * 257}],
         "chat.messages[1].tool_call_id is longer than 256 characters"),
        ([{"role": "user", "content": "hi", "name": "n" * 257}], "chat.messages[0].name is longer than 256 characters"),
        ([{"role": "tool", "content": "4", "tool_call_id": "c", "tool_calls": "[]"}],
         "chat.messages[0].tool_calls must be a list of tool calls"),
        ([{"role": "tool", "content": "4", "tool_call_id": "c", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
         "chat.messages[0].tool_calls applies to assistant messages, not to role 'tool'"),
    ]
    for chat, error in bad:
        with pytest.raises(ValueError) as excinfo:
            convert.chat_messages_to_pb(chat)
        assert str(excinfo.value) == error
    big = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(
        role="tool", content="x" * (convert.MAX_PROMPT_CHARS - 5), tool_call_id="call_1")])
    with pytest.raises(ValueError, match="hold 1048577 characters"):  # the id counts as text
        convert.chat_messages_from_pb(big)


def test_prompt_from_request() -> None:
    chat = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[{"role": "user", "content": "q"}])
    )
    tokens = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 15, 42]))

    assert convert.prompt_from_pb(chat) == [{"role": "user", "content": "q"}]
    assert convert.prompt_from_pb(tokens) == [1, 15, 42]
    with pytest.raises(ValueError, match="^input must be set: either chat or tokens$"):
        convert.prompt_from_pb(inference_pb2.GenerateRequest())
    with pytest.raises(ValueError, match=r"^tokens.ids must hold at least one token id$"):
        convert.prompt_from_pb(inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds()))


@pytest.mark.parametrize("temperature", [2.5, 50.0, 100.0, float("nan"), float("inf")])
def test_temperature_past_the_http_bound_is_refused_as_on_http(temperature: float) -> None:
    """Regression (review 24h M1): gRPC took a temperature up to 100 while the HTTP API
    refused over 2 (OpenAI's range); both refuse past ``MAX_REQUEST_TEMPERATURE`` now."""
    from cache_node.sampling_params import MAX_REQUEST_TEMPERATURE
    from services.openai_api.sampling_fields import SamplingFields

    assert MAX_REQUEST_TEMPERATURE == 2.0 == SamplingFields.model_fields["temperature"].metadata[1].le
    with pytest.raises(ValueError, match=r"^sampling.temperature must be a number in \[0, 2\], got "):
        convert.sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=8, temperature=temperature))
    edge = convert.sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=8, temperature=2.0))
    assert edge.temperature == 2.0


def test_the_developer_role_is_a_system_message_as_on_http() -> None:
    """Regression (review 24h M1): role ``developer`` (OpenAI's newer name for ``system``)
    was refused INVALID_ARGUMENT on gRPC while the HTTP API sent it as ``system``."""
    chat = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="developer", content="be brief"),
                                               inference_pb2.ChatMessage(role="user", content="hi")])
    assert convert.chat_messages_from_pb(chat) == [{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "hi"}]
