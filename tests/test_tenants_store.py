"""TenantStore: SQLite persistence, typed errors, key authentication, admin key."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import sqlite3
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tenants.errors import TenantExistsError, TenantNotFoundError
from tenants.keys import KEY_PATTERN
from tenants.model import SloClass, Tenant, TenantSpec
from tenants.store import TenantStore


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "tenants.sqlite"


@pytest.fixture
def store(db_path: Path) -> Iterator[TenantStore]:
    tenant_store = TenantStore(db_path, clock=FakeClock())
    yield tenant_store
    tenant_store.close()


def _db_bytes(db_path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in db_path.parent.glob(db_path.name + "*"))


def test_register_returns_tenant_and_key(store: TenantStore) -> None:
    spec = TenantSpec("lead", SloClass.INTERACTIVE)
    tenant, api_key = store.register(spec)

    assert tenant.spec == spec
    assert tenant.created_at_s == 1001.0
    assert re.fullmatch(r"[0-9a-f]{16}", tenant.tenant_id)
    assert KEY_PATTERN.fullmatch(api_key)
    assert store.get("lead") == tenant
    assert store.authenticate(api_key) == tenant


def test_duplicate_name_is_a_typed_error(store: TenantStore) -> None:
    first, api_key = store.register(TenantSpec("dup"))

    with pytest.raises(TenantExistsError) as excinfo:
        store.register(TenantSpec("dup", "batch"))

    assert str(excinfo.value) == "tenant 'dup' already exists"
    assert excinfo.value.name == "dup"
    assert store.list() == (first,)
    assert store.authenticate(api_key) == first


def test_tenants_and_keys_survive_reopening(db_path: Path) -> None:
    store = TenantStore(db_path, clock=FakeClock())
    beta, beta_key = store.register(TenantSpec("beta", "batch", kv_quota_bytes=1 << 20))
    alpha, alpha_key = store.register(TenantSpec("alpha", "interactive", policy="snapkv"))
    admin_key = store.ensure_admin_key()
    store.close()

    reopened = TenantStore(db_path)
    try:
        assert reopened.list() == (
            Tenant(alpha.tenant_id, alpha.spec, 1002.0),
            Tenant(beta.tenant_id, beta.spec, 1001.0),
        )
        assert reopened.authenticate(alpha_key) == alpha
        assert reopened.authenticate(beta_key) == beta
        assert admin_key is not None and reopened.verify_admin_key(admin_key) is True
        assert reopened.ensure_admin_key() is None
    finally:
        reopened.close()


def test_keys_are_never_stored_in_plaintext(store: TenantStore, db_path: Path) -> None:
    _, api_key = store.register(TenantSpec("secretive"))
    admin_key = store.ensure_admin_key()
    assert admin_key is not None

    data = _db_bytes(db_path)
    for key in (api_key, admin_key):
        secret = KEY_PATTERN.fullmatch(key).group("secret")  # type: ignore[union-attr]
        assert key.encode() not in data
        assert secret.encode() not in data
        assert KEY_PATTERN.fullmatch(key).group("key_id").encode() in data  # type: ignore[union-attr]
    assert b"secretive" in data


def test_wrong_keys_are_rejected(store: TenantStore) -> None:
    tenant, api_key = store.register(TenantSpec("victim"))
    admin_key = store.ensure_admin_key()
    assert admin_key is not None
    tampered = api_key[:-1] + ("A" if api_key[-1] != "A" else "B")

    assert store.authenticate(api_key) == tenant  # caches the verified key
    assert store.authenticate(tampered) is None
    assert store.authenticate("kvs_000000000000_" + "A" * 43) is None
    assert store.authenticate("not-a-key") is None
    assert store.authenticate(admin_key) is None
    assert store.verify_admin_key(api_key) is False
    assert store.verify_admin_key(admin_key[:-1] + "?") is False
    assert store.verify_admin_key(admin_key) is True


def test_update_keeps_identity(store: TenantStore) -> None:
    tenant, api_key = store.register(TenantSpec("svc"))
    new_spec = TenantSpec("svc", "interactive", weight=8.0)

    updated = store.update("svc", new_spec)

    assert updated == Tenant(tenant.tenant_id, new_spec, tenant.created_at_s)
    assert store.get("svc") == updated
    assert store.authenticate(api_key) == updated


def test_update_errors(store: TenantStore) -> None:
    store.register(TenantSpec("svc"))
    with pytest.raises(ValueError, match="^spec.name 'other' differs from 'svc'; cannot rename$"):
        store.update("svc", TenantSpec("other"))
    with pytest.raises(TenantNotFoundError, match="^tenant 'ghost' not found$"):
        store.update("ghost", TenantSpec("ghost"))


def test_delete_revokes_keys(store: TenantStore) -> None:
    tenant, api_key = store.register(TenantSpec("gone"))
    assert store.authenticate(api_key) == tenant

    store.delete("gone")

    assert store.list() == ()
    assert store.authenticate(api_key) is None
    with pytest.raises(TenantNotFoundError):
        store.get("gone")
    with pytest.raises(TenantNotFoundError, match="^tenant 'gone' not found$"):
        store.delete("gone")
    again, new_key = store.register(TenantSpec("gone"))
    assert again.tenant_id != tenant.tenant_id
    assert store.authenticate(api_key) is None
    assert store.authenticate(new_key) == again


def test_rotate_key(store: TenantStore) -> None:
    tenant, old_key = store.register(TenantSpec("rot"))
    assert store.authenticate(old_key) == tenant

    new_key = store.rotate_key("rot")

    assert new_key != old_key
    assert store.authenticate(old_key) is None
    assert store.authenticate(new_key) == tenant
    with pytest.raises(TenantNotFoundError):
        store.rotate_key("nobody")


def test_admin_key_lifecycle(store: TenantStore) -> None:
    first = store.ensure_admin_key()
    assert first is not None and KEY_PATTERN.fullmatch(first)
    assert store.ensure_admin_key() is None

    second = store.rotate_admin_key()

    assert store.verify_admin_key(first) is False
    assert store.verify_admin_key(second) is True


def test_concurrent_registration_from_threads(store: TenantStore) -> None:
    names = [f"agent-{i}" for i in range(6)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda n: store.register(TenantSpec(n)), names))

    assert [t.name for t in store.list()] == names
    assert [store.authenticate(key) for _, key in results] == [t for t, _ in results]


def test_db_file_is_private(store: TenantStore, db_path: Path) -> None:
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600


def test_db_file_and_journal_are_private_from_their_first_byte(tmp_path: Path, monkeypatch) -> None:
    """Regression: the file was created with the umask's mode (often 0644) and narrowed to 0600
    only after the schema was written; its journal followed the wide mode meanwhile."""
    seen: list[int] = []
    real_connect = sqlite3.connect

    def connect(path, *args, **kw):  # type: ignore[no-untyped-def]
        seen.append(stat.S_IMODE(Path(path).stat().st_mode))  # the file exists, already private
        return real_connect(path, *args, **kw)

    monkeypatch.setattr(sqlite3, "connect", connect)
    old = os.umask(0o022)
    try:
        store = TenantStore(tmp_path / "t.sqlite")
        with store._conn:  # a write: SQLite's rollback journal takes the database's mode
            store._conn.execute("CREATE TABLE probe (x)")
    finally:
        os.umask(old)
    assert seen == [0o600] and stat.S_IMODE((tmp_path / "t.sqlite").stat().st_mode) == 0o600


def test_the_scheduler_creates_its_state_dir_for_its_owner_alone(tmp_path: Path) -> None:
    from services.global_scheduler import GlobalScheduler

    GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700


def test_unknown_schema_version_refuses_to_open(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA user_version = 7")
    conn.close()

    with pytest.raises(RuntimeError, match="^tenant store schema version 7; this code reads 2$"):
        TenantStore(db_path)


def _store_as_pbkdf2(db_path: Path, api_key: str, iterations: int = 1000) -> None:
    """Rewrite ``api_key``'s row as versions before the SHA-256 keys stored it (schema 1,
    salted PBKDF2-HMAC-SHA256); fewer iterations than those versions used, for speed."""
    salt = os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", api_key.encode(), salt, iterations)
    conn = sqlite3.connect(db_path)
    with conn:
        conn.execute("UPDATE api_keys SET salt = ?, iterations = ?, digest = ? WHERE key_id = ?",
                     (salt, iterations, digest, KEY_PATTERN.fullmatch(api_key).group("key_id")))  # type: ignore[union-attr]
        conn.execute("PRAGMA user_version = 1")
    conn.close()


def _wrong_secrets(api_key: str, n: int) -> list[str]:
    return [api_key[: len("kvs_0123456789ab_")] + secrets.token_urlsafe(32) for _ in range(n)]


@pytest.mark.parametrize("stored_as", ["sha256", "pbkdf2"])
def test_wrong_secrets_for_a_key_id_never_lock_out_its_key_after_a_restart(db_path: Path, stored_as: str) -> None:
    """Regression (secrev16 fault A): after a restart, anyone who knew a tenant's public key
    id spent the store's 10 PBKDF2 checks a minute for it on wrong secrets, and the holder's
    correct key was refused. Neither a new (SHA-256) nor an earlier version's (PBKDF2) record
    refuses its correct key, however many wrong secrets came first."""
    store = TenantStore(db_path)
    tenant, api_key = store.register(TenantSpec("victim"))
    admin_key = store.ensure_admin_key()
    assert admin_key is not None
    store.close()
    if stored_as == "pbkdf2":
        _store_as_pbkdf2(db_path, api_key)
        _store_as_pbkdf2(db_path, admin_key)

    reopened = TenantStore(db_path)  # the restart: nothing verified yet
    try:
        assert [reopened.authenticate(k) for k in _wrong_secrets(api_key, 30)] == [None] * 30
        assert [reopened.verify_admin_key(k) for k in _wrong_secrets(admin_key, 30)] == [False] * 30
        assert reopened.authenticate(api_key) == tenant
        assert reopened.verify_admin_key(admin_key) is True
    finally:
        reopened.close()


def test_pbkdf2_records_of_earlier_versions_move_to_sha256_on_first_use(db_path: Path) -> None:
    """A record stored with PBKDF2 (schema 1) verifies with PBKDF2 once, then is rewritten to
    the SHA-256 form (``iterations`` 0); wrong keys rewrite nothing."""
    store = TenantStore(db_path)
    tenant, api_key = store.register(TenantSpec("old"))
    admin_key = store.ensure_admin_key()
    assert admin_key is not None
    store.close()
    _store_as_pbkdf2(db_path, api_key)
    _store_as_pbkdf2(db_path, admin_key)

    def iterations() -> list[int]:
        conn = sqlite3.connect(db_path)
        try:
            return [row[0] for row in conn.execute("SELECT iterations FROM api_keys ORDER BY role")]
        finally:
            conn.close()

    reopened = TenantStore(db_path)
    try:
        assert reopened.authenticate(_wrong_secrets(api_key, 1)[0]) is None
        assert reopened.verify_admin_key(_wrong_secrets(admin_key, 1)[0]) is False
        assert iterations() == [1000, 1000]  # admin, tenant
        assert reopened.authenticate(api_key) == tenant
        assert reopened.verify_admin_key(admin_key) is True
        assert iterations() == [0, 0]
    finally:
        reopened.close()
    again = TenantStore(db_path)  # the rewritten records verify after the next restart
    try:
        assert again.authenticate(api_key) == tenant
        assert again.verify_admin_key(admin_key) is True
        assert again.authenticate(_wrong_secrets(api_key, 1)[0]) is None
    finally:
        again.close()
