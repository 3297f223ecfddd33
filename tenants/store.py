"""``TenantStore``: tenants and API-key hashes in one SQLite file, surviving restarts.

``TenantStore`` is here with the tenants' rows (register, update, delete, get, list); its
tables and schema versions are ``tenants.store_schema``, its API keys (issued, rotated and
checked, PBKDF2 bounded) ``tenants.store_keys.ApiKeys``, and the log of key changes for the
gateways' key directories ``tenants.store_key_ids.KeyIdLog``.

One connection is shared by all callers behind a lock, so one asyncio process (and its
threads) may use a store; ``authenticate`` and ``verify_admin_key`` are synchronous and may run
PBKDF2 (~60-200 ms) for a PBKDF2 row: async code runs them in a thread
(``GlobalSchedulerService``).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

from tenants.errors import TenantExistsError, TenantNotFoundError
from tenants.keys import generate_api_key
from tenants.model import Tenant, TenantSpec
from tenants.ratelimit import ExpiringSet
from tenants.store_key_ids import KEY_LOG_LENGTH, KeyIdLog
from tenants.store_keys import _CHECK_LOCK_STRIPES, FAILED_KEY_TTL_S, PBKDF2_CONCURRENCY, ApiKeys
from tenants.store_schema import _TENANT_COLUMNS, _spec_json, _tenant, migrate
from tenants.store_sessions import LostSessionRows
from tenants.store_spill import SpillRecreationRows
from tenants.store_usage import UsageRows

MAX_DELETED_TENANTS = 65536
"""Deleted tenants' ids kept (``deleted_tenant_ids``; the oldest forgotten first)."""
DELETED_PAGE = 4096
"""Deleted tenants per ``deleted_tenants_after`` answer at most (the scheduler's clamp)."""


