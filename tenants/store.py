"""``TenantStore``: tenants and API-key hashes in one SQLite file, surviving restarts.

Tables (schema version 1, in ``PRAGMA user_version``)::

    tenants(name PK, tenant_id UNIQUE, spec_json, created_at_s)
    api_keys(key_id PK, role 'tenant'|'admin', tenant_id -> tenants ON DELETE CASCADE,
             salt, iterations, digest, created_at_s)

Keys are stored only as ``KeyHash`` rows (see ``tenants.keys``). One connection is shared
by all callers behind a lock, so one asyncio process (and its threads) may use a store;
``authenticate`` and ``verify_admin_key`` are synchronous and run PBKDF2 (~60-200 ms) on a
key's first use: async code runs them in a thread (``GlobalSchedulerService``).

PBKDF2 runs are bounded: a verified key is remembered (its SHA-256 fingerprint by key id),
a wrong key is remembered for ``FAILED_KEY_TTL_S``, and at most ``failed_checks_per_key_id``
PBKDF2 runs per key id happen in any ``FAILED_CHECK_WINDOW_S`` (past that, an unverified key
with that id is refused without PBKDF2 until the window passes; a key verified before keeps
working).
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tenants.errors import TenantExistsError, TenantNotFoundError
from tenants.keys import (
    KeyHash,
    fingerprint,
    generate_api_key,
    hash_api_key,
    parse_key_id,
    verify_api_key,
)
from tenants.model import Tenant, TenantSpec
from tenants.ratelimit import ExpiringSet, WindowLimiter

SCHEMA_VERSION = 1
FAILED_KEY_TTL_S = 60.0
FAILED_CHECK_WINDOW_S = 60.0
FAILED_CHECKS_PER_KEY_ID = 10
_CHECK_LOCK_STRIPES = 64  # PBKDF2 runs of one key id never overlap (striped by key id)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tenants (
    name TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL UNIQUE,
    spec_json TEXT NOT NULL,
    created_at_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id TEXT PRIMARY KEY,
    role TEXT NOT NULL CHECK (role IN ('tenant', 'admin')),
    tenant_id TEXT REFERENCES tenants(tenant_id) ON DELETE CASCADE,
    salt BLOB NOT NULL,
    iterations INTEGER NOT NULL,
    digest BLOB NOT NULL,
    created_at_s REAL NOT NULL,
    CHECK ((role = 'admin') = (tenant_id IS NULL))
);
"""
_TENANT_COLUMNS = "t.tenant_id, t.spec_json, t.created_at_s"
_HAS_ADMIN_KEY = "SELECT 1 FROM api_keys WHERE role = 'admin'"


