"""The bounds on a gateway's streams: what the streams of clients that read slowly or not at all
may hold (``StreamLimits``, set by ``ServiceConfig``), and one stream's events not yet taken by
its reader, coalesced and counted (``StreamBuffer``). ``services.gateway_streams.NodeStreams``
enforces them; ``InferenceServicer`` counts each tenant's open streams.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway_key_watch import KEY_STALENESS_MAX_S

MAX_STREAMS_PER_TENANT = 256
"""Generate calls one tenant may have open at one gateway (``StreamLimits``)."""

MAX_UNDELIVERED_BYTES = 1 << 20
"""Most a stream may hold undelivered (``StreamBuffer.undelivered_bytes``) before it is ended
RESOURCE_EXHAUSTED and its request aborted on its node: ~50K tokens of English text behind."""

UNBOUND_STREAMS_HELD = 4
"""What a gateway holds of the events that arrive for streams whose node is not known yet
(``NodeStreams.bind``: a node's first events may overtake the scheduler's admission reply),
per sending node: at most ``max_undelivered_bytes`` for one stream, and this many times that
for all (4 MiB by default; a real node's are a few events a stream, for a few milliseconds)."""

STREAM_IDLE_TIMEOUT_S = 300.0
"""Longest a stream's undelivered events may wait with its client taking none of them before
it is ended RESOURCE_EXHAUSTED and its request aborted on its node (``StreamLimits``)."""

SILENT_STREAM_S = 30.0
"""How long a bound stream may get no event from its node (``gateway_streams._Entry.event_at``) while the
scheduler stays unreachable (``gateway_streams.SILENT_RUNS``) before its node is asked whether it still holds
its request (``NodeStreams.end_silent``); one it no longer holds ends UNAVAILABLE, retryable. One it holds
(queued, rendering, compiling its grammar, prefilling a long prompt, preempted) stays open
however long it is silent. ``StreamLimits.silent_stream_s``, the gateway config's ``silent_stream_s``."""

TERMINAL = ("finished", "error")
"""Event types that end a stream: nothing after one is kept."""

EVENT_BYTES = 64
"""What a held event other than a delta counts in ``undelivered_bytes`` besides its values."""


def event_bytes(event: dict[str, Any]) -> int:
    """What ``event`` counts in ``StreamBuffer.undelivered_bytes``: a delta 4 per token id and
    per character, and 8 per number and 4 per entry of its ``logprobs`` and ``prompt_logprobs``
    (as ``_Delta``), any
    other ``EVENT_BYTES`` + 4 per character of its strings (keys included), 8 per other value
    and per entry of a map or list, nested values included (a node's ``policy_stats`` values
    are not checked)."""
    if event.get("type") == "delta":
        return (4 * (len(event["token_ids"]) + len(event["text"])) + _logprobs_bytes(event.get("logprobs") or ())
                + _logprobs_bytes(event.get("prompt_logprobs") or ()))
    size, pending = EVENT_BYTES, [event]
    while pending:  # iterative: nesting as deep as msgpack allows never recurses here
        value = pending.pop()
        if isinstance(value, str):
            size += 4 * len(value)
        elif isinstance(value, dict):
            size += 8 * len(value)
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            size += 8 * len(value)
            pending.extend(value)
        else:
            size += 8 + (len(value) if isinstance(value, bytes) else 0)
    return size


@dataclass(frozen=True)
class StreamLimits:
    """What the streams of clients that read slowly or not at all may hold at a gateway
    (``ServiceConfig``'s ``max_streams_per_tenant``, ``max_undelivered_bytes``,
    ``stream_idle_timeout_s``, ``key_staleness_max_s`` and ``silent_stream_s``).

    Attributes:
        max_streams_per_tenant: Generate calls (gRPC or HTTP) a tenant may have open at the
            gateway, each counted until its client has taken its last event or gone; past it a
            call is refused RESOURCE_EXHAUSTED (``InferenceServicer``).
        max_undelivered_bytes: a stream holding more undelivered (``StreamBuffer``: every
            event it holds counts; its end event on its own, ``past_bound``) is ended
            RESOURCE_EXHAUSTED and its request aborted on its node (``NodeStreams``).
        idle_timeout_s: a stream whose reader has taken nothing this long without waiting for
            events (it is stuck handing the last one to a client that takes nothing) is ended
            the same way, and the task writing it to its client stopped, so
            its tenant's stream is released (``NodeStreams.expire_idle``). A client that takes
            something within each such period, however slowly, is never ended.
        key_staleness_max_s: a stream whose API key was last confirmed longer ago than this
            (its opening, or the key watch's last key-directory refresh that answered) ends
            UNAVAILABLE at the watch's next check that fails (``KeyWatch``): its key may have
            been removed meanwhile.
        silent_stream_s: while the scheduler cannot be reached, a stream that got no event
            from its node this long (seconds) has its node asked whether it still holds its
            request; one it no longer holds ends UNAVAILABLE (``NodeStreams.end_silent``).

    Regression (secrev18 B residue): the first two were constructor arguments alone (a
    deployment could not set them), and nothing ended a stream whose client stopped reading:
    its request ran on its node to ``max_tokens``, and the stream, its buffer and its tenant's
    slot were held for as long as the client held its connection.
    """

    max_streams_per_tenant: int = MAX_STREAMS_PER_TENANT
    max_undelivered_bytes: int = MAX_UNDELIVERED_BYTES
    idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S
    key_staleness_max_s: float = KEY_STALENESS_MAX_S
    silent_stream_s: float = SILENT_STREAM_S

    def __post_init__(self) -> None:
        for name in ("max_streams_per_tenant", "max_undelivered_bytes", "idle_timeout_s", "key_staleness_max_s",
                     "silent_stream_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StreamLimits.{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, config: Any) -> StreamLimits:
        """The limits a ``ServiceConfig`` sets."""
        return cls(config.max_streams_per_tenant, config.max_undelivered_bytes, config.stream_idle_timeout_s,
                   config.key_staleness_max_s, config.silent_stream_s)

TEXT_PIECES_JOINED = 64
"""A pending delta joins its text pieces into one string each time it holds this many."""


def past_bound(held: int, event: dict[str, Any], size: int, bound: int) -> bool:
    """Whether a stream holding ``held`` bytes (``event``'s ``size`` included) is past ``bound``
    (``max_undelivered_bytes``) with ``event``: what it holds before its end counts, and its end
    event on its own. So a stream's last event never ends it for size when it is no larger than
    the bound (a node's ``finished`` or error, the gateway's UNAVAILABLE: it replaced the end
    and the pending deltas with RESOURCE_EXHAUSTED), and a stream holds at most twice the bound.
    """
    return size > bound if event["type"] in TERMINAL else held > bound


def _logprobs_bytes(entries: Any) -> int:
    """What a delta's ``logprobs`` (or ``prompt_logprobs``) entries count: 8 per number and 4
    per entry (``_Delta``'s arrays)."""
    return sum(8 * len(entry) + 4 for entry in entries)


class _Delta:
    """Consecutive delta events not delivered yet, as one: token ids in a 4-byte array, text
    pieces joined every ``TEXT_PIECES_JOINED`` (amortised, never quadratic), and the tokens'
    ``logprobs`` entries (``services.node_request.logprobs_entry``, checked for what their
    request asked before they get here) flat in an 8-byte array with each entry's width."""

    __slots__ = ("chars", "ids", "logprobs", "pieces", "prompt", "widths")

    def __init__(self) -> None:
        self.ids = array("i")
        self.pieces: list[str] = []
        self.chars = 0
        self.logprobs: array[float] | None = None
        self.widths = array("i")
        self.prompt: _Entries | None = None  # its ``prompt_logprobs`` entries, likewise

    def add(self, event: dict[str, Any]) -> int:
        """Append ``event``'s tokens, text and logprobs; returns the bytes this added (4 per
        token id, 4 per character: what the array and a UCS-4 string hold at most, and UTF-8
        at most; 8 per logprobs number and 4 per entry)."""
        self.ids.extend(event["token_ids"])
        if event["text"]:
            self.pieces.append(event["text"])
            self.chars += len(event["text"])
            if len(self.pieces) >= TEXT_PIECES_JOINED:
                self.pieces = ["".join(self.pieces)]
        entries = event.get("logprobs") or ()
        if entries:
            if self.logprobs is None:
                self.logprobs = array("d")
            for entry in entries:
                self.logprobs.extend(entry)  # (ids < 2^31: exact as doubles)
                self.widths.append(len(entry))
        prompt = event.get("prompt_logprobs") or ()
        if prompt:
            self.prompt = self.prompt or _Entries()
            self.prompt.add(prompt)
        return 4 * (len(event["token_ids"]) + len(event["text"])) + _logprobs_bytes(entries) + _logprobs_bytes(prompt)

    def event(self) -> dict[str, Any]:
        event = {"type": "delta", "token_ids": self.ids.tolist(), "text": "".join(self.pieces)}
        if self.logprobs is not None:
            flat, entries, start = self.logprobs.tolist(), [], 0
            for width in self.widths:
                entry = flat[start: start + width]
                entry[1::2] = [int(t) for t in entry[1::2]]
                entries.append(entry)
                start += width
            event["logprobs"] = entries
        if self.prompt is not None:
            event["prompt_logprobs"] = self.prompt.entries()
        return event

    def size(self) -> int:
        prompt = self.prompt.size() if self.prompt is not None else 0
        return 4 * (len(self.ids) + self.chars) + 8 * len(self.logprobs or ()) + 4 * len(self.widths) + prompt


class _Entries:
    """Coalesced ``prompt_logprobs`` entries (``services.node_request.prompt_logprobs_entry``:
    ``[token_id, logprob, rank, id, logprob, ...]``), flat in an 8-byte array with each entry's
    width."""

    __slots__ = ("flat", "widths")

    def __init__(self) -> None:
        self.flat = array("d")
        self.widths = array("i")

    def add(self, entries: Any) -> None:
        for entry in entries:
            self.flat.extend(entry)  # (ids and ranks <= 2^31: exact as doubles)
            self.widths.append(len(entry))

    def entries(self) -> list[list[Any]]:
        flat, out, start = self.flat.tolist(), [], 0
        for width in self.widths:
            entry = flat[start: start + width]
            entry[0], entry[2] = int(entry[0]), int(entry[2])
            entry[3::2] = [int(t) for t in entry[3::2]]
            out.append(entry)
            start += width
        return out

    def size(self) -> int:
        return 8 * len(self.flat) + 4 * len(self.widths)


class StreamBuffer:
    """One stream's events not yet taken by its reader, in order and bounded.

    Consecutive delta events coalesce into one pending delta (token ids and texts
    concatenated), a stream takes one ``started`` event (a second is dropped), and nothing is
    kept after a terminal event (``finished`` or ``error``: the reader stops there), so a
    stream holds at most three messages (``started``, a delta, its end) whatever its length; a
    reader that keeps up takes each event as it came, unchanged. ``undelivered_bytes``
    (``event_bytes`` of each held event: 4 per pending token id and per pending character, and
    the size of ``started`` and the end) is what ``NodeStreams`` bounds by
    ``max_undelivered_bytes``, and ``idle_s`` (how long its reader has taken nothing without
    waiting in ``get``, on ``clock``) what it bounds by the idle timeout.

    The ``asyncio.Queue`` calls its reader uses: ``get``, ``get_nowait``, ``empty``, ``qsize``.

    Regression (security review B): each stream was an unbounded ``asyncio.Queue`` of every
    event (~400 bytes a delta): a client that never read its streams (HTTP/2 window never
    granted) made the gateway keep every token its requests produced, growing with the
    nodes' throughput for as long as it held a connection. Regression (review 25a C): only
    deltas were counted and any number of ``started`` events was kept: a node's 200,000 of them
    (1 KiB ``node_id`` each) held 484 MiB for a client that did not read, counted as 0 bytes.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._items: deque[dict[str, Any] | _Delta] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.undelivered_bytes = 0
        self.ended = False  # a terminal event is in: later ones are dropped
        self.started = False  # its ``started`` event is in (or was taken): another is dropped
        self.clock = clock
        self._taken_at = clock()  # its reader's last take (its opening before any)

    def takes(self, event: dict[str, Any]) -> bool:
        """Whether ``put_nowait`` keeps ``event``: not after a terminal event, and not a second
        ``started`` (whether or not the first was taken)."""
        return not (self.ended or (event["type"] == "started" and self.started))

    def put_nowait(self, event: dict[str, Any]) -> bool:
        """Add ``event``; False when it was dropped (``takes``)."""
        if not self.takes(event):
            return False
        if event["type"] == "delta":
            last = self._items[-1] if self._items else None
            if not isinstance(last, _Delta):
                last = _Delta()
                self._items.append(last)
            self.undelivered_bytes += last.add(event)
        else:
            self._items.append(event)
            self.undelivered_bytes += event_bytes(event)
            self.ended = event["type"] in TERMINAL
            self.started = self.started or event["type"] == "started"
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        return True

    def end(self, event: dict[str, Any]) -> None:
        """Drop the pending deltas and the pending end, if any, and end the stream with
        ``event`` (an error)."""
        self._items = deque(item for item in self._items
                            if not isinstance(item, _Delta) and item["type"] not in TERMINAL)
        self.undelivered_bytes = sum(event_bytes(item) for item in self._items)  # its ``started``
        self.ended = False
        self.put_nowait(event)

    def get_nowait(self) -> dict[str, Any]:
        """The next event. Raises ``asyncio.QueueEmpty`` when none is pending."""
        if not self._items:
            raise asyncio.QueueEmpty
        self._taken_at = self.clock()
        item = self._items.popleft()
        if isinstance(item, _Delta):
            self.undelivered_bytes -= item.size()
            return item.event()
        self.undelivered_bytes -= event_bytes(item)
        return item

    async def get(self) -> dict[str, Any]:
        """The next event, once there is one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.get_nowait()

    def empty(self) -> bool:
        return not self._items

    def idle_s(self) -> float:
        """Seconds since its reader last took an event (since its opening before any), 0 while
        the reader waits in ``get`` for the next: a reader that is away that long is stuck
        with the last event it took (writing it to a client that takes nothing), whether or
        not more are pending here."""
        return 0.0 if self._waiter is not None else self.clock() - self._taken_at

    def qsize(self) -> int:
        """Messages pending (at most 3)."""
        return len(self._items)
