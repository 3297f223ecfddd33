"""The tenant store's API keys: issuing, rotating and checking tenants' keys and the admin key.

Keys are stored only as ``KeyHash`` rows (see ``tenants.keys``): ``iterations`` 0 is a
SHA-256 (HMAC) digest, checked in microseconds with no cache and no limit, so no number of
wrong secrets for a key id ever refuses its correct key. Schema version 1 (earlier versions)
held PBKDF2 rows only; opening such a file makes it version 2 and leaves its rows as they are
until each key's first successful check rewrites its row to SHA-256 (``_verify_pbkdf2``).

PBKDF2 for those rows is bounded in CPU, never by refusing a check: at most
``PBKDF2_CONCURRENCY`` runs at once per store (others wait their turn), checks of one key id
run one at a time (a burst of one key costs one run), a verified key is remembered (its
SHA-256 fingerprint by key id) and a wrong one for ``FAILED_KEY_TTL_S``; a caller that must not
spend PBKDF2 (the gateway, for an address over its failure limit) passes ``allow_pbkdf2=False``.

``ApiKeys`` is a part of ``tenants.store.TenantStore``.
"""

from __future__ import annotations

import hmac
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from tenants.errors import StaleKeyError, TenantNotFoundError
from tenants.keys import (
    KeyHash,
    fingerprint,
    generate_api_key,
    hash_api_key,
    parse_key_id,
    verify_api_key,
)
from tenants.model import Tenant
from tenants.ratelimit import ExpiringSet
from tenants.store_schema import _TENANT_COLUMNS, _tenant

log = logging.getLogger(__name__)

FAILED_KEY_TTL_S = 60.0
PBKDF2_CONCURRENCY = 2  # PBKDF2 runs at once per store (legacy rows only)
_CHECK_LOCK_STRIPES = 64  # PBKDF2 runs of one key id never overlap (striped by key id)
_HAS_ADMIN_KEY = "SELECT 1 FROM api_keys WHERE role = 'admin'"


class ApiKeys:
    """API keys of ``TenantStore`` (which provides these attributes)."""

    _lock: threading.Lock
    _conn: sqlite3.Connection
    _clock: Callable[[], float]
    _verified: dict[str, bytes]
    _failed: ExpiringSet
    _pbkdf2_slots: threading.BoundedSemaphore
    _check_locks: list[threading.Lock]

    if TYPE_CHECKING:  # tenants.store_key_ids.KeyIdLog
        def _log_keys(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None: ...

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

    def rotate_key(self, name: str, tenant_id: str | None = None, key_id: str | None = None) -> str:
        """Replace all of a tenant's keys with a new one; old keys stop working at once.

        Args:
            name: the tenant's name.
            tenant_id, key_id: for a tenant's own rotation, the caller's tenant id and the id of
                the key it presented (already checked by the caller, ``authenticate``): the
                rotation is made only if, in the same transaction, ``name`` is still that
                tenant and that key is still one of its keys (a compare-and-swap: a key
                rotated away, or of a tenant deleted and registered again under ``name``,
                rotates nothing, even in a race with that change). None: the admin's rotation.

        Returns:
            The new plaintext key (shown once).

        Raises:
            TenantNotFoundError: no tenant ``name`` (the admin's rotation).
            StaleKeyError: ``tenant_id``/``key_id`` given and ``name`` is no longer that tenant
                or the key is no longer its (nothing changed).
        """
        api_key, key_hash = generate_api_key()
        own = tenant_id is not None or key_id is not None
        with self._lock:
            with self._conn:
                row = self._conn.execute(
                    "SELECT tenant_id FROM tenants WHERE name = ?", (name,)
                ).fetchone()
                if row is None:
                    raise StaleKeyError(name) if own else TenantNotFoundError(name)
                gone = [key_id for (key_id,) in self._conn.execute(
                    "SELECT key_id FROM api_keys WHERE tenant_id = ? AND role = 'tenant'", row).fetchall()]
                if own and (row[0] != tenant_id or key_id not in gone):
                    raise StaleKeyError(name)
                self._conn.execute("DELETE FROM api_keys WHERE tenant_id = ?", row)
                self._insert_key(key_hash, "tenant", row[0], self._clock())
            self._log_keys(added=[key_hash.key_id], removed=gone)
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

    def rotate_admin_key(self, key_id: str | None = None) -> str:
        """Replace the admin key (e.g. when lost); returns the new plaintext, shown once.

        Args:
            key_id: the id of the admin key the caller presented (already verified by the
                caller): the rotation is made only if it is still the admin key's, in the same
                transaction (a compare-and-swap: a key rotated away, through any gateway,
                rotates nothing). None: unconditional (``kvstrata admin rotate-key --local``).

        Raises:
            StaleKeyError: ``key_id`` is no longer the admin key's (nothing changed).
        """
        api_key, key_hash = generate_api_key()
        self._replace_admin_key(key_hash, key_id)
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

    def _replace_admin_key(self, key_hash: KeyHash, expected_key_id: str | None = None) -> bool:
        """Make ``key_hash`` the admin key (only if ``expected_key_id``, when given, is the
        current admin key's id: else ``StaleKeyError``); True when one was replaced."""
        with self._lock:
            with self._conn:
                gone = [key_id for (key_id,) in
                        self._conn.execute("SELECT key_id FROM api_keys WHERE role = 'admin'").fetchall()]
                if expected_key_id is not None and expected_key_id not in gone:
                    raise StaleKeyError("")
                self._conn.execute("DELETE FROM api_keys WHERE role = 'admin'")
                self._insert_key(key_hash, "admin", None, self._clock())
            self._log_keys(added=[key_hash.key_id], removed=gone)
        return bool(gone)

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
