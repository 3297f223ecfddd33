"""What the gateway hands a cache node (plain data; protobuf stays at the gateway)."""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class NodeRequest:
    """One generation request routed to a cache node.

    Exactly one of ``messages`` (chat, rendered by the node's chat template) and ``token_ids``
    is set. With a ``session_id`` the prompt is appended to that session's history.
    ``prefetch``: the global index's hint whether the prompt's prefix continues in the spill
    tier (start a spill prefetch or not); None leaves it to the node (``auto_prefetch``).
    ``priority``: lower is served earlier among the same tenant's waiting requests on the
    node, never ahead of another tenant's (``cache_node.sequence.Sequence.priority``).
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


# Event dicts streamed back by CacheNode.generate (kept as plain dicts so they cross Ray cheaply):
#   {"type": "started", "request_id", "node_id", "prompt_tokens", "cached_tokens": {tier: n}, "queue_ms",
#    "priority" (as the node's engine queued the request)}
#   {"type": "delta", "token_ids": [...], "text": str}
#   {"type": "finished", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
#    "ttft_ms", "tpot_ms", "preempted"}
#   {"type": "error", "code": grpc status name, "message": str}
