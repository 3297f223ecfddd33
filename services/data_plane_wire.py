"""What crosses the data plane, bounded: the wire's limits, the field checks its readers use,
and a request's wire form.

``request_to_wire`` turns a ``NodeRequest`` into msgpack-ready fields; ``request_from_wire``
turns them back, checking every field's type and value, since they come off the network (the
scheduler reads them from the gateway, a node from the scheduler). The limits (``MAX_*``) and
the checks (``_check_type``, ``_check_fields``, ``_check_range``, ``_check_len``, ``_cut``)
serve the event and admission readers too (``services.data_plane_replies``).

A part of ``services.data_plane``, which re-exports its public names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cache_node.msgpack_bounds import UnpackBounds
from cache_node.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS_TOKENS, SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from services.chat_tools import (
    MAX_TOOLS_CHARS,
    MAX_WIRE_CALL_VALUES,
    arguments_values,
    check_tool_output,
    check_wire_tool_calls,
    check_wire_tools,
)
from services.node_request import NodeRequest, check_priority, resolve_prefix_tokens
from tenants.model import POLICY_PATTERN

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
FINISH_REASONS = ("stop", "length", "abort")
"""The ``finish_reason`` of a node's ``finished`` event (``LLMEngine``'s finishes other than
"error" and "rejected", which a node sends as ``error`` events): a metric label and the OpenAI
API's ``finish_reason``, so no other value passes the wire."""
MAX_ID_CHARS = 1024
"""Longest request id or tenant id on the wire (the gateway's scoped ids are far shorter)."""
MAX_NAMESPACE_CHARS = 2 * MAX_ID_CHARS
"""Longest ``cache_namespace`` on the wire: a tenant's namespace, with ``#salt=`` and its cache
salt (``gateway_inputs.salted_namespace``: far shorter). It reaches the spill tier's file headers
(``spill_format.MAX_LABEL_BYTES``, 16 KiB: 2,048 characters are at most 8 KiB of UTF-8)."""

MAX_MESSAGE_BYTES = 64 << 20
"""Largest message a serving socket accepts (ZeroMQ drops the connection of a peer sending more).
Not lower, on any socket: the largest admission is tens of MiB (``MAX_WIRE_TOKENS`` token ids of
up to 5 bytes and as many block hashes at ``block_size`` 1); a node's events are split into
messages within ``EVENT_LIMITS`` (``data_plane.event_messages``). What a message may expand to
is bounded while it is decoded instead (``MessageLimits``)."""

UTF8_MAX_BYTES = 4
# services.convert's MAX_PROMPT_CHARS and MAX_CHAT_MESSAGES (a test ties them), not imported:
# that module loads the protobufs, which neither a node nor the scheduler needs
_PROMPT_CHARS = 1 << 20
_CHAT_MESSAGES = 1024

MAX_TOOL_CALLS_CHARS = _PROMPT_CHARS
"""Most characters of JSON the ``tool_calls`` of one request's messages hold together (a chat's
text, tool calls included, is at most ``MAX_PROMPT_CHARS``: ``services.chat.content_chars``)."""

MAX_WIRE_TOKENS = UTF8_MAX_BYTES * _PROMPT_CHARS + 64 * _CHAT_MESSAGES + (1 << 16)
"""Most token ids, and most block hashes, one request on the wire may carry (4,325,376). A token
prompt holds at most ``MAX_PROMPT_TOKEN_IDS`` (131,072); a chat's first turn goes as the tokens
of its rendered text: at most 1 Mi characters of content of at most 4 UTF-8 bytes each, and
every token of a byte-level or byte-fallback tokenizer covers at least one byte, plus the
template's own tokens (64 a message and 64 Ki for its fixed text, generously). A prompt has at
most one block hash a token (``block_size`` 1)."""


