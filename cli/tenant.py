"""``kvstrata tenant``: register, list, show, remove tenants and rotate their keys."""

from __future__ import annotations

import grpc
import typer
from rich.table import Table

from cli.options import MAX_UINT32, MAX_UINT64, finite
from cli.output import console, fail
from cli.state import admin_metadata, gateway_address
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc

tenant_app = typer.Typer(help="manage tenants", no_args_is_help=True)
SLO_CLASSES = {"interactive": 1, "standard": 2, "batch": 3}  # TenantSpec.slo_class wire numbers


@tenant_app.command("add")
def tenant_add(
    name: str,
    slo_class: str = typer.Option("standard", help="interactive | standard | batch"),
    ttft_slo_ms: float = typer.Option(0.0, min=0, callback=finite, help="0: the class default"),
    tpot_slo_ms: float = typer.Option(0.0, min=0, callback=finite, help="0: the class default"),
    min_tokens_per_s: float | None = typer.Option(None, min=0, callback=finite),
    weight: float = typer.Option(0.0, min=0, callback=finite, help="0: the class default"),
    kv_quota_bytes: int = typer.Option(0, min=0, max=MAX_UINT64),
    max_context_tokens: int = typer.Option(0, min=0, max=MAX_UINT32, help="0: the default (8192)"),
    namespace: str = typer.Option("", help="cache namespace (default: the tenant name)"),
    policy: str = typer.Option("", help="default KV policy spec for its requests, e.g. sentencekv-0.25"),
    allow_policy: list[str] | None = typer.Option(
        None, "--allow-policy", help="a KV policy its requests may name (repeat; default: every policy); "
        "`snapkv` allows every snapkv-* spec"),
    gateway: str | None = None,
) -> None:
    """Register a tenant; prints its API key once."""
    classes = SLO_CLASSES
    if slo_class not in classes:
        console.print(f"[red]unknown SLO class {slo_class!r}; known: {', '.join(classes)}[/red]")
        raise typer.Exit(2)
    spec = tenant_pb2.TenantSpec(
        name=name, slo_class=classes[slo_class], ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
        weight=weight, kv_quota_bytes=kv_quota_bytes, max_context_tokens=max_context_tokens,
        cache_namespace=namespace, policy=policy, allowed_policies=allow_policy or [],
    )
    if min_tokens_per_s is not None:
        spec.min_tokens_per_s = min_tokens_per_s
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
                tenant_pb2.RegisterTenantRequest(spec=spec), metadata=admin_metadata())
        except grpc.RpcError as err:
            fail(err)
    console.print(f"tenant {resp.tenant.spec.name} ({resp.tenant.tenant_id})")
    console.print(f"API key (shown once): [bold]{resp.api_key}[/bold]")


@tenant_app.command("list")
def tenant_list(gateway: str | None = None) -> None:
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).ListTenants(tenant_pb2.ListTenantsRequest(), metadata=admin_metadata())
        except grpc.RpcError as err:
            fail(err)
    table = Table("name", "class", "ttft_slo_ms", "min_tokens_per_s", "weight", "namespace")
    class_names = {number: name for name, number in SLO_CLASSES.items()}
    for t in resp.tenants:
        s = t.spec
        table.add_row(s.name, class_names.get(s.slo_class, str(s.slo_class)), f"{s.ttft_slo_ms:g}", f"{s.min_tokens_per_s:g}",
                      f"{s.weight:g}", s.cache_namespace)
    console.print(table)


@tenant_app.command("show")
def tenant_show(name: str, gateway: str | None = None) -> None:
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        try:
            t = stub.GetTenant(tenant_pb2.GetTenantRequest(name=name), metadata=admin_metadata()).tenant
            u = stub.GetUsage(tenant_pb2.GetUsageRequest(name=name), metadata=admin_metadata()).usage
        except grpc.RpcError as err:
            fail(err)
    console.print(t)
    console.print(u)


@tenant_app.command("rm")
def tenant_rm(name: str, gateway: str | None = None) -> None:
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        try:
            tenant_pb2_grpc.TenantServiceStub(ch).DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=admin_metadata())
        except grpc.RpcError as err:
            fail(err)
    console.print(f"deleted {name}")


@tenant_app.command("rotate-key")
def tenant_rotate_key(
    name: str,
    api_key: str | None = typer.Option(None, help="the tenant's own key (default: the admin key)"),
    gateway: str | None = None,
) -> None:
    """Replace a tenant's API key; prints the new key once (old keys stop at once)."""
    md = (("authorization", f"Bearer {api_key}"),) if api_key else admin_metadata()
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RotateKey(tenant_pb2.RotateKeyRequest(name=name), metadata=md)
        except grpc.RpcError as err:
            fail(err)
    console.print(f"new API key for {name} (shown once): [bold]{resp.api_key}[/bold]")
