"""gRPC servicers for operators: ``TenantServicer`` (tenants, their keys and usage) and
``AdminServicer`` (stats, flush, drain, the admin key).

Each servicer authenticates, converts (services.convert), delegates to the GlobalScheduler or
a CacheNode actor through Ray, and maps failures to precise status codes for that call alone.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import grpc

from kvstrata.v1 import admin_pb2, admin_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services import convert, rotation_replies
from services import scheduler_replies as replies
from services.auth import Authenticator, bearer_key
from services.gateway_key_watch import KEY_CHECK_S, KEY_STALENESS_MAX_S
from services.key_ids import APPLIED, UNREACHABLE
from services.loop_lag import running_lag, wait_past_stall
from services.metrics.requests import GatewayMetrics
from services.store_failures import abort_store_failure
from services.tenant_call_slots import TenantCallSlots
from tenants.errors import (
    NotOwnTenantError,
    StaleKeyError,
    TenantExistsError,
    TenantNotFoundError,
    TooManyRotationsError,
)
from tenants.keys import parse_key_id
from tenants.model import Tenant

log = logging.getLogger(__name__)


def error_message(exc: BaseException) -> str:
    """The error's own message: an exception raised inside an actor reaches the gateway as
    Ray's task error (``cause`` holds the original), whose ``str`` is a whole remote traceback."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


async def _call(context: grpc.aio.ServicerContext, ref: Any, stale: Any = None, check: Any = None,
                method: str = "") -> Any:
    """Await an actor call, mapping tenant errors and bad input to statuses. ``stale``: called
    (no arguments) before the call is aborted UNAUTHENTICATED because the scheduler found the
    caller's key no longer valid (``StaleKeyError``), to forget it here. ``check``: one of
    ``services.scheduler_replies``' checks of the scheduler's reply to ``method`` (a malformed
    one: INTERNAL, logged). The store's own failure (``sqlite3.Error``) gets the status, advice
    and ``retry-after-ms`` of ``store_failure``, logged: the store's transaction was rolled back.

    Regression (s40 diskfull): it reached gRPC uncaught, failing the call UNKNOWN with the
    exception's class and a whole remote traceback."""
    try:
        reply = await ref
    except StaleKeyError as exc:
        if stale is not None:
            stale()
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, error_message(exc))
    except NotOwnTenantError as exc:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, error_message(exc))
    except TooManyRotationsError as exc:
        cause = getattr(exc, "cause", None)
        retry_after_ms = (cause if isinstance(cause, TooManyRotationsError) else exc).retry_after_ms
        context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, error_message(exc))
    except TenantExistsError as exc:
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, error_message(exc))
    except TenantNotFoundError as exc:
        await context.abort(grpc.StatusCode.NOT_FOUND, error_message(exc))
    except ValueError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error_message(exc))
    except sqlite3.Error as exc:
        await abort_store_failure(context, method or "admin call", exc, f" ({error_message(exc)})")
    return reply if check is None else await replies.answer(context, method, reply, check)


async def ask_live(nodes: dict[str, Any], monitor: Any, call: Any, timeout_s: float) -> dict[str, Any]:
    """node id -> ``call(node)`` awaited, for every node the ``monitor`` knows healthy (every
    node without one); an exception in place of the answer of a node that failed or did not
    answer within ``timeout_s`` (``asyncio.TimeoutError``; ``timeout_s`` once more when this
    gateway's own event loop stalled meanwhile: ``services.loop_lag``. Regression (helper 29h):
    a gateway paused past it reported Flush and Drain incomplete, naming nodes that answered)."""
    live = {nid: n for nid, n in nodes.items() if monitor is None or monitor.state[nid].healthy}
    lag = running_lag()

    async def ask(node: Any) -> Any:
        return (await wait_past_stall(asyncio.ensure_future(call(node)), timeout_s, lag, timeout_s))[0]

    answers = await asyncio.gather(*(ask(n) for n in live.values()), return_exceptions=True)
    return dict(zip(live, answers))


