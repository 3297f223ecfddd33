"""API keys: random, shown once, stored only as salted SHA-256 (HMAC) hashes.

A key reads ``kvs_<key_id>_<secret>``: ``key_id`` is 12 public hex characters used to find
the stored hash in O(1); ``secret`` is 256 random bits (url-safe base64). What is stored
(``KeyHash``) is the key id, a per-key random salt, ``iterations`` and a 32-byte digest; the
plaintext never is. Verification recomputes the digest and compares in constant time
(``hmac.compare_digest``).

Two digests, told apart by ``iterations``:

- ``iterations == 0`` (``SHA256_SCHEME``, every key made now): ``HMAC-SHA256(salt, key)``, a
  few microseconds. Stretching (PBKDF2, bcrypt...) protects guessable secrets such as
  passwords; a 256-bit random secret cannot be guessed from its SHA-256 however fast the hash,
  so stretching added nothing but a CPU cost per check, and bounding that cost per key id let
  anyone who knew a key id lock its holder out. There is no pepper (a secret kept beside the
  store): it would sit in the same ``state_dir`` as the store, and the digest is already as
  hard to invert as the secret is to guess.
- ``iterations > 0`` (``PBKDF2_ITERATIONS`` was the default): ``PBKDF2-HMAC-SHA256(key, salt,
  iterations)``, what versions before the SHA-256 keys stored (schema 1). Such a record still
  verifies, and ``tenants.store_keys`` rewrites it to the SHA-256 form on its first success.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvstrata.durable_files import write_file_atomic

KEY_PREFIX = "kvs"
SHA256_SCHEME = 0  # ``KeyHash.iterations`` of a SHA-256 (HMAC) digest
PBKDF2_ITERATIONS = 100_000  # what earlier versions stored keys with
SALT_BYTES = 16
SECRET_BYTES = 32
KEY_ID_BYTES = 6
KEY_PATTERN = re.compile(r"kvs_(?P<key_id>[0-9a-f]{12})_(?P<secret>[A-Za-z0-9_-]{43})")
KEY_ID_PATTERN = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class KeyHash:
    """The stored form of one API key (contains no secret).

    Attributes:
        key_id: the public part of the key, used for lookup.
        salt: per-key random salt (``SALT_BYTES``).
        iterations: ``SHA256_SCHEME`` (0) for ``HMAC-SHA256(salt, full key)``; > 0 for an
            earlier version's ``PBKDF2-HMAC-SHA256(full key, salt, iterations)``.
        digest: that digest, 32 bytes.
    """

    key_id: str
    salt: bytes
    iterations: int
    digest: bytes

    @property
    def slow(self) -> bool:
        """True for an earlier version's PBKDF2 record (a check costs ~60-200 ms of CPU)."""
        return self.iterations != SHA256_SCHEME


def generate_api_key() -> tuple[str, KeyHash]:
    """Create a new random key.

    Returns:
        ``(api_key, key_hash)``: the plaintext, to show once, and its SHA-256 form to store.
    """
    api_key = new_api_key()
    return api_key, hash_api_key(api_key)


def new_api_key() -> str:
    """A new random key, plaintext only (for a caller that saves it before storing its hash)."""
    return f"{KEY_PREFIX}_{secrets.token_hex(KEY_ID_BYTES)}_{secrets.token_urlsafe(SECRET_BYTES)}"


def hash_api_key(api_key: str, iterations: int = SHA256_SCHEME) -> KeyHash:
    """The stored form of a well-formed ``api_key``, with a fresh random salt.

    Args:
        iterations: ``SHA256_SCHEME`` (what to store); > 0 makes an earlier version's PBKDF2
            record (tests of the migration).

    Raises:
        ValueError: ``api_key`` is malformed, or ``iterations`` < 0.
    """
    key_id = parse_key_id(api_key)
    if key_id is None:
        raise ValueError("cannot hash a malformed API key")
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    salt = secrets.token_bytes(SALT_BYTES)
    return KeyHash(key_id, salt, iterations, _digest(api_key, salt, iterations))


def parse_key_id(api_key: str) -> str | None:
    """Return the key id of a well-formed key, or ``None`` when ``api_key`` is malformed."""
    match = KEY_PATTERN.fullmatch(api_key) if isinstance(api_key, str) else None
    return match.group("key_id") if match else None


def is_key_id(value: object) -> bool:
    """True when ``value`` is a key id (a ``str`` of 12 lowercase hex characters) and nothing else."""
    return type(value) is str and KEY_ID_PATTERN.fullmatch(value) is not None


def verify_api_key(api_key: str, stored: KeyHash) -> bool:
    """True when ``api_key`` is the key ``stored`` was made from (constant-time compare).

    Microseconds for a SHA-256 record; ~60-200 ms of CPU for a PBKDF2 one (``stored.slow``).
    """
    if parse_key_id(api_key) != stored.key_id:
        return False
    return hmac.compare_digest(_digest(api_key, stored.salt, stored.iterations), stored.digest)


def fingerprint(api_key: str) -> bytes:
    """Fast SHA-256 of a key, for an in-memory cache of keys already verified."""
    return hashlib.sha256(api_key.encode()).digest()


def write_key_file(path: str | Path, api_key: str) -> None:
    """Write ``api_key`` to ``path`` atomically, readable by the owner only (``write_private_file``).

    Raises:
        ValueError: ``api_key`` is not a well-formed key.
        OSError: the directory cannot be written.
    """
    if parse_key_id(api_key) is None:
        raise ValueError("refusing to write a malformed API key")
    write_private_file(path, api_key + "\n")


def write_private_file(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only (mode 0600): a secret
    (an API key, a token, keys a workload keeps). ``write_file_atomic`` with mode 0600.

    Raises:
        OSError: the directory cannot be written.
    """
    write_file_atomic(path, text, 0o600)


def read_key_file(path: str | Path) -> str | None:
    """The well-formed key in ``path``, or ``None`` when it is missing, empty or garbled."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    return text if parse_key_id(text) is not None else None


def _digest(api_key: str, salt: bytes, iterations: int) -> bytes:
    if iterations == SHA256_SCHEME:
        return hmac.new(salt, api_key.encode(), hashlib.sha256).digest()
    return _pbkdf2(api_key, salt, iterations)


def _pbkdf2(api_key: str, salt: bytes, iterations: int) -> bytes:
    """An earlier version's digest (the one slow step; tests count its calls)."""
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), salt, iterations)
