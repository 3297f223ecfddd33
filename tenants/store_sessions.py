"""The tenant store's session rows, kept across a restart of the global scheduler so that a
session's next turn is never computed without its history:

- lost-session marks: the sessions whose history went with a restarted cache node's process
  (``services.global_scheduler_sessions.Sessions.mark_lost``); their next turns are refused
  until closed or ``session_ttl_s`` passed;
- open sessions: the sessions the scheduler routes (a turn of each was admitted), with when
  each was last used. A restarted scheduler marks lost every one of them that no cache node
  reports holding (``Sessions.lose_stored_sessions``): after ``kvstrata down``/``up`` every one;
  after a crash of the scheduler, those of a node that restarted meanwhile.

A deleted tenant's rows go with it (``ON DELETE CASCADE``).

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping


class LostSessionRows:
    """Session rows of ``TenantStore`` (which provides these attributes)."""

    _conn: sqlite3.Connection
    _lock: threading.Lock

    def save_sessions(self, lost: Mapping[tuple[str, str], float | None],
                      opened: Mapping[tuple[str, str], float | None],
                      prune_before_s: float | None = None) -> None:
        """Apply, in one transaction, ``lost`` ((tenant id, session id) -> when it was lost,
        wall-clock seconds; None: no longer lost) and ``opened`` ((tenant id, session id) ->
        when it was last used, wall-clock seconds; None: no longer routed: closed, expired,
        lost, or its first turn failed). Rows of tenants no longer in the store are skipped.
        With ``prune_before_s``, marks made before it are deleted too (past their TTL: the
        scheduler forgot them; without it they were deleted only at a restart).

        Raises:
            sqlite3.Error: the write failed (nothing of either is applied).
        """
        with self._lock, self._conn:
            if prune_before_s is not None:
                self._conn.execute("DELETE FROM lost_sessions WHERE lost_at_s < ?", (prune_before_s,))
            for table, column, changes in (("lost_sessions", "lost_at_s", lost), ("open_sessions", "used_at_s", opened)):
                for (tenant_id, session_id), at_s in changes.items():
                    if at_s is None:
                        self._conn.execute(f"DELETE FROM {table} WHERE tenant_id = ? AND session_id = ?",
                                           (tenant_id, session_id))
                    else:
                        self._conn.execute(
                            f"INSERT INTO {table} (tenant_id, session_id, {column}) SELECT ?, ?, ? "
                            "WHERE EXISTS (SELECT 1 FROM tenants WHERE tenant_id = ?) "
                            f"ON CONFLICT(tenant_id, session_id) DO UPDATE SET {column} = excluded.{column}",
                            (tenant_id, session_id, float(at_s), tenant_id))

    def load_lost_sessions(self, since_s: float) -> list[tuple[str, str, float]]:
        """``(tenant id, session id, lost at)`` of the marks made at or after ``since_s``
        (wall-clock seconds), oldest first; older ones are deleted (their sessions would have
        expired on their nodes too)."""
        return self._load("lost_sessions", "lost_at_s", since_s)

    def load_open_sessions(self, since_s: float) -> list[tuple[str, str, float]]:
        """``(tenant id, session id, last used at)`` of the open sessions used at or after
        ``since_s`` (wall-clock seconds), least recently used first; older ones are deleted
        (idle that long, they expired on their nodes)."""
        return self._load("open_sessions", "used_at_s", since_s)

    def _load(self, table: str, column: str, since_s: float) -> list[tuple[str, str, float]]:
        with self._lock, self._conn:
            self._conn.execute(f"DELETE FROM {table} WHERE {column} < ?", (since_s,))
            rows = self._conn.execute(
                f"SELECT tenant_id, session_id, {column} FROM {table} ORDER BY {column}").fetchall()
        return [(str(t), str(s), float(at)) for t, s, at in rows]