async def fresh_admin(auth: Authenticator, context: Any) -> None:
    """``auth.admin``, then confirmed at the scheduler past the gateway's key cache
    (``Authenticator.recheck``): for the calls that change state or read tenants, which an
    admin key rotated away through another gateway must not make in the seconds this
    gateway's cache would still accept it."""
    await auth.admin(context)
    await auth.recheck(context, None)


def _one_tenant_call(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A TenantService handler whose tenant callers hold one of their slots while it runs
    (``TenantServicer.slots``); the caller is found from this gateway's key cache, so a call
    refused for want of a slot costs the scheduler nothing."""
    @functools.wraps(handler)
    async def bounded(self: TenantServicer, request: Any, context: Any) -> Any:
        caller = await self.auth.admin_or_tenant(context)
        if caller is None:
            return await handler(self, request, context)
        async with self.slots.hold(context, caller.tenant_id):
            return await handler(self, request, context)
    return bounded


class TenantServicer(tenant_pb2_grpc.TenantServiceServicer):
    """Tenants, their keys and usage. ``nodes`` and ``monitor`` (as ``AdminServicer``'s): the
    cache nodes ``GetUsage`` asks for the blocks a tenant holds now. ``metrics``: the gateway's
    request metrics, whose series of a deleted tenant ``DeleteTenant`` removes (None: none).

    Every call's key is confirmed at the scheduler, past this gateway's 10-s key cache
    (``fresh_admin``, ``_own_or_admin``): with several gateways (``attach_gateway``) a key
    deleted or rotated away through one is still cached at the others for up to that long. A
    tenant's own calls are matched to it by tenant id, never by name, and pass that id (its key,
    for a rotation) to the scheduler, which checks it again where it acts."""

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any] | None = None,
                 monitor: Any = None, node_timeout_s: float = 30.0, metrics: GatewayMetrics | None = None) -> None:
        self.scheduler, self.auth, self.metrics = scheduler, auth, metrics
        self.nodes, self.monitor, self.node_timeout_s = nodes or {}, monitor, node_timeout_s
        self.slots = TenantCallSlots()  # a tenant's own calls in flight here (the admin's uncounted)

    async def _spec(self, msg: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            spec = convert.tenant_spec_from_pb(msg)
            for policy in (spec.policy, *spec.allowed_policies):  # a name alone is a spec too
                convert.check_policy_spec(policy)
            return spec
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def RegisterTenant(self, request, context):
        await fresh_admin(self.auth, context)
        spec = await self._spec(request.spec, context)
        tenant, key = await _call(context, self.scheduler.register_tenant.remote(spec=spec), check=replies.registered,
                                  method="register_tenant")
        return tenant_pb2.RegisterTenantResponse(tenant=convert.tenant_to_pb(tenant), api_key=key)

    async def UpdateTenant(self, request, context):
        """Replace tenant ``name``'s spec; ``spec.name`` may be left empty (it is ``name``).
        An unknown tenant is NOT_FOUND, a differing ``spec.name`` INVALID_ARGUMENT (no renames)."""
        await fresh_admin(self.auth, context)
        wire = request.spec
        if not wire.name:  # regression: an unknown tenant got INVALID_ARGUMENT ("name is empty")
            wire = tenant_pb2.TenantSpec()
            wire.CopyFrom(request.spec)
            wire.name = request.name
        spec = await self._spec(wire, context)
        tenant = await _call(context, self.scheduler.update_tenant.remote(name=request.name, spec=spec), check=replies.tenant,
                             method="update_tenant")
        self.auth.forget_tenant(request.name)
        return tenant_pb2.UpdateTenantResponse(tenant=convert.tenant_to_pb(tenant))

    async def DeleteTenant(self, request, context):
        """Delete tenant ``name``: its rows and keys (the scheduler), its cached keys and its
        metric series here (``GatewayMetrics.forget_tenant``, told its id so that a request of
        it still in flight exports none again). Regression (security review 23d, F): the
        deleted tenant's series stayed in ``/metrics`` until the gateway restarted.

        The id forgotten is the one the delete returns. Regression (session 32 list): it was
        looked up before the delete, so a tenant deleted and registered again under ``name`` in
        between (another admin call) had the new tenant deleted and the old one's id forgotten:
        the new tenant's series stayed exported."""
        await fresh_admin(self.auth, context)
        tenant_id = await _call(context, self.scheduler.delete_tenant.remote(name=request.name), check=replies.text,
                                method="delete_tenant")
        self.auth.forget_tenant(request.name, keys_gone=True)
        if self.metrics is not None:
            self.metrics.forget_tenant(request.name, tenant_id)
        return tenant_pb2.DeleteTenantResponse()

    async def _own_or_admin(self, context: Any, name: str) -> Tenant | None:
        """None for the admin key; for a key of the tenant called ``name``, that tenant as the
        store holds it now. Both confirmed at the scheduler past this gateway's key cache
        (``Authenticator.recheck``: UNAUTHENTICATED for a key rotated away or of a deleted
        tenant, through any gateway). PERMISSION_DENIED for another tenant's key,
        UNAUTHENTICATED (or RESOURCE_EXHAUSTED: ``Authenticator``) for no valid key.

        The caller's tenant id is what the handlers then pass to the scheduler (and compare):
        a tenant deleted since and registered again under ``name`` is another tenant."""
        caller = await self.auth.admin_or_tenant(context)
        caller = await self.auth.recheck(context, caller)
        if caller is not None and caller.spec.name != name:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "a tenant key reaches only its own tenant")
        return caller

    async def _tenant_of(self, context: Any, name: str, caller: Tenant | None) -> Tenant:
        """Tenant ``name``: for the admin (``caller`` None) whichever it is (NOT_FOUND for
        none); for a tenant's own call, only while ``name`` is still ``caller``'s tenant id
        (else UNAUTHENTICATED: the caller's tenant was deleted meanwhile, and its key goes from
        this gateway's cache)."""
        if caller is None:
            return await _call(context, self.scheduler.get_tenant.remote(name=name), check=replies.tenant,
                               method="get_tenant")
        return await _call(context, self.scheduler.get_tenant.remote(name=name, tenant_id=caller.tenant_id),
                           stale=lambda: self.auth.forget_tenant_id(caller.tenant_id), check=replies.tenant,
                           method="get_tenant")

    @_one_tenant_call
    async def GetTenant(self, request, context):
        """The admin key reads any tenant; a tenant's own key reads only its own (by its id:
        ``_own_or_admin``, ``_tenant_of``)."""
        caller = await self._own_or_admin(context, request.name)
        tenant = await self._tenant_of(context, request.name, caller)
        return tenant_pb2.GetTenantResponse(tenant=convert.tenant_to_pb(tenant))

    async def ListTenants(self, request, context):
        """Every tenant, for the admin key. Regression (s41 diff review r1 of fd7d785): the
        scheduler's call was awaited outside ``_call``, so a store failure (a corrupt tenants
        table, the store locked after the key check) failed it UNKNOWN "Unexpected <class
        'sqlite3.DatabaseError'>" (through Ray: with its remote traceback), not per
        ``services.store_failures``."""
        await fresh_admin(self.auth, context)
        tenants = await _call(context, self.scheduler.list_tenants.remote(), check=replies.tenants,
                              method="list_tenants")
        return tenant_pb2.ListTenantsResponse(tenants=[convert.tenant_to_pb(t) for t in tenants])

    @_one_tenant_call
    async def GetUsage(self, request, context):
        """The admin key reads any tenant's usage; a tenant's own key reads only its own (a
        fresh-user trial: a tenant could not see what it had used), by its id (``_tenant_of``:
        a deleted tenant's key never reads the usage of a tenant registered since under its
        name). ``blocks_held`` and ``session_blocks_held`` are summed over the healthy nodes'
        ``tenant_blocks`` (a node that does not answer adds nothing).

        Regression (new-user report): ``blocks_held`` was a ledger gauge nothing ever set, so
        ``kvstrata tenant show`` said 0 blocks held while ``kvstrata status`` counted the
        tenant's idle sessions' blocks.

        Regression (s38): a node's answer was taken as it came (``int(...)`` of each count): a
        negative count took blocks off the others' sum, and a count ``int`` refused (``inf``, a
        string, 5,000 digits) failed the call UNKNOWN; a malformed answer now adds nothing, as a
        node that does not answer (``_blocks_held``)."""
        caller = await self._own_or_admin(context, request.name)
        tenant = await self._tenant_of(context, request.name, caller)
        usage = await _call(context, self.scheduler.usage_of.remote(tenant_id=tenant.tenant_id), check=replies.usage,
                            method="usage_of")
        answers = await ask_live(self.nodes, self.monitor, lambda n: n.tenant_blocks.remote(tenant=tenant.tenant_id),
                                 self.node_timeout_s)
        held = [counts for a in answers.values() if (counts := _blocks_held(a)) is not None]
        requests = sum(r for r, _ in held)
        sessions = sum(s for _, s in held)
        usage = replace(usage, blocks_held=requests + sessions, session_blocks_held=sessions)
        return tenant_pb2.GetUsageResponse(usage=convert.usage_to_pb(usage))

    @_one_tenant_call
    async def RotateKey(self, request, context):
        """The admin key rotates any tenant's key; a tenant's own key rotates only its own: the
        scheduler is given the key itself, checks it again and rotates only while it is still
        one of that tenant's keys (``GlobalScheduler.rotate_tenant_key``: a compare-and-swap
        by tenant id and key id), so a key rotated away or of a deleted tenant, still in some
        gateway's key cache, rotates nothing (UNAUTHENTICATED).

        Regression (secrev16 fault B): it dropped every tenant's cached key at the gateway
        (``Authenticator.forget``), which let a tenant lock another out; it forgets the
        rotated tenant's keys alone (``Authenticator.forget_tenant``).

        Regression (secrev18 A): a tenant's own rotations were not limited, and each new key
        took a place in the gateway's one table of known key ids, so 65,536 of them pushed out
        every other tenant's. A tenant's own key now rotates at most
        ``services.global_scheduler_tenants.OWN_ROTATIONS_PER_WINDOW`` times a minute at the scheduler (past that
        RESOURCE_EXHAUSTED with ``retry-after-ms``), and its rotated-away ids are forgotten here.

        Regression (session 32 review, cross-tenant takeover): the own rotation was checked
        against this gateway's cached key and named the tenant alone; a deleted tenant's key
        cached at a second gateway rotated (took) the key of a new tenant registered under its
        name, and a leaked key its owner had rotated away at one gateway rotated again at
        another.

        A malformed reply (after the rotation) aborts INTERNAL saying whether the key presented
        was rotated away and how the tenant gets a key back (``services.rotation_replies``)."""
        caller = await self._own_or_admin(context, request.name)
        key = bearer_key(context) if caller is not None else None
        stale = (lambda: self.auth.forget_key(key)) if key is not None else None
        reply = await _call(context, self.scheduler.rotate_tenant_key.remote(name=request.name, api_key=key), stale)
        try:  # a malformed reply came after the rotation: it says whether, and how to recover
            new_key = await rotation_replies.new_key(context, self.scheduler, "rotate_tenant_key", reply, key,
                                                     rotation_replies.TENANT_RECOVERY.format(name=request.name))
        finally:
            self.auth.forget_tenant(request.name, keys_gone=True)
        return tenant_pb2.RotateKeyResponse(api_key=new_key)


