"""The only protobuf <-> domain mapping in kvstrata (docs/conventions.md,
'Protobuf stays at the edge').

Every other module works with domain types (``tenants.model``, ``tenants.usage``,
``cache_node.sampling_params``); only this module and gRPC clients import the generated
``kvstrata.v1`` code. ``*_from_pb`` functions validate what arrives from the wire and
raise ``ValueError`` whose message starts with the request field path (``spec.weight
must be ...``, ``sampling.max_tokens must be ...``); the gateway maps ``ValueError`` to
``INVALID_ARGUMENT``.

proto3 zero values mean "unset": a ``TenantSpec`` field left at 0/"" takes the SLO class
default (``min_tokens_per_s`` has explicit presence, so 0 means "no floor"), and a
``SamplingParams.top_p`` of 0 means 1.0.

Bounds on a ``GenerateRequest`` (past one: ``ValueError`` naming the field and the limit):
``sampling.temperature`` in [0, ``MAX_REQUEST_TEMPERATURE``] (2, as the HTTP API);
``sampling.stop_token_ids`` at most ``MAX_STOP_TOKEN_IDS`` (64) ids; ``sampling.stop`` at
most ``MAX_STOP_STRINGS`` (4) strings of 1 to ``MAX_STOP_STRING_CHARS`` (256) characters;
``sampling.structured_output`` one constraint of at most 64 KiB (``StructuredOutputSpec``; a
``choice`` at most 256 strings);
``tokens.ids`` at most ``MAX_PROMPT_TOKEN_IDS`` (131,072) ids; ``chat.messages`` at most
``MAX_CHAT_MESSAGES`` (1,024) messages holding at most ``MAX_PROMPT_CHARS`` (1,048,576)
characters together (content, ``name`` and ``tool_call_id``: ``services.chat.content_chars``),
a message's ``name`` and a tool message's ``tool_call_id`` at most ``MAX_MESSAGE_ID_CHARS`` (256); ``policy`` a name of the tenant policy pattern (at most 63 characters);
``request_id`` and ``session_id`` at most 256 characters, ``priority`` in [-1000, 1000],
``prefix_tokens`` in [0, prompt tokens] of a token prompt (0 with chat) and
``prefix_messages`` in [0, messages] of a chat (0 with tokens; its rendering must be a token
prefix of the chat's: ``services.node_request.resolve_prefix_tokens``), all checked by the
gateway. The model's context length and the KV pool bound a prompt's tokens
further (the gateway).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_REQUEST_TEMPERATURE,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from cache_node.structured_output import (
    MAX_SCHEMA_DEPTH,
    STRUCTURED_OUTPUT_KINDS,
    StructuredOutputSpec,
)
from kvstrata.v1 import admin_pb2, common_pb2, inference_pb2, tenant_pb2
from services.chat_tools import (
    LONE_SURROGATE,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    arguments_values,
    check_arguments,
    check_arguments_values,
    check_tool_answers,
    lone_surrogate,
    template_call,
)
from services.chat_tools import NAME_PATTERN as TOOL_NAME_PATTERN
from services.node_request import entry_logprobs, entry_prompt_logprobs
from services.tool_requests import check_parameters, check_tools
from tenants.model import POLICY_PATTERN, SloClass, Tenant, TenantSpec
from tenants.usage import TenantUsage, TierTokens

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a chat message may have; ``developer`` (OpenAI's newer name for ``system``) is passed on
as ``system``, as the HTTP API does (review 24h M1: gRPC refused it)."""
FLOAT32_DIGITS = 6  # decimal digits a float32 always round-trips (FLT_DIG)
MAX_PROMPT_TOKEN_IDS = 131_072
MAX_CHAT_MESSAGES = 1024
MAX_PROMPT_CHARS = 1 << 20
MAX_REQUEST_ID_CHARS = 256  # request_id, session_id (services.gateway.MAX_ID_CHARS checks them)
MAX_MESSAGE_ID_CHARS = 256
"""Longest ``name`` or ``tool_call_id`` of a chat message (gRPC and HTTP alike)."""
MAX_REQUEST_TOOL_CALLS = 1024
"""Most ``ChatMessage.tool_calls`` of one request's messages together (each message at most
``chat_tools.MAX_TOOL_CALLS``, 128), counted on the wire before it is parsed
(``services.grpc_wire``), as ``MAX_CHAT_MESSAGES``: a session turn sends its new messages
only, the node keeps the history's calls. The HTTP API's bound too (its body's messages'
``tool_calls`` together: ``openai_api.messages.check_tool_answers``). Regression (review 30j F5):
it was gRPC's alone, and 9 x 128 calls were served over HTTP, refused over gRPC."""
MAX_TOOLS_TEXT_CHARS = 6 * MAX_TOOLS_CHARS
"""Most characters of ``GenerateRequest.tools``' names, descriptions and parameters as sent,
before any is parsed (``tools_from_pb``): what is counted against ``MAX_TOOLS_CHARS`` is their
compact JSON (``tool_requests.check_tools``, as the HTTP API counts it), which whitespace and
``\\uXXXX`` escapes (6 characters for one) do not reach. Regression (review 30j F3): the text as
sent was held to ``MAX_TOOLS_CHARS``, so tools HTTP serves (pretty-printed, or escaped as
``json.dumps`` writes by default) were refused over gRPC, with a count the client never wrote."""

