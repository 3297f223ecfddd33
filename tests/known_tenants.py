"""Tests' tenants by fixed ids: a ``GlobalScheduler`` admits only the tenants it knows
(``Tenants.knows_tenant``: those of its store, whose ids are random), so a test that admits
requests of made-up ids (``"t1"``, ``"noisy"``) first makes its scheduler know them. Also the
fakes the admission tests share (``Sender``, ``no_store_reads``)."""

from __future__ import annotations

import pytest

from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec


class Sender:
    """A command channel (``GlobalScheduler.attach_nodes``) that keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, address: str, msg: dict) -> bool:
        self.sent.append(msg)
        return True


def no_store_reads(gs: GlobalScheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if ``gs``'s tenant store is read from here on (admission reads memory)."""
    def read(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("admission read the tenant store")

    for name in ("list", "get", "authenticate", "deleted_tenant_ids"):
        monkeypatch.setattr(gs.store, name, read, raising=False)


def know_tenants(scheduler: GlobalScheduler, *tenant_ids: str, slo_class: str = "standard") -> GlobalScheduler:
    """Make ``scheduler`` know a tenant of each id in ``tenant_ids`` (named as its id, of
    ``slo_class``), as ``register_tenant`` makes it know a registered one; returns it."""
    for tenant_id in tenant_ids:
        scheduler.specs[tenant_id] = TenantSpec(tenant_id, slo_class)
    return scheduler
