"""`kvstrata` command line: start/stop the services, manage tenants, generate, run workloads.

Everything but ``up``/``down`` talks gRPC to the gateway. The gateway address and the admin
key come from flags, the environment (KVSTRATA_GATEWAY, KVSTRATA_ADMIN_KEY) or the state dir
that ``kvstrata up`` writes (~/.kvstrata).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import grpc
import pydantic
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstrata.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tenant_pb2,
    tenant_pb2_grpc,
)
from services.config import ServiceConfig, load_config
from tenants.keys import new_api_key, read_key_file, write_key_file

app = typer.Typer(help="kvstrata: multi-tenant tiered KV-cache serving on Ray", no_args_is_help=True)
tenant_app = typer.Typer(help="manage tenants", no_args_is_help=True)
run_app = typer.Typer(help="run workloads against the gateway", no_args_is_help=True)
admin_app = typer.Typer(help="operator tasks", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
app.add_typer(admin_app, name="admin")
app.add_typer(run_app, name="run")
SLO_CLASSES = {"interactive": 1, "standard": 2, "batch": 3}  # TenantSpec.slo_class wire numbers
console = Console(width=None if sys.stdout.isatty() else 160)  # piped: keep tables readable
STATE_DIR = Path(os.environ.get("KVSTRATA_STATE_DIR", "~/.kvstrata")).expanduser()
ConfigOpt = typer.Option(None, "--config", "-c", exists=True, dir_okay=False, help="service YAML config")


def _state() -> dict:
    path = STATE_DIR / "gateway.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _gateway(address: Optional[str]) -> str:
    addr = address or os.environ.get("KVSTRATA_GATEWAY") or _state().get("address")
    if not addr:
        console.print("[red]no gateway address: run `kvstrata up` or pass --gateway[/red]")
        raise typer.Exit(2)
    return addr


def _admin_key_file() -> Path:
    return Path(_state().get("state_dir", STATE_DIR)) / "admin_key"


def _admin_md() -> tuple[tuple[str, str], ...]:
    key = os.environ.get("KVSTRATA_ADMIN_KEY") or read_key_file(_admin_key_file())
    if not key:
        console.print("[red]no admin key: set KVSTRATA_ADMIN_KEY (lost? `kvstrata admin rotate-key --local`)[/red]")
        raise typer.Exit(2)
    return (("authorization", f"Bearer {key}"),)


INPUT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.ALREADY_EXISTS}
"""Statuses that mean the command's input was wrong: exit code 2 (as a usage error); others 1."""
MAX_UINT32, MAX_UINT64 = 2**32 - 1, 2**64 - 1


def _fail(err: grpc.RpcError) -> None:
    """Print a failed call as one line, ``CODE: details``; exit 2 for input errors, else 1."""
    details = (err.details() or "").splitlines()
    console.print(f"[red]{err.code().name}[/red]: {escape(details[0] if details else '')}", soft_wrap=True)
    raise typer.Exit(2 if err.code() in INPUT_ERRORS else 1)


