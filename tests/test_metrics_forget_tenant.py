"""A deleted tenant's metric series leave the gateway's ``/metrics`` and stay gone
(``GatewayMetrics.forget_tenant``, called by ``DeleteTenant``).

Regression (security review 23d, F): no series was ever removed, so a deleted tenant's name,
request counts and latencies were exported until the gateway restarted, and the series grew
with every tenant ever served.

The real ``Gateway`` (gRPC server, ``/metrics``) in-process and without Ray, as in
tests/test_gateway_restart_start.py: a real ``GlobalSchedulerService`` behind ``LocalActor``
and a fake cache node that answers ``describe`` and ``health``.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.chaos_stack import tiny_checkpoint
from kvstrata.v1 import inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services import gateway_server
from services.global_scheduler_admission import GlobalSchedulerService
from services.metrics import MetricsEndpoint
from services.metrics import requests as request_metrics
from services.metrics.requests import GatewayMetrics
from tenants.errors import TenantNotFoundError
from tenants.model import Tenant, TenantSpec
from tests.gateway_harness import LocalActor
from tests.service_fixtures import chat
from tests.test_gateway_restart_start import FakeNode

pytestmark = pytest.mark.timeout(120)


def serve_one_request(metrics: GatewayMetrics, tenant: Tenant) -> None:
    """A request that finished OK (every tenant-only series, ``request_success``) and one the
    admission refused (``admission_rejections``, ``requests`` by status)."""
    track = metrics.track(tenant)
    for event in ({"type": "started", "prompt_tokens": 7}, {"type": "delta", "token_ids": [1]},
                  {"type": "delta", "token_ids": [2]}, {"type": "finished", "finish_reason": "stop"}):
        track.observe(event)
    track.finish("OK")
    refused = metrics.track(tenant)
    refused.rejected("queue_full")
    refused.finish("RESOURCE_EXHAUSTED")


def tenant_lines(body: str, name: str) -> list[str]:
    return sorted(line for line in body.splitlines() if f'tenant="{name}"' in line)


def test_delete_tenant_removes_every_series_of_that_tenant_alone(tmp_path: Path) -> None:
    """Through the real gateway: after ``DeleteTenant`` no ``tenant="gone"`` line is left in
    ``/metrics`` (every family, every status/reason/finished_reason child), not even after
    the deleted tenant's request in flight ends, nor a request of it that was authenticated
    before the delete and tracked after it; the other tenant's lines are unchanged. A new
    tenant of the same name is exported again."""

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        admin = (("authorization", f"Bearer {sched.store.ensure_admin_key()}"),)
        gw = gateway_server.Gateway(LocalActor(sched), {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()),
                                    metrics=MetricsEndpoint("127.0.0.1", 0, render_interval_s=0.001))
        port = await gw.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await check_deletion(gw, sched, admin, channel)
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())


async def check_deletion(gw: Any, sched: GlobalSchedulerService, admin: Any, channel: grpc.aio.Channel) -> None:
    tenants = tenant_pb2_grpc.TenantServiceStub(channel)
    keys = {}
    for name in ("gone", "kept"):
        reply = await tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name=name)),
                                             metadata=admin)
        keys[name] = reply.api_key
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(
            chat("too long", max_tokens=10**6), metadata=(("authorization", f"Bearer {reply.api_key}"),))
        with pytest.raises(grpc.RpcError) as refused:  # tracked, refused before admission
            [event async for event in call]
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        serve_one_request(gw.metrics, sched.get_tenant(name))
    gone = sched.get_tenant("gone")
    in_flight = gw.metrics.track(gone)
    in_flight.observe({"type": "delta", "token_ids": [3]})
    before = await scrape(gw)
    assert len(tenant_lines(before, "gone")) == len(tenant_lines(before, "kept")) > 80
    assert 'status="INVALID_ARGUMENT",tenant="gone"' in before

    await tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="gone"), metadata=admin)
    in_flight.observe({"type": "delta", "token_ids": [4]})
    in_flight.observe({"type": "finished", "finish_reason": "length"})
    in_flight.rejected("queue_full")
    in_flight.finish("OK")
    late = gw.metrics.track(gone)  # authenticated before the delete, tracked after it
    late.rejected("unknown_tenant")
    late.finish("UNAUTHENTICATED")
    after = await scrape(gw)
    assert tenant_lines(after, "gone") == []
    assert tenant_lines(after, "kept") == tenant_lines(before, "kept")
    list(text_string_to_metric_families(after))  # still a valid exposition

    await tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="gone")),
                                 metadata=admin)
    serve_one_request(gw.metrics, sched.get_tenant("gone"))  # a new tenant: a new id
    assert 'request_success_total{finished_reason="stop",tenant="gone"} 1.0' in await scrape(gw)


async def scrape(gw: Any) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://{gw.metrics_address()}/metrics", timeout=10) as reply:
            return reply.read().decode()

    return await asyncio.to_thread(get)


def test_forgotten_ids_are_bounded_and_the_oldest_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ids of forgotten tenants are the newest ``FORGOTTEN_IDS_KEPT``: a late request of a
    tenant forgotten before that many later deletions exports its series again (the
    documented bound), one of a recently forgotten tenant does not."""
    monkeypatch.setattr(request_metrics, "FORGOTTEN_IDS_KEPT", 2)
    metrics = GatewayMetrics()
    tenants = [Tenant(f"{i:016x}", TenantSpec(name=f"t{i}"), 0.0) for i in range(3)]
    for tenant in tenants:
        serve_one_request(metrics, tenant)
        metrics.forget_tenant(tenant.name)
    assert list(metrics._forgotten_ids) == [tenants[1].tenant_id, tenants[2].tenant_id]
    serve_one_request(metrics, tenants[2])
    serve_one_request(metrics, tenants[0])
    names = {s.labels.get("tenant") for f in metrics.registry.collect() for s in f.samples}
    assert names == {"t0"}


