"""A key rotation's reply that comes malformed, after the scheduler may have rotated already.

The scheduler commits a rotation before it replies (``GlobalScheduler.rotate_tenant_key``,
``rotate_admin_key``), and the store keeps only hashes of keys, so a malformed reply
(``scheduler_replies.text`` refuses it) cannot be undone, nor its new key read again. What the
gateway can still do is say which of the two happened and how to get a key back: it asks the
scheduler whether the presented key's id still exists (``key_ids_exist``, an indexed read;
no key check counted) and aborts the call INTERNAL with

- *rotated*: the key presented no longer works and the new one was not received, then the
  exact recovery (a tenant's key: the admin runs ``kvstrata tenant rotate-key NAME``; the admin
  key: ``kvstrata admin rotate-key --local`` where ``kvstrata up`` ran, which needs no key);
- *not rotated*: the key presented still works, the call may be retried;
- *unknown* (that read failed or was malformed too): both, the key presented tried first.

The admin's rotation of a tenant's key is retried by the admin itself (its admin key is
untouched). Regression (s39): the call ended INTERNAL "malformed rotate_tenant_key reply" alone,
with the old key already gone: the tenant (or the admin) was locked out with no word of it.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

import grpc

from services import scheduler_replies as replies
from tenants.keys import parse_key_id

log = logging.getLogger(__name__)

TENANT_RECOVERY = "the admin gives {name} a new key with `kvstrata tenant rotate-key {name}`"
ADMIN_RECOVERY = ("recover it with `kvstrata admin rotate-key --local` where `kvstrata up` ran (no key needed: it "
                  "writes a new admin key to the state dir's admin_key file)")


async def new_key(context: grpc.aio.ServicerContext, scheduler: Any, method: str, reply: Any,
                  presented: str | None, recovery: str) -> str:
    """``reply``, the new key (``scheduler_replies.text``); a malformed one aborts the call
    INTERNAL saying whether the key ``presented`` (None: the admin rotated another's key) was
    rotated away, and ``recovery`` (the command that gets a key back) when it was or may be."""
    try:
        return replies.text(method, reply)
    except replies.MalformedReply as exc:
        await _abort_lost(context, exc, await _presented_gone(scheduler, presented), presented is None, recovery)


async def _presented_gone(scheduler: Any, presented: str | None) -> bool | None:
    """Whether ``presented``'s key id is gone from the store now (True), still there (False);
    None when unknown (none presented, the read failed, or its reply is not a tuple of ids)."""
    key_id = parse_key_id(presented) if presented is not None else None
    if key_id is None:
        return None
    try:
        found = await scheduler.key_ids_exist.remote(key_ids=[key_id])
    except Exception as exc:  # noqa: BLE001 - any failure: unknown, said so
        log.warning("gateway: after a malformed rotation reply, checking the presented key failed: %s", exc)
        return None
    if not isinstance(found, (tuple, list)) or not all(type(k) is str for k in found):
        return None
    return key_id not in found


async def _abort_lost(context: grpc.aio.ServicerContext, exc: replies.MalformedReply, gone: bool | None,
                      by_admin: bool, recovery: str) -> NoReturn:
    if by_admin:
        outcome = ("the tenant's earlier keys may be gone; rotate it again for a key you receive "
                   f"({recovery})")
    elif gone:
        outcome = f"the key was rotated: the key presented no longer works and the new one was not received; {recovery}"
    elif gone is False:
        outcome = "nothing was rotated: the key presented still works; retry"
    else:
        outcome = f"whether the key was rotated is unknown: try the key presented; if it is refused, {recovery}"
    message = f"{exc}; {outcome}"
    log.error("gateway: %s", message)
    await context.abort(grpc.StatusCode.INTERNAL, message)
    raise AssertionError("context.abort returned")  # (it raises)
