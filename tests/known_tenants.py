"""Tests' tenants by fixed ids: a ``GlobalScheduler`` admits only the tenants it knows
(``Tenants.knows_tenant``: those of its store, whose ids are random), so a test that admits
requests of made-up ids (``"t1"``, ``"noisy"``) first makes its scheduler know them."""

from __future__ import annotations

from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec


def know_tenants(scheduler: GlobalScheduler, *tenant_ids: str, slo_class: str = "standard") -> GlobalScheduler:
    """Make ``scheduler`` know a tenant of each id in ``tenant_ids`` (named as its id, of
    ``slo_class``), as ``register_tenant`` makes it know a registered one; returns it."""
    for tenant_id in tenant_ids:
        scheduler.specs[tenant_id] = TenantSpec(tenant_id, slo_class)
    return scheduler