def test_no_created_series_are_exported() -> None:
    """Trial 29k P9: every counter and histogram child also exported ``<name>_created`` (53
    series on a gateway with two tenants), doubling each tenant's series for a value no
    dashboard reads; ``services.metrics`` turns them off."""
    from prometheus_client import generate_latest

    metrics = GatewayMetrics()
    serve_one_request(metrics, Tenant("0" * 16, TenantSpec(name="t0"), 0.0))
    text = generate_latest(metrics.registry).decode()
    assert "time_to_first_token_seconds_count" in text and "_created" not in text


class RacingScheduler:
    """The scheduler, with another admin's ``DeleteTenant`` + ``RegisterTenant`` of ``name``
    landing right after any ``get_tenant(name)`` (the window the gateway's DeleteTenant had
    between its lookup and its delete)."""

    def __init__(self, sched: GlobalSchedulerService, name: str) -> None:
        self.sched, self.name = sched, name
        self.second: Tenant | None = None  # the tenant registered in the window, once raced

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.sched, attr)

    def get_tenant(self, name: str, tenant_id: str = "") -> Tenant:
        tenant = self.sched.get_tenant(name, tenant_id)
        if name == self.name and self.second is None:
            self.sched.end_deleted_tenant(self.sched.delete_stored_tenant(name))
            self.second, _ = super(GlobalSchedulerService, self.sched).register_tenant(TenantSpec(name=name))
        return tenant


def test_delete_tenant_forgets_the_tenant_it_deleted_not_one_looked_up_before(tmp_path: Path) -> None:
    """Regression (session 32's open list): DeleteTenant looked the tenant up, then deleted by
    name. A tenant deleted and registered again under that name in between had the new tenant
    deleted and the old one's id forgotten: a request of the new tenant authenticated before
    the delete and tracked after it exported the deleted tenant's series again. The id
    forgotten is now the one the scheduler's delete returns."""

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        admin = (("authorization", f"Bearer {sched.store.ensure_admin_key()}"),)
        racing = RacingScheduler(sched, "gone")
        gw = gateway_server.Gateway(LocalActor(racing), {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()),
                                    metrics=MetricsEndpoint("127.0.0.1", 0, render_interval_s=0.001))
        port = await gw.start("127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                tenants = tenant_pb2_grpc.TenantServiceStub(channel)
                await tenants.RegisterTenant(
                    tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="gone")), metadata=admin)
                first = sched.get_tenant("gone")
                await tenants.DeleteTenant(tenant_pb2.DeleteTenantRequest(name="gone"), metadata=admin)
                with pytest.raises(TenantNotFoundError):  # whichever tenant was called "gone" is deleted
                    sched.get_tenant("gone")
                deleted = racing.second or first  # the tenant called "gone" when the delete ran
                late = gw.metrics.track(deleted)  # authenticated before the delete, tracked after
                late.rejected("unknown_tenant")
                late.finish("UNAUTHENTICATED")
                assert tenant_lines(await scrape(gw), "gone") == []
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())