MAX_NODE_COUNT = (1 << 32) - 1
"""Largest count (blocks, requests) a cache node's answer may give: the replies' ``uint32``
fields (``FlushResponse``, ``DrainResponse``); past it the answer is malformed. Their sums over
the nodes are capped at it (``_capped``)."""


def _capped(total: int) -> int:
    """A sum of node counts as a ``uint32`` reply field holds it (at most ``MAX_NODE_COUNT``)."""
    return min(total, MAX_NODE_COUNT)


def _is_count(n: Any) -> bool:
    """Whether a node's ``n`` is a count: an int (not a bool) in ``[0, MAX_NODE_COUNT]``."""
    return type(n) is int and 0 <= n <= MAX_NODE_COUNT


def _blocks_held(answer: Any) -> tuple[int, int] | None:
    """A cache node's ``tenant_blocks`` answer as ``(requests, idle_sessions)`` (0 where not
    given); None for an answer that is not a map of such counts (``_is_count``: the answer is
    untrusted)."""
    if not isinstance(answer, dict):
        return None
    requests, sessions = answer.get("requests", 0), answer.get("idle_sessions", 0)
    return (requests, sessions) if _is_count(requests) and _is_count(sessions) else None


def node_stats_entry(node_id: str, answer: Any, failure: str) -> tuple[dict[str, Any], admin_pb2.NodeStats]:
    """A cache node's ``stats`` answer as ``Stats`` reports it: the answer and its
    ``NodeStats`` when it is a map naming ``node_id`` that converts (``convert.node_stats_to_pb``)
    and is JSON; else the node as unhealthy, ``failure`` (no answer) or "sent a malformed
    answer" its failure (the answer is untrusted: one node's must not fail the call, nor name
    another node)."""
    if isinstance(answer, dict) and answer.get("node_id") == node_id:
        try:
            json.dumps(answer)
            return answer, convert.node_stats_to_pb(answer)
        except (TypeError, ValueError, OverflowError):
            failure = "sent a malformed answer"
    elif isinstance(answer, dict):
        failure = "sent a malformed answer"
    entry = {"node_id": node_id, "healthy": False, "failure": failure}
    return entry, convert.node_stats_to_pb(entry)


