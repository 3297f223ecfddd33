"""How long this process's own event loop was stalled: ``LoopLag``, and ``wait_past_stall``.

A deadline kept on the gateway's clock (``asyncio.wait_for``, ``loop.call_later``) fires on
resume after the gateway itself stopped running (SIGSTOP, a VM pause, swapping, a long GC, a
blocking call on the loop): when the timer and an answer that arrived meanwhile (waiting unread
in a socket, or in another thread's hands) become due in the same loop turn, the timer runs
first, and the other side is blamed for the gateway's own pause. A deadline whose wait spanned
such a stall gets one more chance before it counts against the other side: the node monitor's
health polls (``services.node_monitor``), admissions and the idle sweep of streams
(``services.gateway_streams``).

Regression (review 29a F6, helper 29h): a gateway paused past a deadline declared every healthy
node down on resume (health polls), refused requests the scheduler had admitted (admissions)
and ended streams whose clients were reading (``stream_idle_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

LAG_TICK_S = 0.25
"""``LoopLag``'s clock ticks this often."""

LAG_STALL_S = 1.0
"""Seconds a tick may come late before the event loop counts as stalled for that long: a
deadline that passed across more stall than this gets its one more chance."""


class LoopLag:
    """How long this process's event loop was stalled (a tick came late: the gateway paused by
    SIGSTOP or a VM pause, swapped, a long GC or a blocking call on the loop). ``run`` ticks
    every ``tick_s``; ``since(t0)`` sums the stalls seen after ``t0``, the one going on now
    included (a timer that fired as the loop resumed may run before the tick) while ``run``
    runs (a clock that never started sees no stall).

    Regression (review 29a F6): a gateway paused past ``poll_s + timeout_s`` (15 s) declared
    every healthy node down on resume: the health polls' deadlines run on the gateway's own
    clock and fired before the answers waiting in its sockets were read, ending every stream
    UNAVAILABLE."""

    def __init__(self, tick_s: float = LAG_TICK_S, stall_s: float = LAG_STALL_S) -> None:
        self.tick_s, self.stall_s = tick_s, stall_s
        self.last = time.monotonic()
        self.running = False
        self.stalls: deque[tuple[float, float]] = deque(maxlen=256)  # (when it ended, seconds)

    def start(self) -> None:
        """Run the clock on the running loop (a task of its own, ended with the loop's)."""
        self.last, self.running = time.monotonic(), True
        asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        self.last, self.running = time.monotonic(), True
        try:
            while True:
                await asyncio.sleep(self.tick_s)
                now = time.monotonic()
                late = now - self.last - self.tick_s
                if late > self.stall_s:
                    self.stalls.append((now, late))
                    log.warning("this process's event loop was stalled for %.1f s", late)
                self.last = now
        finally:
            self.running = False

    def since(self, t0: float) -> float:
        """Seconds of stall (each longer than ``stall_s``) seen since ``t0`` (monotonic)."""
        now = time.monotonic()
        going_on = now - self.last - self.tick_s if self.running else 0.0
        return sum(late for end, late in self.stalls if end > t0) + (going_on if going_on > self.stall_s else 0.0)


_LAGS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag] = weakref.WeakKeyDictionary()


def running_lag() -> LoopLag:
    """The running loop's shared ``LoopLag``, started by the first call on that loop (a stall
    before it is not seen: call it when a wait begins)."""
    loop = asyncio.get_running_loop()
    lag = _LAGS.get(loop)
    if lag is None or not lag.running:
        lag = _LAGS[loop] = LoopLag()
        lag.start()
    return lag


async def wait_past_stall(fut: asyncio.Future[T], timeout_s: float, lag: LoopLag, grace_s: float) -> tuple[T, bool]:
    """``fut``'s result within ``timeout_s``; when that deadline passed while this loop stalled
    for more than ``lag.stall_s`` (the answer may be waiting unread), within ``grace_s`` more
    (once). Returns (its result, whether the grace was used). ``fut`` is cancelled when no
    result came (as ``asyncio.wait_for`` does).

    Raises:
        asyncio.TimeoutError: no result in time (after the grace, when there was a stall).
    """
    t0 = time.monotonic()
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout_s)
        graced = False
        if not done and lag.since(t0) > lag.stall_s:
            graced = True
            done, _ = await asyncio.wait({fut}, timeout=grace_s)
    finally:
        if not fut.done():  # no result in time, or this wait was cancelled
            fut.cancel()
    if not done:
        raise asyncio.TimeoutError
    return fut.result(), graced