@dataclass(frozen=True)
class MessageLimits(UnpackBounds):
    """What one data-plane message may hold (``UnpackBounds``, and ``max_bytes`` in all),
    checked while msgpack decodes it (``services.data_plane.unpack``): each array's and map's
    length, each string's and binary's bytes (``max_ext_len`` is 0: no message has an extension type), and over the
    whole message the arrays and maps (``max_containers``) and their elements
    (``max_elements``, a map's entry counting two). Each is sized from what the real senders
    send on that socket (``REQUEST_LIMITS``, ``EVENT_LIMITS``, ``REPLY_LIMITS``).

    msgpack's own defaults allow as many elements as the message has bytes, and one byte
    (``0x80``, an empty map) becomes a 64-byte dict: every object was built before any reader
    looked at the message's shape. A message now costs at most its bytes plus
    ``max_containers`` containers and ``max_elements`` (+ one array's ``max_array_len``, built
    before its count is taken) elements, about the cost of the largest real message.

    Regression (review 25a B): one 32 MiB message of empty maps to the gateway's event inbox
    became 2.3 GiB of Python objects and stalled its event loop (every tenant's streams and
    admissions) for 5.7 s; at the 64 MiB cap ~4.6 GiB and ~11 s.
    """

    max_bytes: int = MAX_MESSAGE_BYTES


REQUEST_LIMITS = MessageLimits(
    max_bytes=MAX_MESSAGE_BYTES,
    max_array_len=MAX_WIRE_TOKENS,  # token_ids, hashes; messages <= 1,024, stop lists <= 64
    max_map_len=32,  # a request's 16 fields, sampling's 18, extra's 8, an envelope's 4
    # one chat message's content, 4 MiB (a structured_output spec: <= MAX_STRUCTURED_SPEC_BYTES)
    max_str_len=UTF8_MAX_BYTES * _PROMPT_CHARS,
    max_bin_len=64,  # a block hash (32 bytes)
    max_containers=_CHAT_MESSAGES + 64,  # a map a chat message ({role, content}), the fixed ones
    # tokens, hashes, messages; logit_bias' ids and biases (two arrays), allowed_token_ids;
    # structured_output's [kind, spec]
    max_elements=2 * MAX_WIRE_TOKENS + 8 * _CHAT_MESSAGES + 1024 + 2 * MAX_LOGIT_BIAS_TOKENS + MAX_ALLOWED_TOKEN_IDS
    + 2,
)
"""An admission (gateway -> the scheduler's admission socket: ``{"id", "req", "sub",
"hashes"}``) and a node's commands (the scheduler's ``submit`` of the same request, ``abort``,
``abort_subscriber``, ``end_tenant``, ``close_session``; the gateway's ``abort``): the default of
``data_plane.unpack``."""

MAX_EVENTS_PER_MESSAGE = 1 << 15
"""Most events one node message to a gateway may hold: a step's message has at most three per
stream of that gateway on the node (a delta, a held-back tail, its end; or a ``started``):
room for 10,922 streams, ten times vLLM's largest usual ``max_num_seqs``. Nothing bounds a
node's streams to that (``max_num_seqs``, ``queue_limit``), so a node splits what it sends past
``EVENT_LIMITS`` into consecutive messages (``data_plane.event_messages``)."""

EVENT_LIMITS = MessageLimits(
    max_bytes=MAX_MESSAGE_BYTES,
    max_array_len=MAX_EVENTS_PER_MESSAGE,  # the items; a delta's token ids are one step's
    max_map_len=32,  # an event's <= 11 fields, policy_stats' figures, cached_tokens' 4 tiers
    max_str_len=1 << 20,  # ids <= MAX_ID_CHARS; texts are one step's, or a node's error text
    max_bin_len=0,
    max_containers=4 * MAX_EVENTS_PER_MESSAGE + 1,  # an item, its event, 2 maps (or token ids)
    # 96 a stream (a third of the items): a delta 9, a tail 8, its end 32 + 2 a policy figure (<= 16)
    max_elements=32 * MAX_EVENTS_PER_MESSAGE,
)
"""A node's event message to a gateway's event inbox: ``[[request_id, event], ...]``.

A delta with log probabilities (``SamplingParams.logprobs``) is the largest item of a step: 5
containers (the item, its event, its token ids, its ``logprobs`` and the one token's entry) and
at most 53 elements (``1 + 2 * MAX_LOGPROBS`` numbers in the entry), well within every bound
alone; a step of many such streams goes out in more messages (``data_plane.event_messages``
groups items by their exact cost) rather than past these bounds."""

