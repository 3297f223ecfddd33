"""The global scheduler's tenant calls: the admin key, tenants and their keys, usage.

The gateway checks the admin key before any of these (``services.auth``); they delegate to the
tenant store (``tenants.store``) and the usage ledger. ``Tenants`` is a part of
``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

from typing import Any

from tenants.model import Tenant, TenantSpec
from tenants.store import KeyIdsDelta


class Tenants:
    """The tenant part of ``GlobalScheduler`` (its ``store``, ``usage`` and ``specs``)."""

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

    def rotate_admin_key(self) -> str:
        return self.store.rotate_admin_key()

    def rotate_tenant_key(self, name: str) -> str:
        return self.store.rotate_key(name)

    def register_tenant(self, spec: TenantSpec) -> tuple[Tenant, str]:
        return self.store.register(spec)

    def update_tenant(self, name: str, spec: TenantSpec) -> Tenant:
        return self.store.update(name, spec)

    def delete_tenant(self, name: str) -> None:
        """Delete ``name``; its requests in flight end (ABORTED) and its sessions close on
        every node (``end_tenant`` on their command inboxes), and its session routes go.

        Raises:
            TenantNotFoundError: no tenant is called ``name``.
        """
        tenant_id = self.store.get(name).tenant_id
        self.store.delete(name)
        self.specs.pop(tenant_id, None)
        for sid in [sid for sid, (owner, _) in self.session_nodes.items() if owner == tenant_id]:
            self.drop_session_route(sid)
        if self.commands is not None:
            for inbox in self.node_inboxes.values():
                self.commands.send(inbox, {"op": "end_tenant", "tenant": tenant_id})

    def get_tenant(self, name: str) -> Tenant:
        return self.store.get(name)

    def list_tenants(self) -> tuple[Tenant, ...]:
        return self.store.list()

    def authenticate(self, api_key: str, allow_pbkdf2: bool = True) -> Tenant | None:
        """``TenantStore.authenticate`` (``allow_pbkdf2`` as in ``verify_admin_key``); notes
        the tenant's spec for admission."""
        tenant = self.store.authenticate(api_key, allow_pbkdf2)
        if tenant is not None:
            self.specs[tenant.tenant_id] = tenant.spec
        return tenant

    def key_ids_since(self, epoch: str, version: int) -> KeyIdsDelta:
        """``TenantStore.key_ids_since``: the key ids that exist, for a gateway's key directory
        (``services.auth``), as a delta since ``(epoch, version)`` or all of them."""
        return self.store.key_ids_since(epoch, version)

    def usage_of(self, tenant_id: str) -> Any:
        return self.usage.snapshot(tenant_id)
