"""One DeepResearch job end to end: plan, run, report, summary, exit code.

The entry points ``make demo`` and ``kvstrata run deepresearch`` call
:func:`run_deepresearch_grpc` (or :func:`run_deepresearch` with their own client)
and exit with ``outcome.exit_code``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from services.grpc_messages import client_channel_options
from services.tls import ClientTls, open_aio_channel
from workloads.deepresearch.client import InferenceClient, StatsProbe
from workloads.deepresearch.config import WorkloadConfig
from workloads.deepresearch.generator import generate_plan
from workloads.deepresearch.grpc_client import GrpcInferenceClient
from workloads.deepresearch.metrics import compute_report, exit_code
from workloads.deepresearch.openai_client import OpenAIInferenceClient
from workloads.deepresearch.report import write_report
from workloads.deepresearch.runner import RunOptions, RunResult, run_workload
from workloads.deepresearch.stats_probe import gateway_scheduler, grpc_stats_probe
from workloads.deepresearch.summary import print_summary
from workloads.deepresearch.trace import load_replay


class ReportNotWritten(RuntimeError):
    """A run's report folder could not be written (its disk full, ``root`` unusable); the
    run's summary was printed first. Regression (s40 diskfull): the ``OSError`` left the
    command with a traceback, the outcome of a run of minutes never shown."""


@dataclass(frozen=True)
class JobOutcome:
    """Where the report went, what it says, and the process exit code (1: nothing succeeded)."""

    run_dir: Path
    report: dict[str, Any]
    exit_code: int
    result: RunResult


async def run_deepresearch(
    config: WorkloadConfig,
    client: InferenceClient,
    api_keys: Mapping[str, str],
    *,
    options: RunOptions | None = None,
    stats_probe: StatsProbe | None = None,
    root: str | Path = "reports",
    console: Console | None = None,
    replay: str | Path | None = None,
    scheduler: str = "",
    policy: str = "",
) -> JobOutcome:
    """Generate the plan for ``config`` (or replay a trace), run it, write and print the report.

    Args:
        config: the workload (tenants, seed, duration, ...).
        client: any :class:`InferenceClient`.
        api_keys: tenant name -> API key, for every tenant of ``config``.
        options: runner options (time scale, progress, ...); by default real time with
            session ids prefixed ``run<unix time>-<8 random hex>:`` so runs never share a session.
        stats_probe: optional server-stats sampler for the time series.
        root: reports root; the run goes to ``root/deepresearch/<timestamp>`` (``<timestamp>-<n>``
            when another run took that second).
        console: where progress and the summary print.
        replay: a ``trace.jsonl`` of an earlier run: its calls are sent again with their
            recorded messages, arrivals and pauses (:func:`workloads.deepresearch.trace.load_replay`);
            ``config`` still gives the tenants.
        scheduler / policy: the server's scheduler and the tenants' KV policy, for the
            report's header ("" = not known / each node's default).

    Raises:
        ValueError: a tenant has no API key; the replay trace is malformed.
        FileNotFoundError: no replay trace at ``replay``.
        ReportNotWritten: the run's report could not be written (its summary printed first).
    """
    # the unix second alone is shared by two runs started in it (s39): their sessions would mix
    options = options or RunOptions(session_prefix=f"run{int(time.time())}-{secrets.token_hex(4)}:")
    console = console or Console()
    plan = load_replay(replay, config.seed) if replay else generate_plan(config)
    source = f"replay of {replay}" if replay else "plan"
    console.print(f"DeepResearch {source}: {len(plan.sessions)} sessions, {plan.num_calls()} calls")
    result = await run_workload(
        plan, client, api_keys, options=options, stats_probe=stats_probe, console=console
    )
    run_info = {
        "wall_s": result.wall_s,
        "close_failures": result.close_failures,
        "options": dataclasses.asdict(options),
        "replay": str(replay) if replay else None,
    }
    try:
        run_dir, report = write_report(result.records, result.timeseries, config.tenants, root=root,
                                       config=config, trace=result.trace, run_info=run_info,
                                       scheduler=scheduler, policy=policy)  # fmt: skip
    except OSError as exc:  # the run's outcome is printed all the same: the summary is its record
        print_summary(compute_report(result.records, result.timeseries, config.tenants, scheduler=scheduler,
                                     policy=policy), console)
        raise ReportNotWritten(f"the run's report could not be written under {root} ({exc}): its summary is "
                               f"above; {Path(root) / 'latest'} still points to the previous report") from exc
    print_summary(report, console)
    console.print(f"report: {run_dir} (also {Path(root) / 'latest'})")
    return JobOutcome(run_dir, report, exit_code(report), result)


async def run_deepresearch_grpc(
    config: WorkloadConfig,
    target: str,
    api_keys: Mapping[str, str],
    *,
    admin_key: str | None = None,
    timeout_s: float | None = 600.0,
    options: RunOptions | None = None,
    root: str | Path = "reports",
    console: Console | None = None,
    replay: str | Path | None = None,
    policy: str = "",
    openai_url: str = "",
    tls: ClientTls | None = None,
) -> JobOutcome:
    """:func:`run_deepresearch` against the gateway at ``target`` (``host:port``).

    With ``admin_key``, ``AdminService.Stats`` is sampled for the time series and names the
    gateway's scheduler for the report. With ``openai_url`` (``http://host:port/v1``) the calls
    go through the gateway's OpenAI-compatible API with the ``openai`` package
    (``OpenAIInferenceClient``) instead of gRPC; the admin calls stay on gRPC. With ``tls``
    both APIs are reached over TLS (``services.tls.ClientTls``; ``openai_url`` then https).
    """
    async with open_aio_channel(target, tls, client_channel_options()) as channel:
        client: InferenceClient = (OpenAIInferenceClient(openai_url, timeout_s=timeout_s, tls=tls) if openai_url
                                   else GrpcInferenceClient(channel=channel, timeout_s=timeout_s))
        probe = grpc_stats_probe(channel, admin_key) if admin_key else None
        scheduler = await gateway_scheduler(channel, admin_key) if admin_key else ""
        try:
            return await run_deepresearch(config, client, api_keys, options=options,
                                          stats_probe=probe, root=root, console=console,
                                          replay=replay, scheduler=scheduler, policy=policy)  # fmt: skip
        finally:
            if isinstance(client, OpenAIInferenceClient):
                await client.close()