_SLO_CLASS_TO_PB: dict[SloClass, common_pb2.SloClass] = {
    SloClass.INTERACTIVE: common_pb2.SLO_CLASS_INTERACTIVE,
    SloClass.STANDARD: common_pb2.SLO_CLASS_STANDARD,
    SloClass.BATCH: common_pb2.SLO_CLASS_BATCH,
}
_SLO_CLASS_FROM_PB: dict[int, SloClass] = {int(n): slo for slo, n in _SLO_CLASS_TO_PB.items()}


@contextmanager
def _field_path(prefix: str) -> Iterator[None]:
    """Re-raise a domain ``ValueError`` ("weight must ...") as "<prefix>.weight must ..."."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{prefix}.{exc}") from None


# ---------------------------------------------------------------- SLO class


def slo_class_to_pb(slo_class: SloClass) -> common_pb2.SloClass:
    """``SloClass`` -> ``kvstrata.v1.SloClass`` enum number."""
    return _SLO_CLASS_TO_PB[slo_class]


def slo_class_from_pb(number: int) -> SloClass | None:
    """Enum number -> ``SloClass``; ``None`` for ``SLO_CLASS_UNSPECIFIED``.

    Raises:
        ValueError: a number this server does not know.
    """
    if number == common_pb2.SLO_CLASS_UNSPECIFIED:
        return None
    if number not in _SLO_CLASS_FROM_PB:
        raise ValueError(f"slo_class {number} is not a known SloClass value")
    return _SLO_CLASS_FROM_PB[number]


# ---------------------------------------------------------------- tenants


def tenant_spec_from_pb(msg: tenant_pb2.TenantSpec, prefix: str = "spec") -> TenantSpec:
    """Wire spec -> validated ``TenantSpec``; zero/empty fields take the class defaults.

    Raises:
        ValueError: an invalid field, e.g. ``"spec.weight must be a positive finite number"``.
    """
    with _field_path(prefix):
        slo_class = slo_class_from_pb(msg.slo_class) or SloClass.STANDARD
        optional: dict[str, Any] = {
            "ttft_slo_ms": msg.ttft_slo_ms or None,
            "tpot_slo_ms": msg.tpot_slo_ms or None,
            "weight": msg.weight or None,
            "cache_namespace": msg.cache_namespace or None,
        }
        if msg.HasField("min_tokens_per_s"):
            optional["min_tokens_per_s"] = msg.min_tokens_per_s
        if msg.max_context_tokens:
            optional["max_context_tokens"] = msg.max_context_tokens
        return TenantSpec(
            msg.name,
            slo_class,
            kv_quota_bytes=msg.kv_quota_bytes,
            policy=msg.policy,
            allowed_policies=tuple(msg.allowed_policies),
            **optional,
        )


def tenant_spec_to_pb(spec: TenantSpec) -> tenant_pb2.TenantSpec:
    """``TenantSpec`` -> wire spec with every field set explicitly."""
    return tenant_pb2.TenantSpec(
        name=spec.name,
        slo_class=slo_class_to_pb(spec.slo_class),
        ttft_slo_ms=spec.ttft_slo_ms,
        tpot_slo_ms=spec.tpot_slo_ms,
        min_tokens_per_s=spec.min_tokens_per_s,
        weight=spec.weight,
        kv_quota_bytes=spec.kv_quota_bytes,
        max_context_tokens=spec.max_context_tokens,
        cache_namespace=spec.cache_namespace,
        policy=spec.policy,
        allowed_policies=spec.allowed_policies,
    )


def tenant_to_pb(tenant: Tenant) -> tenant_pb2.Tenant:
    return tenant_pb2.Tenant(
        tenant_id=tenant.tenant_id,
        spec=tenant_spec_to_pb(tenant.spec),
        created_at_s=tenant.created_at_s,
    )


def tenant_from_pb(msg: tenant_pb2.Tenant) -> Tenant:
    """Wire tenant -> ``Tenant`` (clients). Raises ``ValueError`` for an invalid record."""
    with _field_path("tenant"):
        return Tenant(msg.tenant_id, tenant_spec_from_pb(msg.spec), msg.created_at_s)


# ---------------------------------------------------------------- usage


def tier_tokens_to_pb(counts: TierTokens | Mapping[str, int]) -> common_pb2.TierTokens:
    """``TierTokens`` or ``{tier: tokens}`` (absent tiers 0) -> wire ``TierTokens``.

    Raises:
        ValueError: unknown tier name (the known ones are listed) or a negative count.
    """
    tiers = counts if isinstance(counts, TierTokens) else TierTokens.from_dict(counts)
    return common_pb2.TierTokens(**tiers.as_dict())


def tier_tokens_from_pb(msg: common_pb2.TierTokens) -> TierTokens:
    return TierTokens(
        device=msg.device, host=msg.host, spill_ram=msg.spill_ram, spill_disk=msg.spill_disk
    )


def usage_to_pb(usage: TenantUsage) -> tenant_pb2.Usage:
    return tenant_pb2.Usage(
        tenant_id=usage.tenant_id,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=tier_tokens_to_pb(usage.cached_tokens),
        blocks_held=usage.blocks_held,
        requests=usage.requests,
        rejected=usage.rejected,
        preempted=usage.preempted,
        session_blocks_held=usage.session_blocks_held,
    )


def usage_from_pb(msg: tenant_pb2.Usage) -> TenantUsage:
    """Wire usage -> ``TenantUsage`` (clients). Raises ``ValueError`` for an empty id."""
    with _field_path("usage"):
        return TenantUsage(
            tenant_id=msg.tenant_id,
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
            cached_tokens=tier_tokens_from_pb(msg.cached_tokens),
            blocks_held=msg.blocks_held,
            requests=msg.requests,
            rejected=msg.rejected,
            preempted=msg.preempted,
            session_blocks_held=msg.session_blocks_held,
        )


# ---------------------------------------------------------------- generate requests


def sampling_params_from_pb(
    msg: inference_pb2.SamplingParams, prefix: str = "sampling"
) -> SamplingParams:
    """Wire sampling -> validated ``SamplingParams``.

    ``top_p`` and ``repetition_penalty`` 0 mean 1.0; an unset ``seed`` means None, an unset
    ``logprobs`` None (none asked; 0 asks for the generated token's alone), an unset
    ``prompt_logprobs`` None likewise; ``top_k`` -1 is 0
    (off, vLLM's); an empty ``allowed_token_ids`` None (all allowed). ``temperature``,
    ``top_p``, ``min_p``, the penalties and the ``logit_bias`` values travel as float32 and are
    rounded to 6 significant digits, so 0.7 arrives as 0.7. ``logit_bias`` and
    ``allowed_token_ids`` are counted before either is read (a message may hold ~1M entries).
    An unset ``structured_output`` is None (``structured_output_from_pb``).

    Raises:
        ValueError: ``max_tokens`` is 0 (unset) or another field is out of range, e.g.
            ``"sampling.top_p must be in (0, 1], got 1.5"``.
    """
    if msg.max_tokens == 0:
        raise ValueError(f"{prefix}.max_tokens must be > 0 (it is required), got 0")
    if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"{prefix}.stop_token_ids holds {len(msg.stop_token_ids)} ids; "
                         f"at most {MAX_STOP_TOKEN_IDS} are allowed")
    for name, bound in (("logit_bias", MAX_LOGIT_BIAS_TOKENS), ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)):
        if len(getattr(msg, name)) > bound:
            raise ValueError(f"{prefix}.{name} must hold at most {bound} token ids, got {len(getattr(msg, name))}")
    temperature = _from_float32(msg.temperature)
    if not 0.0 <= temperature <= MAX_REQUEST_TEMPERATURE:  # NaN too
        raise ValueError(f"{prefix}.temperature must be a number in [0, {MAX_REQUEST_TEMPERATURE:g}], "
                         f"got {temperature!r}")
    with _field_path(prefix):
        return SamplingParams(
            max_tokens=msg.max_tokens,
            temperature=temperature,
            top_p=_from_float32(msg.top_p) if msg.top_p != 0 else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
            stop=tuple(msg.stop),
            top_k=msg.top_k,
            min_tokens=msg.min_tokens,
            presence_penalty=_from_float32(msg.presence_penalty),
            frequency_penalty=_from_float32(msg.frequency_penalty),
            repetition_penalty=_from_float32(msg.repetition_penalty) if msg.repetition_penalty != 0 else 1.0,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
            min_p=_from_float32(msg.min_p),
            logit_bias=tuple((token, _from_float32(bias)) for token, bias in msg.logit_bias.items()),
            allowed_token_ids=tuple(msg.allowed_token_ids) or None,
            structured_output=structured_output_from_pb(msg.structured_output)
            if msg.HasField("structured_output") else None,
            prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        )


def structured_output_from_pb(msg: inference_pb2.StructuredOutput) -> StructuredOutputSpec:
    """The one constraint ``msg`` sets -> ``StructuredOutputSpec`` (a ``choice`` list becomes
    its JSON array text), which checks its size, JSON and choices.

    Raises:
        ValueError: no member set, ``json_object`` false, a ``json_schema`` whose JSON holds a
            lone surrogate (``chat_tools.lone_surrogate``), or the spec's refusal; the message
            starts with ``structured_output`` (``sampling_params_from_pb`` prefixes its path).
    """
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError(f"structured_output must set one of {', '.join(STRUCTURED_OUTPUT_KINDS)} "
                         "(leave it unset for no constraint)")
    if kind == "json_object" and not msg.json_object:
        raise ValueError("structured_output.json_object must be true (leave structured_output unset for no "
                         "constraint)")
    if kind == "choice":  # at most MAX_CHOICES strings (grpc_wire counts them before parsing)
        return StructuredOutputSpec("choice", json.dumps(list(msg.choice.choices), ensure_ascii=False))
    if kind == "json_schema" and lone_surrogate(msg.json_schema):  # (review 30j F1, as tools' parameters)
        raise ValueError(f"structured_output.json_schema {LONE_SURROGATE}")
    return StructuredOutputSpec(kind, "" if kind == "json_object" else getattr(msg, kind))


def structured_output_to_pb(spec: StructuredOutputSpec) -> inference_pb2.StructuredOutput:
    """Inverse of ``structured_output_from_pb`` (a ``choice`` spec as its list)."""
    if spec.kind == "json_object":
        return inference_pb2.StructuredOutput(json_object=True)
    if spec.kind == "choice":
        return inference_pb2.StructuredOutput(choice=inference_pb2.ChoiceList(choices=spec.choices))
    msg = inference_pb2.StructuredOutput()
    setattr(msg, spec.kind, spec.spec)  # json_schema, regex or grammar: a string member
    return msg


def sampling_params_to_pb(params: SamplingParams) -> inference_pb2.SamplingParams:
    msg = inference_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        stop=params.stop,
        top_k=params.top_k,
        min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=params.allowed_token_ids or (),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_pb(params.structured_output))
    return msg


def chat_message(role: str, content: str, name: str = "", tool_call_id: str = "") -> dict[str, str]:
    """One message as the chat template takes it (transformers' ``apply_chat_template``):
    ``role`` (``developer`` as ``system``) and ``content``, and ``name`` and ``tool_call_id``
    when given, as vLLM passes them on (``vllm.entrypoints.chat_utils``)."""
    message = {"role": "system" if role == "developer" else role, "content": content}
    if name:
        message["name"] = name
    if tool_call_id:
        message["tool_call_id"] = tool_call_id
    return message


def check_message_ids(where: str, role: str, name: str, tool_call_id: str) -> None:
    """A message's ``name`` and ``tool_call_id`` ("": not given).

    Raises:
        ValueError: one is longer than ``MAX_MESSAGE_ID_CHARS``, ``tool_call_id`` is on a
            message whose role is not ``tool``, or a tool message has none (``where`` names the
            message). Regression (session 30): a gRPC tool message without one was served as an
            answer to no call, which the HTTP API refuses.
    """
    for field, value in (("name", name), ("tool_call_id", tool_call_id)):
        if len(value) > MAX_MESSAGE_ID_CHARS:
            raise ValueError(f"{where}.{field} is longer than {MAX_MESSAGE_ID_CHARS} characters")
    if tool_call_id and role != "tool":
        raise ValueError(f"{where}.tool_call_id applies to tool messages (role \"tool\"), not to role {role!r}")
    if role == "tool" and not tool_call_id:  # as the HTTP API's ChatMessage (OpenAI requires it)
        raise ValueError(f"{where}.tool_call_id is required on a tool message (role \"tool\"): the id of the "
                         "assistant's tool call it answers")


def tool_calls_from_pb(calls: Sequence[inference_pb2.ToolCall], where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the chat template takes them
    (``chat_tools.template_call``, as the HTTP API's ``ToolCall.as_template``).

    Raises:
        ValueError: more than ``MAX_TOOL_CALLS``, an id not of 1 to ``MAX_MESSAGE_ID_CHARS``
            characters, a name off OpenAI's pattern, or ``arguments`` whose JSON holds a lone
            surrogate (``chat_tools.check_arguments``; ``where.tool_calls[j]`` named).
    """
    if len(calls) > MAX_TOOL_CALLS:
        raise ValueError(f"{where}.tool_calls holds {len(calls)} calls; at most {MAX_TOOL_CALLS} are allowed")
    for j, call in enumerate(calls):
        if not 0 < len(call.id) <= MAX_MESSAGE_ID_CHARS:
            raise ValueError(f"{where}.tool_calls[{j}].id must have 1 to {MAX_MESSAGE_ID_CHARS} characters")
        if TOOL_NAME_PATTERN.fullmatch(call.name) is None:
            raise ValueError(f"{where}.tool_calls[{j}].name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {call.name[:80]!r}")
        check_arguments(f"{where}.tool_calls[{j}].arguments", call.arguments)
    return [template_call(c.id, c.name, c.arguments) for c in calls]


def chat_messages_from_pb(
    msg: inference_pb2.ChatMessages, prefix: str = "chat", in_session: bool = False
) -> list[dict[str, Any]]:
    """Wire chat -> ``[{"role": ..., "content": ...}, ...]`` (with ``name`` and
    ``tool_call_id`` where given: ``chat_message``; an assistant's ``tool_calls``:
    ``tool_calls_from_pb``) for the chat template.

    Raises:
        ValueError: no messages or more than ``MAX_CHAT_MESSAGES``, more than
            ``MAX_PROMPT_CHARS`` characters of text together (content, names, tool call ids,
            the tool calls' ids, names and arguments), more than ``MAX_ARGUMENTS_VALUES`` JSON
            values in the calls' arguments together (``chat_tools.check_arguments_values``,
            counted before any is parsed; review s33 F1: each was parsed, within the characters'
            bound, 0.25-0.48 s of the GIL for 0.75 MB of empty lists), a role outside ``CHAT_ROLES``, a bad
            ``name`` or ``tool_call_id`` (``check_message_ids``; named by index), tool calls on
            a message not the assistant's or bad ones, a tool message answering no earlier
            call when any message has calls (``chat_tools.check_tool_answers``; not for a
            session turn, ``in_session``, whose answers may be to calls of the session's
            earlier turns: its cache node checks them against those, review F9), or every
            message's content is blank.
    """
    if not msg.messages:
        raise ValueError(f"{prefix}.messages must hold at least one message")
    if len(msg.messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"{prefix}.messages holds {len(msg.messages)} messages; "
                         f"at most {MAX_CHAT_MESSAGES} are allowed")
    chars = sum(len(m.content) + len(m.name) + len(m.tool_call_id)
                + sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls) for m in msg.messages)
    if chars > MAX_PROMPT_CHARS:
        raise ValueError(f"{prefix}.messages hold {chars} characters; at most {MAX_PROMPT_CHARS} are allowed")
    # the calls' arguments' JSON values, counted on their text before any is parsed
    check_arguments_values((f"{prefix}.messages[{i}].tool_calls[{j}].arguments", c.arguments)
                           for i, m in enumerate(msg.messages) for j, c in enumerate(m.tool_calls))
    if not any(m.content.strip() for m in msg.messages):
        raise ValueError(f"{prefix}.messages: every message is empty; the prompt needs some text")
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(msg.messages):
        where = f"{prefix}.messages[{index}]"
        if message.role not in CHAT_ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}")
        check_message_ids(where, message.role, message.name, message.tool_call_id)
        converted: dict[str, Any] = chat_message(message.role, message.content, message.name, message.tool_call_id)
        if message.tool_calls:
            if message.role != "assistant":
                raise ValueError(f"{where}.tool_calls applies to assistant messages, not to role {message.role!r}")
            converted["tool_calls"] = tool_calls_from_pb(message.tool_calls, where)
        messages.append(converted)
    if not in_session:
        check_tool_answers(messages, f"{prefix}.messages[{{}}].tool_call_id")
    return messages


_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})