REPLY_LIMITS = MessageLimits(
    max_bytes=MAX_MESSAGE_BYTES,
    max_array_len=0,  # a reply holds no array
    max_map_len=8,  # the envelope {"id", "adm" | "error"}; an admission's 7 fields
    # a node id, and texts the gateway cuts to MAX_TEXT_CHARS (an error's is the scheduler's
    # exception text, not cut at its source: a longer one fails its admission at its timeout)
    max_str_len=1 << 20,
    max_bin_len=0,
    max_containers=2,
    max_elements=2 * 2 + 2 * 7,
)
"""The scheduler's admission reply to a gateway (``{"id", "adm"}`` or ``{"id", "error"}``)."""

_REQUEST_FIELDS: dict[str, type | tuple[type, ...]] = {
    "request_id": str, "tenant": str, "cache_namespace": str, "sampling": dict, "messages": (list, tuple),
    "token_ids": (list, tuple), "session_id": str, "policy": str, "max_context_tokens": int,
    "arrival_time_s": (int, float), "extra": dict, "prefetch": (bool, type(None)), "priority": int,
    "prefix_tokens": int, "continues_session": bool, "opens_session": bool, "tools": str, "tool_output": str,
}
_REQUIRED = ("request_id", "tenant", "cache_namespace", "sampling")
_SAMPLING_FIELDS: dict[str, type | tuple[type, ...]] = {  # ``SamplingParams``' fields
    "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "seed": (int, type(None)),
    "stop_token_ids": (list, tuple), "ignore_eos": bool, "stop": (list, tuple), "top_k": int,
    "min_tokens": int, "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "repetition_penalty": (int, float), "logprobs": (int, type(None)), "min_p": (int, float),
    "logit_bias": (list, tuple), "allowed_token_ids": (list, tuple, type(None)),
    "structured_output": (list, tuple, type(None)), "prompt_logprobs": (int, type(None)),
}  # (bools are refused by ``SamplingParams``, which checks every range too)


def request_to_wire(req: NodeRequest) -> dict[str, Any]:
    """``req`` as msgpack-ready fields (shallow: ``dataclasses.asdict`` deep-copies every token
    id, ~1 ms for an 800-token prompt here)."""
    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    sampling = {f.name: getattr(req.sampling, f.name) for f in dataclasses.fields(req.sampling)}
    # two flat arrays, not a container per entry: [[id, ...], [bias, ...]]
    sampling["logit_bias"] = [[t for t, _ in req.sampling.logit_bias], [b for _, b in req.sampling.logit_bias]]
    constraint = req.sampling.structured_output
    sampling["structured_output"] = None if constraint is None else [constraint.kind, constraint.spec]
    fields["sampling"] = sampling
    return fields


def _logit_bias_from_wire(value: list[Any] | tuple[Any, ...]) -> list[tuple[int, float]]:
    """``[[id, ...], [bias, ...]]`` (``request_to_wire``) as pairs; ``SamplingParams`` checks
    their ranges and count. Raises TypeError: another shape, or mistyped elements."""
    if len(value) != 2 or not all(isinstance(part, (list, tuple)) for part in value) or len(value[0]) != len(value[1]):
        raise TypeError("request.sampling.logit_bias must be two arrays of equal length (token ids, biases)")
    _check_all_types("request.sampling.logit_bias ids[]", value[0], int)
    _check_all_types("request.sampling.logit_bias biases[]", value[1], (int, float))
    return list(zip(value[0], value[1]))


def _structured_output_from_wire(value: list[Any] | tuple[Any, ...] | None) -> StructuredOutputSpec | None:
    """``[kind, spec]`` (``request_to_wire``; None: off) as a ``StructuredOutputSpec``, which
    checks the kind, the spec's size and its JSON. Raises TypeError: another shape, or a kind or
    spec that is not a string; ValueError: the spec's refusal (naming ``structured_output``)."""
    if value is None:
        return None
    if len(value) != 2:
        raise TypeError("request.sampling.structured_output must be [kind, spec]")
    _check_type("request.sampling.structured_output kind", value[0], str)
    _check_type("request.sampling.structured_output spec", value[1], str)
    return StructuredOutputSpec(value[0], value[1])


def _check_type(what: str, value: Any, kind: type | tuple[type, ...]) -> None:
    if isinstance(value, bool) and kind in (int, (int, float)):
        raise TypeError(f"{what} must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be {kind}, got {type(value).__name__}")


