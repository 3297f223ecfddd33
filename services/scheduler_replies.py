"""The gateway's checks of the global scheduler's Ray replies, taken as untrusted: a reply
of another shape than the method's (a version skew between the gateway and the scheduler, a
bug) is ``MalformedReply``, which ``answer`` turns into INTERNAL for that call alone (logged,
its message naming the method), never UNKNOWN from a ``KeyError`` or a protobuf range error
deep in a handler, nor a wrong answer (a truthy non-bool taken for "the admin key").

What is checked elsewhere: admissions (``data_plane_replies.admission_reply``), the key
directory (``key_ids.py``), ``knows_tenant`` (``gateway_key_watch``: only ``False`` counts).

Regression (s38): every other reply was used as it came: ``Stats`` read ``sched["queued"]``
(a missing key, a count past ``StatsResponse``'s uint32: UNKNOWN), ``CloseSession`` unpacked
``close_session``'s reply (a wrong shape: UNKNOWN after the scheduler had dropped the
session), tenant records were converted as they came (UNKNOWN), and ``verify_admin_key``'s
reply was taken by its truth (any non-empty string passed a key as the admin key).

Regression (s39): ``open_data_plane``'s reply at a gateway's start was used as it came: a
``None`` or a number failed deep in ``NodeStreams`` (TypeError from ZeroMQ's ``connect``), and
bytes or a ``tcp://`` string with no host or a port out of range was connected to, the gateway
serving with an admission socket that never answers. Now the start fails naming the reply (``data_address``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from services import convert
from services.recovery_report import MAX_ADDRESS_CHARS
from tenants.model import Tenant
from tenants.usage import TenantUsage

log = logging.getLogger(__name__)

MAX_UINT32 = (1 << 32) - 1
"""Largest count a reply field of ``uint32`` holds (``StatsResponse.queued``, ``.sessions``)."""


class MalformedReply(Exception):
    """The scheduler's reply to ``method`` is not of the method's shape (``why``)."""

    def __init__(self, method: str, why: str) -> None:
        super().__init__(f"the global scheduler sent a malformed {method} reply ({why})")
        self.method = method


async def answer(context: grpc.aio.ServicerContext, method: str, reply: Any, check: Any) -> Any:
    """``check(method, reply)`` (one of this module's checks); a ``MalformedReply`` aborts the
    call INTERNAL with its message, logged (``abort_malformed``)."""
    try:
        return check(method, reply)
    except MalformedReply as exc:
        await abort_malformed(context, exc)


async def abort_malformed(context: grpc.aio.ServicerContext, exc: MalformedReply) -> NoReturn:
    """Log ``exc`` and abort the call INTERNAL with its message (the server's fault)."""
    log.warning("gateway: %s", exc)
    await context.abort(grpc.StatusCode.INTERNAL, str(exc))
    raise AssertionError("context.abort returned")  # (it raises)


def _is_count(n: Any) -> bool:
    return type(n) is int and 0 <= n <= MAX_UINT32


def stats(method: str, reply: Any) -> dict[str, Any]:
    """``stats``: a map with ``queued`` and ``sessions`` counts (ints in [0, ``MAX_UINT32``])
    that JSON holds (it goes out in ``stats_json``)."""
    if not isinstance(reply, dict):
        raise MalformedReply(method, f"a {type(reply).__name__}, not a map")
    for name in ("queued", "sessions"):
        if not _is_count(reply.get(name)):
            raise MalformedReply(method, f"{name} {reply.get(name)!r:.40} is not a count in [0, {MAX_UINT32}]")
    try:
        json.dumps(reply)
    except (TypeError, ValueError) as exc:
        raise MalformedReply(method, f"not JSON: {exc}") from exc
    return reply


def closing(method: str, reply: Any) -> tuple[str, list[str]] | None:
    """``close_session``: None (no such session), or ``(node_id, turns)``: the node's id ("" for
    none to ask) and the ids of the session's turns still in flight, all strings."""
    if reply is None:
        return None
    if not isinstance(reply, (tuple, list)) or len(reply) != 2:
        raise MalformedReply(method, f"{reply!r:.60} is neither None nor (node_id, turns)")
    node_id, turns = reply
    if not isinstance(node_id, str) and node_id is not None:
        raise MalformedReply(method, f"node id {node_id!r:.40} is not a string")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise MalformedReply(method, f"turns {turns!r:.60} are not a list of request ids")
    return node_id or "", turns


def tenant(method: str, reply: Any) -> Tenant:
    """A tenant record (``get_tenant``, ``update_tenant``, ...): a ``Tenant`` whose id is a
    non-empty string and that the wire's ``Tenant`` holds (``convert.tenant_to_pb``)."""
    if not isinstance(reply, Tenant) or not isinstance(getattr(reply, "tenant_id", None), str) or not reply.tenant_id:
        raise MalformedReply(method, f"{reply!r:.60} is not a tenant record")
    return _wire_holds(method, reply, convert.tenant_to_pb, "a tenant record")


def tenants(method: str, reply: Any) -> list[Tenant]:
    """``list_tenants``: a tuple (or list) of tenant records (``tenant``)."""
    if not isinstance(reply, (tuple, list)):
        raise MalformedReply(method, f"a {type(reply).__name__}, not a tuple of tenant records")
    return [tenant(method, t) for t in reply]


def registered(method: str, reply: Any) -> tuple[Tenant, str]:
    """``register_tenant``: ``(tenant record, its API key)``."""
    if not isinstance(reply, (tuple, list)) or len(reply) != 2:
        raise MalformedReply(method, f"{reply!r:.60} is not (tenant, api_key)")
    return tenant(method, reply[0]), text(method, reply[1])


def text(method: str, reply: Any) -> str:
    """A non-empty string: an API key (``rotate_*_key``), a tenant id (``delete_tenant``)."""
    if not isinstance(reply, str) or not reply:
        raise MalformedReply(method, f"{type(reply).__name__} {reply!r:.20} is not a non-empty string")
    return reply


def usage(method: str, reply: Any) -> TenantUsage:
    """``usage_of``: a ``TenantUsage`` that the wire's ``Usage`` holds."""
    if not isinstance(reply, TenantUsage):
        raise MalformedReply(method, f"a {type(reply).__name__}, not a tenant's usage")
    return _wire_holds(method, reply, convert.usage_to_pb, "a usage")


def _wire_holds(method: str, reply: Any, to_pb: Callable[[Any], Any], what: str) -> Any:
    """``reply`` when ``to_pb`` (its ``convert`` function) turns it into the wire's message;
    MalformedReply naming ``what`` when the conversion raises."""
    try:
        to_pb(reply)
    except (TypeError, ValueError, AttributeError) as exc:
        raise MalformedReply(method, f"{what} the wire cannot hold: {exc}") from exc
    return reply


def verdict(method: str, reply: Any) -> bool:
    """A yes or no (``verify_admin_key``): a bool, never a value's truth."""
    if type(reply) is not bool:
        raise MalformedReply(method, f"a {type(reply).__name__}, not a bool")
    return reply


def tenant_or_none(method: str, reply: Any) -> Tenant | None:
    """``authenticate``: the key's tenant record (``tenant``), None for no tenant's key."""
    return None if reply is None else tenant(method, reply)


def addresses(method: str, reply: Any, names: tuple[str, ...]) -> dict[str, str]:
    """``gateway_addresses``: ``names`` -> ``host:port`` (an int port) or "" (not served)."""
    if not isinstance(reply, dict):
        raise MalformedReply(method, f"a {type(reply).__name__}, not a map")
    for name in names:
        value = reply.get(name)
        host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        if not isinstance(value, str) or value and not (host and port.isdigit() and int(port) < 65536):
            raise MalformedReply(method, f"{name} {value!r:.60} is neither host:port nor empty")
    return {name: reply[name] for name in names}


def data_address(method: str, reply: Any) -> str:
    """``open_data_plane``: the admission socket's ``tcp://host:port`` (a port in [1, 65535]),
    at most ``MAX_ADDRESS_CHARS`` characters."""
    if not isinstance(reply, str) or len(reply) > MAX_ADDRESS_CHARS or not reply.startswith("tcp://"):
        raise MalformedReply(method, f"{reply!r:.60} is not a tcp:// address of at most {MAX_ADDRESS_CHARS} characters")
    host, _, port = reply[len("tcp://"):].rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise MalformedReply(method, f"{reply!r:.60} is not tcp://host:port")
    return reply
