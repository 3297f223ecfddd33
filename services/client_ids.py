"""The characters a client-named string may hold: the rule every API edge applies to the ids and
keys a client names things by (``request_id``, ``session_id``, ``cache_salt``, ``routing_key`` /
``prompt_cache_key``), before any of them is held, hashed, routed or logged. (OpenAI's ``user``
is none of these: kvstrata ignores it, so it takes any text.)

Such a string is any Unicode text within its length limit (``MAX_ID_CHARS``, checked beside
this) except for the characters that end or reorder a line where it is shown (``UNPRINTABLE``):

- category Cc, the C0 and C1 controls and DEL (``\\n``, ``\\r``, ``\\t``, NUL, ESC, which starts
  a terminal's escape sequences, NEL U+0085);
- categories Zl and Zp, U+2028 and U+2029 (line and paragraph separators);
- category Cs, lone surrogates (not text: no UTF-8 encodes them);
- the bidirectional formatting controls of category Cf (U+061C, U+200E, U+200F, U+202A to
  U+202E, U+2066 to U+2069), which reorder the text shown after them (CVE-2021-42574).

The rest of category Cf is taken: the zero-width joiners of emoji and of Indic and Persian
names (U+200C, U+200D), the soft hyphen, a byte order mark; so is every printable character,
space included. An id is matched as the client sent it; nothing is normalized.

Regression (s40 security hunt): only the length of these strings was checked, so a tenant's
``request_id`` of ``"r1\\n... tenant=bob ..."`` or one holding ESC sequences went into the
nodes' and gateways' logs and every reply and error naming it (log injection, CWE-117: lines
forged about another tenant; an escape sequence reaching an operator's terminal through
a worker's log file or stderr). The logs escape such characters too (``cache_node.log_records``), whatever
text reaches them.
"""

from __future__ import annotations

import re

UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff"
                         "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""The characters no client-named string may hold (the module's rule). Categories Cc, Zl, Zp and
Cs are closed sets: Unicode assigns them no new characters."""


def refusal(value: str) -> str | None:
    """Why ``value`` cannot be a client-named string ("holds U+000A, a control or line break
    character, at index 3 ..."), or None when it can. The first such character is named."""
    found = UNPRINTABLE.search(value)
    if found is None:
        return None
    return (f"holds U+{ord(found.group()):04X}, a control, line break or bidirectional formatting character, at "
            f"index {found.start()}; ids, salts and keys must be printable text")


def check(field: str, value: str) -> None:
    """Raise ``ValueError("<field>: holds U+...")`` when ``value`` breaks the module's rule."""
    why = refusal(value)
    if why is not None:
        raise ValueError(f"{field}: {why}")
