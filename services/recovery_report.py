"""A restarted global scheduler's reports, checked field by field before anything is applied
(``services.global_scheduler_recovery``): a cache node's ``recovery_report`` and a spill
node's ``held_blocks`` are untrusted input. Each check raises ``BadReport`` (the holder is then
treated as not answering). The block checks (``check_block``) serve the live path too: every
batch of block events a holder reports (``block_changes``, ``GlobalScheduler.report_events``).
"""

from __future__ import annotations

from typing import Any

from cache_node.session_ids import session_scope_chars
from services.block_index import EVENTS, TIER_DEVICE
from services.data_plane_wire import MAX_ID_CHARS

MAX_REPORTED_BLOCKS = 1 << 22
"""Block hashes one holder may report (a larger report is refused whole), and block events one
live batch may carry."""

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


def check_block(block_hash: Any, tier: Any, tiers: tuple[str, ...]) -> tuple[bytes, str]:
    """``(block_hash, tier)``: a hash of 1 to ``MAX_HASH_BYTES`` bytes, in one of ``tiers`` (the
    holder's own: ``block_index.NODE_TIERS`` for a cache node, ``SPILL_TIERS`` for a spill node)."""
    if type(block_hash) is not bytes or not 0 < len(block_hash) <= MAX_HASH_BYTES or tier not in tiers:
        raise BadReport(f"a block is (hash of at most {MAX_HASH_BYTES} bytes, one of {list(tiers)})")
    return block_hash, tier


def block_events(value: Any, tiers: tuple[str, ...]) -> list[tuple[str, bytes, str]]:
    """``("stored", hash, tier)`` events of a report's ``(hash, tier)`` pairs."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REPORTED_BLOCKS:
        raise BadReport(f"blocks must be a list of at most {MAX_REPORTED_BLOCKS} (hash, tier) pairs")
    events = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadReport(f"a block is (hash of at most {MAX_HASH_BYTES} bytes, one of {list(tiers)})")
        events.append(("stored", *check_block(item[0], item[1], tiers)))
    return events


def block_changes(value: Any, tiers: tuple[str, ...]) -> list[tuple[str, bytes, str]]:
    """A live batch of a holder's block events: ``(event, hash, tier)`` items, ``event`` one of
    ``block_index.EVENTS``, a block as ``check_block`` takes it; ``(event, hash)`` is tier
    "device". At most ``MAX_REPORTED_BLOCKS`` items."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_REPORTED_BLOCKS:
        raise BadReport(f"events must be a list of at most {MAX_REPORTED_BLOCKS} (event, hash, tier) items")
    events = []
    for item in value:
        if not isinstance(item, (list, tuple)) or len(item) not in (2, 3) or type(item[0]) is not str or (
                item[0] not in EVENTS):
            raise BadReport(f"an event is (one of {list(EVENTS)}, block hash[, tier])")
        events.append((item[0], *check_block(item[1], item[2] if len(item) == 3 else TIER_DEVICE, tiers)))
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
    """A request id of ``tenant_id`` (``gateway_inputs.scoped_id``: ``<tenant>/<id>``), or a
    session id of it (``gateway_inputs.session_scope``: that, or a salted ``<tenant>:<tag>/<id>``;
    ``key`` "session_id")."""
    if isinstance(value, str) and len(value) <= MAX_SCOPED_ID_CHARS:
        if key == "session_id":
            if session_scope_chars(value, tenant_id):
                return value
        elif value.startswith(f"{tenant_id}/") and len(value) > len(tenant_id) + 1:
            return value
    forms = "'<tenant>/<id>' or '<tenant>:<salt tag>/<id>'" if key == "session_id" else "'<tenant>/<id>'"
    raise BadReport(f"{key} must be an id of its tenant ({forms}, at most {MAX_SCOPED_ID_CHARS} characters)")


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
