"""Register a workload's tenants over gRPC (TenantService) and collect their API keys."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from kvstrata.v1 import common_pb2, tenant_pb2, tenant_pb2_grpc
from workloads.deepresearch.config import TenantProfile

_CLASSES = {
    "interactive": common_pb2.SLO_CLASS_INTERACTIVE,
    "standard": common_pb2.SLO_CLASS_STANDARD,
    "batch": common_pb2.SLO_CLASS_BATCH,
}


def profile_to_spec(profile: TenantProfile, name: str, policy: str = "") -> tenant_pb2.TenantSpec:
    return tenant_pb2.TenantSpec(
        name=name,
        slo_class=_CLASSES[profile.slo_class],
        ttft_slo_ms=profile.ttft_slo_ms,
        tpot_slo_ms=profile.tpot_slo_ms,
        min_tokens_per_s=profile.min_tokens_per_s,
        weight=profile.weight,
        kv_quota_bytes=profile.kv_quota_bytes,
        cache_namespace=profile.cache_namespace or name,
        policy=policy,
    )


async def register_tenants(
    channel: grpc.aio.Channel, admin_key: str, profiles: Iterable[TenantProfile], name_suffix: str = "",
    policy: str = "",
) -> dict[str, str]:
    """Register each profile as tenant ``<name><name_suffix>``; returns profile name -> API key.

    An existing tenant of that name is deleted and registered again (its old key stops working),
    so a run always starts from the profile's exact promises.
    """
    stub = tenant_pb2_grpc.TenantServiceStub(channel)
    md = (("authorization", f"Bearer {admin_key}"),)
    keys: dict[str, str] = {}
    for profile in profiles:
        name = f"{profile.name}{name_suffix}"
        spec = profile_to_spec(profile, name, policy)
        try:
            resp = await stub.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), metadata=md)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            await stub.DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=md)
            resp = await stub.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), metadata=md)
        keys[profile.name] = resp.api_key
    return keys