def _check_all_types(what: str, values: list[Any] | tuple[Any, ...], kind: type | tuple[type, ...]) -> None:
    """Each of ``values`` is exactly of ``kind`` (a type or a tuple of them: what msgpack
    decodes, so no subclass; a bool is no int), found by one C-speed scan of the element types
    rather than a Python call per element. Raises TypeError as ``_check_type`` (the first stray
    type by name)."""
    stray = set(map(type, values)).difference(kind if isinstance(kind, tuple) else (kind,))
    if stray:
        found = min(stray, key=lambda k: k.__name__)
        raise TypeError(f"{what} must be {kind}, got {'a bool' if found is bool else found.__name__}")


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


def request_from_wire(data: Any, parse_tools: bool = True, check_tokens: bool = True) -> NodeRequest:
    """Inverse of ``request_to_wire`` (msgpack turns tuples into lists), checking every field's
    type: ``data`` comes off the network. ``tools``, ``tool_output`` and a message's
    ``tool_calls`` are JSON text, bounded (``MAX_TOOLS_CHARS``, ``MAX_TOOL_CALLS_CHARS``; the
    ``tool_calls`` together to ``chat_tools.MAX_WIRE_CALL_VALUES`` JSON values, counted on the
    text) before they are parsed and checked (``services.chat_tools``).

    ``parse_tools`` False (the global scheduler, which routes the request and renders nothing):
    ``tools`` and the messages' ``tool_calls`` are bounded so but not parsed; the node that
    renders them parses and checks them. Regression (review s33 F1): the scheduler parsed every
    session turn's calls on its one admission loop, before the tenant was checked, 0.3-0.38 s
    for a 0.75 MB turn within the characters' bound (empty lists), stalling every gateway's
    admissions.

    ``check_tokens`` False (the global scheduler, which routes on the gateway's block hashes and
    uses only how many token ids there are): ``token_ids``' elements are not looked at; the
    node checks them when the request arrives there (its ``submit`` refuses a bad one with an
    INVALID_ARGUMENT error to the gateway, which releases it). The checks that remain are
    C-speed scans (``_check_all_types``, ``min``/``max``), never a Python step per element.
    Regression (review s34 B F3): the per-token generator ``all(type(t) is int ...)`` cost
    the scheduler most of 57-80 ms per 131,072-token admission on its one loop, before the
    tenant was checked.

    Raises:
        ValueError: out-of-range values (token ids outside [0, 2**31), a priority outside
            [-1000, 1000], ``prefix_tokens`` outside [0, len(token_ids)], sampling parameters, ``SamplingParams``),
            a ``session_id`` over ``MAX_ID_CHARS``, a ``cache_namespace`` over
            ``MAX_NAMESPACE_CHARS``, or a ``policy`` off the policy pattern (63
            characters at most: the node parses it on its step thread; security review 19 H2),
            ``opens_session`` without a ``session_id`` or with ``continues_session``, tools or
            tool calls out of bounds or of another shape;
            TypeError: unknown, missing or mistyped fields.
    """
    _check_fields("request", data, _REQUEST_FIELDS, _REQUIRED)
    fields = dict(data)
    for name in ("request_id", "tenant"):
        if not 0 < len(fields[name]) <= MAX_ID_CHARS:
            raise ValueError(f"request.{name} must have 1 to {MAX_ID_CHARS} characters")
    if len(fields["cache_namespace"]) > MAX_NAMESPACE_CHARS:  # (review 28a F3)
        raise ValueError(f"request.cache_namespace must have at most {MAX_NAMESPACE_CHARS} characters")
    if len(fields.get("session_id", "")) > MAX_ID_CHARS:
        raise ValueError(f"request.session_id must have at most {MAX_ID_CHARS} characters")
    policy = fields.get("policy", "")
    if policy and POLICY_PATTERN.fullmatch(policy) is None:  # parsed on the node's step thread
        raise ValueError(f"request.policy must match {POLICY_PATTERN.pattern}, got {policy[:80]!r}")
    tokens = fields.get("token_ids", [])
    if check_tokens:
        if not set(map(type, tokens)) <= {int}:  # C speed; a bool's type is bool, refused
            raise TypeError("request.token_ids must be integers")
        if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
            raise ValueError(f"request.token_ids must lie in [0, {MAX_TOKEN_ID}]")
    call_chars = call_values = 0
    for i, message in enumerate(fields.get("messages", [])):
        _check_type("request.messages[]", message, dict)
        _check_str_map("request.messages[]", message)
        if "tool_calls" in message:  # JSON text (``chat_tools.wire_messages``), bounded before it is parsed
            call_chars += len(message["tool_calls"])
            if call_chars > MAX_TOOL_CALLS_CHARS:
                raise ValueError(f"request.messages: their tool_calls hold more than {MAX_TOOL_CALLS_CHARS} "
                                 "characters of JSON")
            call_values += arguments_values(message["tool_calls"], MAX_WIRE_CALL_VALUES - call_values)
            if call_values > MAX_WIRE_CALL_VALUES:
                raise ValueError(f"request.messages[{i}].tool_calls: the messages' tool_calls hold more than "
                                 f"{MAX_WIRE_CALL_VALUES} JSON values together")
            if message.get("role") != "assistant":
                raise ValueError(f"request.messages[{i}].tool_calls applies to assistant messages")
    if parse_tools:  # (all bounded first: a refused request parses nothing)
        for i, message in enumerate(fields.get("messages", [])):
            if "tool_calls" in message:
                check_wire_tool_calls(message["tool_calls"], f"request.messages[{i}].tool_calls")
    if fields.get("tools") or fields.get("tool_output"):
        if not fields.get("messages"):
            raise ValueError("request.tools and request.tool_output apply to chat messages the node renders")
        if len(fields.get("tools", "")) > MAX_TOOLS_CHARS:
            raise ValueError(f"request.tools holds {len(fields['tools'])} characters of JSON; at most "
                             f"{MAX_TOOLS_CHARS} are allowed")
        if parse_tools:
            check_wire_tools(fields.get("tools", ""))
        check_tool_output(fields.get("tool_output", ""))  # (at most ``TOOL_OUTPUT_CHARS``, ~9 K)
    _check_str_map("request.extra", fields.get("extra", {}))
    check_priority(fields.get("priority", 0))
    if fields.get("opens_session") and (fields.get("continues_session") or not fields.get("session_id")):
        # an opening turn drops a stale session of its id on the node: only a session turn
        # the scheduler routed nowhere before opens one, and it continues nothing
        raise ValueError("request.opens_session needs a session_id and excludes continues_session")
    if fields.get("prefix_tokens", 0):  # of token_ids only (a node renders messages whole)
        resolve_prefix_tokens(fields["prefix_tokens"], 0, fields.get("messages") or tokens, tokens, None)
    sampling = fields["sampling"]  # each field its exact type (regression: "0.5" for top_p
    _check_fields("request.sampling", sampling, _SAMPLING_FIELDS, ())  # passed, and raised in
    _check_all_types("request.sampling.stop_token_ids[]", sampling.get("stop_token_ids", ()), int)  # the step
    _check_all_types("request.sampling.stop[]", sampling.get("stop", ()), str)  # for every request in it)
    _check_all_types("request.sampling.allowed_token_ids[]", sampling.get("allowed_token_ids") or (), int)
    if "logit_bias" in sampling:
        sampling = {**sampling, "logit_bias": _logit_bias_from_wire(sampling["logit_bias"])}
    if "structured_output" in sampling:
        sampling = {**sampling, "structured_output": _structured_output_from_wire(sampling["structured_output"])}
    if isinstance(sampling.get("seed"), bool):
        raise TypeError("request.sampling.seed must be an integer, got a bool")
    fields["sampling"] = SamplingParams(**sampling)
    fields["messages"] = tuple(dict(m) for m in fields.get("messages", ()))
    fields["token_ids"] = tuple(fields.get("token_ids", ()))
    return NodeRequest(**fields)


def _check_range(what: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # NaN fails too
        raise ValueError(f"{what} must lie in [{low}, {high}], got {value!r}")


def _check_len(what: str, value: str, high: int, low: int = 0) -> None:
    if not low <= len(value) <= high:
        raise ValueError(f"{what} must have {low} to {high} characters, got {len(value)}")


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "\u2026"
