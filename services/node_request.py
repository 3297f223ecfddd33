"""What the gateway hands a cache node (plain data; protobuf stays at the gateway)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cache_node.sampling_params import SamplingParams

MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
"""The range of a request's ``priority`` (checked by the gateway and the data plane)."""


def check_priority(value: object) -> int:
    """``value`` as a request priority. Raises ValueError (an int out of
    [``MIN_PRIORITY``, ``MAX_PRIORITY``]) or TypeError (not an int), naming ``priority``."""
    if type(value) is not int:
        raise TypeError(f"priority must be an integer, got {type(value).__name__}")
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {value}")
    return value


def resolve_prefix_tokens(prefix_tokens: int, prefix_messages: int, prompt: Sequence[Any],
                          tokens: Sequence[int], templater: Any, tools: list[dict[str, Any]] | None = None) -> int:
    """The prompt tokens forming a request's reusable document prefix
    (``cache_node.compressed_prefix``): ``prefix_tokens`` of a token prompt, or, for a chat
    ``prompt`` rendered to ``tokens`` here, the tokens of its first ``prefix_messages``
    messages rendered by ``templater`` (a ``services.chat.ChatTemplater``) without the
    generation prompt, with the chat's ``tools`` (templates put them in the system prompt, so
    the prefix renders them as the whole chat does), which must be a token prefix of ``tokens``.

    Raises:
        ValueError: naming the field: a bound (``prefix_tokens`` in [0, prompt tokens],
            ``prefix_messages`` in [0, messages]), the field of the other prompt kind set, a
            chat prefix the node would render (a session turn), or a rendered prefix that is
            not a token prefix of the whole chat.
    """
    from cache_node.compressed_prefix import check_prefix_tokens  # torch: only when asked

    chat = bool(prompt) and isinstance(prompt[0], dict)
    if not chat:
        if prefix_messages:
            raise ValueError("prefix_messages applies to chat prompts; a token prompt names prefix_tokens")
        return check_prefix_tokens(prefix_tokens, len(tokens))
    if prefix_tokens:
        raise ValueError("prefix_tokens applies to token prompts; a chat names prefix_messages")
    if type(prefix_messages) is not int or not 0 <= prefix_messages <= len(prompt):
        raise ValueError(f"prefix_messages must be an integer in [0, {len(prompt)}] (the chat's messages), "
                         f"got {prefix_messages!r}")
    if not prefix_messages:
        return 0
    if not tokens or templater is None:
        raise ValueError("prefix_messages needs a chat the gateway renders: not a session turn")
    ids = templater.encode(templater.render(list(prompt[:prefix_messages]), add_generation_prompt=False, tools=tools))
    if list(tokens[: len(ids)]) != ids:
        raise ValueError(f"prefix_messages={prefix_messages}: those messages rendered without a generation "
                         "prompt are not a token prefix of the whole chat's rendering")
    return len(ids)


