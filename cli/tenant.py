"""``kvstrata tenant``: add, list, show, update and remove (``rm``, alias ``remove``) tenants,
and rotate their keys (``rotate-key``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from enum import Enum
from typing import NoReturn

import grpc
import typer
from rich.table import Table

from cli.options import MAX_UINT32, GatewayOpt, TenantNameArg, finite, uint64
from cli.options import api_key as api_key_value
from cli.output import console, fail
from cli.state import RPC_TIMEOUT_S, admin_metadata, gateway_channel
from kvstrata.v1 import tenant_pb2, tenant_pb2_grpc
from tenants.model import SLO_CLASS_DEFAULTS

tenant_app = typer.Typer(help="Manage tenants: add, list, show, update, rm, rotate-key.",
                         no_args_is_help=True)
SLO_CLASSES = {"interactive": 1, "standard": 2, "batch": 3}  # TenantSpec.slo_class wire numbers
OwnKeyOpt = typer.Option(None, "--api-key", envvar="KVSTRATA_API_KEY", callback=api_key_value,
                         help="authorize with the tenant's own key (it reaches only its own tenant; default: the "
                         "admin key); prefer KVSTRATA_API_KEY: a command line is visible to every local user")


OWN_KEY_HINT = (" (the CLI sent the tenant key of --api-key / KVSTRATA_API_KEY; unset KVSTRATA_API_KEY, "
                "or run `env -u KVSTRATA_API_KEY kvstrata tenant ...`, to act with the admin key)")
"""Appended to a PERMISSION_DENIED of ``show`` / ``rotate-key`` sent with a tenant's own key.
Regression (s41 new-user walkthrough): with ``KVSTRATA_API_KEY`` exported, as the README's
walkthrough has it, ``tenant show bob`` said only "a tenant key reaches only its own tenant",
while ``tenant list`` and ``update`` in the same shell acted with the admin key."""


def key_metadata(api_key: str | None, gateway: str | None) -> tuple[tuple[str, str], ...]:
    """``api_key`` as gRPC metadata, else the admin key's for ``gateway``."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else admin_metadata(gateway)


def fail_own_key(err: grpc.RpcError, api_key: str | None) -> NoReturn:
    """``fail(err)``, saying which key was sent when a tenant's own key was refused for
    another tenant (``OWN_KEY_HINT``)."""
    if api_key and err.code() == grpc.StatusCode.PERMISSION_DENIED:
        fail(err, lambda line: line + OWN_KEY_HINT)
    fail(err)


class SloClass(str, Enum):
    """``--slo-class`` values (click refuses any other, a usage error)."""

    interactive = "interactive"
    standard = "standard"
    batch = "batch"


def class_defaults(field: str) -> str:
    """``"interactive 1000, standard 5000, batch 60000"``: ``field``'s default per SLO class
    (``tenants.model.SLO_CLASS_DEFAULTS``), for help texts."""
    return ", ".join(f"{cls.value} {getattr(d, field):g}" for cls, d in SLO_CLASS_DEFAULTS.items())


@tenant_app.command("add")
def tenant_add(
    name: str = typer.Argument(..., metavar="NAME", help="the new tenant's name: 1-63 lowercase letters, "
                               "digits, _ or -, not starting with _ or -"),
    slo_class: SloClass = typer.Option(SloClass.standard, help="the order the kvstrata scheduler serves "
                                       "classes in (interactive first), and the targets' defaults"),
    ttft_slo_ms: float = typer.Option(0.0, min=0, callback=finite, help="time-to-first-token target, ms "
                                      f"(0: the class default, {class_defaults('ttft_slo_ms')})"),
    tpot_slo_ms: float = typer.Option(0.0, min=0, callback=finite, help="time-per-output-token target, ms "
                                      f"(0: the class default, {class_defaults('tpot_slo_ms')})"),
    min_tokens_per_s: float | None = typer.Option(
        None, min=0, callback=finite, help="token-rate floor while it has work waiting, tokens/s "
        f"(default: the class's, {class_defaults('min_tokens_per_s')})"),
    weight: float = typer.Option(0.0, min=0, callback=finite, help="its share of what is left after "
                                 f"floors (0: the class default, {class_defaults('weight')})"),
    kv_quota_bytes: int = typer.Option(0, min=0, callback=uint64, help="device-tier KV bytes guaranteed "
                                       "to it (0: none; at most 2^64 - 1)"),
    max_context_tokens: int = typer.Option(0, min=0, max=MAX_UINT32, help="longest prompt + output, "
                                           "tokens (0: the default, 8192)"),
    namespace: str = typer.Option("", help="cache namespace shared with tenants naming the same one (default: the tenant's own)"),
    policy: str = typer.Option("", help="default KV policy spec for its requests, e.g. sentencekv-0.25"),
    allow_policy: list[str] | None = typer.Option(
        None, "--allow-policy", help="a KV policy its requests may name (repeat; default: every policy); "
        "`snapkv` allows every snapkv-* spec"),
    gateway: str | None = GatewayOpt,
) -> None:
    """Register a tenant; prints its API key once (stored only as a salted hash)."""
    spec = tenant_pb2.TenantSpec(
        name=name, slo_class=SLO_CLASSES[slo_class.value], ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
        weight=weight, kv_quota_bytes=kv_quota_bytes, max_context_tokens=max_context_tokens,
        cache_namespace=namespace, policy=policy, allowed_policies=allow_policy or [],
    )
    if min_tokens_per_s is not None:
        spec.min_tokens_per_s = min_tokens_per_s
    with gateway_channel(gateway) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
                tenant_pb2.RegisterTenantRequest(spec=spec), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    console.print(f"tenant {resp.tenant.spec.name} ({resp.tenant.tenant_id})")
    console.print(f"API key (shown once): [bold]{resp.api_key}[/bold]")


