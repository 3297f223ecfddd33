"""Request ids released at the scheduler before their admission arrived (``EarlyReleases``).

A gateway that gives up on an admission (its ``admit_timeout_s`` passed) aborts the request on
every node and sends ``release``, a Ray call. The admission itself travels on the data plane,
and may still be unread in the scheduler's socket (a stall, a stop, a backlog of admissions):
when the loop runs again, Ray's queued calls run first. ``GlobalScheduler.release`` remembers
such an id here, and ``admit_and_submit`` refuses its admission (CANCELLED) when it comes, as a
cache node refuses a ``submit`` its abort overtook (``Commands._refuse_on_arrival``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

RELEASED_EARLY_MAX = 1 << 16
"""Most ids remembered (the oldest forgotten first): 16 bytes of digest each, ~10 MB at most,
whatever the ids' length."""

RELEASED_EARLY_S = 600.0
"""How long an id is remembered: far past any wait of an admission in the scheduler's socket
or a gateway's queue (a longer stall makes every gateway count the scheduler down)."""


class EarlyReleases:
    """Ids released before their admission arrived, by a digest, with when (``clock``,
    monotonic seconds), oldest first; bounded in count (``max_ids``) and time (``ttl_s``).

    The ids come from gateways on behalf of clients (an id is the client's own, ``#`` and a
    random suffix per attempt), so a flood must not grow this: past ``max_ids`` the oldest go.
    Ids are unique per attempt, so one remembered never refuses a later request.
    """

    def __init__(self, clock: Any, max_ids: int = RELEASED_EARLY_MAX, ttl_s: float = RELEASED_EARLY_S) -> None:
        self.clock, self.max_ids, self.ttl_s = clock, max_ids, ttl_s
        self._when: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._when)

    def note(self, request_id: Any) -> None:
        """Remember ``request_id`` (not a str: ignored, no admission has such an id), and
        forget those past ``max_ids`` or older than ``ttl_s``."""
        if not isinstance(request_id, str):
            return
        now, when = self.clock(), self._when
        key = _digest(request_id)
        when[key] = now
        when.move_to_end(key)
        while len(when) > self.max_ids:
            when.popitem(last=False)
        while when and now - next(iter(when.values())) > self.ttl_s:
            when.popitem(last=False)

    def take(self, request_id: str) -> bool:
        """``request_id`` was released before its admission, within ``ttl_s``; forgotten now
        (its admission is answered once)."""
        if not self._when:
            return False
        when = self._when.pop(_digest(request_id), None)
        return when is not None and self.clock() - when <= self.ttl_s


def _digest(request_id: str) -> bytes:
    return hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