def chat_messages_to_pb(messages: Sequence[Mapping[str, Any]], in_session: bool = False) -> inference_pb2.ChatMessages:
    """``[{"role", "content"[, "name"][, "tool_call_id"][, "tool_calls"]}, ...]`` -> wire chat
    (clients), ``tool_calls`` in OpenAI's shape (``[{"id", "type": "function", "function":
    {"name", "arguments"}}]``, ``arguments`` its JSON text or a JSON value, and ``content`` may
    then be None); validated like the server does (``in_session``: a session turn's messages,
    whose tool messages may answer the session's earlier calls: ``chat_messages_from_pb``).

    Raises:
        ValueError: a message lacks ``role``/``content``, has another key, an unknown role or a
            bad ``name``/``tool_call_id``/``tool_calls``.
    """
    msg = inference_pb2.ChatMessages()
    for index, message in enumerate(messages):
        if not {"role", "content"} <= set(message) <= _MESSAGE_KEYS:
            raise ValueError(
                f"chat.messages[{index}] must have the keys role and content, and may have name, "
                f"tool_call_id and tool_calls; got {sorted(message)}"
            )
        fields = {k: v for k, v in message.items() if k != "tool_calls"}
        fields["content"] = fields["content"] or ""
        added = msg.messages.add(**fields)
        calls = message.get("tool_calls") or ()
        if isinstance(calls, (str, bytes, Mapping)):
            raise ValueError(f"chat.messages[{index}].tool_calls must be a list of tool calls")  # noqa: TRY004
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(call.get("id"), str):
                raise ValueError(f'chat.messages[{index}].tool_calls[{j}] must be {{"id", "type": "function", '  # noqa: TRY004
                                 '"function": {"name", "arguments"}}')
            arguments = function.get("arguments", "")
            added.tool_calls.add(id=call["id"], name=str(function.get("name", "")), arguments=arguments
                                 if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
    chat_messages_from_pb(msg, in_session=in_session)
    return msg


def tools_from_pb(tools: Sequence[inference_pb2.Tool], prefix: str = "tools") -> list[dict[str, Any]] | None:
    """Wire tools -> OpenAI's tools list as the chat template takes them (None: none), checked as
    the HTTP API checks its ``tools`` (``tool_requests.check_parameters``, ``check_tools``).

    Raises:
        ValueError: more than ``MAX_TOOLS``, more than ``MAX_TOOLS_TEXT_CHARS`` characters as
            given, or more than ``MAX_TOOLS_CHARS`` JSON values in the parameters (counted on
            their text, ``chat_tools.arguments_values``: no compact JSON of that many characters
            holds more; review s33 F1, the 6x text as sent was parsed whole first), before any
            is parsed, more than ``MAX_TOOLS_CHARS`` as compact JSON, a name
            off OpenAI's pattern or listed twice, ``parameters`` not the JSON text of an
            object's schema at most 32 levels deep, or holding a lone surrogate
            (``chat_tools.lone_surrogate``).
    """
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{prefix} holds {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    given = sum(len(t.name) + len(t.description) + len(t.parameters) for t in tools)
    if given > MAX_TOOLS_TEXT_CHARS:
        raise ValueError(f"{prefix} hold {given} characters as sent; at most {MAX_TOOLS_TEXT_CHARS} are allowed "
                         f"(and {MAX_TOOLS_CHARS} as compact JSON)")
    # each value past a container's first needs a separator, each container a bracket: more than
    # MAX_TOOLS_CHARS of them are more characters of compact JSON than the tools may hold
    values = sum(arguments_values(t.parameters, MAX_TOOLS_CHARS) for t in tools)
    if values > MAX_TOOLS_CHARS:
        raise ValueError(f"{prefix} hold more than {MAX_TOOLS_CHARS} JSON values in their parameters (more than "
                         f"{MAX_TOOLS_CHARS} characters as compact JSON, which are at most allowed)")
    converted: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"{prefix}[{index}]"
        if TOOL_NAME_PATTERN.fullmatch(tool.name) is None:
            raise ValueError(f"{where}.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {tool.name[:80]!r}")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                parameters = json.loads(tool.parameters)
            except RecursionError:
                raise ValueError(f"{where}.parameters nests more than {MAX_SCHEMA_DEPTH} levels deep") from None
            except ValueError:
                raise ValueError(f"{where}.parameters must be JSON text (a JSON schema)") from None
            if not isinstance(parameters, dict):
                raise ValueError(f"{where}.parameters must be a JSON object's text (a JSON schema)")
            if lone_surrogate(tool.parameters, parameters):
                raise ValueError(f"{where}.parameters {LONE_SURROGATE}")
            try:
                function["parameters"] = check_parameters(parameters)
            except ValueError as exc:
                raise ValueError(f"{where}.parameters {exc}") from None
        if tool.strict:
            function["strict"] = True
        converted.append({"type": "function", "function": function})
    try:
        check_tools(converted)
    except ValueError as exc:
        raise ValueError(f"{prefix} {exc}") from None
    return converted


_TOOL_CHOICE_MODES = {inference_pb2.TOOL_CHOICE_MODE_NONE: "none", inference_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
                      inference_pb2.TOOL_CHOICE_MODE_REQUIRED: "required"}


def tool_choice_from_pb(request: inference_pb2.GenerateRequest) -> tuple[str | None, str | None]:
    """The request's ``tool_choice``: (a mode of ``tool_requests.TOOL_CHOICE_MODES``, None), (None,
    a named function) or (None, None) when unset.

    Raises:
        ValueError: naming ``tool_choice``: neither member set, a mode unspecified or unknown, a
            function name off OpenAI's pattern.
    """
    if not request.HasField("tool_choice"):
        return None, None
    choice = request.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function":
        if TOOL_NAME_PATTERN.fullmatch(choice.function) is None:
            raise ValueError(f"tool_choice.function must match ^[a-zA-Z0-9_-]{{1,64}}$, got {choice.function[:80]!r}")
        return None, choice.function
    if which == "mode" and choice.mode in _TOOL_CHOICE_MODES:
        return _TOOL_CHOICE_MODES[choice.mode], None
    if which == "mode":
        raise ValueError(f"tool_choice.mode must be TOOL_CHOICE_MODE_NONE, _AUTO or _REQUIRED, got {choice.mode} "
                         "(leave tool_choice unset for the default: auto with tools, none without)")
    raise ValueError("tool_choice must set mode or function (leave it unset for the default: auto with tools, "
                     "none without)")


def prompt_from_pb(request: inference_pb2.GenerateRequest) -> list[dict[str, str]] | list[int]:
    """The request's ``input`` oneof: chat messages, or raw prompt token ids.

    Raises:
        ValueError: neither ``chat`` nor ``tokens`` is set, a chat is invalid, or the
            token list is empty or longer than ``MAX_PROMPT_TOKEN_IDS``.
    """
    which = request.WhichOneof("input")
    if which == "chat":
        return chat_messages_from_pb(request.chat, in_session=bool(request.session_id))
    if which == "tokens":
        if not request.tokens.ids:
            raise ValueError("tokens.ids must hold at least one token id")
        if len(request.tokens.ids) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"tokens.ids holds {len(request.tokens.ids)} ids; "
                             f"at most {MAX_PROMPT_TOKEN_IDS} are allowed")
        return list(request.tokens.ids)
    raise ValueError("input must be set: either chat or tokens")


def check_policy_spec(spec: str) -> None:
    """Refuse a KV policy spec this node's policies would refuse: an unknown name, an unknown
    field, a value not of its field's type or out of its range (``cache_node.policies
    .make_policy`` builds it, as the cache node will). ``""`` (the node's default) passes.

    Raises:
        ValueError: the policy's own message (it lists the known names or fields).
    """
    if not spec:
        return
    try:
        from cache_node.policies import make_policy
    except ImportError as exc:
        raise ValueError(f"unknown KV policy {spec!r}: this node has no policies") from exc
    make_policy(spec)


def policy_compresses(spec: str) -> bool:
    """Whether the KV policy ``spec`` (checked: ``check_policy_spec``) keeps fewer tokens'
    KV than the prompt's, so a request under it may outgrow the pool in tokens."""
    from cache_node.policies import make_policy

    return bool(make_policy(spec).compresses)


def policy_from_pb(policy: str, tenant_policy: str) -> str:
    """The KV policy a request runs under: its own ``policy`` override, else the tenant's.

    Raises:
        ValueError: the override does not match the policy name pattern (at most 63 chars).
    """
    if policy and POLICY_PATTERN.fullmatch(policy) is None:
        raise ValueError(f"policy must match {POLICY_PATTERN.pattern}, got {policy[:80]!r}")
    return policy or tenant_policy


def _from_float32(value: float) -> float:
    return float(f"{value:.{FLOAT32_DIGITS}g}")


# ================================================================ generation events
# A cache node's stream events (started / delta / finished dicts) as GenerateResponse
# messages, one message per event.


def generate_event_to_pb(event: Mapping[str, Any]) -> inference_pb2.GenerateResponse:
    """Map a cache node's event dict (services.node_request) to a GenerateResponse.

    Raises:
        ValueError: unknown event type (error events are turned into statuses by the gateway).
    """
    kind = event.get("type")
    if kind == "started":
        return inference_pb2.GenerateResponse(
            started=inference_pb2.GenerateStarted(
                request_id=event["request_id"],
                node_id=event["node_id"],
                prompt_tokens=event["prompt_tokens"],
                cached_tokens=tier_tokens_to_pb(event.get("cached_tokens", {})),
                queue_ms=event.get("queue_ms", 0.0),
                priority=event.get("priority", 0),
            )
        )
    if kind == "delta":
        delta = inference_pb2.GenerateDelta(token_ids=event["token_ids"], text=event["text"])
        for entry in event.get("logprobs") or ():  # (checked at the gateway: data_plane.check_event)
            logprob, top = entry_logprobs(entry)
            delta.logprobs.add(logprob=logprob,
                               top=[inference_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in top])
        for entry in event.get("prompt_logprobs") or ():  # (checked there too)
            token, logprob, rank, top = entry_prompt_logprobs(entry)
            delta.prompt_logprobs.add(token_id=token, logprob=logprob, rank=rank,
                                      top=[inference_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in top])
        return inference_pb2.GenerateResponse(delta=delta)
    if kind == "finished":
        return inference_pb2.GenerateResponse(
            finished=inference_pb2.GenerateFinished(
                finish_reason=event["finish_reason"] or "",
                prompt_tokens=event["prompt_tokens"],
                completion_tokens=event["completion_tokens"],
                cached_tokens=tier_tokens_to_pb(event.get("cached_tokens", {})),
                ttft_ms=event.get("ttft_ms", 0.0),
                tpot_ms=event.get("tpot_ms", 0.0),
                preempted=bool(event.get("preempted", False)),
                tool_calls=[inference_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                   arguments=c["function"]["arguments"])
                            for c in event.get("tool_calls") or ()],
                content=event.get("content") or "",
            )
        )
    raise ValueError(f"unknown generate event type {kind!r}")


def node_stats_to_pb(stats: Mapping[str, Any]) -> admin_pb2.NodeStats:
    """A cache node's ``stats()`` dict as NodeStats (unknown keys are ignored)."""
    return admin_pb2.NodeStats(
        node_id=stats["node_id"],
        num_blocks=stats.get("num_blocks", 0),
        free_blocks=stats.get("free_blocks", 0),
        cached_blocks=stats.get("cached_blocks", 0),
        used_blocks=stats.get("used_blocks", 0),
        block_size=stats.get("block_size", 0),
        device_bytes_used=stats.get("device_bytes_used", 0),
        host_bytes_used=stats.get("host_bytes_used", 0),
        running=stats.get("running", 0),
        waiting=stats.get("waiting", 0),
        session_blocks=stats.get("session_blocks", 0),
        prefix_blocks=stats.get("compressed_prefix_blocks", 0),
        integrity_ok=stats.get("integrity_ok", False),
        integrity_error=stats.get("integrity_error", ""),
    )