FLUSH_KINDS = ("device", "prefixes", "host", "spill")
"""The tiers a cache node's ``flush_by_tier`` answer counts freed KV blocks of."""


def _flush_counts(answer: Any) -> dict[str, int] | None:
    """A cache node's ``flush_by_tier`` answer's counts, one per ``FLUSH_KINDS`` (0 where not
    given); None for an answer that is not a map of such counts (non-negative ints: the answer
    is untrusted)."""
    if not isinstance(answer, dict):
        return None
    counts = {kind: answer.get(kind, 0) for kind in FLUSH_KINDS}
    return counts if all(_is_count(n) for n in counts.values()) else None


def _drain_count(answer: Any) -> int | None:
    """A cache node's ``drain`` answer (requests aborted), None when it is not a count."""
    return answer if _is_count(answer) else None


def _not_done(answers: dict[str, Any], read: Any, waited_s: float) -> list[str]:
    """``"<node id> (<why>)"`` of each node of ``ask_live``'s ``answers`` that did not do its
    part, in order: it did not answer within ``waited_s`` (alive, maybe stopped or stuck), its
    call failed (it died or restarted between the monitor's check and the call, its step loop
    failed, ...), or its answer is not one ``read`` reads (None). What such a node holds or runs
    may still be there. Regression (session 30): a node whose call failed with an error rather
    than a timeout counted as 0 and was not named, and Flush/Drain answered OK."""
    out = []
    for nid, answer in answers.items():
        if isinstance(answer, asyncio.TimeoutError):
            why = f"did not answer within {waited_s:g} s"
        elif isinstance(answer, BaseException):
            why = f"failed: {_line(error_message(answer), 200) or type(answer).__name__}"
        elif read(answer) is None:
            why = "sent a malformed answer"
        else:
            continue
        out.append(f"{nid} ({why})")
    return out


