"""Session ids as the gateway scopes them (``services.gateway_inputs.session_scope``):
``<tenant>/<id>`` without a ``cache_salt``, ``<tenant>:<salt tag>/<id>`` with one.

Plain string functions, apart from ``cache_node.sessions`` (which imports torch through the
KV cache manager) so that the global scheduler, which reads these ids in node reports
(``services.recovery_report``), and the gateway import no torch for them.
"""

from __future__ import annotations

SALT_TAG_CHARS = 32
"""Hex digits of a salted session's tag (``services.gateway_inputs.session_scope``)."""

SALTED_MARK = ":"
"""What follows the tenant id in a salted session's id, ``<tenant>:<tag>/<id>``, where an
unsalted one's has ``/`` (``services.gateway_inputs.session_scope``)."""


def session_scope_chars(session_id: str, tenant: str) -> int:
    """How many leading characters of ``session_id`` are the scope the gateway adds to a client's
    session id (``services.gateway_inputs.session_scope``): ``<tenant>/`` (no ``cache_salt``,
    the form of every session id before salts scoped them) or ``<tenant>:<tag>/`` (a salt's
    ``SALT_TAG_CHARS`` lowercase hex digits); 0 when it has neither, or when nothing follows."""
    if not tenant:
        return 0
    scope = len(tenant) + 1
    if session_id.startswith(f"{tenant}/"):
        return scope if len(session_id) > scope else 0
    if session_id.startswith(f"{tenant}{SALTED_MARK}"):
        tag = session_id[scope:scope + SALT_TAG_CHARS]
        end = scope + SALT_TAG_CHARS + 1
        if (len(tag) == SALT_TAG_CHARS and all(c in "0123456789abcdef" for c in tag)
                and session_id[end - 1:end] == "/" and len(session_id) > end):
            return end
    return 0


def client_session_id(session_id: str, tenant: str) -> str:
    """``session_id`` as its client named it: without the ``<tenant>/`` (no ``cache_salt``) or
    ``<tenant>:<salt tag>/`` scope the gateway adds (``session_scope_chars``); unchanged when it
    has neither."""
    return session_id[session_scope_chars(session_id, tenant):]
