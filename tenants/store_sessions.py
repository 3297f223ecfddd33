"""The tenant store's lost-session marks: the sessions whose history went with a restarted cache
node's process (``services.global_scheduler_sessions.Sessions.mark_lost``), kept across a
restart of the global scheduler so that their next turns are still refused (never computed
without their history) until closed or ``session_ttl_s`` passed. A deleted tenant's rows go
with it (``ON DELETE CASCADE``).

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping


class LostSessionRows:
    """Lost-session rows of ``TenantStore`` (which provides these attributes)."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def save_lost_sessions(self, changes: Mapping[tuple[str, str], float | None],
                           prune_before_s: float | None = None) -> None:
        """Apply ``changes`` ((tenant id, session id) -> when it was lost, wall-clock seconds;
        None: no longer lost) in one transaction; marks of tenants no longer in the store are
        skipped. With ``prune_before_s``, marks made before it are deleted too (past their TTL:
        the scheduler forgot them; without it they were deleted only at a restart).

        Raises:
            sqlite3.Error: the write failed (nothing of ``changes`` is applied).
        """
        with self._lock, self._conn:
            if prune_before_s is not None:
                self._conn.execute("DELETE FROM lost_sessions WHERE lost_at_s < ?", (prune_before_s,))
            for (tenant_id, session_id), lost_at_s in changes.items():
                if lost_at_s is None:
                    self._conn.execute("DELETE FROM lost_sessions WHERE tenant_id = ? AND session_id = ?",
                                       (tenant_id, session_id))
                else:
                    self._conn.execute(
                        "INSERT INTO lost_sessions (tenant_id, session_id, lost_at_s) SELECT ?, ?, ? "
                        "WHERE EXISTS (SELECT 1 FROM tenants WHERE tenant_id = ?) "
                        "ON CONFLICT(tenant_id, session_id) DO UPDATE SET lost_at_s = excluded.lost_at_s",
                        (tenant_id, session_id, float(lost_at_s), tenant_id))

    def load_lost_sessions(self, since_s: float) -> list[tuple[str, str, float]]:
        """``(tenant id, session id, lost at)`` of the marks made at or after ``since_s``
        (wall-clock seconds), oldest first; older ones are deleted (their sessions would have
        expired on their nodes too)."""
        with self._lock, self._conn:
            self._conn.execute("DELETE FROM lost_sessions WHERE lost_at_s < ?", (since_s,))
            rows = self._conn.execute(
                "SELECT tenant_id, session_id, lost_at_s FROM lost_sessions ORDER BY lost_at_s").fetchall()
        return [(str(t), str(s), float(at)) for t, s, at in rows]
