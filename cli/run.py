"""``kvstrata run``: run workloads against the gateway."""

from __future__ import annotations

import asyncio
import json
from enum import Enum

import grpc
import typer

from cli.options import GatewayOpt, positive
from cli.output import CANCELLED_EXIT_CODE, EXIT_USAGE, console, die, fail
from cli.state import (
    RPC_TIMEOUT_S,
    admin_metadata,
    client_tls,
    gateway_address,
    gateway_aio_channel,
    gateway_channel,
    openai_api_url,
    state_dir,
)
from kvstrata.v1 import admin_pb2, admin_pb2_grpc


class Api(str, Enum):
    """The API a workload's calls go through."""

    grpc = "grpc"
    openai = "openai"


run_app = typer.Typer(help="Run workloads against the gateway.", no_args_is_help=True)


@run_app.command("deepresearch")
def run_deepresearch(
    duration: float = typer.Option(50.0, "--duration", callback=positive, help="arrival window, seconds"),
    tenants: int = typer.Option(4, "--tenants", min=1, max=4, help="number of demo tenant profiles to use (1-4)"),
    sessions_per_s: float = typer.Option(0.054, callback=positive,
                                         help="research sessions per second of one tenant share "
                                         "(the noisy tenant arrives at 4x this rate)"),
    seed: int = typer.Option(0, min=0, help="the plan's random seed (same seed: same sessions, prompts and pauses)"),
    max_subagents: int = typer.Option(3, min=2, max=6, help="sub-agents per research session (2..6)"),
    scheduler: str = typer.Option("", help="the scheduler the gateway must run (chosen at `kvstrata up "
                                  "--scheduler`); the run stops at once when it runs another "
                                  "(default: any)"),
    policy: str = typer.Option("", help="KV policy for every tenant"),
    gateway: str | None = GatewayOpt,
    reports: str = typer.Option("reports", metavar="DIR", help="where reports go: each run writes a folder "
                                "named by its start time under DIR/deepresearch and points DIR/latest at it"),
    replay: str = typer.Option("", "--replay", help="trace.jsonl of an earlier run (its report folder): send "
                               "its calls again with the recorded messages, arrivals and pauses, whatever the "
                               "model replies (for benchmarking)"),
    api: Api = typer.Option(Api.grpc, "--api",
                            help="the API the calls go through: kvstrata's gRPC, or the OpenAI-compatible HTTP "
                            "API with the official openai client (async, streaming)"),
    openai_url: str = typer.Option("", "--openai-url", help="with --api openai: the API root, "
                                   "http://host:port/v1 (default: the one `kvstrata up` printed)"),
) -> None:
    """Run the DeepResearch multi-agent workload against a running gateway.

    Registers the demo tenants (chat, analyst, indexer, noisy) afresh. A tenant of those names
    that an earlier run from here registered (its key, kept in the CLI's state directory's
    workload_keys.json, 0600, still works) is deleted and registered again with a new key; a
    tenant of such a name that someone else registered is left alone and the run stops (exit
    1) before changing any tenant or sending any request. A plan without a research
    session (a --duration too short for --sessions-per-s under --seed) is refused before
    anything runs, as a usage error (exit 2).
    """
    from workloads.deepresearch.config import WorkloadConfig
    from workloads.deepresearch.demo_config import demo_tenants
    from workloads.deepresearch.generator import generate_plan, no_session_message
    from workloads.deepresearch.job import ReportNotWritten, run_deepresearch_grpc
    from workloads.deepresearch.register import (
        KEYS_FILE,
        KeysNotSaved,
        TenantNameTaken,
        load_keys,
        register_tenants,
        save_or_unregister,
    )
    from workloads.deepresearch.register import RPC_TIMEOUT_S as REGISTER_TIMEOUT_S

    profiles = demo_tenants(sessions_per_s)[:tenants]
    cfg = WorkloadConfig(seed=seed, duration_s=duration, tenants=profiles, max_subagents=max_subagents)
    if not replay and not generate_plan(cfg).sessions:  # nothing would run: say so before connecting
        die(no_session_message(cfg, sessions_per_s), EXIT_USAGE)
    address = gateway_address(gateway)
    url = openai_api_url(openai_url) if api == Api.openai else ""
    if scheduler:
        with gateway_channel(gateway) as ch:
            try:
                resp = admin_pb2_grpc.AdminServiceStub(ch).Stats(
                    admin_pb2.StatsRequest(check_integrity=False), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                fail(err)
        running = json.loads(resp.stats_json)["scheduler"]["scheduler"]
        if running != scheduler:
            die(f"the gateway runs the {running} scheduler, not {scheduler}: `kvstrata down` then "
                f"`kvstrata up --scheduler {scheduler}`")
    admin_key = admin_metadata(gateway)[0][1].split(" ", 1)[1]
    keys_file = state_dir() / KEYS_FILE

    async def go() -> int:
        async with gateway_aio_channel(gateway) as ch:
            try:
                keys = await register_tenants(ch, admin_key, cfg.tenants, policy=policy,
                                              earlier_keys=load_keys(keys_file, address), on_interrupt=lambda: console.print(
                                                  "Ctrl-C: removing the tenants this run registered, the one under way "
                                                  f"once it answers (each call up to {REGISTER_TIMEOUT_S:.0f} s); Ctrl-C "
                                                  "again to stop"))
            except TenantNameTaken as err:
                try:
                    await save_or_unregister(ch, admin_key, keys_file, address, err.registered)
                except KeysNotSaved as lost:
                    die(f"{err}\n{lost}")
                die(str(err))
            try:  # profile names are the tenants' (no suffix)
                await save_or_unregister(ch, admin_key, keys_file, address, keys)
            except KeysNotSaved as err:
                die(str(err))
        try:
            out = await run_deepresearch_grpc(cfg, address, keys, admin_key=admin_key, root=reports,
                                              console=console, policy=policy, replay=replay or None,
                                              openai_url=url, tls=client_tls(address))
        except ReportNotWritten as err:
            die(str(err))
        return out.exit_code

    try:
        code = asyncio.run(go())
    except grpc.RpcError as err:  # registering the tenants or asking the scheduler failed
        fail(err)
    except KeyboardInterrupt:  # Ctrl-C: a registration under way took back what it registered
        # (register_tenants); 130 as every command cancelled so (typer's own exit for it, silent)
        console.print("cancelled (Ctrl-C)")
        raise typer.Exit(CANCELLED_EXIT_CODE) from None
    raise typer.Exit(code)
