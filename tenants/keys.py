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
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
    api_key = new_api_key()
    return api_key, hash_api_key(api_key, iterations)


def new_api_key() -> str:
    """A new random key, plaintext only (for a caller that saves it before storing its hash)."""
    return f"{KEY_PREFIX}_{secrets.token_hex(KEY_ID_BYTES)}_{secrets.token_urlsafe(SECRET_BYTES)}"


def hash_api_key(api_key: str, iterations: int = PBKDF2_ITERATIONS) -> KeyHash:
    """The stored form of a well-formed ``api_key``, with a fresh random salt.

    Raises:
        ValueError: ``api_key`` is malformed.
    """
    key_id = parse_key_id(api_key)
    if key_id is None:
        raise ValueError("cannot hash a malformed API key")
    salt = secrets.token_bytes(SALT_BYTES)
    return KeyHash(key_id, salt, iterations, _digest(api_key, salt, iterations))


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


def write_key_file(path: str | Path, api_key: str) -> None:
    """Write ``api_key`` to ``path`` atomically, readable by the owner only (mode 0600).

    The key goes to a temp file in the same directory (created 0600), is fsynced, and
    replaces ``path`` with ``os.replace``; the directory is fsynced after. A crash at any
    point leaves either the old file whole or the new one whole (plus, at worst, a stray
    ``.<name>.*`` temp file), never a partial key.

    Raises:
        ValueError: ``api_key`` is not a well-formed key.
        OSError: the directory cannot be written.
    """
    if parse_key_id(api_key) is None:
        raise ValueError("refusing to write a malformed API key")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(api_key + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_key_file(path: str | Path) -> str | None:
    """The well-formed key in ``path``, or ``None`` when it is missing, empty or garbled."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return text if parse_key_id(text) is not None else None


def _digest(api_key: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), salt, iterations)
