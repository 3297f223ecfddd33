"""The gateway's event messages, queued per sender and routed in turns (``SenderTurns``), so that
one cache node that sends more than the gateway reads (a flood: a faulty node, or anything
holding its data-plane key) cannot starve another node's streams or grow the gateway's memory.

``NodeStreams`` reads its event inbox as fast as messages come, into one queue per sender (its
node id with per-node keys: ``data_plane_auth``), bounded in bytes (``MAX_QUEUED_BYTES_PER_NODE``);
it routes them in turns, ``EVENTS_PER_TURN`` events of each sender with messages waiting in turn
(deficit round robin with a quantum of events: Shreedhar and Varghese, "Efficient fair queuing
using deficit round robin", SIGCOMM 1995). A normal node's message thus waits behind at most one
turn of each other sender, however many a flooding one sent; a message past its sender's bound
is dropped unread, and ``NodeStreams`` ends that sender's streams UNAVAILABLE (events of theirs
were lost: their requests are aborted on the node and retried).
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

EVENTS_PER_TURN = 128
"""Events of one sender routed in one turn before the next sender with messages waiting (and
the gateway's other tasks) runs: ~5-20 ms of routing on a loaded 2-core host (40-130 us an
event), the most a normal node's message waits for each flooding one."""


@dataclass
class _Queue:
    """One sender's messages not routed yet: raw ones, and the items of the one being routed."""

    messages: deque[bytes] = field(default_factory=deque)
    items: list[tuple[str, Any]] = field(default_factory=list)  # of the head message, unpacked
    next_item: int = 0
    head_bytes: int = 0  # the unpacked head message's size, counted until its last item is routed
    queued_bytes: int = 0  # ``messages``' and the head's


class SenderTurns:
    """Per-sender queues of event messages, taken in turns of ``events_per_turn`` events.

    Args:
        unpack: a message's bytes -> its ``[(request id, event), ...]`` items (raises on a bad
            message: ``take`` hands the error on).
        max_queued_bytes: each sender's bound (bytes of messages not fully routed).
        events_per_turn: the events of one sender a ``take`` returns at most.
    """

    def __init__(self, unpack: Callable[[bytes], list[tuple[str, Any]]],
                 max_queued_bytes: int = MAX_QUEUED_BYTES_PER_NODE,
                 events_per_turn: int = EVENTS_PER_TURN) -> None:
        if max_queued_bytes <= 0 or events_per_turn <= 0:
            raise ValueError(f"max_queued_bytes ({max_queued_bytes}) and events_per_turn ({events_per_turn}) "
                             "must be positive")
        self.unpack = unpack
        self.max_queued_bytes, self.events_per_turn = max_queued_bytes, events_per_turn
        self._queues: dict[str | None, _Queue] = {}
        self._ring: deque[str | None] = deque()  # senders with work, in turn order
        self._ready = asyncio.Event()

    def add(self, sender: str | None, message: bytes) -> bool:
        """Queue ``message`` from ``sender``; False (dropped) when it would take the sender past
        ``max_queued_bytes`` (a message alone in an empty queue always fits)."""
        queue = self._queues.get(sender)
        if queue is None:
            queue = self._queues[sender] = _Queue()
        if queue.queued_bytes and queue.queued_bytes + _size(message) > self.max_queued_bytes:
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

    async def take(self) -> tuple[str | None, list[tuple[str, Any]] | BaseException, bool]:
        """The next turn, waiting for one: (sender, up to ``events_per_turn`` of its items, in
        the order sent, whether they are the first of their message), or (sender, the error
        ``unpack`` raised for its next message, which is dropped, True). The sender goes to the
        back of the turns when it has more waiting."""
        while not self._ring:
            self._ready.clear()
            await self._ready.wait()
        sender = self._ring.popleft()
        queue = self._queues[sender]
        turn: list[tuple[str, Any]] | BaseException
        first = queue.next_item >= len(queue.items)
        if first:  # the head message is next: unpack it
            message = queue.messages.popleft()
            try:
                queue.items, queue.next_item, queue.head_bytes = self.unpack(message), 0, _size(message)
            except Exception as exc:  # noqa: BLE001 - any bytes at all: the caller drops and counts
                queue.items, queue.next_item, queue.head_bytes = [], 0, 0
                queue.queued_bytes -= _size(message)
                self._requeue(sender, queue)
                return sender, exc, True
        end = queue.next_item + self.events_per_turn
        turn, queue.next_item = queue.items[queue.next_item:end], min(end, len(queue.items))
        if queue.next_item >= len(queue.items):  # its last items: the message is routed
            queue.queued_bytes -= queue.head_bytes
            queue.items, queue.next_item, queue.head_bytes = [], 0, 0
        self._requeue(sender, queue)
        return sender, turn, first

    def _requeue(self, sender: str | None, queue: _Queue) -> None:
        if queue.queued_bytes:
            self._ring.append(sender)
        else:
            del self._queues[sender]


def _size(message: bytes) -> int:
    """What ``message`` counts against its sender's bound: its bytes, and 1 for an empty one
    (every queued message counts, so a sender with any waiting has a turn)."""
    return len(message) or 1