def _finite(value: float | None) -> float | None:
    """Typer callback: refuse nan and infinities (FloatRange lets nan through)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _positive(value: float) -> float:
    """Typer callback: a finite number > 0."""
    if not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a finite number > 0")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reachable(address: str, timeout_s: float = 2.0) -> bool:
    """True when a TCP connection to ``host:port`` opens within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _stop_local_ray(temp_dir: str, gcs_port: int = 0) -> int:
    """Terminate the processes of the Ray cluster ``kvstrata up`` started under ``temp_dir``.

    The cluster's processes are those whose command line carries its session directory (under
    ``temp_dir``: GCS, raylet, workers) or its GCS address (``--address=<ip>:<gcs_port>``: the
    Ray client server), and their descendants (the dashboard and runtime-env agents rename
    themselves ``ray::...``). Other Ray clusters on the machine match none of these, so they
    are left alone (unlike ``ray stop``, which stops every cluster of the user). Returns the
    number of processes stopped.
    """
    import psutil

    gcs = f":{gcs_port}" if gcs_port else None
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or ()
            if proc.pid == os.getpid():
                continue
            if any(temp_dir in part or (gcs and part.startswith("--address=") and part.endswith(gcs))
                   for part in cmdline):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found.pop(os.getpid(), None)
    ours = list(found.values())
    for proc in ours:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(ours, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return len(ours)


@app.command()
def up(config: Optional[Path] = ConfigOpt, address: Optional[str] = typer.Option(
        None, help="join this Ray cluster (e.g. auto); default: start a local one"),
        scheduler: str = typer.Option("", help="fcfs | priority | vtc | kvstrata (overrides the config)")) -> None:
    """Start the global scheduler, cache nodes and gateway; print the gateway address.

    Without ``--address`` it starts a local Ray cluster of its own (under a temp directory that
    ``kvstrata down`` uses to stop exactly that cluster).
    """
    import ray

    from services.launcher import start_services

    try:
        cfg = load_config(config)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        console.print(f"[red]{escape(str(config))}: {'.'.join(map(str, err['loc']))}: {escape(err['msg'])}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    except (OSError, yaml.YAMLError) as exc:
        console.print(f"[red]{escape(str(config))}: {escape(str(exc).splitlines()[0])}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    if scheduler:
        try:
            cfg = ServiceConfig.model_validate({**cfg.model_dump(), "scheduler": scheduler})
        except pydantic.ValidationError as exc:
            console.print(f"[red]--scheduler: {escape(exc.errors()[0]['msg'])}[/red]")
            raise typer.Exit(2) from None
    cfg = cfg.model_copy(update={"detached": True})
    state = _state()
    if state.get("address") and _reachable(state["address"]):
        console.print(f"[red]kvstrata is already up at {state['address']}; run `kvstrata down` first[/red]")
        raise typer.Exit(1)
    if cfg.gateway_port and _reachable(f"{cfg.gateway_host}:{cfg.gateway_port}", 0.5):
        console.print(f"[red]port {cfg.gateway_port} on {cfg.gateway_host} is taken; set gateway_port in "
                      "the config (0 = any free port)[/red]")
        raise typer.Exit(1)
    started_ray = address is None
    temp_dir = ""
    if started_ray:
        ray_port = _free_port()
        temp_dir = tempfile.mkdtemp(prefix="kvstrata-ray-")
        resources = json.dumps({cfg.cache_node_resource: cfg.num_cache_nodes,
                                cfg.spill_node_resource: max(1, cfg.num_spill_nodes)})
        subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={ray_port}",
                        f"--temp-dir={temp_dir}", f"--resources={resources}", "--include-dashboard=false",
                        "--disable-usage-stats"], check=True, capture_output=True)
        address = f"127.0.0.1:{ray_port}"
    try:
        ray.init(address=address, namespace=cfg.namespace, log_to_driver=False)
        with console.status("loading the model on every cache node ..."):
            # a joined cluster (--address) binds the data plane on node IPs (it may span machines)
            services = start_services(cfg, None if started_ray else address)
    except Exception as exc:  # noqa: BLE001 -- leave nothing half-started behind, whatever failed
        if temp_dir:
            _stop_local_ray(temp_dir, ray_port)
        console.print(f"[red]kvstrata up failed:[/red] {escape(str(exc).splitlines()[0] if str(exc) else repr(exc))}")
        raise typer.Exit(1) from None
    if not started_ray and "://" not in address:  # `auto` -> the cluster's GCS address, for `down`
        address = ray.get_runtime_context().gcs_address
    cfg.state_path.mkdir(parents=True, exist_ok=True)
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / "gateway.json").write_text(json.dumps({
        "address": services.address, "ray_address": address, "started_ray": started_ray,
        "ray_temp_dir": temp_dir, "namespace": cfg.namespace, "state_dir": str(cfg.state_path),
    }))
    console.print(f"gateway: [bold]{services.address}[/bold]")
    console.print(f"admin key: {cfg.state_path / 'admin_key'} (or set KVSTRATA_ADMIN_KEY)")


SERVICE_ACTOR_NAME = re.compile(r"gateway|global_scheduler|(cache|spill)_node_\d+")
"""Names of the actors ``start_services`` places (``services.launcher``)."""


def _ray_target(state: dict) -> str | None:
    """The Ray address ``down`` connects to, or None when nothing answers there.

    ``auto`` and ``ray://`` addresses are Ray's to resolve (``auto`` finds the machine's
    running cluster), so they are returned as they are; a ``host:port`` must accept a TCP
    connection.
    """
    address = state.get("ray_address", "")
    if address == "auto" or "://" in address:
        return address
    return address if address and _reachable(address) else None


