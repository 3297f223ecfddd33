"""What a gateway's ``Authenticator`` knows of the keys that passed its checks: each key id
*known* here with its key's fingerprint (``_KNOWN_ID_TTL_S``), kept per owner (a tenant, the
admin key) so that one owner's keys evict only its own ids (``_KNOWN_IDS_PER_OWNER``, and
``_MAX_KNOWN_IDS`` in all), and the forgetting of a tenant's or the admin key's cached keys and
known ids when they change. ``KnownKeys`` is a part of ``services.auth.Authenticator`` (see
``services.auth``'s module docstring for the whole scheme).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from services.key_ids import SuspectKeyIds
from tenants.keys import fingerprint, parse_key_id
from tenants.model import Tenant

_KNOWN_ID_TTL_S = 3600.0
"""How long a key id stays known after its key last passed a check here."""
_KNOWN_IDS_PER_OWNER = 4
"""Key ids known here per owner (a tenant, or the admin key), its newest first kept: a tenant has
one live key (``RotateKey`` replaces them all), so its own rotations evict only its own ids."""
_MAX_KNOWN_IDS = 65536
"""Known key ids at most, all owners together (a memory guard: past it the owner holding the
most loses its oldest, so it bites only past ``_MAX_KNOWN_IDS / _KNOWN_IDS_PER_OWNER`` owners)."""
_ADMIN_OWNER = ""
"""The owner of the admin key's id in the known ids (a tenant's is its name, never empty)."""


class KnownKeys:
    """Known key ids and forgetting of ``Authenticator`` (which provides these attributes)."""

    clock: Any
    _tenants: dict[bytes, tuple[Tenant, float, str]]
    _admins: dict[bytes, tuple[float, str]]
    _known: dict[str, tuple[bytes, float, str]]
    _known_by_owner: dict[str, OrderedDict[str, None]]
    _suspects: SuspectKeyIds
    _forgets: int
    on_keys_gone: Callable[[set[str] | None], None] | None
    """Told of keys found gone (``_keys_gone``): the gateway's key watch
    (``services.gateway_key_watch.KeyWatch``) ends the open streams they authorized."""

    def _keys_gone(self, key_ids: set[str] | None) -> None:
        """Tell ``on_keys_gone`` (if set) that keys stopped working: ``key_ids`` when the key
        directory names them (removed from the store: never valid again), None when a tenant's
        keys or one key were found gone otherwise (rotated away or deleted through this gateway,
        refused at admission or at a recheck): the watch then asks the directory which."""
        if self.on_keys_gone is not None:
            self.on_keys_gone(key_ids)

    def forget_tenant(self, name: str, keys_gone: bool = False) -> None:
        """Drop the cached keys of tenant ``name`` (after its spec or keys changed, or it was
        deleted); every other tenant's cached keys stay. With ``keys_gone`` (its keys were
        rotated away, or it was deleted) its known key ids go too; otherwise (a spec change:
        its key still works) they stay, and keep exempting it from the failure limits. (Ids
        of keys removed through another gateway go at this one's next directory refresh.)

        Regression (secrev16 fault B): ``forget`` dropped every tenant's cached key and the
        exemption of keys that passed lately, so a tenant that sent wrong secrets for another
        tenant's key id from their shared address and then rotated its own key had the other
        tenant refused RESOURCE_EXHAUSTED there. (A valid key now passes over the failure
        limit anyway: see ``services.auth``'s module docstring.)
        """
        self._forgets += 1
        for fp in [fp for fp, (tenant, _, _) in self._tenants.items() if tenant.spec.name == name]:
            del self._tenants[fp]
        if keys_gone:
            for key_id in list(self._known_by_owner.get(name, ())):
                self._unknow(key_id)
            self._keys_gone(None)

    def forget_tenant_id(self, tenant_id: str, keys_gone: bool = True) -> None:
        """Drop the cached keys of the tenant whose id is ``tenant_id``, and (``keys_gone``) its
        known key ids: admission answered that no such tenant exists (``tenant_deleted``,
        ``unknown_tenant``) or that the key was removed (``key_revoked``). Without
        ``keys_gone`` (admission answered ``tenant_changed``: the spec cached with its keys is
        stale, the keys still work) the known ids stay, as in ``forget_tenant``.

        Regression (secrev18 E residue): a key of a tenant deleted through another gateway (or
        before the scheduler restarted) stayed cached here for its TTL, each call refused at
        admission instead of at the key check."""
        self._forgets += 1
        gone = [(fp, tenant.spec.name) for fp, (tenant, _, _) in self._tenants.items() if tenant.tenant_id == tenant_id]
        for fp, _ in gone:
            del self._tenants[fp]
        for name in {name for _, name in gone} if keys_gone else ():
            for key_id in list(self._known_by_owner.get(name, ())):
                self._unknow(key_id)
        if keys_gone:
            self._keys_gone(None)

    def forget_key(self, key: str) -> None:
        """Forget ``key`` alone (the scheduler answered that it is no longer valid: rotated
        away, or its tenant deleted, through another gateway): its cached success as a tenant's
        or the admin key, and its id's knowledge here; other keys stay."""
        key_id = parse_key_id(key)
        fp = fingerprint(key)
        self._forgets += 1
        self._tenants.pop(fp, None)
        self._admins.pop(fp, None)
        if key_id is not None:
            self._unknow(key_id)
        self._keys_gone(None)

    def forget_admin(self) -> None:
        """Drop the cached admin key (after the admin key changed); tenants' keys stay."""
        self._forgets += 1
        self._admins.clear()

    def _forget_key_ids(self, key_ids: set[str]) -> None:
        """Forget every key of ``key_ids`` (the key directory found them removed: a deleted
        tenant's or a rotated key's): known ids, cached tenant and admin keys."""
        self._forgets += 1
        for key_id in key_ids:
            self._unknow(key_id)
            self._suspects.cleared(key_id)
        for fp in [fp for fp, (_, _, key_id) in self._tenants.items() if key_id in key_ids]:
            del self._tenants[fp]
        for fp in [fp for fp, (_, key_id) in self._admins.items() if key_id in key_ids]:
            del self._admins[fp]
        self._keys_gone(set(key_ids))

    def _know(self, key: str, owner: str) -> None:
        """Remember ``key``'s id as known here, with ``key``'s fingerprint (it just passed), as
        one of ``owner``'s (a tenant's name, or ``_ADMIN_OWNER``): each owner keeps its newest
        ``_KNOWN_IDS_PER_OWNER`` ids, and past ``_MAX_KNOWN_IDS`` in all the owner holding the
        most loses its oldest.

        Regression (secrev18 A): the known ids were one LRU of 65,536 for all tenants, so a
        tenant that rotated its own key 65,536 times evicted every other tenant's id, and a
        NAT-mate's 50 wrong keys then got the other tenant's valid key RESOURCE_EXHAUSTED. A
        tenant's keys now evict only its own ids.
        """
        key_id = parse_key_id(key)
        if key_id is None:
            return
        self._unknow(key_id)
        self._suspects.cleared(key_id)
        ids = self._known_by_owner.setdefault(owner, OrderedDict())
        ids[key_id] = None
        self._known[key_id] = (fingerprint(key), self.clock() + _KNOWN_ID_TTL_S, owner)
        while len(ids) > _KNOWN_IDS_PER_OWNER:
            self._unknow(next(iter(ids)))
        if len(self._known) > _MAX_KNOWN_IDS:
            self._shed_known()

    def _unknow(self, key_id: str) -> None:
        """Forget that ``key_id`` is known here (no-op when it is not)."""
        entry = self._known.pop(key_id, None)
        if entry is None:
            return
        ids = self._known_by_owner[entry[2]]
        del ids[key_id]
        if not ids:
            del self._known_by_owner[entry[2]]

    def _shed_known(self) -> None:
        """Bring the known ids back to ``_MAX_KNOWN_IDS``: expired ones first, then the oldest
        of the owner holding the most (never one owner's for another's, while any holds more)."""
        now = self.clock()
        for key_id in [k for k, (_, until, _) in self._known.items() if until <= now]:
            self._unknow(key_id)
        while len(self._known) > _MAX_KNOWN_IDS:
            largest = max(self._known_by_owner.values(), key=len)
            self._unknow(next(iter(largest)))

    def _known_fingerprint(self, key_id: str) -> bytes | None:
        """The fingerprint of the key of ``key_id`` that passed here lately, if any."""
        known = self._known.get(key_id)
        return known[0] if known is not None and known[1] > self.clock() else None
