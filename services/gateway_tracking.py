"""What the gateway keeps of one call while it streams: ``StreamWriter`` (the task handing its
events to its client, which the idle-reader deadline stops), ``_Seen`` (the usage its events
showed, accounted when it ends without its ``finished`` event) and ``_RecordedAbort`` (its
context, counting a refusal in its metrics before sending it).

Part of the gateway's inference servicer (``services.gateway``, which re-exports
``StreamWriter``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.metrics.requests import RequestTracker


@dataclass
class _Seen:
    """What a stream's events said its request used: the usage to account when the request
    ends without its ``finished`` event (cancelled, past its deadline, failed on its node).
    Tokens the node made after the gateway stopped reading are not in it."""

    prompt_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def observe(self, event: dict[str, Any]) -> None:
        if event["type"] == "started":
            self.prompt_tokens, self.cached_tokens = event["prompt_tokens"], dict(event.get("cached_tokens", {}))
        elif event["type"] == "delta":
            self.completion_tokens += len(event["token_ids"])

    def usage(self) -> dict[str, Any] | None:
        """``release``'s usage (None when nothing ran)."""
        if not (self.prompt_tokens or self.completion_tokens):
            return None
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens}


class StreamWriter:
    """The task that hands one call's events to its client (a gRPC call's, an HTTP response's),
    which the idle-reader deadline stops (``NodeStreams.expire_idle``): it is stuck in a write
    its client does not take, so it would never take the error that ends its stream.

    ``stop(message, code)`` cancels ``task``; the writer, catching that ``CancelledError``,
    calls ``withdraw()``: True when the cancellation was this stop (it is then withdrawn,
    ``Task.uncancel``, and ``stopped`` holds the client's message, ``code`` its status:
    RESOURCE_EXHAUSTED for an idle reader, UNAUTHENTICATED for a stream whose key was removed,
    ABORTED for one whose tenant was deleted),
    False for any other (re-raise it).
    """

    def __init__(self, task: asyncio.Task[Any] | None = None) -> None:
        self.task = task if task is not None else asyncio.current_task()
        self.stopped: str | None = None
        self.code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def stop(self, message: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED) -> None:
        if self.stopped is None and self.task is not None:
            self.stopped, self.code = message, code
            self.task.cancel()

    def withdraw(self) -> bool:
        if self.stopped is None or self.task is None:
            return False
        self.task.uncancel()
        return True


class _RecordedAbort:
    """``context`` whose ``abort`` records the refusal's status in the request's metrics first:
    the client has the status as soon as ``abort`` sends it, so counting it afterwards (in
    ``generate``'s ``finally``) raced a scrape that followed the refusal."""

    def __init__(self, context: Any, track: RequestTracker) -> None:
        self._context, self._track, self.recorded = context, track, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def record(self, code: grpc.StatusCode) -> None:
        """Count the call as ended with ``code`` (once)."""
        if not self.recorded:
            self.recorded = True
            self._track.finish(code.name)

    async def abort(self, code: grpc.StatusCode, *args: Any, **kwargs: Any) -> Any:
        self.record(code)
        return await self._context.abort(code, *args, **kwargs)