class TenantStore:
    """Persistent tenant registry and key verifier.

    Args:
        path: SQLite file (created with mode 0600 if missing), or ``":memory:"``.
        clock: returns unix seconds; stamps ``created_at_s`` (injectable for tests).
        failed_checks_per_key_id: PBKDF2 runs allowed per key id per ``FAILED_CHECK_WINDOW_S``
            for keys not verified before.

    Raises:
        RuntimeError: the file holds a different schema version.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time,
                 failed_checks_per_key_id: int = FAILED_CHECKS_PER_KEY_ID) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._verified: dict[str, bytes] = {}  # key_id -> fingerprint of a verified key
        self._failed = ExpiringSet(FAILED_KEY_TTL_S)  # fingerprints of keys that failed
        self.failed_checks_per_key_id = failed_checks_per_key_id
        self._checks = WindowLimiter(failed_checks_per_key_id, FAILED_CHECK_WINDOW_S)
        self._check_locks = [threading.Lock() for _ in range(_CHECK_LOCK_STRIPES)]
        if str(path) != ":memory:":  # born 0600: key hashes are never readable by others, not
            os.close(os.open(path, os.O_CREAT | os.O_RDWR, 0o600))  # even until the chmod below
        self._conn = sqlite3.connect(str(path), check_same_thread=False)
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._migrate()
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
        with self._lock, self._conn:
            try:
                self._conn.execute(
                    "INSERT INTO tenants (name, tenant_id, spec_json, created_at_s) "
                    "VALUES (?, ?, ?, ?)",
                    (spec.name, tenant.tenant_id, _spec_json(spec), tenant.created_at_s),
                )
            except sqlite3.IntegrityError:
                raise TenantExistsError(spec.name) from None
            self._insert_key(key_hash, "tenant", tenant.tenant_id, tenant.created_at_s)
        return tenant, api_key

    def update(self, name: str, spec: TenantSpec) -> Tenant:
        """Replace a tenant's spec; its id, creation time and keys stay.

        Raises:
            ValueError: ``spec.name`` differs from ``name`` (tenants cannot be renamed).
            TenantNotFoundError: no tenant ``name``.
        """
        if spec.name != name:
            raise ValueError(f"spec.name {spec.name!r} differs from {name!r}; cannot rename")
        with self._lock, self._conn:
            cursor = self._conn.execute(
                "UPDATE tenants SET spec_json = ? WHERE name = ?", (_spec_json(spec), name)
            )
            if cursor.rowcount == 0:
                raise TenantNotFoundError(name)
        return self.get(name)

    def delete(self, name: str) -> None:
        """Remove a tenant and all its keys. Raises ``TenantNotFoundError`` if absent."""
        with self._lock, self._conn:
            cursor = self._conn.execute("DELETE FROM tenants WHERE name = ?", (name,))
            if cursor.rowcount == 0:
                raise TenantNotFoundError(name)

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

    def authenticate(self, api_key: str) -> Tenant | None:
        """Return the tenant owning ``api_key``, or ``None`` for a wrong/unknown/admin key.

        The first successful check of a key runs PBKDF2 (~60 ms); later checks of the
        same key compare a SHA-256 fingerprint kept in memory. Deleting the tenant or
        rotating its key invalidates both.
        """
        key_id = parse_key_id(api_key)
        if key_id is None:
            return None
        with self._lock:
            row = self._conn.execute(
                f"SELECT {_TENANT_COLUMNS}, k.key_id, k.salt, k.iterations, k.digest "
                "FROM api_keys AS k JOIN tenants AS t ON t.tenant_id = k.tenant_id "
                "WHERE k.key_id = ? AND k.role = 'tenant'",
                (key_id,),
            ).fetchone()
        if row is None:  # a deleted tenant's key id forgets its verified key; the admin key's
            # id keeps it (regression: the admin key on a tenant call evicted it, and after a
            # flood of wrong secrets for its id, the admin key itself was refused)
            with self._lock:
                other = self._conn.execute("SELECT 1 FROM api_keys WHERE key_id = ?", (key_id,)).fetchone()
            if other is None:
                self._verified.pop(key_id, None)
            return None
        if not self._verify(api_key, KeyHash(*row[3:])):
            return None
        return _tenant(row[:3])

    def rotate_key(self, name: str) -> str:
        """Replace all of a tenant's keys with a new one; old keys stop working at once.

        Returns:
            The new plaintext key (shown once).

        Raises:
            TenantNotFoundError: no tenant ``name``.
        """
        api_key, key_hash = generate_api_key()
        with self._lock, self._conn:
            row = self._conn.execute(
                "SELECT tenant_id FROM tenants WHERE name = ?", (name,)
            ).fetchone()
            if row is None:
                raise TenantNotFoundError(name)
            self._conn.execute("DELETE FROM api_keys WHERE tenant_id = ?", row)
            self._insert_key(key_hash, "tenant", row[0], self._clock())
        return api_key

    def ensure_admin_key(self) -> str | None:
        """Create the admin key on first run.

        Returns:
            The plaintext admin key when it was created now; ``None`` when one exists.
        """
        if self.has_admin_key():
            return None
        api_key, key_hash = generate_api_key()
        with self._lock, self._conn:
            if self._conn.execute(_HAS_ADMIN_KEY).fetchone():  # created meanwhile
                return None
            self._insert_key(key_hash, "admin", None, self._clock())
        return api_key

    def rotate_admin_key(self) -> str:
        """Replace the admin key (e.g. when lost); returns the new plaintext, shown once."""
        api_key, key_hash = generate_api_key()
        self._replace_admin_key(key_hash)
        return api_key

    def set_admin_key(self, api_key: str) -> bool:
        """Make ``api_key`` (made by ``tenants.keys.generate_api_key``) the admin key.

        For a caller that stores the plaintext first (``write_key_file``) and commits its
        hash second, so that no crash leaves a hash without its key.

        Returns:
            True when it replaced an existing admin key (a rotation), False on first set.

        Raises:
            ValueError: ``api_key`` is malformed.
        """
        return self._replace_admin_key(hash_api_key(api_key))

    def has_admin_key(self) -> bool:
        """True when an admin key's hash is stored."""
        with self._lock:
            return self._conn.execute(_HAS_ADMIN_KEY).fetchone() is not None

    def _replace_admin_key(self, key_hash: KeyHash) -> bool:
        with self._lock, self._conn:
            replaced = self._conn.execute("DELETE FROM api_keys WHERE role = 'admin'").rowcount > 0
            self._insert_key(key_hash, "admin", None, self._clock())
        return replaced

    def verify_admin_key(self, api_key: str) -> bool:
        """True when ``api_key`` is the current admin key."""
        with self._lock:
            row = self._conn.execute(
                "SELECT key_id, salt, iterations, digest FROM api_keys "
                "WHERE key_id = ? AND role = 'admin'",
                (parse_key_id(api_key),),
            ).fetchone()
        return row is not None and self._verify(api_key, KeyHash(*row))

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _verify(self, api_key: str, stored: KeyHash) -> bool:
        """Check ``api_key`` against its stored row, outside the lock (PBKDF2 is slow).

        Runs PBKDF2 only for a key neither verified nor failed recently, and only while the
        key id's budget of checks lasts (see the module docstring). Checks of one key id run
        one at a time, so a burst of requests with a new key costs one PBKDF2 run, not one
        each. The verified cache is a dict touched by single get/set operations (atomic under
        the GIL).
        """
        fp = fingerprint(api_key)
        if self._verified_before(stored.key_id, fp):
            return True
        with self._check_locks[hash(stored.key_id) % _CHECK_LOCK_STRIPES]:
            if self._verified_before(stored.key_id, fp):  # checked while this one waited
                return True
            if fp in self._failed or not self._checks.try_acquire(stored.key_id):
                return False
            if not verify_api_key(api_key, stored):
                self._failed.add(fp)
                return False
            self._verified[stored.key_id] = fp
        return True

    def _verified_before(self, key_id: str, fp: bytes) -> bool:
        cached = self._verified.get(key_id)
        return cached is not None and hmac.compare_digest(cached, fp)

    def _insert_key(
        self, key_hash: KeyHash, role: str, tenant_id: str | None, created_at_s: float
    ) -> None:
        self._conn.execute(
            "INSERT INTO api_keys "
            "(key_id, role, tenant_id, salt, iterations, digest, created_at_s) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                key_hash.key_id,
                role,
                tenant_id,
                key_hash.salt,
                key_hash.iterations,
                key_hash.digest,
                created_at_s,
            ),
        )

    def _migrate(self) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            self._conn.close()
            raise RuntimeError(
                f"tenant store schema version {version}; this code reads {SCHEMA_VERSION}"
            )
        self._conn.executescript(_SCHEMA)
        self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self._conn.commit()


def _spec_json(spec: TenantSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True)


def _tenant(row: tuple[str, str, float]) -> Tenant:
    tenant_id, spec_json, created_at_s = row
    return Tenant(tenant_id, TenantSpec.from_dict(json.loads(spec_json)), created_at_s)
