"""How large a gRPC message the gateway and kvstrata's own clients take.

grpc core refuses a received message over 4 MiB unless told otherwise, before any handler runs
(RESOURCE_EXHAUSTED "received message larger than max"). The largest request ``convert``'s bounds
admit is larger: a chat of ``MAX_PROMPT_CHARS`` characters, up to 4 UTF-8 bytes each, plus its
messages' framing, ids, tool calls, tools, stop strings and the rest (``MAX_GENERATE_REQUEST_BYTES``, ~5.70 MiB). So
the cap is a setting, ``ServiceConfig.grpc_max_message_bytes`` (``DEFAULT_MAX_MESSAGE_BYTES``,
8 MiB, as the HTTP API's body cap), never below that request, set on the server for both
directions (``GrpcLimits.server_options``) and on every channel our clients open to the gateway
(``channel_options``). Regression: the cap was grpc's default, so a valid 1 Mi-character prompt
of 4-byte characters was refused for its size with nothing naming the limit.
"""

from __future__ import annotations

from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from cache_node.structured_output import MAX_CHOICES, MAX_STRUCTURED_SPEC_BYTES
from services.chat_tools import MAX_TOOLS
from services.convert import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_REQUEST_TOOL_CALLS,
    MAX_TOOLS_TEXT_CHARS,
)

UTF8_MAX_BYTES = 4
"""Bytes of the longest UTF-8 encoding of one character (a code point past U+FFFF)."""

_TAG = 1  # every GenerateRequest field number is below 16: a one-byte key (SamplingParams' 16, 17 are counted)
_VARINT_32 = 5  # the longest varint of a uint32 / length prefix under 4 GiB
_VARINT_64 = 10  # the longest varint of a uint64, or of a negative int32
_FLOAT = 4
_LONGEST_ROLE_BYTES = len("assistant")  # services.convert.CHAT_ROLES
_POLICY_CHARS = 63  # tenants.model.POLICY_PATTERN, ASCII


def _string_field(max_bytes: int) -> int:
    return _TAG + _VARINT_32 + max_bytes


def _largest_chat_bytes() -> int:
    # role; content's, name's and tool_call_id's keys and lengths; each tool call's key, length
    # and its id's, name's and arguments' keys and lengths (all their characters count together
    # against MAX_PROMPT_CHARS, the tools' JSON with them)
    message = _string_field(_LONGEST_ROLE_BYTES) + 3 * (_TAG + _VARINT_32)
    # (a call's length, and its arguments', under 256 MiB: 4-byte varints; an id's at most
    # MAX_MESSAGE_ID_CHARS x 4 bytes: 2; a name's at most 64 bytes: 1)
    calls = MAX_REQUEST_TOOL_CALLS * (_TAG + 4 + _TAG + 2 + _TAG + 1 + _TAG + 4)
    messages = MAX_CHAT_MESSAGES * (_TAG + _VARINT_32 + message) + calls + MAX_PROMPT_CHARS * UTF8_MAX_BYTES
    return _TAG + _VARINT_32 + messages


def _largest_tools_bytes() -> int:
    # GenerateRequest.tools: each tool's key, length and its three strings' keys and lengths;
    # their text's characters count against MAX_PROMPT_CHARS as compact JSON (with the chat's
    # bytes above), save what compacting drops (whitespace, escapes: ASCII, one byte each, at
    # most MAX_TOOLS_TEXT_CHARS as given); tool_choice (a function name of 64 ASCII characters) and
    # parallel_tool_calls
    tools = MAX_TOOLS * (_TAG + _VARINT_32 + 3 * (_TAG + _VARINT_32)) + MAX_TOOLS_TEXT_CHARS
    return tools + _TAG + _VARINT_32 + _string_field(64) + _TAG + 1


def _largest_structured_output_bytes() -> int:
    # its one member: a text of MAX_STRUCTURED_SPEC_BYTES, or a choice list whose strings' JSON
    # array (longer than their bytes) fits in as many, each string with its key and length
    text = _string_field(MAX_STRUCTURED_SPEC_BYTES)
    choices = _TAG + _VARINT_32 + MAX_STRUCTURED_SPEC_BYTES + MAX_CHOICES * (_TAG + _VARINT_32)
    return max(text, choices)


