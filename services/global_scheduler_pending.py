"""The global scheduler's session-row changes not stored yet (``Sessions.flush_sessions``): for
one table of the tenant store (``open_sessions`` or ``lost_sessions``), (tenant id, session id)
-> wall time of the row to write, or None: the row to delete.

Bounded per tenant while the store fails (review 26e F4: 20,000 sessions opened and closed
while the disk was full left 20,000 changes pending):

- a row written and then deleted before any write of it was stored cancels out: nothing is
  kept of either (``remove``). A row is "unstored" when it was new (``put(new=True)``: the
  caller knows the store held no row of the key) and no flush carrying it has succeeded since;
- so the rows to write are at most the tenant's routes (or marks), and the rows to delete at
  most the rows the store holds of the tenant, which a working store keeps to its sessions;
- past ``max_removals`` (the tenant's ``max_sessions_per_tenant``) pending deletions while the
  store fails (rows a previous process with a larger cap stored, say), the tenant's oldest
  pending deletions are discarded (``discarded`` counts them): such a row stays stored, so a
  scheduler that crashes before its next successful flush, and the next process, marks that
  closed session lost (refused ABORTED ``session_lost`` until closed again or its TTL), the
  safe side: no session's turn ever runs without its history for it. A write is never
  discarded.

Not thread-safe: the caller holds its lock (``Sessions.lost_changes_lock``) around each call.
"""

from __future__ import annotations

from collections import Counter

Key = tuple[str, str]  # (tenant id, session id)


class PendingRows:
    """Changes to one table's session rows since the last successful flush."""

    def __init__(self, max_removals: int) -> None:
        self.max_removals = max_removals
        self.changes: dict[Key, float | None] = {}  # oldest first
        self.unstored: set[Key] = set()  # keys in ``changes`` whose row the store does not hold
        self.removals: Counter[str] = Counter()  # tenant -> its None entries in ``changes``
        self.taken: dict[Key, float | None] = {}  # the batch a flush is writing (``take``)
        self.taken_unstored: set[Key] = set()
        self.failing = False  # the last flush failed: ``max_removals`` applies
        self.discarded = 0

    def __len__(self) -> int:
        return len(self.changes)

    def __contains__(self, key: object) -> bool:
        return key in self.changes

    def get(self, key: Key, default: float | None = None) -> float | None:
        return self.changes.get(key, default)

    def put(self, key: Key, at_s: float, new: bool = False) -> None:
        """Write ``key``'s row with ``at_s``. ``new``: the store holds no row of ``key`` unless
        a change of it is pending or being written (a route opened where none was: the
        previous one's removal was stored, or is one of those)."""
        if key in self.changes:
            if self.changes[key] is None:
                self.removals[key[0]] -= 1
        elif new and key not in self.taken:
            self.unstored.add(key)
        self.changes[key] = at_s

    def remove(self, key: Key) -> None:
        """Delete ``key``'s row: nothing at all when its row was never stored."""
        if key in self.unstored:
            self.unstored.discard(key)
            del self.changes[key]
            return
        if self.changes.get(key, 0.0) is None:
            return
        self.changes.pop(key, None)  # the newest change goes last (``_bound`` drops the oldest)
        self.changes[key] = None
        self.removals[key[0]] += 1
        if self.failing:
            self._bound(key[0])

    def take(self) -> dict[Key, float | None]:
        """The changes to write (one flush at a time), handed back by ``done``."""
        self.taken, self.changes = self.changes, {}
        self.taken_unstored, self.unstored = self.unstored, set()
        self.removals = Counter()
        return self.taken

    def done(self, stored: bool) -> None:
        """The flush of ``take``'s changes ended: stored, or failed with nothing of them
        applied; then they are pending again, each behind any change of its key made
        meanwhile (which wins), and an unstored row deleted meanwhile cancels out."""
        taken, was_unstored = self.taken, self.taken_unstored
        self.taken, self.taken_unstored = {}, set()
        if taken or not stored:  # (nothing written tells nothing of the store)
            self.failing = not stored
        if stored:
            return
        newer, self.changes = self.changes, {}
        for key, at_s in taken.items():
            if key not in newer:
                self.changes[key] = at_s
                if key in was_unstored:
                    self.unstored.add(key)
                elif at_s is None:
                    self.removals[key[0]] += 1
        for key, at_s in newer.items():
            if key in was_unstored and at_s is None:  # removed meanwhile: still never stored
                self.removals[key[0]] -= 1
                continue
            self.changes[key] = at_s
            if key in was_unstored:
                self.unstored.add(key)
        for tenant_id in [t for t, n in self.removals.items() if n > self.max_removals]:
            self._bound(tenant_id)
        self.removals = +self.removals

    def _bound(self, tenant_id: str) -> None:
        """Discard ``tenant_id``'s oldest pending removals past ``max_removals``."""
        excess = self.removals[tenant_id] - self.max_removals
        if excess <= 0:
            return
        for key in [k for k, at_s in self.changes.items() if at_s is None and k[0] == tenant_id][:excess]:
            del self.changes[key]
        self.removals[tenant_id] -= excess
        self.discarded += excess
