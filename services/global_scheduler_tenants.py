"""The global scheduler's tenant calls: the admin key, tenants and their keys, usage.

The gateway checks the admin key before any of these (``services.auth``), or the tenant's key
for a tenant's own calls, which pass what identifies the caller here (its tenant id, or the key
itself for a rotation: checked again here, past the gateways' key caches); they delegate to the
tenant store (``tenants.store``) and the usage ledger. ``Tenants`` is a part of
``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import OrderedDict
from typing import Any

from services.block_index import CommonPrefix
from services.global_scheduler_checks import Admission
from services.global_scheduler_routing import RoutingKeys
from tenants.errors import (
    NotOwnTenantError,
    StaleKeyError,
    TenantNotFoundError,
    TooManyRotationsError,
)
from tenants.keys import is_key_id, parse_key_id
from tenants.model import Tenant, TenantSpec, spec_digest
from tenants.ratelimit import WindowLimiter
from tenants.store import DELETED_PAGE, MAX_DELETED_TENANTS, TenantStore
from tenants.store_key_ids import MAX_KEY_IDS_ASKED, KeyIdsDelta
from tenants.usage import UsageLedger

OWN_ROTATIONS_PER_WINDOW = 6
"""Rotations a tenant may make of its own key (with its own key) per ``OWN_ROTATION_WINDOW_S``."""
OWN_ROTATION_WINDOW_S = 60.0
TENANT_CHANGED_RETRY_S = 0.1
"""The retry hint of a ``tenant_changed`` refusal (``Tenants._changed_spec``), which reaches a
client only when its spec changed again while its gateway prepared the request anew."""


class Tenants:
    """The tenant part of ``GlobalScheduler`` (its ``store``, ``usage``, ``specs``,
    ``deleted_tenants`` and ``own_rotations``: a ``WindowLimiter`` of
    ``OWN_ROTATIONS_PER_WINDOW`` per ``OWN_ROTATION_WINDOW_S`` by tenant id, made by
    ``own_rotation_limiter``).

    ``specs`` holds every tenant's spec, kept current here: admission reads nothing else, and
    admits (closes sessions of, reports usage of) only the tenant ids it holds (``knows_tenant``);
    ``deleted_tenants`` the ids of the last ``tenants.store.MAX_DELETED_TENANTS`` deleted tenants
    (kept by the store, so that a restart remembers them), whose late requests admission refuses
    with their own reason."""

    store: TenantStore
    usage: UsageLedger
    usage_flush_lock: threading.Lock
    own_rotations: WindowLimiter
    specs: dict[str, TenantSpec]
    deleted_tenants: OrderedDict[str, None]
    session_nodes: dict[str, tuple[str, str]]
    lost_sessions: dict[str, dict[str, float]]
    routing_keys: RoutingKeys
    common_prefix: CommonPrefix
    node_inboxes: dict[str, str]
    commands: Any

    def drop_session_route(self, session_id: str) -> None: ...

    @staticmethod
    def own_rotation_limiter(clock: Any) -> WindowLimiter:
        return WindowLimiter(OWN_ROTATIONS_PER_WINDOW, OWN_ROTATION_WINDOW_S, clock=clock)

    def ensure_admin_key(self) -> str | None:
        return self.store.ensure_admin_key()

    def verify_admin_key(self, key: str, allow_pbkdf2: bool = True) -> bool:
        """``TenantStore.verify_admin_key``: ``allow_pbkdf2`` False never runs PBKDF2 (an
        earlier version's row not verified since start is then refused)."""
        return self.store.verify_admin_key(key, allow_pbkdf2)

    def has_admin_key(self) -> bool:
        return self.store.has_admin_key()

    def set_admin_key(self, key: str) -> bool:
        """Commit ``key`` (already saved by the caller) as the admin key; True if rotated."""
        return self.store.set_admin_key(key)

    def rotate_admin_key(self, api_key: str | None = None) -> str:
        """Replace the admin key; returns the new one. ``api_key``: the admin key the caller
        presented, checked here now (no gateway's cache) and the rotation made only while it
        is still the admin key (``TenantStore.rotate_admin_key``'s compare-and-swap), so a key
        rotated away through another gateway, still in this gateway's key cache, cannot rotate
        it again (and so take it over). None: unconditional.

        Raises:
            StaleKeyError: ``api_key`` is not (or no longer) the admin key (nothing changed).
        """
        if api_key is None:
            return self.store.rotate_admin_key()
        if not self.store.verify_admin_key(api_key):
            raise StaleKeyError("")
        return self.store.rotate_admin_key(key_id=parse_key_id(api_key))

    def rotate_tenant_key(self, name: str, api_key: str | None = None) -> str:
        """Replace tenant ``name``'s keys with a new one; returns it.

        Args:
            name: the tenant.
            api_key: None for the admin's rotation (the gateway checked the admin key). For a
                tenant's own rotation, the key it presented: checked here now, past every
                gateway's key cache (``TenantStore.authenticate``), it must be a key of the
                tenant called ``name`` (its id compared, not its name: a tenant deleted and
                registered again under ``name`` is another tenant), and the rotation is made
                only while that key is still one of that tenant's (``TenantStore.rotate_key``'s
                compare-and-swap). A tenant rotates its own key at most
                ``OWN_ROTATIONS_PER_WINDOW`` times per ``OWN_ROTATION_WINDOW_S`` (counted by
                tenant id; the admin key's rotations are not limited).

        Regression (secrev18 A): a tenant could rotate its own key without limit, each new key
        taking a place in every gateway's known key ids (65,536 rotations pushed out every
        other tenant's) and each a synchronous SQLite commit on the scheduler's loop
        (``GlobalSchedulerService`` now runs it in a worker thread).

        Regression (session 32 review, cross-tenant takeover): the own rotation named only the
        tenant, with the key checked from a gateway's 10-s cache by name. A key deleted or
        rotated away through one gateway, still cached at another, rotated there: a deleted
        "alice"'s key took the key of a new tenant registered as "alice" (locking its owner
        out), and a leaked key its owner had rotated away rotated again and took the tenant.

        Raises:
            StaleKeyError: ``api_key`` is no tenant's key now, or not ``name``'s current one
                (nothing rotated).
            NotOwnTenantError: ``api_key`` is another tenant's key (nothing rotated).
            TooManyRotationsError: an own rotation past the limit (nothing rotated).
            sqlite3.Error: the store failed (nothing rotated; an own rotation's slot given back).
            TenantNotFoundError: no tenant ``name`` (the admin's rotation).
        """
        if api_key is None:
            return self.store.rotate_key(name)
        caller = self.store.authenticate(api_key)
        if caller is None:
            raise StaleKeyError(name)
        if caller.spec.name != name:
            raise NotOwnTenantError(name)
        if not self.own_rotations.try_acquire(caller.tenant_id):
            raise TooManyRotationsError(name, self.own_rotations.retry_after_s(caller.tenant_id))
        try:
            return self.store.rotate_key(name, tenant_id=caller.tenant_id, key_id=parse_key_id(api_key))
        except sqlite3.Error:
            # nothing rotated (the store rolled back): the rotation's slot is not used.
            # Regression (s40 diff review r7 of 01ed7ce): it was, so a tenant retrying
            # through a full disk ran out of its own_rotations before the disk had room.
            self.own_rotations.give_back(caller.tenant_id)
            raise

    def knows_tenant(self, tenant_id: str) -> bool:
        """Whether ``tenant_id`` is a tenant of the store (``specs``, never a store read).

        The gateway checks keys against this scheduler's store, so any other id comes from a
        gateway's stale key cache (a key of a tenant deleted before this scheduler started) or
        from a forged or buggy caller: nothing of it is admitted, closed or counted.

        Regression (secrev18 E residue): an id not in ``specs`` was admitted with the default
        class, and after a restart a deleted tenant's late request was admitted so."""
        return tenant_id in self.specs

    def _changed_spec(self, tenant_id: str, digest: str) -> Admission | None:
        """The refusal of a request a gateway prepared with a spec of ``tenant_id`` other than
        its current one here (``digest``: ``tenants.model.spec_digest`` of the spec it used;
        "" = not said, never refused): UNAVAILABLE, "tenant_changed", with a
        ``TENANT_CHANGED_RETRY_S`` hint. The gateway then forgets the tenant's cached keys,
        authenticates the call's key again (which brings the current spec) and prepares and
        sends it once more, unseen by its client. None when the digest is current, or the
        tenant unknown here (``_unknown_tenant`` refuses that first).

        Regression (review s35 C C2): a spec changed through one gateway (``UpdateTenant``:
        moved out of a shared ``cache_namespace``, fewer ``allowed_policies``, a lower
        ``max_context_tokens``, another SLO class, weight or KV quota) was not seen by the other
        gateways' key caches for up to 10 s: the tenant's requests there were still hashed into
        the namespace it had left (reading and writing its prefix KV), under policies and bounds
        it no longer had."""
        spec = self.specs.get(tenant_id)
        if not digest or spec is None or spec_digest(spec) == digest:
            return None
        return Admission(code="UNAVAILABLE", reason="tenant_changed", retry_after_s=TENANT_CHANGED_RETRY_S,
                         message="this tenant's settings changed while the request was on its way; retry")

    def register_tenant(self, spec: TenantSpec) -> tuple[Tenant, str]:
        tenant, key = self.store.register(spec)
        self.specs[tenant.tenant_id] = tenant.spec
        return tenant, key

    def update_tenant(self, name: str, spec: TenantSpec) -> Tenant:
        """Replace tenant ``name``'s spec; admission uses it from its next request (before,
        from the tenant's next key check)."""
        tenant = self.store.update(name, spec)
        self.specs[tenant.tenant_id] = tenant.spec
        return tenant

    def delete_tenant(self, name: str) -> str:
        """Delete ``name``: the store's rows (``delete_stored_tenant``), then
        ``end_deleted_tenant``; returns the deleted tenant's id (what its caller forgets: the
        tenant called ``name`` when the delete ran, not one looked up before it).

        Raises:
            TenantNotFoundError: no tenant is called ``name``.
        """
        tenant_id = self.delete_stored_tenant(name)
        self.end_deleted_tenant(tenant_id)
        return tenant_id

    def deleted_tenants_after(self, seq: int, limit: int = DELETED_PAGE) -> list[tuple[int, str]]:
        """``TenantStore.deleted_tenants_after``: the tenants deleted after deletion ``seq``,
        ``(seq, tenant_id)``, oldest first, at most ``limit`` (clamped to 1..``DELETED_PAGE``).
        Spill nodes page through it to purge deleted tenants' own namespaces, whatever they
        missed while down (``services.spill_node.DeletedTenantSweep``).

        Raises:
            TypeError: ``seq`` or ``limit`` is not an int.
        """
        if type(seq) is not int or type(limit) is not int:
            raise TypeError("seq and limit must be ints")
        return self.store.deleted_tenants_after(max(seq, 0), min(max(limit, 1), DELETED_PAGE))

    def flush_usage(self) -> int:
        """Store the usage counters changed since the last flush in the tenant store (one
        transaction), so that ``GetUsage`` survives a restart of this scheduler or of the
        service (loaded at start); returns the tenants stored. A failed write hands them back
        for the next flush.

        Regression: the counters lived only in this actor's memory, so a crashed (and now
        restarted) scheduler, or ``kvstrata down``/``up``, reset every tenant's usage to zero.

        Raises:
            sqlite3.Error: the write failed (the counters stay marked for the next flush).
        """
        # Regression (review 24r F5): the periodic flush and stop's could overlap in two worker
        # threads; the later snapshot committed first and the older one last (5 requests in
        # memory, 2 stored), and stop's found nothing dirty and returned while the periodic
        # write could still be killed. Now one at a time: stop's waits, then writes what is left.
        with self.usage_flush_lock:
            rows = self.usage.take_dirty()
            if not rows:
                return 0
            try:
                return self.store.save_usage(rows)
            except Exception:
                self.usage.mark_dirty(rows)
                raise

    def delete_stored_tenant(self, name: str) -> str:
        """Delete ``name`` and its keys from the store; returns its tenant id (the store alone:
        may run in a worker thread).

        Raises:
            TenantNotFoundError: no tenant is called ``name``.
        """
        return self.store.delete(name)

    def end_deleted_tenant(self, tenant_id: str) -> None:
        """The deleted tenant ``tenant_id``'s requests are refused from now on (admission:
        UNAUTHENTICATED), its requests in flight end (ABORTED) and its sessions close on every
        node (``end_tenant`` on their command inboxes), and its session routes, lost-session
        marks, routing keys, common-prefix windows and usage counters go.

        Regression (secrev18 E): only the spec went, so a request of the tenant reaching
        admission afterwards (still in a gateway's pipeline) was admitted and ran after the
        ``end_tenant``, and a session it opened was never closed.

        Regression (secrev18 E residue): its lost-session marks, routing keys and usage
        counters stayed in memory for good.
        """
        self.deleted_tenants.pop(tenant_id, None)
        self.deleted_tenants[tenant_id] = None
        while len(self.deleted_tenants) > MAX_DELETED_TENANTS:
            self.deleted_tenants.popitem(last=False)
        self.specs.pop(tenant_id, None)
        for sid in [sid for sid, (owner, _) in self.session_nodes.items() if owner == tenant_id]:
            self.drop_session_route(sid)
        self.lost_sessions.pop(tenant_id, None)
        self.routing_keys.forget(tenant_id)
        self.common_prefix.forget(tenant_id)
        self.usage.forget(tenant_id)
        if self.commands is not None:
            for inbox in self.node_inboxes.values():
                self.commands.send(inbox, {"op": "end_tenant", "tenant": tenant_id})

    def get_tenant(self, name: str, tenant_id: str = "") -> Tenant:
        """``TenantStore.get``; notes the spec as ``authenticate`` does (a tenant registered
        in the store by another connection since this scheduler started is then known).

        ``tenant_id``: for a tenant's own call, the caller's tenant id (from its key): a tenant
        called ``name`` with another id (the caller's was deleted, and ``name`` registered
        again) or none at all is ``StaleKeyError``, never the other tenant.

        Raises:
            TenantNotFoundError: no tenant ``name`` (``tenant_id`` empty).
            StaleKeyError: ``tenant_id`` given and ``name`` is not that tenant now.
        """
        if not tenant_id:
            return self._note(self.store.get(name))
        try:
            tenant = self.store.get(name)
        except TenantNotFoundError:
            raise StaleKeyError(name) from None
        if tenant.tenant_id != tenant_id:
            raise StaleKeyError(name)
        return self._note(tenant)

    def list_tenants(self) -> tuple[Tenant, ...]:
        return tuple(self._note(t) for t in self.store.list())

    def _note(self, tenant: Tenant) -> Tenant:
        if tenant.tenant_id not in self.deleted_tenants:
            self.specs[tenant.tenant_id] = tenant.spec
        return tenant

    def authenticate(self, api_key: str, allow_pbkdf2: bool = True) -> Tenant | None:
        """``TenantStore.authenticate`` (``allow_pbkdf2`` as in ``verify_admin_key``); notes
        the tenant's spec for admission (unless it was deleted meanwhile: a check that read
        its row before the delete never brings it back)."""
        tenant = self.store.authenticate(api_key, allow_pbkdf2)
        return None if tenant is None else self._note(tenant)

    def key_ids_since(self, epoch: str, version: int) -> KeyIdsDelta:
        """``TenantStore.key_ids_since``: the key ids that exist, for a gateway's key directory
        (``services.auth``), as a delta since ``(epoch, version)`` or all of them."""
        return self.store.key_ids_since(epoch, version)

    def key_ids_exist(self, key_ids: list[str]) -> tuple[str, ...]:
        """The ids of ``key_ids`` that exist in the tenant store (``TenantStore.existing_key_ids``),
        sorted: a gateway confirms the keys of its open streams so when its key directory is
        unusable (the store holds more ids than a directory may: ``services.key_ids``). Indexed
        reads of at most ``MAX_KEY_IDS_ASKED`` ids, on the caller's thread (milliseconds).

        Raises:
            ValueError: ``key_ids`` is not a list of at most ``MAX_KEY_IDS_ASKED`` strings.
        """
        if not isinstance(key_ids, (list, tuple)) or len(key_ids) > MAX_KEY_IDS_ASKED:
            raise ValueError(f"key_ids must be a list of at most {MAX_KEY_IDS_ASKED} key ids")
        if not all(type(k) is str for k in key_ids):
            raise ValueError("key_ids must be strings")
        return self.store.existing_key_ids([k for k in key_ids if is_key_id(k)])

    def usage_of(self, tenant_id: str) -> Any:
        """``tenant_id``'s usage counters.

        Raises:
            TenantNotFoundError: ``tenant_id`` is no tenant's (``knows_tenant``; deleted since
                the caller looked it up, or never one).
        """
        if not self.knows_tenant(tenant_id):
            raise TenantNotFoundError(tenant_id)
        return self.usage.snapshot(tenant_id)
