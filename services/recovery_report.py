"""A restarted global scheduler's reports, checked field by field before anything is applied
(``services.global_scheduler_recovery``): a cache node's ``recovery_report`` and a spill
node's ``held_blocks`` are untrusted input. Each check raises ``BadReport`` (the holder is then
treated as not answering).
"""

from __future__ import annotations

from typing import Any

from services.data_plane_wire import MAX_ID_CHARS

MAX_REPORTED_BLOCKS = 1 << 22
"""Block hashes one holder may report (a larger report is refused whole)."""

MAX_HASH_BYTES = 64
"""Longest block hash a report may carry (the nodes' hashes are 32 bytes)."""

MAX_ADDRESS_CHARS = 256
"""Longest data-plane address (``tcp://host:port``) a report may carry."""

MAX_SCOPED_ID_CHARS = 2 * MAX_ID_CHARS + 64
"""Longest request or session id a report may carry: ``<tenant>/<client id>[#<attempt>]``."""


class BadReport(ValueError):
    """A recovery report that fails a check (its holder is then treated as not answering)."""


def int_field(report: dict[str, Any], key: str, default: int) -> int:
    """``report[key]`` (``default`` when absent), an int in [0, 2**62)."""
    value = report.get(key, default)
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise BadReport(f"{key} must be a non-negative int, got {value!r:.100}")
    return value


def address(value: Any, key: str) -> str:
    """``value``, a ``tcp://`` address (``key`` names it in the error)."""
    if not isinstance(value, str) or not value.startswith("tcp://") or len(value) > MAX_ADDRESS_CHARS:
        raise BadReport(f"{key} must be a tcp:// address of at most {MAX_ADDRESS_CHARS} characters")
    return value


def block_events(value: Any, tiers: tuple[str, ...]) -> list[tuple[str, bytes, str]]:
    """``("stored", hash, tier)`` events of a report's ``(hash, tier)`` pairs."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REPORTED_BLOCKS:
        raise BadReport(f"blocks must be a list of at most {MAX_REPORTED_BLOCKS} (hash, tier) pairs")
    events = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or type(item[0]) is not bytes
                or not 0 < len(item[0]) <= MAX_HASH_BYTES or item[1] not in tiers):
            raise BadReport(f"a block is (hash of at most {MAX_HASH_BYTES} bytes, one of {list(tiers)})")
        events.append(("stored", item[0], item[1]))
    return events


def rows(value: Any, width: int, key: str, check: Any) -> list[tuple[Any, ...]]:
    """Each row of the list ``value`` (``width`` fields) passed through ``check(*row)``."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REPORTED_BLOCKS:
        raise BadReport(f"{key} must be a list")
    rows = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != width:
            raise BadReport(f"each of {key} has {width} fields")
        rows.append(check(*item))
    return rows


def _scoped(value: Any, tenant_id: str, key: str) -> str:
    """A request or session id of ``tenant_id`` (``gateway_inputs.scoped_id``)."""
    if (not isinstance(value, str) or len(value) > MAX_SCOPED_ID_CHARS
            or not value.startswith(f"{tenant_id}/") or len(value) == len(tenant_id) + 1):
        raise BadReport(f"{key} must be an id of its tenant ('<tenant>/<id>', at most {MAX_SCOPED_ID_CHARS} characters)")
    return value


def _tenant(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or "/" in value:
        raise BadReport("a tenant id must be a non-empty string without '/'")
    return value


def session_row(session_id: Any, tenant_id: Any, kept: Any) -> tuple[str, str, bool]:
    """A ``sessions`` row: ``(session id of the tenant, tenant id, kept)``."""
    tenant = _tenant(tenant_id)
    if type(kept) is not bool:
        raise BadReport("a session's kept flag must be a bool")
    return _scoped(session_id, tenant, "session_id"), tenant, kept


def request_row(request_id: Any, tenant_id: Any, session_id: Any, subscriber: Any) -> tuple[str, str, str, str]:
    """A ``requests`` row: ``(request id, tenant id, session id or "", gateway inbox)``."""
    tenant = _tenant(tenant_id)
    session = _scoped(session_id, tenant, "session_id") if session_id != "" else ""
    return _scoped(request_id, tenant, "request_id"), tenant, session, address(subscriber, "subscriber")
