"""API keys: random, shown once, stored only as salted PBKDF2 hashes.

A key reads ``kvs_<key_id>_<secret>``: ``key_id`` is 12 public hex characters used to find
the stored hash in O(1); ``secret`` is 256 random bits (url-safe base64). What is stored
(``KeyHash``) is the key id, a per-key random salt, the iteration count and
``PBKDF2-HMAC-SHA256(key, salt, iterations)``; the plaintext never is. Verification
recomputes the hash and compares in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "kvs"
PBKDF2_ITERATIONS = 100_000
SALT_BYTES = 16
SECRET_BYTES = 32
KEY_ID_BYTES = 6
KEY_PATTERN = re.compile(r"kvs_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_-]{43})")


@dataclass(frozen=True)
class KeyHash:
    """The stored form of one API key (contains no secret).

    Attributes:
        key_id: the public part of the key, used for lookup.
        salt: per-key random salt (``SALT_BYTES``).
        iterations: PBKDF2 iteration count used for ``digest``.
        digest: ``PBKDF2-HMAC-SHA256(full key, salt, iterations)``, 32 bytes.
    """

    key_id: str
    salt: bytes
    iterations: int
    digest: bytes


def generate_api_key(iterations: int = PBKDF2_ITERATIONS) -> tuple[str, KeyHash]:
    """Create a new random key.

    Returns:
        ``(api_key, key_hash)``: the plaintext, to show once, and what to store.
    """
    key_id = secrets.token_hex(KEY_ID_BYTES)
    api_key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(SECRET_BYTES)}"
    salt = secrets.token_bytes(SALT_BYTES)
    return api_key, KeyHash(key_id, salt, iterations, _digest(api_key, salt, iterations))


def parse_key_id(api_key: str) -> str | None:
    """Return the key id of a well-formed key, or ``None`` when ``api_key`` is malformed."""
    match = KEY_PATTERN.fullmatch(api_key) if isinstance(api_key, str) else None
    return match.group("key_id") if match else None


def verify_api_key(api_key: str, stored: KeyHash) -> bool:
    """True when ``api_key`` is the key ``stored`` was made from (constant-time compare)."""
    if parse_key_id(api_key) != stored.key_id:
        return False
    return hmac.compare_digest(_digest(api_key, stored.salt, stored.iterations), stored.digest)


def fingerprint(api_key: str) -> bytes:
    """Fast SHA-256 of a key, for an in-memory cache of keys already verified."""
    return hashlib.sha256(api_key.encode()).digest()


def _digest(api_key: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), salt, iterations)
