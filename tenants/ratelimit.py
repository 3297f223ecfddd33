"""Bounded, thread-safe memory of recent events: a sliding-window limiter and an expiring set.

Both forget what is older than their window, and hold at most ``max_keys`` keys (the oldest
are forgotten first), so a flood of distinct keys cannot grow them without bound.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable


class WindowLimiter:
    """At most ``max_events`` events per key in any ``window_s`` seconds (a sliding log).

    Args:
        max_events: events allowed per key per window (>= 1).
        window_s: window length, seconds (> 0).
        clock: monotonic seconds (tests inject one).
        max_keys: keys remembered at most.

    Raises:
        ValueError: ``max_events`` < 1 or ``window_s`` <= 0.
    """

    def __init__(self, max_events: int, window_s: float, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 65536) -> None:
        if max_events < 1 or window_s <= 0:
            raise ValueError(f"need max_events >= 1 and window_s > 0, got {max_events}, {window_s}")
        self.max_events, self.window_s, self.clock, self.max_keys = max_events, window_s, clock, max_keys
        self._events: OrderedDict[Hashable, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def try_acquire(self, key: Hashable) -> bool:
        """Record one event for ``key`` and return True, or return False (nothing recorded)
        when ``key`` already had ``max_events`` in the last ``window_s`` seconds."""
        now = self.clock()
        with self._lock:
            events = self._live(key, now)
            if len(events) >= self.max_events:
                return False
            events.append(now)
            return True

    def give_back(self, key: Hashable) -> None:
        """Forget ``key``'s latest event (one ``try_acquire`` whose action did not happen);
        nothing when it has none in the window."""
        with self._lock:
            events = self._events.get(key)
            if events:
                events.pop()

    def retry_after_s(self, key: Hashable) -> float:
        """Seconds until ``key`` may have an event again (0 when it may now)."""
        now = self.clock()
        with self._lock:
            events = self._live(key, now)
            return 0.0 if len(events) < self.max_events else events[0] + self.window_s - now

    def _live(self, key: Hashable, now: float) -> deque[float]:
        events = self._events.pop(key, None) or deque()
        while events and events[0] <= now - self.window_s:
            events.popleft()
        self._events[key] = events  # most recently used last
        while len(self._events) > self.max_keys:
            self._events.popitem(last=False)
        return events


class ExpiringSet:
    """Items remembered for ``ttl_s`` seconds after their last ``add`` (at most ``max_keys``)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 65536) -> None:
        self.ttl_s, self.clock, self.max_keys = ttl_s, clock, max_keys
        self._expiry: OrderedDict[Hashable, float] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, item: Hashable) -> None:
        with self._lock:
            self._expiry.pop(item, None)
            self._expiry[item] = self.clock() + self.ttl_s
            while len(self._expiry) > self.max_keys:
                self._expiry.popitem(last=False)

    def discard(self, item: Hashable) -> None:
        with self._lock:
            self._expiry.pop(item, None)

    def clear(self) -> None:
        with self._lock:
            self._expiry.clear()

    def __contains__(self, item: Hashable) -> bool:
        with self._lock:
            expiry = self._expiry.get(item)
            if expiry is not None and expiry <= self.clock():
                del self._expiry[item]
                return False
            return expiry is not None