@dataclass(frozen=True)
class NodeRequest:
    """One generation request routed to a cache node.

    Exactly one of ``messages`` (chat, rendered by the node's chat template) and ``token_ids``
    is set. With a ``session_id`` the prompt is appended to that session's history.
    ``prefetch``: the global index's hint whether the prompt's prefix continues in the spill
    tier (start a spill prefetch or not); None leaves it to the node (``auto_prefetch``).
    ``priority``: lower is served earlier among the same tenant's waiting requests on the
    node, never ahead of another tenant's (``cache_node.sequence.Sequence.priority``).
    ``prefix_tokens``: the first that many of ``token_ids`` form a reusable document prefix,
    compressed once under a compressing ``policy`` and forked by later requests
    (``cache_node.compressed_prefix``); 0: none (always 0 with ``messages``).
    ``continues_session``: set by the global scheduler when it routed this turn to the node
    holding its session; such a turn finding no session there is refused (ABORTED), never
    computed without its history.
    ``opens_session``: set by the global scheduler when this turn opened its session's route
    (no route led anywhere: a new session id, or one closed, expired, lost or whose first turn
    failed): a session of that id the node still holds is stale (its close never reached the
    node, or the scheduler forgot it) and is dropped before this turn starts, never continued
    (``services.cache_node_requests.Requests._drop_stale_session``). Both flags are the
    scheduler's to say (``GlobalScheduler.admit_and_submit`` overrides a gateway's); never
    both set.
    ``tools``: the tools the node renders ``messages`` with (a session turn: JSON text of
    OpenAI's tools list, ``services.chat_tools.check_wire_tools``; "" none); a message's
    ``tool_calls`` is JSON text too (``chat_tools.wire_messages``). ``tool_output``: how the
    HTTP edge reads a session turn's reply as tool calls (``chat_tools.tool_output_spec``; ""
    none): the node keeps such a reply in the session's messages as the calls the client got.
    """

    request_id: str
    tenant: str
    cache_namespace: str
    sampling: SamplingParams
    messages: tuple[dict[str, str], ...] = ()
    token_ids: tuple[int, ...] = ()
    session_id: str = ""
    policy: str = ""
    max_context_tokens: int = 0
    arrival_time_s: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)
    prefetch: bool | None = None
    priority: int = 0
    prefix_tokens: int = 0
    continues_session: bool = False
    opens_session: bool = False
    tools: str = ""
    tool_output: str = ""


# Event dicts streamed back by CacheNode.generate (kept as plain dicts so they cross Ray cheaply):
#   {"type": "started", "request_id", "node_id", "prompt_tokens", "cached_tokens": {tier: n}, "queue_ms",
#    "priority" (as the node's engine queued the request)}
#   {"type": "delta", "token_ids": [...], "text": str, "logprobs" (only when the request's sampling asks
#    for them: ``logprobs_entry`` of each token id's ``TokenLogprobs``),
#    and "prompt_logprobs" (only when its sampling asks for them: ``prompt_logprobs_entry`` of the
#    next prompt tokens' ``PromptLogprob``, continuing the previous deltas'; such a delta may have
#    no token id, as a prompt chunk computes)}
#   {"type": "finished", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
#    "ttft_ms", "tpot_ms", "preempted", "grammar_wait_ms" (a structured request's only: from its arrival
#    to its grammar compiled, part of ttft_ms)}
#   {"type": "error", "code": grpc status name, "message": str}


def logprobs_entry(logprob: float, top: Sequence[tuple[int, float]]) -> list[float | int]:
    """One token's log probabilities (``cache_node.outputs.TokenLogprobs``) as a delta event's
    ``logprobs`` holds them, flat: ``[logprob, id_1, logprob_1, ..., id_k, logprob_k]``, its
    top k most probable first (one array per token on the data plane, not k + 1 of them)."""
    entry: list[float | int] = [logprob]
    for token_id, value in top:
        entry += (token_id, value)
    return entry


def entry_logprobs(entry: Sequence[float | int]) -> tuple[float, list[tuple[int, float]]]:
    """``logprobs_entry``'s inverse: the token's logprob and its top ``(id, logprob)``."""
    return float(entry[0]), [(int(entry[i]), float(entry[i + 1])) for i in range(1, len(entry), 2)]


def prompt_logprobs_entry(token_id: int, logprob: float, rank: int,
                          top: Sequence[tuple[int, float]]) -> list[float | int]:
    """One prompt token's log probabilities (``cache_node.outputs.PromptLogprob``) as a delta
    event's ``prompt_logprobs`` holds them, flat: ``[token_id, logprob, rank, id_1, logprob_1,
    ..., id_k, logprob_k]``."""
    return [token_id, logprob, rank, *logprobs_entry(logprob, top)[1:]]


def entry_prompt_logprobs(entry: Sequence[float | int]) -> tuple[int, float, int, list[tuple[int, float]]]:
    """``prompt_logprobs_entry``'s inverse: the token, its logprob and rank, its top ``(id, logprob)``."""
    return (int(entry[0]), float(entry[1]), int(entry[2]),
            [(int(entry[i]), float(entry[i + 1])) for i in range(3, len(entry), 2)])
