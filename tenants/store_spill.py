"""The tenant store's record of spill node recreations, kept across a restart of the global
scheduler (``services.spill_recreate.SpillRecreator``): when each spill node was created again,
so that a restarted scheduler keeps counting a node's recreations within the policy's window
(its cap and its backoff) rather than starting from none.

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import sqlite3
import threading

MAX_RECREATIONS_KEPT = 64
"""Rows kept per spill node (the newest): a window never needs more than its ``max_per_window``."""


class SpillRecreationRows:
    """Spill recreation rows of ``TenantStore`` (which provides these attributes)."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def add_spill_recreation(self, node: str, at_s: float) -> None:
        """Record that spill node ``node`` was created again at ``at_s`` (wall-clock seconds);
        only its newest ``MAX_RECREATIONS_KEPT`` rows are kept.

        Raises:
            sqlite3.Error: the write failed."""
        with self._lock, self._conn:
            self._conn.execute("INSERT INTO spill_recreations (node, at_s) VALUES (?, ?)", (node, float(at_s)))
            self._conn.execute(
                "DELETE FROM spill_recreations WHERE node = ? AND seq NOT IN "
                "(SELECT seq FROM spill_recreations WHERE node = ? ORDER BY seq DESC LIMIT ?)",
                (node, node, MAX_RECREATIONS_KEPT))

    def load_spill_recreations(self, since_s: float) -> dict[str, list[float]]:
        """Spill node name -> when it was created again (wall-clock seconds, oldest first), of
        the recreations at or after ``since_s``; older rows are deleted."""
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM spill_recreations WHERE at_s < ?", (since_s,))
            rows = self._conn.execute("SELECT node, at_s FROM spill_recreations ORDER BY seq").fetchall()
        history: dict[str, list[float]] = {}
        for node, at_s in rows:
            history.setdefault(str(node), []).append(float(at_s))
        return history

    def forget_spill_recreations(self) -> None:
        """Delete every recreation row (a first start of the scheduler: ``kvstrata up``).

        Raises:
            sqlite3.Error: the write failed."""
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM spill_recreations")
