"""The gateway's event messages, queued per sender and routed in turns (``SenderTurns``), so that
one cache node that sends more than the gateway reads (a flood: a faulty node, or anything
holding its data-plane key) cannot starve another node's streams or grow the gateway's memory.

``NodeStreams`` reads its event inbox as fast as messages come, into one queue per sender (its
node id with per-node keys: ``data_plane_auth``), bounded in bytes (``MAX_QUEUED_BYTES_PER_NODE``);
it routes them in turns, ``EVENTS_PER_TURN`` events of each sender with messages waiting in turn
(deficit round robin with a quantum of events: Shreedhar and Varghese, "Efficient fair queuing
using deficit round robin", SIGCOMM 1995). A normal node's message thus waits behind at most one
turn of each other sender, however many a flooding one sent; a message past its sender's bound
is dropped unread, a ``BEHIND`` mark queued in its place, and ``NodeStreams`` ends that sender's
streams UNAVAILABLE when routing reaches the mark (events of theirs were lost: their requests are
aborted on the node and retried); a stream ended by events queued before the drop ends as sent.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.data_plane_wire import MAX_MESSAGE_BYTES

MAX_QUEUED_BYTES_PER_NODE = MAX_MESSAGE_BYTES
"""The most bytes of one sender's event messages the gateway holds unrouted (64 MiB): one message
of the largest size always fits in an empty queue; a message past the bound is dropped. A node
that keeps more waiting sends faster than the gateway routes, with its fair share of turns."""

MESSAGE_OVERHEAD_BYTES = 64
"""What one queued message takes of the gateway's memory beyond its bytes, counted against its
sender's bound: its ``bytes`` object's header (33 bytes in CPython) and its queue slot, rounded up.
Regression (review s38 r1): only its bytes counted, so a sender of tiny messages (2 bytes each)
had ~20 times the bound held (64 MiB counted, ~1.4 GB held)."""

EVENTS_PER_TURN = 128
"""Events of one sender routed in one turn, over as many of its messages as they take, before
the next sender with messages waiting (the gateway's other tasks run between its messages):
~5-20 ms of routing on a loaded 2-core host (40-130 us an event), the most a normal node's
message waits for each flooding one."""

BYTES_PER_TURN = 1 << 20
"""Bytes of one sender's messages unpacked in one turn, at most after its first message (1 MiB):
a turn of many messages of few events each (``EVENTS_PER_TURN`` counts them) is bounded in
decoding work too."""


class Behind:
    """The place in a sender's queue where messages of it were dropped past its bound (one mark
    for drops with no message queued between them)."""

    def __repr__(self) -> str:
        return "BEHIND"


BEHIND = Behind()
"""The one ``Behind`` mark: ``SenderTurns.take`` hands it on in place of items."""


@dataclass
class _Queue:
    """One sender's messages not routed yet: raw ones (and ``BEHIND`` marks), and the items of
    the one being routed."""

    messages: deque[bytes | Behind] = field(default_factory=deque)
    items: list[tuple[str, Any]] = field(default_factory=list)  # of the head message, unpacked
    next_item: int = 0
    head_bytes: int = 0  # the unpacked head message's size, counted until its last item is routed
    queued_bytes: int = 0  # ``messages``' and the head's
    turn_events: int = 0  # what is left of its turn (none: its next ``take`` starts one)
    turn_bytes: int = 0


class SenderTurns:
    """Per-sender queues of event messages, taken in turns of ``events_per_turn`` events.

    Args:
        unpack: a message's bytes -> its ``[(request id, event), ...]`` items (raises on a bad
            message: ``take`` hands the error on).
        max_queued_bytes: each sender's bound (bytes of messages not fully routed).
        events_per_turn: the events of one sender's turn, at most.
        bytes_per_turn: the bytes of the messages one sender's turn unpacks, at most after its
            first.
    """

    def __init__(self, unpack: Callable[[bytes], list[tuple[str, Any]]],
                 max_queued_bytes: int = MAX_QUEUED_BYTES_PER_NODE,
                 events_per_turn: int = EVENTS_PER_TURN, bytes_per_turn: int = BYTES_PER_TURN) -> None:
        if min(max_queued_bytes, events_per_turn, bytes_per_turn) <= 0:
            raise ValueError(f"max_queued_bytes ({max_queued_bytes}), events_per_turn ({events_per_turn}) and "
                             f"bytes_per_turn ({bytes_per_turn}) must be positive")
        self.unpack = unpack
        self.max_queued_bytes, self.events_per_turn = max_queued_bytes, events_per_turn
        self.bytes_per_turn = bytes_per_turn
        self._queues: dict[str | None, _Queue] = {}
        self._ring: deque[str | None] = deque()  # senders with work, in turn order
        self._ready = asyncio.Event()

    def add(self, sender: str | None, message: bytes) -> bool:
        """Queue ``message`` from ``sender``; False (dropped) when it would take the sender past
        ``max_queued_bytes`` (a message alone in an empty queue always fits): a ``BEHIND`` mark
        is queued in its place instead, unless the last thing queued is one (a mark counts
        ``MESSAGE_OVERHEAD_BYTES``, the one thing queued past the bound).

        Regression (s38): a drop was known only where it happened, so ``NodeStreams`` ended the
        sender's streams then, before routing the messages queued ahead of the dropped one: a
        stream whose ``finished`` event was among them failed UNAVAILABLE anyway."""
        queue = self._queues.get(sender)
        if queue is None:
            queue = self._queues[sender] = _Queue()
        if queue.queued_bytes and queue.queued_bytes + _size(message) > self.max_queued_bytes:
            if not queue.messages or queue.messages[-1] is not BEHIND:
                queue.messages.append(BEHIND)
                queue.queued_bytes += MESSAGE_OVERHEAD_BYTES
            return False
        if not queue.queued_bytes:
            self._ring.append(sender)
        queue.messages.append(message)
        queue.queued_bytes += _size(message)
        self._ready.set()
        return True

    def queued_bytes(self, sender: str | None) -> int:
        """Bytes of ``sender``'s messages not fully routed (0: none waiting)."""
        queue = self._queues.get(sender)
        return queue.queued_bytes if queue is not None else 0

    async def take(self) -> tuple[str | None, list[tuple[str, Any]] | BaseException | Behind, bool]:
        """The next part of the current turn, waiting for one: (sender, up to the rest of its
        turn of its items, in the order sent, whether they are the first of their message),
        (sender, the error ``unpack`` raised for its next message, which is dropped, True), or
        (sender, ``BEHIND``, True) where messages of its were dropped (``add``). A
        sender's turn goes on over its messages (one a ``take``) until it has had
        ``events_per_turn`` events (a message of none, refused, or a mark counts one) or unpacked
        ``bytes_per_turn`` bytes of messages (its first message always), or has none waiting;
        then the next sender's starts, and it goes to the back of the turns if it has more.

        Regression (review s38 r1): a turn ended with its message, so a sender of small
        messages (a node's step events are one message a step) had one message routed per
        turn beside a flood's ``events_per_turn`` events, and fell behind for good once it
        sent more messages a second than the turns went round: not deficit round robin."""
        while not self._ring:
            self._ready.clear()
            await self._ready.wait()
        sender = self._ring.popleft()
        queue = self._queues[sender]
        if queue.turn_events <= 0 or queue.turn_bytes <= 0:  # its turn starts
            queue.turn_events, queue.turn_bytes = self.events_per_turn, self.bytes_per_turn
        turn: list[tuple[str, Any]] | BaseException
        first = queue.next_item >= len(queue.items)
        if first:  # the head message is next: unpack it
            message = queue.messages.popleft()
            if isinstance(message, Behind):
                queue.queued_bytes -= MESSAGE_OVERHEAD_BYTES
                queue.turn_events -= 1
                self._requeue(sender, queue)
                return sender, message, True
            queue.turn_bytes -= len(message)
            try:
                queue.items, queue.next_item, queue.head_bytes = self.unpack(message), 0, _size(message)
            except Exception as exc:  # noqa: BLE001 - any bytes at all: the caller drops and counts
                queue.items, queue.next_item, queue.head_bytes = [], 0, 0
                queue.queued_bytes -= _size(message)
                queue.turn_events -= 1
                self._requeue(sender, queue)
                return sender, exc, True
        end = queue.next_item + queue.turn_events
        turn, queue.next_item = queue.items[queue.next_item:end], min(end, len(queue.items))
        queue.turn_events -= max(len(turn), 1)
        if queue.next_item >= len(queue.items):  # its last items: the message is routed
            queue.queued_bytes -= queue.head_bytes
            queue.items, queue.next_item, queue.head_bytes = [], 0, 0
        self._requeue(sender, queue)
        return sender, turn, first

    def _requeue(self, sender: str | None, queue: _Queue) -> None:
        if not queue.queued_bytes:
            del self._queues[sender]
        elif queue.turn_events > 0 and queue.turn_bytes > 0:
            self._ring.appendleft(sender)  # its turn goes on
        else:
            self._ring.append(sender)


def _size(message: bytes) -> int:
    """What ``message`` counts against its sender's bound: its bytes and ``MESSAGE_OVERHEAD_BYTES``
    (every queued message counts, an empty one included, so a sender with any waiting has a
    turn)."""
    return len(message) + MESSAGE_OVERHEAD_BYTES
