"""The tenant store's log of key changes, for gateways' key directories (``key_ids_since``,
answered as a ``KeyIdsDelta``).

The key directory (``key_ids_since``) tells gateways which key ids exist, so that they refuse a
key of any other id without a check: a version counts every key added or removed through this
store (in memory, under a random ``epoch`` per store instance); the last ``KEY_LOG_LENGTH``
changes answer a gateway that is behind, anything older (another epoch: a restart, or a write
by another connection, such as ``kvstrata admin rotate-key --local``) gets every key id.

``KeyIdLog`` is a part of ``tenants.store.TenantStore``.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

KEY_LOG_LENGTH = 4096  # key ids added or removed lately, for ``key_ids_since``'s deltas
MAX_KEY_IDS_ASKED = 4096
"""Key ids one ``key_ids_exist`` call may ask about (a gateway asks in batches of at most this)."""
_EXISTING_PER_QUERY = 500  # ids per SQL query of ``existing_key_ids`` (under SQLite's 999 host parameters)


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


class KeyIdLog:
    """The key directory's side of ``TenantStore`` (which provides these attributes)."""

    _lock: threading.Lock
    _conn: sqlite3.Connection
    _key_epoch: str
    _key_version: int
    _key_log: deque[tuple[str, bool]]
    _removed_key_ids: OrderedDict[str, None]
    _data_version: int

    def key_removed(self, key_id: str) -> bool:
        """Whether key ``key_id`` was removed through this store (rotated away, or its tenant
        deleted) among its last ``KEY_LOG_LENGTH`` removals: admission refuses a request
        authenticated with it from a gateway's key cache (``GlobalScheduler.admit``). Key ids
        are random and never reused, so a removed one never comes back. A read of one dict,
        without the lock (admission runs on the scheduler's event loop, the store's writes in
        worker threads). Removals by another connection (``kvstrata admin rotate-key --local``)
        and before this store instance was opened are not seen: gateways drop those keys at
        their key directory's next refresh, or their cache's TTL."""
        return key_id in self._removed_key_ids

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

    def existing_key_ids(self, key_ids: Sequence[str]) -> tuple[str, ...]:
        """Which of ``key_ids`` exist (tenants' and the admin key's), sorted: a gateway confirms
        its open streams' keys so when its key directory cannot hold the store's every id
        (``services.key_ids.KeyDirectory.which_exist``). One indexed read per
        ``_EXISTING_PER_QUERY`` ids; the caller bounds how many it asks about."""
        found: list[str] = []
        asked = sorted(set(key_ids))
        with self._lock:
            for start in range(0, len(asked), _EXISTING_PER_QUERY):
                chunk = asked[start:start + _EXISTING_PER_QUERY]
                marks = ",".join("?" * len(chunk))
                rows = self._conn.execute(f"SELECT key_id FROM api_keys WHERE key_id IN ({marks})", chunk).fetchall()
                found += (k for (k,) in rows)
        return tuple(sorted(found))

    def _log_keys(self, added: Sequence[str] = (), removed: Sequence[str] = ()) -> None:
        """Count committed key changes for ``key_ids_since`` (under ``_lock``, after the commit,
        so a rolled-back change is never announced)."""
        for key_id, exists in [(k, False) for k in removed] + [(k, True) for k in added]:
            self._key_version += 1
            self._key_log.append((key_id, exists))
        for key_id in removed:
            self._removed_key_ids[key_id] = None
        while len(self._removed_key_ids) > KEY_LOG_LENGTH:
            self._removed_key_ids.popitem(last=False)