def _largest_sampling_bytes() -> int:
    fields = (
        _TAG + _VARINT_32                                           # max_tokens
        + 2 * (_TAG + _FLOAT)                                       # temperature, top_p
        + _TAG + _VARINT_64                                         # seed
        + _TAG + _VARINT_32 + MAX_STOP_TOKEN_IDS * _VARINT_32       # stop_token_ids, packed
        + _TAG + 1                                                  # ignore_eos
        + MAX_STOP_STRINGS * _string_field(MAX_STOP_STRING_CHARS * UTF8_MAX_BYTES)
        + _TAG + _VARINT_64 + _TAG + _VARINT_32                     # top_k (int32: -1), min_tokens
        + 3 * (_TAG + _FLOAT)                                       # the three penalties
        + _TAG + _VARINT_32 + _TAG + _FLOAT                         # logprobs, min_p
        # logit_bias: an entry a map key {key varint, value float} of <= 11 bytes
        + MAX_LOGIT_BIAS_TOKENS * (_TAG + 1 + _TAG + _VARINT_32 + _TAG + _FLOAT)
        + 2 + _VARINT_32 + MAX_ALLOWED_TOKEN_IDS * _VARINT_32       # allowed_token_ids (field 16: a 2-byte key)
        + 2 + _VARINT_32 + _largest_structured_output_bytes()       # structured_output (field 17)
        + 2 + _VARINT_32                                            # prompt_logprobs (field 18)
    )
    return _TAG + _VARINT_32 + fields


MAX_GENERATE_REQUEST_BYTES = (
    _largest_chat_bytes()  # the larger input: MAX_PROMPT_TOKEN_IDS packed ids are <= 640 KiB
    + _largest_tools_bytes()
    + _largest_sampling_bytes()
    + 2 * _string_field(MAX_REQUEST_ID_CHARS * UTF8_MAX_BYTES)      # session_id, request_id
    + _string_field(_POLICY_CHARS)                                  # policy
    + 3 * (_TAG + _VARINT_64)                                       # priority, prefix_tokens, prefix_messages
)
"""An upper bound on the encoded size of any ``GenerateRequest`` the gateway accepts (the
largest request of any call): 5,973,133 bytes, ~5.70 MiB."""

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20
"""``ServiceConfig.grpc_max_message_bytes``' default and our clients' cap: 8 MiB."""

MAX_MESSAGE_BYTES_LIMIT = 256 << 20
"""The largest ``grpc_max_message_bytes`` a config may set."""


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """grpc channel (or server) arguments capping a message sent or received at
    ``max_message_bytes``; for ``grpc.insecure_channel(target, options=...)``.

    Raises:
        ValueError: ``max_message_bytes`` is below ``MAX_GENERATE_REQUEST_BYTES`` (it would
            refuse valid requests).
    """
    if max_message_bytes < MAX_GENERATE_REQUEST_BYTES:
        raise ValueError(f"max_message_bytes must be >= {MAX_GENERATE_REQUEST_BYTES} (the largest valid "
                         f"request), got {max_message_bytes}")
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


CLIENT_KEEPALIVE_S = 310.0
"""A channel of our clients (``client_channel_options``) with a call open pings the gateway
once it has heard nothing from it this long (any byte resets it: the gateway's own keepalive
pings every ``grpc_keepalive_time_s``, 60 s, so a live gateway is seldom pinged at all). Over
the 5 min grpc core's and grpc-go's servers allow by default between a client's pings without
data (a proxy in front of the gateway; the gateway allows ``grpc_min_ping_interval_s``, 10 s):
past 2 faster pings such a server answers GOAWAY ``too_many_pings``, ending the connection's
calls UNAVAILABLE.

Regression (s38 review): 30 s. A grpc server with its defaults ended a healthy stream silent
90 s (a slow tool call after a token) or 150 s (a queued request, a long prefill) UNAVAILABLE
"Too many pings"."""

CLIENT_KEEPALIVE_TIMEOUT_S = 20.0
"""How long such a ping waits for its answer before the channel's calls end UNAVAILABLE."""


def client_channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """``channel_options`` for a channel of our clients (``cli/``, ``workloads/``, ``bench/``)
    to the gateway, with keepalive pings while a call is open (``CLIENT_KEEPALIVE_S``,
    ``CLIENT_KEEPALIVE_TIMEOUT_S``; none on an idle channel): a gateway that stops answering
    (its host gone without a word, its process stopped, a network path dropped) ends the call
    UNAVAILABLE within their sum (5.5 min).

    Regression (s38): our channels sent no pings, so a stream without a deadline (``kvstrata
    generate``, the workload's and the benchmarks' Generate calls) waited forever on a gateway
    that had stopped answering: nothing but the gateway's own bytes could end it.

    Raises:
        ValueError: as ``channel_options``.
    """
    return [*channel_options(max_message_bytes),
            ("grpc.keepalive_time_ms", round(CLIENT_KEEPALIVE_S * 1000)),
            ("grpc.keepalive_timeout_ms", round(CLIENT_KEEPALIVE_TIMEOUT_S * 1000)),
            # grpc core (1.85) waits for a keepalive ping's ack this long, not keepalive_timeout_ms (60 s default)
            ("grpc.http2.ping_timeout_ms", round(CLIENT_KEEPALIVE_TIMEOUT_S * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0)]  # a server-streaming call sends no data after its request