def _service_actor_names(named: list[dict], namespace: str) -> list[str]:
    """kvstrata's actors among ``ray.util.list_named_actors(all_namespaces=True)``: those in
    ``namespace`` whose names ``start_services`` gives (gateway, scheduler, cache and spill
    nodes); anything else on the cluster is the user's."""
    return [a["name"] for a in named if a["namespace"] == namespace and SERVICE_ACTOR_NAME.fullmatch(a["name"])]


def _kill_services(namespace: str, gateway_address: str, timeout_s: float = 10.0) -> int:
    """Kill kvstrata's actors in ``namespace`` on the connected cluster and wait (up to
    ``timeout_s``) until the gateway's port no longer answers. Returns the number killed."""
    import ray

    names = _service_actor_names(ray.util.list_named_actors(all_namespaces=True), namespace)
    for name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(name, namespace=namespace))
    deadline = time.monotonic() + timeout_s
    while gateway_address and _reachable(gateway_address, 0.2) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(names)


@app.command()
def down() -> None:
    """Stop the services started by `kvstrata up`: its actors on the Ray cluster it joined
    (that cluster keeps running), or the local Ray cluster it started (only that one)."""
    import ray

    state = _state()
    if not state:
        console.print("nothing to stop")
        return
    try:
        target = _ray_target(state)
        if target is not None:
            try:
                ray.init(address=target, namespace=state["namespace"], log_to_driver=False)
            except (ConnectionError, RuntimeError) as exc:
                console.print(f"Ray at {target} is not reachable ({escape(str(exc).splitlines()[0])}); "
                              "removing the stale state")
            else:
                killed = _kill_services(state["namespace"], state.get("address", ""))
                ray.shutdown()
                console.print(f"stopped {killed} kvstrata actors")
        else:
            console.print(f"Ray at {state.get('ray_address')} is not reachable; removing the stale state")
    finally:
        if state.get("started_ray") and state.get("ray_temp_dir"):
            _stop_local_ray(state["ray_temp_dir"], int(state["ray_address"].rpartition(":")[2] or 0))
            shutil.rmtree(state["ray_temp_dir"], ignore_errors=True)
        elif state.get("started_ray"):
            console.print("[yellow]state from an older kvstrata: its local Ray cluster was not stopped "
                          "(`ray stop` stops it, and every other Ray cluster of this user)[/yellow]")
        (STATE_DIR / "gateway.json").unlink(missing_ok=True)
    console.print("stopped")


@app.command()
def status(gateway: Optional[str] = None, integrity: bool = True) -> None:
    """Per-node pool usage, queue and session counts."""
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            resp = admin_pb2_grpc.AdminServiceStub(ch).Stats(
                admin_pb2.StatsRequest(check_integrity=integrity), metadata=_admin_md(), timeout=30)
        except grpc.RpcError as err:
            _fail(err)
    table = Table("node", "blocks", "used", "cached", "free", "running", "waiting", "integrity")
    for n in resp.nodes:
        table.add_row(n.node_id, str(n.num_blocks), str(n.used_blocks), str(n.cached_blocks),
                      str(n.free_blocks), str(n.running), str(n.waiting),
                      "ok" if n.integrity_ok else f"[red]{n.integrity_error}[/red]")
    console.print(table)
    console.print(f"queued: {resp.queued}  sessions: {resp.sessions}")


@tenant_app.command("add")
def tenant_add(
    name: str,
    slo_class: str = typer.Option("standard", help="interactive | standard | batch"),
    ttft_slo_ms: float = typer.Option(0.0, min=0, callback=_finite, help="0: the class default"),
    tpot_slo_ms: float = typer.Option(0.0, min=0, callback=_finite, help="0: the class default"),
    min_tokens_per_s: Optional[float] = typer.Option(None, min=0, callback=_finite),
    weight: float = typer.Option(0.0, min=0, callback=_finite, help="0: the class default"),
    kv_quota_bytes: int = typer.Option(0, min=0, max=MAX_UINT64),
    max_context_tokens: int = typer.Option(0, min=0, max=MAX_UINT32, help="0: the default (8192)"),
    namespace: str = typer.Option("", help="cache namespace (default: the tenant name)"),
    policy: str = typer.Option("", help="default KV policy spec for its requests, e.g. sentencekv-0.25"),
    allow_policy: Optional[list[str]] = typer.Option(
        None, "--allow-policy", help="a KV policy its requests may name (repeat; default: every policy); "
        "`snapkv` allows every snapkv-* spec"),
    gateway: Optional[str] = None,
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
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
                tenant_pb2.RegisterTenantRequest(spec=spec), metadata=_admin_md())
        except grpc.RpcError as err:
            _fail(err)
    console.print(f"tenant {resp.tenant.spec.name} ({resp.tenant.tenant_id})")
    console.print(f"API key (shown once): [bold]{resp.api_key}[/bold]")


