"""The tenant store's durable usage counters (``tenants.usage.COUNTERS`` per tenant), so that
``GetUsage`` survives a restarted scheduler and ``kvstrata down``/``up``: the scheduler stores
the counters changed since its last flush every ``USAGE_FLUSH_S`` and loads them at start.
A deleted tenant's row goes with it (``ON DELETE CASCADE``).

A stored row is never overwritten with counts this code could not read from it. Keys that are
not ``COUNTERS`` (a later version's counters, read back after a rollback) are carried through
every save; a row that is not a JSON object, or whose known counter is not a non-negative
integer, is moved whole to ``usage_unread`` at load (logged, kept for an operator), and the
tenant counts on from zero in ``usage``.

Regression (review s35 D C1): a row ``load_usage`` or ``UsageLedger.restore`` skipped left the
tenant at zero in memory, and its next flush replaced the stored row with those counts: the
tenant's lifetime usage (``GetUsage``, billing) was gone, unlogged.

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tenants.usage import COUNTERS

log = logging.getLogger(__name__)


class UsageRows:
    """Usage rows of ``TenantStore`` (which provides these attributes)."""

    _conn: sqlite3.Connection
    _lock: threading.Lock
    _clock: Callable[[], float]

    def load_usage(self) -> dict[str, dict[str, int]]:
        """Every stored tenant's counters: tenant id -> counter name (of ``COUNTERS``) -> count.
        Keys that are not ``COUNTERS`` stay in the stored row (``save_usage`` keeps them); a row
        this code cannot read is moved to ``usage_unread`` (and logged) in the same transaction.

        Raises:
            sqlite3.Error: the read or the move failed (nothing is moved).
        """
        out: dict[str, dict[str, int]] = {}
        with self._lock, self._conn:
            rows = self._conn.execute("SELECT tenant_id, counters_json FROM usage").fetchall()
            for tenant_id, text in rows:
                counters = _readable(text)
                if counters is None:
                    self._move_unread(tenant_id, text)
                else:
                    out[tenant_id] = {k: v for k, v in counters.items() if k in COUNTERS}
        return out

    def save_usage(self, rows: Mapping[str, Mapping[str, int]]) -> int:
        """Store ``rows`` (tenant id -> ``COUNTERS``), replacing those counters of each tenant's
        row and keeping its other keys, in one transaction; rows of tenants no longer in the
        store (deleted meanwhile) are skipped. A stored row this code cannot read (written
        since ``load_usage``) is moved to ``usage_unread`` first. Returns the rows stored.

        Raises:
            sqlite3.Error: the write failed (nothing of ``rows`` is stored).
        """
        now = self._clock()
        with self._lock, self._conn:
            stored = 0
            for tenant_id, counters in rows.items():
                merged = dict(counters)
                found = self._conn.execute("SELECT counters_json FROM usage WHERE tenant_id = ?",
                                           (tenant_id,)).fetchone()
                if found is not None:
                    held = _readable(found[0])
                    if held is None:
                        self._move_unread(tenant_id, found[0])
                    else:
                        merged = {**{k: v for k, v in held.items() if k not in COUNTERS}, **merged}
                cur = self._conn.execute(
                    "INSERT INTO usage (tenant_id, counters_json, updated_at_s) "
                    "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM tenants WHERE tenant_id = ?) "
                    "ON CONFLICT(tenant_id) DO UPDATE SET counters_json = excluded.counters_json, "
                    "updated_at_s = excluded.updated_at_s",
                    (tenant_id, json.dumps(merged, sort_keys=True), now, tenant_id))
                stored += cur.rowcount
        return stored

    def unread_usage(self) -> list[tuple[str, str, float]]:
        """The rows ``load_usage``/``save_usage`` set aside: (tenant id, stored text, moved at s),
        oldest first."""
        with self._lock:
            return [tuple(r) for r in self._conn.execute(
                "SELECT tenant_id, counters_json, moved_at_s FROM usage_unread ORDER BY seq")]

    def _move_unread(self, tenant_id: str, text: Any) -> None:
        """Under the lock, in a transaction: move ``tenant_id``'s usage row to ``usage_unread``."""
        self._conn.execute("INSERT INTO usage_unread (tenant_id, counters_json, moved_at_s) VALUES (?, ?, ?)",
                           (tenant_id, str(text), self._clock()))
        self._conn.execute("DELETE FROM usage WHERE tenant_id = ?", (tenant_id,))
        log.error("tenant %s: its stored usage row is not readable counters and was moved to the "
                  "usage_unread table (its counts go on from zero): %.200r", tenant_id, text)


def _readable(text: Any) -> dict[str, Any] | None:
    """``text`` as a JSON object whose ``COUNTERS`` present are non-negative integers (other
    keys: anything), else None."""
    try:
        counters = json.loads(text)
    except (TypeError, ValueError):
        return None
    if not isinstance(counters, dict):
        return None
    for name in COUNTERS:
        value = counters.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
    return counters
