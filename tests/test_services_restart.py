"""Restarting the services keeps tenants and API keys (SQLite state dir)."""

from __future__ import annotations

import pytest

from kvstrata.v1 import tenant_pb2
from tests.service_fixtures import chat, collect

pytestmark = pytest.mark.slow


def test_restart_keeps_tenants_and_keys(stack) -> None:
    key = stack.register("dora", slo_class=1)
    admin_key = stack.services.admin_key
    before = [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=stack.admin_md()).tenants]
    stack.restart()
    assert stack.services.admin_key == admin_key
    after = [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=stack.admin_md()).tenants]
    assert after == before and "dora" in after
    r = collect(stack.inference.Generate(chat("Hello!", 3), metadata=(("authorization", f"Bearer {key}"),)))
    assert r["finished"].completion_tokens > 0