@tenant_app.command("list")
def tenant_list(gateway: Optional[str] = None) -> None:
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).ListTenants(tenant_pb2.ListTenantsRequest(), metadata=_admin_md())
        except grpc.RpcError as err:
            _fail(err)
    table = Table("name", "class", "ttft_slo_ms", "min_tokens_per_s", "weight", "namespace")
    class_names = {number: name for name, number in SLO_CLASSES.items()}
    for t in resp.tenants:
        s = t.spec
        table.add_row(s.name, class_names.get(s.slo_class, str(s.slo_class)), f"{s.ttft_slo_ms:g}", f"{s.min_tokens_per_s:g}",
                      f"{s.weight:g}", s.cache_namespace)
    console.print(table)


@tenant_app.command("show")
def tenant_show(name: str, gateway: Optional[str] = None) -> None:
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        stub = tenant_pb2_grpc.TenantServiceStub(ch)
        try:
            t = stub.GetTenant(tenant_pb2.GetTenantRequest(name=name), metadata=_admin_md()).tenant
            u = stub.GetUsage(tenant_pb2.GetUsageRequest(name=name), metadata=_admin_md()).usage
        except grpc.RpcError as err:
            _fail(err)
    console.print(t)
    console.print(u)


@tenant_app.command("rm")
def tenant_rm(name: str, gateway: Optional[str] = None) -> None:
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            tenant_pb2_grpc.TenantServiceStub(ch).DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=_admin_md())
        except grpc.RpcError as err:
            _fail(err)
    console.print(f"deleted {name}")


@tenant_app.command("rotate-key")
def tenant_rotate_key(
    name: str,
    api_key: Optional[str] = typer.Option(None, help="the tenant's own key (default: the admin key)"),
    gateway: Optional[str] = None,
) -> None:
    """Replace a tenant's API key; prints the new key once (old keys stop at once)."""
    md = (("authorization", f"Bearer {api_key}"),) if api_key else _admin_md()
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            resp = tenant_pb2_grpc.TenantServiceStub(ch).RotateKey(tenant_pb2.RotateKeyRequest(name=name), metadata=md)
        except grpc.RpcError as err:
            _fail(err)
    console.print(f"new API key for {name} (shown once): [bold]{resp.api_key}[/bold]")


@admin_app.command("rotate-key")
def admin_rotate_key(
    local: bool = typer.Option(False, "--local", help="rotate in the tenant database of the state dir "
                               "directly (when the admin key is lost; run where `kvstrata up` ran)"),
    gateway: Optional[str] = None,
) -> None:
    """Replace the admin key and save the new one to the state dir's admin_key file (0600).

    Over gRPC with the current admin key by default; ``--local`` needs no key: it writes the
    new key file first, then commits its hash to the tenant database.
    """
    path = _admin_key_file()
    if local:
        db = path.parent / "tenants.sqlite"
        if not db.exists():
            console.print(f"[red]no tenant database at {db}[/red]")
            raise typer.Exit(2)
        from tenants.store import TenantStore

        key = new_api_key()
        write_key_file(path, key)
        store = TenantStore(db)
        try:
            store.set_admin_key(key)
        finally:
            store.close()
    else:
        with grpc.insecure_channel(_gateway(gateway)) as ch:
            try:
                key = admin_pb2_grpc.AdminServiceStub(ch).RotateAdminKey(
                    admin_pb2.RotateAdminKeyRequest(), metadata=_admin_md(), timeout=30).api_key
            except grpc.RpcError as err:
                _fail(err)
        try:
            write_key_file(path, key)
        except OSError as exc:
            console.print(f"[red]could not save the new admin key to {path} ({exc}); it is: {key}[/red]")
            raise typer.Exit(1) from None
    console.print(f"admin key rotated; the new key is in {path} (the old one no longer works)")


