"""The tenant store's durable usage counters (``tenants.usage.COUNTERS`` per tenant), so that
``GetUsage`` survives a restarted scheduler and ``kvstrata down``/``up``: the scheduler stores
the counters changed since its last flush every ``USAGE_FLUSH_S`` and loads them at start.
A deleted tenant's row goes with it (``ON DELETE CASCADE``).

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable, Mapping


class UsageRows:
    """Usage rows of ``TenantStore`` (which provides these attributes)."""

    _conn: sqlite3.Connection
    _lock: threading.Lock
    _clock: Callable[[], float]

    def load_usage(self) -> dict[str, dict[str, int]]:
        """Every stored tenant's counters: tenant id -> counter name -> count. A row whose JSON
        is not an object of integers is left out (``UsageLedger.restore`` checks the names)."""
        with self._lock:
            rows = self._conn.execute("SELECT tenant_id, counters_json FROM usage").fetchall()
        out: dict[str, dict[str, int]] = {}
        for tenant_id, text in rows:
            try:
                counters = json.loads(text)
            except ValueError:
                continue
            if isinstance(counters, dict) and all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in counters.values()):
                out[tenant_id] = counters
        return out

    def save_usage(self, rows: Mapping[str, Mapping[str, int]]) -> int:
        """Store ``rows`` (tenant id -> counters), replacing each tenant's, in one transaction;
        rows of tenants no longer in the store (deleted meanwhile) are skipped. Returns the rows
        stored.

        Raises:
            sqlite3.Error: the write failed (nothing of ``rows`` is stored).
        """
        now = self._clock()
        with self._lock, self._conn:
            stored = 0
            for tenant_id, counters in rows.items():
                cur = self._conn.execute(
                    "INSERT INTO usage (tenant_id, counters_json, updated_at_s) "
                    "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM tenants WHERE tenant_id = ?) "
                    "ON CONFLICT(tenant_id) DO UPDATE SET counters_json = excluded.counters_json, "
                    "updated_at_s = excluded.updated_at_s",
                    (tenant_id, json.dumps(dict(counters), sort_keys=True), now, tenant_id))
                stored += cur.rowcount
        return stored
