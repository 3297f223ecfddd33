"""The tenant store's SQLite schema: its tables, the schema versions it reads and their
migration (``migrate``), and the conversion of a tenant row to a ``Tenant``.

Tables (schema version 2, in ``PRAGMA user_version``)::

    tenants(name PK, tenant_id UNIQUE, spec_json, created_at_s)
    api_keys(key_id PK, role 'tenant'|'admin', tenant_id -> tenants ON DELETE CASCADE,
             salt, iterations, digest, created_at_s)
    deleted_tenants(seq PK, tenant_id UNIQUE, deleted_at_s)   -- the newest MAX_DELETED_TENANTS
    usage(tenant_id PK -> tenants ON DELETE CASCADE, counters_json, updated_at_s)
    usage_unread(seq PK, tenant_id -> tenants ON DELETE CASCADE, counters_json, moved_at_s)
    lost_sessions(tenant_id -> tenants ON DELETE CASCADE, session_id, lost_at_s; PK both)
    open_sessions(tenant_id -> tenants ON DELETE CASCADE, session_id, used_at_s; PK both)
    spill_recreations(seq PK, node, at_s)   -- tenants.store_spill

``deleted_tenants``, ``usage``, ``usage_unread``, ``lost_sessions``, ``open_sessions`` and
``spill_recreations`` were added within version
2: opening a file without them creates them (an earlier version reading a file with them ignores
them).

Part of ``tenants.store`` (``TenantStore``).
"""

from __future__ import annotations

import json
import sqlite3

from tenants.model import Tenant, TenantSpec

SCHEMA_VERSION = 2  # 2: api_keys.iterations 0 marks a SHA-256 row (1: PBKDF2 rows only)
_READABLE_VERSIONS = (0, 1, SCHEMA_VERSION)  # 0: a new file
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
CREATE TABLE IF NOT EXISTS lost_sessions (
    tenant_id TEXT NOT NULL REFERENCES tenants(tenant_id) ON DELETE CASCADE,
    session_id TEXT NOT NULL,
    lost_at_s REAL NOT NULL,
    PRIMARY KEY (tenant_id, session_id)
);
CREATE TABLE IF NOT EXISTS open_sessions (
    tenant_id TEXT NOT NULL REFERENCES tenants(tenant_id) ON DELETE CASCADE,
    session_id TEXT NOT NULL,
    used_at_s REAL NOT NULL,
    PRIMARY KEY (tenant_id, session_id)
);
CREATE TABLE IF NOT EXISTS usage (
    tenant_id TEXT PRIMARY KEY REFERENCES tenants(tenant_id) ON DELETE CASCADE,
    counters_json TEXT NOT NULL,
    updated_at_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS spill_recreations (
    seq INTEGER PRIMARY KEY,
    node TEXT NOT NULL,
    at_s REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_unread (
    seq INTEGER PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(tenant_id) ON DELETE CASCADE,
    counters_json TEXT NOT NULL,
    moved_at_s REAL NOT NULL
);
"""
_TENANT_COLUMNS = "t.tenant_id, t.spec_json, t.created_at_s"


def migrate(conn: sqlite3.Connection) -> None:
    """Create the tables missing from ``conn``'s file and stamp it ``SCHEMA_VERSION``.

    Raises:
        RuntimeError: the file holds a version this code cannot read (``conn`` is closed).
    """
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in _READABLE_VERSIONS:
        conn.close()
        raise RuntimeError(
            f"tenant store schema version {version}; this code reads {SCHEMA_VERSION}"
        )
    conn.executescript(_SCHEMA)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.commit()


def _spec_json(spec: TenantSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True)


def _tenant(row: tuple[str, str, float]) -> Tenant:
    tenant_id, spec_json, created_at_s = row
    return Tenant(tenant_id, TenantSpec.from_dict(json.loads(spec_json)), created_at_s)
