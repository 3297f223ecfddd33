"""API keys: format, salted SHA-256 (HMAC) hashes, earlier PBKDF2 ones, constant-time verification."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import pytest

from tenants.keys import (
    KEY_PATTERN,
    SHA256_SCHEME,
    fingerprint,
    generate_api_key,
    hash_api_key,
    parse_key_id,
    verify_api_key,
)


def test_generated_key_format_and_hash() -> None:
    api_key, stored = generate_api_key()

    match = KEY_PATTERN.fullmatch(api_key)
    assert match is not None
    assert len(api_key) == len("kvs_") + 12 + 1 + 43
    assert stored.key_id == match.group("key_id") == parse_key_id(api_key)
    assert (len(stored.salt), stored.iterations, len(stored.digest)) == (16, SHA256_SCHEME, 32)
    assert stored.digest == hmac.new(stored.salt, api_key.encode(), hashlib.sha256).digest()
    assert stored.slow is False


def test_an_earlier_versions_pbkdf2_hash_still_verifies() -> None:
    """Records stored before the SHA-256 keys (PBKDF2-HMAC-SHA256) keep verifying."""
    api_key, _ = generate_api_key()
    stored = hash_api_key(api_key, iterations=10)
    assert stored.digest == hashlib.pbkdf2_hmac("sha256", api_key.encode(), stored.salt, 10)
    assert stored.slow is True
    assert verify_api_key(api_key, stored) is True
    assert verify_api_key(api_key[:-1] + ("A" if api_key[-1] != "A" else "B"), stored) is False
    with pytest.raises(ValueError):
        hash_api_key(api_key, iterations=-1)


def test_stored_hash_holds_no_secret() -> None:
    api_key, stored = generate_api_key()
    secret = KEY_PATTERN.fullmatch(api_key).group("secret")  # type: ignore[union-attr]

    stored_bytes = repr(dataclasses.astuple(stored)).encode()
    assert secret.encode() not in stored_bytes
    assert stored.key_id.encode() in stored_bytes


def test_each_key_gets_its_own_salt() -> None:
    (key_a, hash_a), (key_b, hash_b) = generate_api_key(), generate_api_key()
    assert key_a != key_b
    assert hash_a.salt != hash_b.salt
    assert hash_a.key_id != hash_b.key_id


def test_verify_accepts_only_the_exact_key() -> None:
    api_key, stored = generate_api_key()
    last = api_key[-1]
    tampered = api_key[:-1] + ("A" if last != "A" else "B")
    other_key, _ = generate_api_key()

    assert verify_api_key(api_key, stored) is True
    assert verify_api_key(tampered, stored) is False
    assert verify_api_key(other_key, stored) is False
    assert verify_api_key(api_key + "x", stored) is False
    assert verify_api_key("", stored) is False
    bad_digest = dataclasses.replace(stored, digest=bytes(32))
    assert verify_api_key(api_key, bad_digest) is False


def test_parse_key_id_rejects_malformed_keys() -> None:
    assert parse_key_id("kvs_0123456789ab_" + "A" * 43) == "0123456789ab"
    assert parse_key_id("kvs_0123456789AB_" + "A" * 43) is None
    assert parse_key_id("kvs_0123456789ab_" + "A" * 42) is None
    assert parse_key_id("Bearer kvs_0123456789ab_" + "A" * 43) is None
    assert parse_key_id(None) is None  # type: ignore[arg-type]


def test_fingerprint_is_sha256() -> None:
    assert fingerprint("kvs_x") == hashlib.sha256(b"kvs_x").digest()
