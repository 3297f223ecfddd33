"""``TenantStore``: tenants and API-key hashes in one SQLite file, surviving restarts.

Tables (schema version 2, in ``PRAGMA user_version``)::

    tenants(name PK, tenant_id UNIQUE, spec_json, created_at_s)
    api_keys(key_id PK, role 'tenant'|'admin', tenant_id -> tenants ON DELETE CASCADE,
             salt, iterations, digest, created_at_s)
    deleted_tenants(seq PK, tenant_id UNIQUE, deleted_at_s)   -- the newest MAX_DELETED_TENANTS

``deleted_tenants`` was added within version 2: opening a file without it creates it (an
earlier version reading a file with it ignores it).

Keys are stored only as ``KeyHash`` rows (see ``tenants.keys``): ``iterations`` 0 is a
SHA-256 (HMAC) digest, checked in microseconds with no cache and no limit, so no number of
wrong secrets for a key id ever refuses its correct key. Schema version 1 (earlier versions)
held PBKDF2 rows only; opening such a file makes it version 2 and leaves its rows as they are
until each key's first successful check rewrites its row to SHA-256 (``_verify_pbkdf2``).

One connection is shared by all callers behind a lock, so one asyncio process (and its
threads) may use a store; ``authenticate`` and ``verify_admin_key`` are synchronous and may run
PBKDF2 (~60-200 ms) for a PBKDF2 row: async code runs them in a thread
(``GlobalSchedulerService``).

PBKDF2 for those rows is bounded in CPU, never by refusing a check: at most
``PBKDF2_CONCURRENCY`` runs at once per store (others wait their turn), checks of one key id
run one at a time (a burst of one key costs one run), a verified key is remembered (its
SHA-256 fingerprint by key id) and a wrong one for ``FAILED_KEY_TTL_S``; a caller that must not
spend PBKDF2 (the gateway, for an address over its failure limit) passes ``allow_pbkdf2=False``.

The key directory (``key_ids_since``) tells gateways which key ids exist, so that they refuse a
key of any other id without a check: a version counts every key added or removed through this
store (in memory, under a random ``epoch`` per store instance); the last ``KEY_LOG_LENGTH``
changes answer a gateway that is behind, anything older (another epoch: a restart, or a write
by another connection, such as ``kvstrata admin rotate-key --local``) gets every key id.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

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
from tenants.ratelimit import ExpiringSet

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: api_keys.iterations 0 marks a SHA-256 row (1: PBKDF2 rows only)
_READABLE_VERSIONS = (0, 1, SCHEMA_VERSION)  # 0: a new file
FAILED_KEY_TTL_S = 60.0
PBKDF2_CONCURRENCY = 2  # PBKDF2 runs at once per store (legacy rows only)
_CHECK_LOCK_STRIPES = 64  # PBKDF2 runs of one key id never overlap (striped by key id)
KEY_LOG_LENGTH = 4096  # key ids added or removed lately, for ``key_ids_since``'s deltas
MAX_DELETED_TENANTS = 65536
"""Deleted tenants' ids kept (``deleted_tenant_ids``; the oldest forgotten first)."""
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
CREATE TABLE IF NOT EXISTS deleted_tenants (
    seq INTEGER PRIMARY KEY,
    tenant_id TEXT NOT NULL UNIQUE,
    deleted_at_s REAL NOT NULL
);
"""
_TENANT_COLUMNS = "t.tenant_id, t.spec_json, t.created_at_s"
_HAS_ADMIN_KEY = "SELECT 1 FROM api_keys WHERE role = 'admin'"


class KeyIdsDelta(NamedTuple):
    """``TenantStore.key_ids_since``'s answer: which key ids exist, as of ``(epoch, version)``.

    Attributes:
        epoch: 16 hex characters naming the version's sequence (new for each store instance,
            and after a write by another connection).
        version: key changes counted in ``epoch`` (>= 0).
        full: True when ``added`` is every key id there is (``removed`` is then empty);
            False when ``added`` and ``removed`` (disjoint) are what changed since the version
            asked about.
        added: key ids, sorted.
        removed: key ids, sorted.
    """

    epoch: str
    version: int
    full: bool
    added: tuple[str, ...]
    removed: tuple[str, ...]


class TenantStore:
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
        self._data_version = -1  # PRAGMA data_version when last read: another connection's write changes it
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

    def authenticate(self, api_key: str, allow_pbkdf2: bool = True) -> Tenant | None:
        """Return the tenant owning ``api_key``, or ``None`` for a wrong/unknown/admin key.

        A SHA-256 row is checked in microseconds, whatever was tried before. A PBKDF2 row (an
        earlier version's) costs one PBKDF2 run (~60-200 ms) on the key's first success,
        which rewrites the row to SHA-256; see ``_verify_pbkdf2``. Deleting the tenant or
        rotating its key invalidates the key at once.

        Args:
            allow_pbkdf2: False refuses (``None``), without running it, a key whose row is
                still PBKDF2 and that was not verified since the store opened.
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
        if not self._verify(api_key, KeyHash(*row[3:]), allow_pbkdf2):
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
        with self._lock:
            with self._conn:
                row = self._conn.execute(
                    "SELECT tenant_id FROM tenants WHERE name = ?", (name,)
                ).fetchone()
                if row is None:
                    raise TenantNotFoundError(name)
                gone = self._conn.execute("SELECT key_id FROM api_keys WHERE tenant_id = ?", row).fetchall()
                self._conn.execute("DELETE FROM api_keys WHERE tenant_id = ?", row)
                self._insert_key(key_hash, "tenant", row[0], self._clock())
            self._log_keys(added=[key_hash.key_id], removed=[key_id for (key_id,) in gone])
        return api_key

    def ensure_admin_key(self) -> str | None:
        """Create the admin key on first run.

        Returns:
            The plaintext admin key when it was created now; ``None`` when one exists.
        """
        if self.has_admin_key():
            return None
        api_key, key_hash = generate_api_key()
        with self._lock:
            with self._conn:
                if self._conn.execute(_HAS_ADMIN_KEY).fetchone():  # created meanwhile
                    return None
                self._insert_key(key_hash, "admin", None, self._clock())
            self._log_keys(added=[key_hash.key_id])
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
        with self._lock:
            with self._conn:
                gone = self._conn.execute("SELECT key_id FROM api_keys WHERE role = 'admin'").fetchall()
                self._conn.execute("DELETE FROM api_keys WHERE role = 'admin'")
                self._insert_key(key_hash, "admin", None, self._clock())
            self._log_keys(added=[key_hash.key_id], removed=[key_id for (key_id,) in gone])
        return bool(gone)

    def key_ids_since(self, epoch: str, version: int) -> KeyIdsDelta:
        """Which key ids exist (tenants' and the admin key's), for a gateway's key directory.

        Args:
            epoch, version: what the caller last heard (``KeyIdsDelta.epoch``, ``.version``);
                any other values (``""``, -1 on a first call) get every key id.

        Returns:
            The key ids added and removed since ``version`` when it is of this ``epoch`` and
            at most ``KEY_LOG_LENGTH`` changes old (``full`` False), else every key id (``full``
            True; one 12-character id per key: the reply is as large as the store).
        """
        with self._lock:
            data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
            if data_version != self._data_version:  # another connection wrote: no delta holds
                self._data_version, self._key_epoch = data_version, secrets.token_hex(8)
                self._key_log.clear()
            behind = self._key_version - version if type(version) is int else -1
            if epoch == self._key_epoch and 0 <= behind <= len(self._key_log):
                changes = dict(list(self._key_log)[len(self._key_log) - behind:])  # the last word per id
                return KeyIdsDelta(self._key_epoch, self._key_version, False,
                                   tuple(sorted(k for k, exists in changes.items() if exists)),
                                   tuple(sorted(k for k, exists in changes.items() if not exists)))
            rows = self._conn.execute("SELECT key_id FROM api_keys ORDER BY key_id").fetchall()
            return KeyIdsDelta(self._key_epoch, self._key_version, True, tuple(k for (k,) in rows), ())

    def _log_keys(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        """Count committed key changes for ``key_ids_since`` (under ``_lock``, after the commit,
        so a rolled-back change is never announced)."""
        for key_id, exists in [(k, False) for k in removed] + [(k, True) for k in added]:
            self._key_version += 1
            self._key_log.append((key_id, exists))

    def verify_admin_key(self, api_key: str, allow_pbkdf2: bool = True) -> bool:
        """True when ``api_key`` is the current admin key (``allow_pbkdf2`` as in
        ``authenticate``)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT key_id, salt, iterations, digest FROM api_keys "
                "WHERE key_id = ? AND role = 'admin'",
                (parse_key_id(api_key),),
            ).fetchone()
        return row is not None and self._verify(api_key, KeyHash(*row), allow_pbkdf2)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _verify(self, api_key: str, stored: KeyHash, allow_pbkdf2: bool = True) -> bool:
        """Check ``api_key`` against its stored row, outside the lock.

        A SHA-256 row is compared directly (constant time): no allowance, no cache, so a
        correct key is never refused because of wrong secrets sent before. Regression
        (secrev16 fault A): every row was PBKDF2 and a key id had 10 checks a minute for keys
        not verified since the start, spent by wrong secrets too: after a restart, anyone who
        knew a tenant's public key id kept its holder refused UNAUTHENTICATED.
        """
        if not stored.slow:
            return verify_api_key(api_key, stored)
        return self._verify_pbkdf2(api_key, stored, allow_pbkdf2)

    def _verify_pbkdf2(self, api_key: str, stored: KeyHash, allow_pbkdf2: bool) -> bool:
        """Check ``api_key`` against an earlier version's PBKDF2 row; on success rewrite the
        row to SHA-256 (``_rehash``), so the key's later checks are cheap.

        CPU is bounded without refusing anything: at most ``PBKDF2_CONCURRENCY`` runs at once
        (a check waits for a slot), checks of one key id run one at a time (a burst of one key
        costs one run), a verified key's fingerprint is remembered by key id and a wrong key's
        for ``FAILED_KEY_TTL_S``. A correct key is therefore at worst delayed by other
        checks, never refused; the rate of wrong secrets is bounded by the gateway (per client
        address and key id; over that limit it passes ``allow_pbkdf2=False``). The verified
        cache is a dict touched by single get/set operations (atomic under the GIL).
        """
        fp = fingerprint(api_key)
        if self._verified_before(stored.key_id, fp):
            return True
        if not allow_pbkdf2 or fp in self._failed:
            return False
        with self._check_locks[hash(stored.key_id) % _CHECK_LOCK_STRIPES]:
            if self._verified_before(stored.key_id, fp):  # checked while this one waited
                return True
            if fp in self._failed:
                return False
            with self._pbkdf2_slots:
                ok = verify_api_key(api_key, stored)
            if not ok:
                self._failed.add(fp)
                return False
            self._verified[stored.key_id] = fp
        self._rehash(api_key, stored)
        return True

    def _rehash(self, api_key: str, stored: KeyHash) -> None:
        """Replace the verified ``api_key``'s PBKDF2 row ``stored`` by its SHA-256 form (unless
        the row changed meanwhile, e.g. a rotation). A failed write is logged; the key keeps
        working from the verified cache until the next restart, and is rewritten then."""
        new = hash_api_key(api_key)
        try:
            with self._lock, self._conn:
                self._conn.execute(
                    "UPDATE api_keys SET salt = ?, iterations = ?, digest = ? "
                    "WHERE key_id = ? AND iterations = ? AND digest = ?",
                    (new.salt, new.iterations, new.digest, stored.key_id, stored.iterations, stored.digest),
                )
        except sqlite3.Error as exc:
            log.warning("could not rewrite key %s's PBKDF2 hash as SHA-256: %s", stored.key_id, exc)

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
        if version not in _READABLE_VERSIONS:
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