@app.command()
def generate(
    prompt: str, api_key: str = typer.Option(..., envvar="KVSTRATA_API_KEY"),
    max_tokens: int = typer.Option(128, min=1, max=MAX_UINT32),
    temperature: float = typer.Option(0.0, min=0, max=100, callback=_finite, help="0: greedy"),
    session: str = "",
    policy: str = typer.Option("", help="KV policy spec for this request (default: the tenant's)"),
    gateway: Optional[str] = None,
) -> None:
    """Stream a chat completion to the terminal."""
    req = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature),
        session_id=session, policy=policy,
    )
    with grpc.insecure_channel(_gateway(gateway)) as ch:
        try:
            for msg in inference_pb2_grpc.InferenceServiceStub(ch).Generate(
                    req, metadata=(("authorization", f"Bearer {api_key}"),)):
                kind = msg.WhichOneof("event")
                if kind == "delta":
                    print(msg.delta.text, end="", flush=True)
                elif kind == "finished":
                    f = msg.finished
                    print()
                    console.print(f"[dim]{f.finish_reason}: {f.prompt_tokens} prompt tokens "
                                  f"({f.cached_tokens.device} cached), {f.completion_tokens} generated, "
                                  f"TTFT {f.ttft_ms:.0f} ms, TPOT {f.tpot_ms:.0f} ms[/dim]")
        except grpc.RpcError as err:
            _fail(err)


@run_app.command("deepresearch")
def run_deepresearch(
    duration: float = typer.Option(50.0, "--duration", callback=_positive, help="arrival window, seconds"),
    tenants: int = typer.Option(4, "--tenants", min=1, max=4, help="number of demo tenant profiles to use (1-4)"),
    sessions_per_s: float = typer.Option(0.054, callback=_positive,
                                         help="one tenant share of research sessions per second"),
    seed: int = typer.Option(0, min=0),
    max_subagents: int = typer.Option(3, min=2, max=6, help="sub-agents per research session (2..6)"),
    scheduler: str = typer.Option("", help="the scheduler the gateway must run (chosen at `kvstrata up "
                                  "--scheduler`); the run stops at once when it runs another"),
    policy: str = typer.Option("", help="KV policy for every tenant"),
    gateway: Optional[str] = None, reports: str = "reports",
) -> None:
    """Run the DeepResearch multi-agent workload against a running gateway.

    Registers the demo tenants (chat, analyst, indexer, noisy) afresh: tenants of those names
    already in the store are deleted and re-registered with new keys.
    """
    from workloads.deepresearch.config import WorkloadConfig
    from workloads.deepresearch.demo_config import demo_tenants
    from workloads.deepresearch.job import run_deepresearch_grpc
    from workloads.deepresearch.register import register_tenants

    address = _gateway(gateway)
    if scheduler:
        with grpc.insecure_channel(address) as ch:
            try:
                resp = admin_pb2_grpc.AdminServiceStub(ch).Stats(
                    admin_pb2.StatsRequest(check_integrity=False), metadata=_admin_md(), timeout=30)
            except grpc.RpcError as err:
                _fail(err)
        running = json.loads(resp.stats_json)["scheduler"]["scheduler"]
        if running != scheduler:
            console.print(f"[red]the gateway runs the {running} scheduler, not {scheduler}: "
                          f"`kvstrata down` then `kvstrata up --scheduler {scheduler}`[/red]")
            raise typer.Exit(2)
    profiles = demo_tenants(sessions_per_s)[:tenants]
    cfg = WorkloadConfig(seed=seed, duration_s=duration, tenants=profiles, max_subagents=max_subagents)
    admin_key = _admin_md()[0][1].split(" ", 1)[1]

    async def go() -> int:
        async with grpc.aio.insecure_channel(address) as ch:
            keys = await register_tenants(ch, admin_key, cfg.tenants, policy=policy)
        out = await run_deepresearch_grpc(cfg, address, keys, admin_key=admin_key, root=reports, console=console)
        return out.exit_code

    raise typer.Exit(asyncio.run(go()))


if __name__ == "__main__":
    app()