class TenantStore(ApiKeys, KeyIdLog, UsageRows, LostSessionRows, SpillRecreationRows):
    """Persistent tenant registry and key verifier.

    Args:
        path: SQLite file (created with mode 0600 if missing), or ``":memory:"``.
        clock: returns unix seconds; stamps ``created_at_s`` (injectable for tests).

    Raises:
        RuntimeError: the file holds a schema version this code cannot read (a newer one).
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # PBKDF2 rows only (SHA-256 rows need no memory):
        self._verified: dict[str, bytes] = {}  # key_id -> fingerprint of a verified key
        self._failed = ExpiringSet(FAILED_KEY_TTL_S)  # fingerprints of keys that failed
        self._pbkdf2_slots = threading.BoundedSemaphore(PBKDF2_CONCURRENCY)
        self._check_locks = [threading.Lock() for _ in range(_CHECK_LOCK_STRIPES)]
        self._key_epoch = secrets.token_hex(8)
        self._key_version = 0
        self._key_log: deque[tuple[str, bool]] = deque(maxlen=KEY_LOG_LENGTH)  # (key id, exists), oldest first
        self._removed_key_ids: OrderedDict[str, None] = OrderedDict()  # ``key_removed``, oldest first
        self._data_version = -1  # PRAGMA data_version when last read: another connection's write changes it
        if str(path) != ":memory:":  # born 0600: key hashes are never readable by others, not
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # even until the chmod below
        self._conn = sqlite3.connect(str(path), check_same_thread=False)
        self._conn.execute("PRAGMA foreign_keys = ON")
        migrate(self._conn)
        if str(path) != ":memory:":
            os.chmod(path, 0o600)

    def register(self, spec: TenantSpec) -> tuple[Tenant, str]:
        """Add a tenant and create its first API key.

        Returns:
            ``(tenant, api_key)``; the plaintext key is returned here and never again.

        Raises:
            TenantExistsError: a tenant with ``spec.name`` exists.
        """
        tenant = Tenant(secrets.token_hex(8), spec, self._clock())
        api_key, key_hash = generate_api_key()
        with self._lock:
            with self._conn:
                try:
                    self._conn.execute(
                        "INSERT INTO tenants (name, tenant_id, spec_json, created_at_s) "
                        "VALUES (?, ?, ?, ?)",
                        (spec.name, tenant.tenant_id, _spec_json(spec), tenant.created_at_s),
                    )
                except sqlite3.IntegrityError:
                    raise TenantExistsError(spec.name) from None
                self._insert_key(key_hash, "tenant", tenant.tenant_id, tenant.created_at_s)
            self._log_keys(added=[key_hash.key_id])
        return tenant, api_key

    def update(self, name: str, spec: TenantSpec) -> Tenant:
        """Replace a tenant's spec; its id, creation time and keys stay. The row is read back in
        the same transaction, so an error raised here (``sqlite3.Error``) changed nothing.

        Regression (s40 diff review r7): it was read back after the commit, a failed read
        ('database is locked': another connection's write) raising with the new spec stored,
        the gateway answering UNAVAILABLE 'nothing changed' and the scheduler keeping the old.

        Raises:
            ValueError: ``spec.name`` differs from ``name`` (tenants cannot be renamed).
            TenantNotFoundError: no tenant ``name``.
            sqlite3.Error: the store failed (its disk full, locked); nothing changed.
        """
        if spec.name != name:
            raise ValueError(f"spec.name {spec.name!r} differs from {name!r}; cannot rename")
        with self._lock, self._conn:
            cursor = self._conn.execute(
                "UPDATE tenants SET spec_json = ? WHERE name = ?", (_spec_json(spec), name)
            )
            if cursor.rowcount == 0:
                raise TenantNotFoundError(name)
            row = self._conn.execute(
                f"SELECT {_TENANT_COLUMNS} FROM tenants AS t WHERE t.name = ?", (name,)
            ).fetchone()
        return _tenant(row)

    def delete(self, name: str) -> str:
        """Remove a tenant and all its keys, and note its id among the deleted ones
        (``deleted_tenant_ids``), in one transaction; returns its tenant id.

        Raises:
            TenantNotFoundError: no tenant ``name``.
        """
        with self._lock:
            with self._conn:
                row = self._conn.execute("SELECT tenant_id FROM tenants WHERE name = ?", (name,)).fetchone()
                if row is None:
                    raise TenantNotFoundError(name)
                gone = self._conn.execute("SELECT key_id FROM api_keys WHERE tenant_id = ?", row).fetchall()
                self._conn.execute("DELETE FROM tenants WHERE tenant_id = ?", row)
                self._conn.execute("INSERT OR REPLACE INTO deleted_tenants (tenant_id, deleted_at_s) VALUES (?, ?)",
                                   (row[0], self._clock()))
                self._conn.execute("DELETE FROM deleted_tenants "
                                   "WHERE seq <= (SELECT MAX(seq) FROM deleted_tenants) - ?", (MAX_DELETED_TENANTS,))
            self._log_keys(removed=[key_id for (key_id,) in gone])
        return row[0]

    def deleted_tenant_ids(self) -> tuple[str, ...]:
        """The ids of the last ``MAX_DELETED_TENANTS`` tenants deleted, oldest first.

        Regression (secrev18 E residue): deletions were not kept, so a restarted scheduler
        could not tell a deleted tenant's late request from any other unknown id."""
        with self._lock:
            rows = self._conn.execute("SELECT tenant_id FROM deleted_tenants ORDER BY seq").fetchall()
        return tuple(tenant_id for (tenant_id,) in rows)

    def deleted_tenants_after(self, seq: int, limit: int = 4096) -> list[tuple[int, str]]:
        """``(seq, tenant_id)`` of the tenants deleted after the deletion numbered ``seq`` (0:
        all kept), oldest first, at most ``limit``: a reader pages through deletions it has
        not seen by passing the last ``seq`` it got (the spill nodes' sweep)."""
        with self._lock:
            rows = self._conn.execute("SELECT seq, tenant_id FROM deleted_tenants WHERE seq > ? ORDER BY seq LIMIT ?",
                                      (int(seq), int(limit))).fetchall()
        return [(int(s), str(t)) for s, t in rows]

    def get(self, name: str) -> Tenant:
        """Return tenant ``name``. Raises ``TenantNotFoundError`` if absent."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_TENANT_COLUMNS} FROM tenants AS t WHERE t.name = ?", (name,)
            ).fetchone()
        if row is None:
            raise TenantNotFoundError(name)
        return _tenant(row)

    def list(self) -> tuple[Tenant, ...]:
        """All tenants, sorted by name."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_TENANT_COLUMNS} FROM tenants AS t ORDER BY t.name"
            ).fetchall()
        return tuple(_tenant(row) for row in rows)

    def close(self) -> None:
        with self._lock:
            self._conn.close()
