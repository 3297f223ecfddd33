"""What a stream's chunks carry besides their choices, per the body's ``stream_options``:
``usage`` (OpenAI's ``include_usage``: null on every chunk, then a usage chunk before
``[DONE]``; with vLLM's ``continuous_usage_stats`` also the counts so far on every chunk, as
vLLM's ``serving_chat`` / ``serving_completion`` send them) and OpenAI's ``obfuscation``
padding (``include_obfuscation``, on by default as at OpenAI).

The padding is OpenAI's mitigation of the length side channel of a stream: each event is one
token's text or a few, and its size on the wire (TLS hides bytes, not lengths) tells an
observer how long each token is, from which a reply's topic can be read. Every chunk event
(text, role, finish and usage chunks; not an error event, not ``[DONE]``) gets a top-level
``obfuscation`` string of random ASCII letters and digits whose length, drawn by ``secrets``,
brings the event's JSON to a multiple of ``OBFUSCATION_BUCKET_CHARS`` plus a random
0 to ``OBFUSCATION_BUCKET_CHARS - 1`` characters: an event's size tells its content's length
to within a bucket (32 characters) and no finer; the random part stays inside the bucket, so it
hides nothing beyond that (``size // 32`` is the content's bucket, plus one), and within one
stream, whose other fields keep their length, an event still tells whether its text crossed a
bucket's edge (s40 diff review r6: the docs said the size told nothing). A client that trusts the links to this server
sends ``include_obfuscation: false`` to save those bytes (at most ``2 * OBFUSCATION_BUCKET_CHARS
- 1`` per event).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OBFUSCATION_BUCKET_CHARS = 32
"""The granularity (characters of an event's JSON, ASCII: one byte each) to which the padding
rounds each chunk event up, before its random part of 0 to this less one."""

_ALPHABET = string.ascii_letters + string.digits
"""What the padding is made of (as OpenAI's): JSON-safe, one byte each."""

_TO_ALPHABET = bytes(ord(_ALPHABET[b % len(_ALPHABET)]) for b in range(256))
"""``bytes.translate`` table from a random byte to a padding character (the slight bias of
``% 62`` is of no matter: only the padding's length hides anything)."""

_FIELD = ',"obfuscation":"'


def obfuscation(chars: int) -> str:
    """The padding for an event whose JSON is ``chars`` characters long with an empty
    ``obfuscation``: 1 to ``2 * OBFUSCATION_BUCKET_CHARS - 1`` random characters, so that the
    padded length is ``chars`` rounded down to the bucket, plus one bucket, plus a random
    0 to ``OBFUSCATION_BUCKET_CHARS - 1``. Its characters are one ``secrets.token_bytes`` draw
    translated (``_TO_ALPHABET``). Regression (s40 diff review r6 of 7a4f038): one
    ``secrets.choice`` per character cost ~55 us an event on the API's event loop, 10 times the
    event's own serialization, on every streamed token by default."""
    length = OBFUSCATION_BUCKET_CHARS - chars % OBFUSCATION_BUCKET_CHARS + secrets.randbelow(OBFUSCATION_BUCKET_CHARS)
    return secrets.token_bytes(length).translate(_TO_ALPHABET).decode("ascii")


@dataclass(frozen=True)
class StreamShape:
    """A stream's ``stream_options`` as its chunks apply them.

    Attributes:
        usage: ``include_usage``: ``usage`` null on each chunk and a usage chunk at the end.
        continuous_usage: vLLM's ``continuous_usage_stats`` (only with ``usage``, as vLLM):
            each chunk's ``usage`` is its choice's counts so far, not null.
        obfuscate: ``include_obfuscation``: each chunk event padded (module docstring).
    """

    usage: bool = False
    continuous_usage: bool = False
    obfuscate: bool = True

    def event(self, chunk: dict[str, Any], usage: Callable[[], dict[str, Any]] | None = None) -> bytes:
        """``chunk`` as one server-sent event: with ``usage()`` (its choice's counts so far) when
        continuous usage is on and one is given, and padded when obfuscation is on. ``chunk``
        is changed (its ``usage``); the padding is added to its JSON only."""
        if self.continuous_usage and usage is not None:
            chunk["usage"] = usage()
        body = json.dumps(chunk, separators=(",", ":"))  # ASCII (ensure_ascii): a character a byte
        if self.obfuscate and body.endswith("}"):
            padding = obfuscation(len(body) + len(_FIELD) + 1)  # its `,"obfuscation":""` counted
            body = f'{body[:-1]}{_FIELD}{padding}"}}'
        return f"data: {body}\n\n".encode()