@tenant_app.command("list")
def tenant_list(gateway: str | None = GatewayOpt) -> None:
    """List the tenants: SLO class, TTFT and TPOT targets, floor, weight, cache namespace, KV policy."""
    with gateway_channel(gateway) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).ListTenants(tenant_pb2.ListTenantsRequest(), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    console.print(tenants_table(resp.tenants))


def tenants_table(tenants: Iterable[tenant_pb2.Tenant]) -> Table:
    """The tenants one row each, headed and filled as ``tenant show`` words them (an unset
    field says what applies: "class default")."""
    table = Table("name", "SLO class", "TTFT target (ms)", "TPOT target (ms)", "floor (tokens/s)", "weight",
                  "cache namespace", "KV policy")
    for t in tenants:
        s = t.spec
        table.add_row(s.name, _class_name(s.slo_class), _or(s.ttft_slo_ms, "class default"),
                      _or(s.tpot_slo_ms, "class default"), _floor(s), _or(s.weight, "class default"),
                      s.cache_namespace or "own", s.policy or "node default")
    return table


def _class_name(number: int) -> str:
    return {n: name for name, n in SLO_CLASSES.items()}.get(number, str(number))


def _floor(s: tenant_pb2.TenantSpec) -> str:
    return f"{s.min_tokens_per_s:g}" if s.HasField("min_tokens_per_s") else "class default"


def _or(value: float, unset: str) -> str:
    return f"{value:g}" if value else unset


def tenant_table(t: tenant_pb2.Tenant, u: tenant_pb2.Usage) -> Table:
    """One tenant as a two-column table: its spec (unset fields say what applies), then usage;
    the KV blocks it holds now split into its requests' and its idle sessions' (the latter are
    what ``kvstrata status`` counts "by sessions", there for every tenant together)."""
    s = t.spec
    cached = u.cached_tokens
    table = Table("field", "value", title=f"tenant {s.name}", title_justify="left")
    for field, value in (
        ("tenant id", t.tenant_id),
        ("created", datetime.fromtimestamp(t.created_at_s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")),
        ("SLO class", _class_name(s.slo_class)),
        ("TTFT target (ms)", _or(s.ttft_slo_ms, "class default")),
        ("TPOT target (ms)", _or(s.tpot_slo_ms, "class default")),
        ("floor (tokens/s)", _floor(s)),
        ("weight", _or(s.weight, "class default")),
        ("KV quota (bytes)", _or(s.kv_quota_bytes, "none")),
        ("max context (tokens)", _or(s.max_context_tokens, "default")),
        ("cache namespace", s.cache_namespace or "own (not shared)"),
        ("KV policy", s.policy or "node default"),
        ("allowed policies", ", ".join(s.allowed_policies) or "every policy"),
        ("requests", str(u.requests)),
        ("rejected / preempted", f"{u.rejected} / {u.preempted}"),
        ("prompt / completion tokens", f"{u.prompt_tokens} / {u.completion_tokens}"),
        ("cached tokens: device / host / spill RAM / disk",
         f"{cached.device} / {cached.host} / {cached.spill_ram} / {cached.spill_disk}"),
        ("KV blocks held now, all nodes",
         f"{u.blocks_held} ({u.blocks_held - u.session_blocks_held} by requests, {u.session_blocks_held} by idle sessions)"),
    ):
        table.add_row(field, value)
    return table


@tenant_app.command("show")
def tenant_show(
    name: str = TenantNameArg,
    api_key: str | None = OwnKeyOpt,
    gateway: str | None = GatewayOpt,
) -> None:
    """One tenant's settings, usage counters (stored across restarts) and the KV blocks it
    holds now on the healthy nodes: its requests' and its idle sessions' (`status` counts the
    latter "by sessions", for every tenant together)."""
    md = key_metadata(api_key, gateway)
    with gateway_channel(gateway) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        try:
            t = stub.GetTenant(tenant_pb2.GetTenantRequest(name=name), metadata=md, timeout=RPC_TIMEOUT_S).tenant
            u = stub.GetUsage(tenant_pb2.GetUsageRequest(name=name), metadata=md, timeout=RPC_TIMEOUT_S).usage
        except grpc.RpcError as err:
            fail_own_key(err, api_key)
    console.print(tenant_table(t, u))


@tenant_app.command("update")
def tenant_update(
    name: str = TenantNameArg,
    slo_class: SloClass | None = typer.Option(None, help="the order the kvstrata scheduler serves classes in"),
    ttft_slo_ms: float | None = typer.Option(None, min=0, callback=finite, help="time-to-first-token target, ms"),
    tpot_slo_ms: float | None = typer.Option(None, min=0, callback=finite, help="time-per-output-token target, ms"),
    min_tokens_per_s: float | None = typer.Option(None, min=0, callback=finite,
                                                  help="token-rate floor while it has work waiting, tokens/s"),
    weight: float | None = typer.Option(None, min=0, callback=finite, help="its share of what is left after floors"),
    kv_quota_bytes: int | None = typer.Option(None, min=0, callback=uint64, help="device-tier KV bytes guaranteed"),
    max_context_tokens: int | None = typer.Option(None, min=1, max=MAX_UINT32, help="longest prompt + output, tokens"),
    namespace: str | None = typer.Option(None, help="cache namespace (\"\": the tenant's own)"),
    policy: str | None = typer.Option(None, help="default KV policy spec (\"\": the node's default)"),
    allow_policy: list[str] | None = typer.Option(None, "--allow-policy", help="replaces the allowed KV policies "
                                                  "(repeat)"),
    gateway: str | None = GatewayOpt,
) -> None:
    """Change some of a tenant's settings; the ones not given keep their current values (a
    new `--slo-class` does not reset the targets to its defaults). Its keys stay valid."""
    with gateway_channel(gateway) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        try:
            spec = stub.GetTenant(tenant_pb2.GetTenantRequest(name=name), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S).tenant.spec
            given = {"ttft_slo_ms": ttft_slo_ms, "tpot_slo_ms": tpot_slo_ms, "min_tokens_per_s": min_tokens_per_s,
                     "weight": weight, "kv_quota_bytes": kv_quota_bytes, "max_context_tokens": max_context_tokens,
                     "cache_namespace": namespace, "policy": policy}
            for field, value in given.items():
                if value is not None:
                    setattr(spec, field, value)
            if slo_class is not None:
                spec.slo_class = SLO_CLASSES[slo_class.value]
            if allow_policy is not None:
                spec.ClearField("allowed_policies")
                spec.allowed_policies.extend(allow_policy)
            stub.UpdateTenant(tenant_pb2.UpdateTenantRequest(name=name, spec=spec), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    changed = [f for f, v in given.items() if v is not None]
    changed += ["slo_class"] * (slo_class is not None) + ["allowed_policies"] * (allow_policy is not None)
    console.print(f"updated {name}: {', '.join(changed) or 'nothing changed'} (`kvstrata tenant show {name}`)")


@tenant_app.command("remove", hidden=True)  # an alias: "remove" is what people try first
@tenant_app.command("rm")
def tenant_rm(name: str = TenantNameArg, gateway: str | None = GatewayOpt) -> None:
    """Delete a tenant: its API keys stop working at once."""
    with gateway_channel(gateway) as ch:
        try:
            tenant_pb2_grpc.TenantServiceStub(ch).DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    console.print(f"deleted {name}")


@tenant_app.command("rotate-key")
def tenant_rotate_key(
    name: str = TenantNameArg,
    api_key: str | None = OwnKeyOpt,
    gateway: str | None = GatewayOpt,
) -> None:
    """Replace a tenant's API key; prints the new key once. The old key stops at once, and its
    in-flight requests end (UNAUTHENTICATED / HTTP 401) on every gateway within about 5 s."""
    md = key_metadata(api_key, gateway)
    with gateway_channel(gateway) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RotateKey(tenant_pb2.RotateKeyRequest(name=name), metadata=md, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail_own_key(err, api_key)
    console.print(f"new API key for {name} (shown once): [bold]{resp.api_key}[/bold]")
