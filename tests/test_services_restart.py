"""Restarting the services keeps tenants and API keys (SQLite state dir)."""

from __future__ import annotations

import pytest

from kvstrata.v1 import tenant_pb2
from tests.service_fixtures import chat, collect, start_stack

pytestmark = pytest.mark.slow


def test_restart_keeps_tenants_and_keys(tmp_path) -> None:
    gen = start_stack(state_dir=str(tmp_path))
    stack = next(gen)
    key = stack.register("dora", slo_class=1)
    admin_key = stack.services.admin_key
    gen.close()
    gen = start_stack(state_dir=str(tmp_path))
    stack = next(gen)
    try:
        assert stack.services.admin_key == admin_key
        names = [t.spec.name for t in stack.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=stack.admin_md()).tenants]
        assert names == ["dora"]
        r = collect(stack.inference.Generate(chat("Hello!", 3), metadata=(("authorization", f"Bearer {key}"),)))
        assert r["finished"].completion_tokens > 0
    finally:
        gen.close()
