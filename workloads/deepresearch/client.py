"""The inference client contract the runner drives, and the result of one call.

Clients never raise for a failed call: a failure is a :class:`CallResult` whose
``status`` is a gRPC status name (``"RESOURCE_EXHAUSTED"``, ``"UNAVAILABLE"``,
...), so the runner counts failures instead of hiding them. Cancellation
(``asyncio.CancelledError``) does propagate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

TIERS = ("device", "host", "spill_ram", "spill_disk")
OK = "ok"


@dataclass(frozen=True)
class CallResult:
    """What one ``generate`` call produced, as the client saw it.

    Attributes:
        status: ``"ok"`` or a gRPC status name.
        text: the generated text (what streamed before a failure, if any).
        prompt_tokens / completion_tokens: as reported by the server.
        cached_<tier>_tokens: prompt tokens whose KV was reused from that tier.
        ttft_ms: client-observed, from sending the request to the first output
            token (the server's figure when no token was streamed); None if unknown.
        tpot_ms: client-observed mean gap between output tokens after the first
            (the server's figure when the client cannot tell); None if < 2 tokens.
        server_ttft_ms / server_tpot_ms / queue_ms: the server's own figures.
        start_s / end_s: ``time.monotonic()`` when the request was sent / finished.
        preempted: the server preempted the request at least once.
        finish_reason: ``stop``, ``length`` or ``abort`` (empty on failure).
        node_id: the cache node that served it.
        error: the failure's details (empty when ok).
        retry_after_s: a refusal's retry hint (gRPC ``retry-after-ms`` trailer, HTTP
            ``retry-after-ms`` / ``Retry-After`` header); None without one.
    """

    status: str
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    cached_spill_ram_tokens: int = 0
    cached_spill_disk_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    server_ttft_ms: float | None = None
    server_tpot_ms: float | None = None
    queue_ms: float | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    preempted: bool = False
    finish_reason: str = ""
    node_id: str = ""
    error: str = ""
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    def cached_tokens(self, tier: str) -> int:
        """Cached prompt tokens from ``tier`` (one of ``TIERS``)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {TIERS}")
        return int(getattr(self, f"cached_{tier}_tokens"))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StreamAccumulator:
    """Accumulates one streamed call into the fields of a :class:`CallResult` (a client's
    ``add`` fills ``fields``, ``text`` and the token times). Client-side TTFT is from
    ``start_s`` to the first token; TPOT spans the first to the last token (None under 2)."""

    def __init__(self, start_s: float) -> None:
        self.start_s = start_s
        self.fields: dict[str, Any] = {}
        self.text: list[str] = []
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finished = False

    def result(self, status: str, end_s: float, error: str = "", retry_after_s: float | None = None) -> CallResult:
        fields = dict(self.fields)
        n = int(fields.get("completion_tokens", 0))
        ttft_ms, tpot_ms = fields.get("server_ttft_ms"), fields.get("server_tpot_ms")
        if self.first_token_s is not None:
            ttft_ms = (self.first_token_s - self.start_s) * 1000.0
            if n > 1 and self.last_token_s is not None and self.last_token_s > self.first_token_s:
                tpot_ms = (self.last_token_s - self.first_token_s) * 1000.0 / (n - 1)
        if n < 2:
            tpot_ms = None
        if status == OK and fields.get("finish_reason") == "abort":
            status, error = "ABORTED", "server aborted the request (finish_reason=abort)"
        return CallResult(status=status, text="".join(self.text), ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                          start_s=self.start_s, end_s=end_s, error=error, retry_after_s=retry_after_s,
                          **fields)


class InferenceClient(Protocol):
    """What the runner needs from a serving endpoint."""

    async def generate(
        self, *, api_key: str, session_id: str, messages: list[dict[str, str]], max_tokens: int,
        temperature: float, request_id: str,
    ) -> CallResult:
        """Send ``messages`` (appended to ``session_id``'s history), stream the reply.

        Never raises for a failed call; returns a non-ok :class:`CallResult`.
        """
        ...

    async def close_session(self, *, api_key: str, session_id: str) -> str:
        """Free the session's server-side state; returns ``"ok"`` or a status name."""
        ...


StatsProbe = Callable[[], Awaitable[dict[str, float]]]
"""Samples server stats (e.g. ``device_bytes_used``) for the run's time series."""


def retry_after_from(headers: Any) -> float | None:
    """Seconds from a ``retry-after-ms`` entry (kvstrata's, in ms) or an HTTP ``Retry-After``
    one (seconds) of ``headers`` (a mapping, or gRPC metadata as (key, value) pairs); None
    when absent or malformed."""
    items = headers.items() if hasattr(headers, "items") else (headers or ())
    found = {str(k).lower(): (v[-1] if isinstance(v, list) and v else v) for k, v in items}  # grpc.aio: lists
    for key, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            value = float(found[key]) * scale
        except (KeyError, TypeError, ValueError):
            continue
        if value >= 0:
            return value
    return None