def _nodes_text(node_ids: list[str]) -> str:
    shown = ", ".join(node_ids[:8]) + (f" and {len(node_ids) - 8} more" if len(node_ids) > 8 else "")
    return f"cache node{'s' if len(node_ids) > 1 else ''} {shown}"


MAX_SPILL_NAMED = 64
"""Most spill nodes one cache node's flush answer may name as unflushed (the rest are cut)."""


def _line(text: object, limit: int) -> str:
    """``text`` on one line, at most ``limit`` characters (a node's answer is untrusted)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def spill_unflushed(answers: dict[str, Any]) -> dict[str, str]:
    """Spill node name -> why, of every spill node a cache node's ``flush_by_tier`` answer
    names as not flushed (``spill_unflushed``: it may still hold blocks), the first cache node's
    word on each; an answer whose field is not such a map names "the spill tier" as unflushed."""
    out: dict[str, str] = {}
    for nid, answer in answers.items():
        given = answer.get("spill_unflushed") if isinstance(answer, dict) else None
        if not given:
            continue
        if not isinstance(given, dict):
            out.setdefault("the spill tier", f"cache node {nid} sent a malformed answer about it")
            continue
        for name, why in list(given.items())[:MAX_SPILL_NAMED]:
            out.setdefault(_line(name, 100), f"{_line(why, 200)}, asked by cache node {nid}")
    return out


def _spill_text(unflushed: dict[str, str]) -> str:
    names = list(unflushed)
    shown = ", ".join(f"{name} ({unflushed[name]})" for name in names[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    many = len(names) > 1
    return (f"spill node{'s' if many else ''} {shown}{more} did not flush, so the KV blocks "
            f"{'they store' if many else 'it stores'} may still be there")


SPILL_REPLY_MARGIN_S = 5.0
"""How long before the gateway's own deadline on a cache node (``node_timeout_s``) the node's
flush must end its wait on the spill nodes (at most a fifth of that deadline), so that the node
answers naming a silent spill node instead of being timed out itself."""


def spill_timeout_s(node_timeout_s: float) -> float:
    """The time a cache node's flush gets in all (``flush_by_tier``'s ``spill_timeout_s``)."""
    return node_timeout_s - min(SPILL_REPLY_MARGIN_S, node_timeout_s / 5)


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Operator calls. A node the ``monitor`` (``services.node_monitor``) knows down is not
    asked (Stats lists it with ``healthy`` false and why; Flush and Drain skip it), and a node
    that does not answer within ``node_timeout_s`` counts as down for Stats. Flush and Drain
    are not done until every node asked has done its part: one that did not answer in time
    (stopped, or its step loop stuck) fails the call UNAVAILABLE naming it and what the others
    did, on one line (``kvstrata admin`` prints it); run it again once the node answers. So does
    a spill node that did not confirm a cache node's flush of it (silent, or failed): the cache
    node's wait on it ends ``SPILL_REPLY_MARGIN_S`` before the gateway's on the cache node
    (``spill_timeout_s``), and its answer names it (``spill_unflushed``).
    Regression (review 29a F7): Flush and Drain answered OK with zeros when a node did not
    answer, and a spill tier not flushed was reported flushed. Regression (session 30): a spill
    node silent for the spill client's 30 s was 0 blocks dropped and the flush OK, or, racing
    the gateway's own 30 s, the cache node was named as not answering.

    Flush, Drain and RotateAdminKey confirm the admin key at the scheduler past this gateway's
    key cache (``fresh_admin``; RotateAdminKey by the scheduler's compare-and-swap on the key
    presented), so an admin key rotated away through another gateway makes none of them here;
    Stats takes the cached check. A Drain waits (its ``timeout_s``, any length) before it
    aborts, so it also goes on only while its admin key does (``_while_admin``): the key
    rotated away (through any gateway) ends it UNAUTHENTICATED within ``key_check_s`` (plus a
    directory refresh), and a key not confirmed for ``key_staleness_max_s`` (the key
    directory does not answer) ends it UNAVAILABLE; either way its nodes' drains are cancelled
    (``CacheNode.cancel_drain``) and abort nothing. Regression (session 37): a drain started
    with an admin key later rotated away (a leaked one, say) still aborted every running
    request at its end. The other admin calls act at once (Flush within ``node_timeout_s``):
    nothing of theirs waits to be done after their key goes."""

    def __init__(self, scheduler: Any, auth: Authenticator, nodes: dict[str, Any],
                 monitor: Any = None, node_timeout_s: float = 30.0, key_check_s: float = KEY_CHECK_S,
                 key_staleness_max_s: float = KEY_STALENESS_MAX_S) -> None:
        self.scheduler, self.auth, self.nodes = scheduler, auth, nodes
        self.monitor, self.node_timeout_s = monitor, node_timeout_s
        self.key_check_s, self.key_staleness_max_s = key_check_s, key_staleness_max_s

    async def _ask_live(self, call: Any, extra_s: float = 0.0) -> dict[str, Any]:
        """``ask_live`` of this servicer's nodes, within ``node_timeout_s + extra_s``."""
        return await ask_live(self.nodes, self.monitor, call, self.node_timeout_s + extra_s)

    def _held_down(self) -> list[str]:
        """``"<node id>: <why it went down>"`` of each node the monitor holds down, which
        ``ask_live`` does not ask (Flush and Drain report them: trial 29k P1, a flush printed
        "0 KV blocks freed" with the only node held down, its cache still there when it came
        back)."""
        if self.monitor is None:
            return []
        return [f"{nid}: {(state.failure or 'down')[:200]}" for nid in self.nodes
                if not (state := self.monitor.state[nid]).healthy]

    async def Stats(self, request, context):
        await self.auth.admin(context)
        answers = await self._ask_live(
            lambda n: n.integrity_stats.remote() if request.check_integrity else n.stats.remote())
        node_stats, node_pbs = [], []
        for nid in self.nodes:
            answer = answers.get(nid)
            why = ("" if isinstance(answer, dict) else self.monitor.state[nid].failure if answer is None
                   else f"no answer: {error_message(answer)}")
            entry, pb = node_stats_entry(nid, answer, why)
            node_stats.append(entry)
            node_pbs.append(pb)
        sched = await replies.answer(context, "stats", await self.scheduler.stats.remote(), replies.stats)
        health = self.monitor.snapshot() if self.monitor is not None else {}
        return admin_pb2.StatsResponse(
            nodes=node_pbs, queued=sched["queued"],
            sessions=sched["sessions"],
            stats_json=json.dumps({"scheduler": sched, "nodes": node_stats, "health": health}),
        )

    async def Flush(self, request, context):
        await fresh_admin(self.auth, context)
        skipped = self._held_down()  # before asking: what ask_live leaves out (review 29o F3)
        spill_s = spill_timeout_s(self.node_timeout_s)  # ends before ours on the node: it names the spill node
        answers = await self._ask_live(lambda n: n.flush_by_tier.remote(spill_timeout_s=spill_s))
        counts = [c for a in answers.values() if (c := _flush_counts(a)) is not None]
        freed = {kind: _capped(sum(c[kind] for c in counts)) for kind in FLUSH_KINDS}
        await self.scheduler.flush_index.remote()
        failed, unflushed = _not_done(answers, _flush_counts, self.node_timeout_s), spill_unflushed(answers)
        if failed or unflushed:
            parts = [_spill_text(unflushed)] if unflushed else []
            if failed:
                parts.insert(0, f"{_nodes_text(failed)} did not flush, so the KV blocks cached there (and on the "
                                "spill tier, which those nodes flush) may still be stored")
            await context.abort(grpc.StatusCode.UNAVAILABLE, (
                f"flush incomplete: {'; '.join(parts)}; the nodes that answered freed {sum(freed.values())} KV "
                f"blocks (device {freed['device']}, compressed prefixes {freed['prefixes']}, host {freed['host']}, "
                f"spill {freed['spill']}); run the flush again once every node answers (kvstrata status shows the "
                "cache nodes' health)"))
        return admin_pb2.FlushResponse(freed_blocks=_capped(sum(freed.values())), device_blocks=freed["device"],
                                       prefix_blocks=freed["prefixes"], host_blocks=freed["host"],
                                       spill_blocks=freed["spill"], skipped_nodes=skipped)

    async def Drain(self, request, context):
        await fresh_admin(self.auth, context)
        timeout_s = request.timeout_s
        if not math.isfinite(timeout_s) or timeout_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be >= 0 seconds, got {timeout_s}")
        # running requests get timeout_s to finish, then the rest are aborted (CacheNode.drain)
        skipped = self._held_down()
        drain_id = uuid.uuid4().hex
        asking = asyncio.ensure_future(self._ask_live(lambda n: n.drain.remote(timeout_s=timeout_s, drain_id=drain_id),
                                                      extra_s=timeout_s))
        try:
            answers = await self._while_admin(context, asking)
        finally:
            if not asking.done():  # the key went, or the call ended: the nodes abort nothing
                asking.cancel()
                for name, node in self.nodes.items():
                    try:  # not awaited: a node that does not answer aborts at its end
                        node.cancel_drain.remote(drain_id=drain_id)
                    except AttributeError:  # a node without cancel_drain (an older one): its drain runs to
                        # its end, and the call's own error is not masked by this one (s37 CI)
                        log.warning("cache node %s has no cancel_drain (an older version): its drain runs to its "
                                    "end", name)
        aborted = _capped(sum(n for a in answers.values() if (n := _drain_count(a)) is not None))
        if failed := _not_done(answers, _drain_count, self.node_timeout_s + timeout_s):
            await context.abort(grpc.StatusCode.UNAVAILABLE, (
                f"drain incomplete: {_nodes_text(failed)} did not drain, so requests may still run there; the nodes that answered aborted {aborted} requests; run the "
                "drain again once every node answers (kvstrata status shows their health)"))
        return admin_pb2.DrainResponse(aborted=aborted, skipped_nodes=skipped)

    async def _while_admin(self, context: Any, task: asyncio.Future[Any]) -> Any:
        """``task``'s answer, awaited while the call's admin key still exists: every
        ``key_check_s`` the key's id is looked up (``KeyDirectory.which_exist``: a directory
        refresh, or the scheduler asked about that id when the directory is unusable), and
        the call aborted UNAUTHENTICATED once it is gone (rotated away), or UNAVAILABLE when
        the scheduler did not answer two checks in a row and none answered for
        ``key_staleness_max_s`` (as the key watch ends data streams:
        ``services.gateway_key_watch``). A scheduler that answers but cannot tell counts as
        answering. ``task`` is left running either way. Regression (review r1 F1/F4, session
        37): an unusable directory (more than 2**18 key ids) counted as no answer, and one
        failed refresh past the bound ended the drain."""
        key_id = parse_key_id(bearer_key(context)) or ""
        confirmed, failed = time.monotonic(), 0
        while True:
            done, _ = await asyncio.wait({task}, timeout=self.key_check_s)
            if done:
                return task.result()
            started = time.monotonic()
            outcome, existing = await self.auth.directory.which_exist({key_id})
            if outcome != UNREACHABLE:
                confirmed, failed = started, 0
                if outcome == APPLIED and key_id not in existing:
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, (
                        "the admin key that started this drain was rotated away; the drain was cancelled: nothing "
                        "more is aborted"))
                continue
            failed += 1
            if failed >= 2 and started - confirmed > self.key_staleness_max_s:
                await context.abort(grpc.StatusCode.UNAVAILABLE, (
                    f"this gateway could not confirm the admin key for {self.key_staleness_max_s:g} s (the "
                    "scheduler's key directory does not answer); the drain was cancelled: nothing more is aborted; "
                    "run it again"))

    async def RotateAdminKey(self, request, context):
        """Replace the admin key. The scheduler is given the key presented, checks it and
        rotates only while it is still the admin key (a compare-and-swap), so an admin key
        rotated away through another gateway, still in this one's key cache, rotates nothing
        (UNAUTHENTICATED): it cannot take the admin key back. A malformed reply (after the
        rotation) says whether the key was rotated and how to recover (``rotation_replies``)."""
        await self.auth.admin(context)
        presented = bearer_key(context)
        reply = await _call(context, self.scheduler.rotate_admin_key.remote(api_key=presented),
                            stale=lambda: self.auth.forget_key(presented))
        try:  # a malformed reply came after the rotation: it says whether, and how to recover
            key = await rotation_replies.new_key(context, self.scheduler, "rotate_admin_key", reply, presented,
                                                 rotation_replies.ADMIN_RECOVERY)
        finally:
            self.auth.forget_admin()
        return admin_pb2.RotateAdminKeyResponse(api_key=key)
