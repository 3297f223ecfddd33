"""``kvstrata up``, ``down`` and ``status``: start and stop the services, show their load."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import typer
from rich.markup import escape
from rich.table import Table

from cli import state
from cli.options import GatewayOpt, validation_message
from cli.output import console, die, fail, say
from cli.processes import stop_processes
from cli.state import RPC_TIMEOUT_S, admin_metadata, gateway_channel, reachable, read_state
from kvstrata.v1 import admin_pb2, admin_pb2_grpc
from services.private_dir import ensure_private_dir
from services.ray_auth import new_token_file, token_env, use_token
from services.tls import ServerTls, http_scheme, is_loopback

# Only `up` reads a config, so only it imports services.config (and with it torch, through
# cache_node.config: ~1 s, paid by every command before, `--help` included), pydantic and yaml;
# services.metrics.targets (prometheus_client) is imported by `up` and `down` alone too.
if TYPE_CHECKING:
    from services.config import ServiceConfig

ConfigOpt = typer.Option(None, "--config", "-c", exists=True, dir_okay=False,
                         help="service YAML config (fields of services/config.py; default: all defaults)")


RAY_QUIET = {"log_to_driver": False, "logging_level": logging.WARNING}
"""``ray.init`` arguments of ``up`` and ``down``: no worker output and none of the driver's
INFO lines ("Connecting to existing Ray cluster at address: ...", said of the cluster ``up``
has just started); Ray's warnings and errors still print."""


ANSI = re.compile(r"\x1b\[[0-9;]*m")
"""Terminal colour codes (``ray start`` colours its log lines)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_local_ray(temp_dir: str, gcs_port: int = 0) -> int:
    """Terminate the processes of the Ray cluster ``kvstrata up`` started under ``temp_dir``.

    The cluster's processes are this user's whose command line carries an option naming a path
    under ``temp_dir`` (``--session-dir=``, ``--log_dir=``, ``--temp-dir=``, ...: GCS, raylet,
    workers, monitors) or its GCS address (``--address=<ip>:<gcs_port>``: the Ray client
    server), and their descendants (the dashboard and runtime-env agents rename
    themselves ``ray::...``). Other Ray clusters on the machine match none of these, so they
    are left alone (unlike ``ray stop``, which stops every cluster of the user). Returns the
    number of processes stopped.

    The GCS server is stopped last, once every other process has exited. Signalled with the
    others, it never exited on SIGTERM, so every ``down`` waited out ``stop_processes``'
    10-s timeout and then SIGKILLed the GCS, the raylet and the autoscaler monitor: the GCS's
    SIGTERM handler shuts its gRPC server down on its only event loop and waits there for the
    calls in flight (its clients' long polls), whose replies need that loop, so it waits until
    killed; meanwhile the raylet (unregistering its node) and the monitor (its SIGTERM handler
    writes to the GCS's KV store) wait on the GCS. With its clients gone first, each of them
    exits within about a second and the GCS right after them.
    """
    gcs = f":{gcs_port}" if gcs_port else None
    return stop_processes(lambda cmdline: any(
        _option_under(part, temp_dir) or (gcs and part.startswith("--address=") and part.endswith(gcs))
        for part in cmdline), last=_is_gcs_server)


def _option_under(part: str, directory: str) -> bool:
    """Whether the argument ``part`` is an option ``--name=<path>`` whose path is ``directory``
    or lies under it, as every process of a Ray cluster names its temp or session directory.
    A path given as a plain argument (``tail -f <temp_dir>/.../raylet.out``, an editor on a
    log there) is not: review s34 B F5, ``down`` stopped such processes with the cluster."""
    if not part.startswith("--") or "=" not in part:
        return False
    value = part.split("=", 1)[1].rstrip("/")
    root = directory.rstrip("/")
    return value == root or value.startswith(root + "/")


def _is_gcs_server(cmdline: list[str]) -> bool:
    """Whether ``cmdline`` runs Ray's GCS server (its executable is ``.../gcs_server``)."""
    return bool(cmdline) and Path(cmdline[0]).name == "gcs_server"


def _up_config(config: Path | None, scheduler: str, device: str = "") -> ServiceConfig:
    """The service config ``up`` runs (``--scheduler`` and ``--device`` applied, detached
    actors).

    Raises:
        typer.BadParameter: a malformed or out-of-range config file (naming ``--config``, the
            file and its first bad field), or a bad ``--scheduler`` / ``--device``: a usage
            error, exit code 2.
    """
    import pydantic
    import yaml

    from services.config import ServiceConfig, load_config

    try:
        cfg = load_config(config)
    except pydantic.ValidationError as exc:
        raise typer.BadParameter(f"{config}: {validation_message(exc.errors()[0])}", param_hint="'--config'") from None
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{config}: {_yaml_message(exc)}", param_hint="'--config'") from None
    except UnicodeDecodeError as exc:  # regression (s39 review r3): a Latin-1 file was a traceback
        raise typer.BadParameter(f"{config}: {_encoding_message(exc)}", param_hint="'--config'") from None
    except OSError as exc:
        raise typer.BadParameter(f"{config}: {str(exc).splitlines()[0]}", param_hint="'--config'") from None
    if scheduler:
        try:
            cfg = ServiceConfig.model_validate({**cfg.model_dump(), "scheduler": scheduler})
        except pydantic.ValidationError as exc:
            raise typer.BadParameter(validation_message({**exc.errors()[0], "loc": ()}),
                                     param_hint="'--scheduler'") from None
    if device:
        try:
            node = {**cfg.node.model_dump(), "device": device}
            cfg = ServiceConfig.model_validate({**cfg.model_dump(), "node": node})
        except pydantic.ValidationError as exc:
            raise typer.BadParameter(validation_message({**exc.errors()[0], "loc": ()}),
                                     param_hint="'--device'") from None
    return cfg.model_copy(update={"detached": True})


def _yaml_message(exc: Exception) -> str:
    """One line telling what is wrong with a config file's YAML and where (1-based line and
    column), e.g. "not valid YAML: expected the node content, but found '<stream end>' (line 2,
    column 1)". Regression (s39 fresh-user trial): only the first line of PyYAML's message was
    kept, its context ("while parsing a flow node"), which says neither what is wrong nor where.
    """
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if not problem:
        return f"not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"not valid YAML: {problem}{where}"


def _encoding_message(exc: UnicodeDecodeError) -> str:
    """Where a config file stops being UTF-8, e.g. "not UTF-8 text: byte 0xe9 (line 2, column
    6)" (1-based; the column counts bytes)."""
    data, at = exc.object, exc.start
    line, line_start = data.count(b"\n", 0, at) + 1, data.rfind(b"\n", 0, at) + 1
    return f"not UTF-8 text: byte 0x{data[at]:02x} (line {line}, column {at - line_start + 1})"


def _start_local_ray(cfg: ServiceConfig, token: Path) -> tuple[int, str]:
    """``ray start --head`` on a free port under a new temp directory, offering the config's
    cache- and spill-node resources, with Ray's token authentication on (the token at
    ``token``: ``services.ray_auth``); returns (GCS port, temp directory).

    Ray's own temp directory is ``<temp directory>/ray``: Ray makes it and its ``sockets/``
    world-writable (0777, no sticky bit), so another local user could replace the raylet's and
    the object store's socket files for workers started later. The temp directory around it is
    ``mkdtemp``'s (0700, this user's alone), so no one else reaches into it (review 23d).

    Raises:
        RuntimeError: ``ray start`` failed; the message ends with its last line of output.
            Whatever it started is stopped and the temp directory removed.
    """
    ray_port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="kvstrata-ray-")  # 0700; Ray's own under it (docstring)
    resources = json.dumps({cfg.cache_node_resource: cfg.num_cache_nodes,
                            cfg.spill_node_resource: max(1, cfg.num_spill_nodes)})
    done = subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={ray_port}",
                           f"--temp-dir={Path(temp_dir) / 'ray'}", f"--resources={resources}", "--include-dashboard=false",
                           "--disable-usage-stats"], check=False, capture_output=True, text=True,
                          env={**os.environ, **token_env(token)})
    if done.returncode:
        _stop_local_ray(temp_dir, ray_port)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise RuntimeError(f"`ray start --head --port={ray_port}` exited {done.returncode}: "
                           f"{_ray_start_error(done.stderr, done.stdout)}")
    return ray_port, temp_dir


def _ray_start_error(stderr: str, stdout: str, limit: int = 400) -> str:
    """What ``ray start`` said went wrong: the last ``SomethingError: ...`` line of its stderr
    (with the next line when it ends in a colon), else its last line of output; colour codes
    removed, cut to ``limit`` characters."""
    lines = [ANSI.sub("", line).strip() for line in stderr.splitlines()]
    errors = [i for i, line in enumerate(lines) if re.match(r"\w*(Error|Exception)\b:", line)]
    if errors:
        i = errors[-1]
        text = " ".join(lines[i:i + 2]) if lines[i].endswith(":") else lines[i]
    else:
        text = next((ANSI.sub("", line).strip() for line in reversed((stderr + stdout).splitlines())
                     if line.strip()), "no output")
    return text[:limit]

def _fixed_ports(cfg: Any) -> list[tuple[int, str, str]]:
    """(port, host, config field) of each fixed port ``kvstrata up`` binds on this machine: the
    gateway's gRPC and HTTP ports and its metrics port (0 or off: none). Regression (trial 30n
    P1): only the gRPC port was checked, so with port 8000 (the HTTP API's default, vLLM's and
    Jupyter's too) taken, ``up`` failed after loading the model, with no cause shown."""
    ports = [(cfg.gateway_port, cfg.gateway_host, "gateway_port"), (cfg.http_port, cfg.gateway_host, "http_port")]
    if cfg.metrics_enabled and cfg.metrics_host != "node_ip":
        ports.append((cfg.gateway_metrics_port, cfg.metrics_host, "gateway_metrics_port"))
    return [(port, host, field) for port, host, field in ports if port]


def failure_text(exc: BaseException) -> str:
    """One line saying why ``exc`` happened: for an error raised in a Ray actor, its cause's
    type and message (Ray's own text starts with a ``ray::Actor.method() (pid=...)`` header and
    the remote traceback). Regression (trial 30n P1): ``kvstrata up failed: ray::RayGateway.start()
    (pid=..., repr=...)`` was all a taken HTTP port printed; the OSError was dropped. An actor
    whose constructor raised (or whose class failed to import on its worker) ends in an
    ``ActorDiedError`` that keeps no ``cause``, only the text "The actor died because of an error
    raised in its creation task, ray::Actor.__init__() (pid=...)" and the remote traceback after
    it: that header anywhere in the first line counts too, ANSI colours removed. Regression
    (session 40 new user): ``kvstrata up failed: The actor died because of an error raised in its
    creation task, ray::global_scheduler:GlobalSchedulerService.__init__() (pid=...)`` was all a
    worker importing another checkout's code printed; its AttributeError was dropped. Only a Ray
    error's first line is read so (s40 diff review r6 of 995683a): any error whose first line
    named a ``ray::`` process was cut to its last line, type and message lost."""
    seen: set[int] = set()
    while isinstance(getattr(exc, "cause", None), BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.cause  # type: ignore[attr-defined]
    lines = [ANSI.sub("", line).strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return repr(exc)
    # a remote traceback (its last line is the error): Ray's header first, or after Ray's own
    # sentence (ActorDiedError's); another error's text that names a ray:: process is its own
    remote = lines[0].startswith("ray::") or ("ray::" in lines[0] and type(exc).__module__.startswith("ray"))
    if remote and len(lines) > 1:
        return lines[-1]
    text = lines[0]
    return text if type(exc).__module__.startswith("ray") else f"{type(exc).__name__}: {text}"



def up(config: Path | None = ConfigOpt, address: str | None = typer.Option(
        None, help="join this Ray cluster (e.g. auto); default: start a local one"),
        scheduler: str = typer.Option("", help="kvstrata (the default: SLO classes, token-rate floors, "
                                      "early rejection) | fcfs | priority | vtc; overrides the config"),
        device: str = typer.Option("", help="auto | cpu | cuda: where cache nodes run, one GPU each on "
                                   "cuda (overrides node.device in the config)")) -> None:
    """Start the global scheduler, cache nodes and gateway; print the gateway address.

    Every node runs the `kvstrata` SLO scheduler unless --scheduler or the config's
    `scheduler:` names fcfs, priority or vtc. `up` prints, each on a line of its own, the gateway
    address and the OpenAI-compatible API address, then the scheduler and the device the nodes
    run on, the admin key file, and (with metrics on) each /metrics address and the Prometheus
    targets file.

    Without `--address` it starts a local Ray cluster of its own (under a temp directory that
    `kvstrata down` uses to stop exactly that cluster), with Ray's token authentication on (the
    token in the state directory's `ray_token`, 0600): Ray's ports listen on every interface.
    """
    import ray

    from services.launcher import start_services

    cfg = _up_config(config, scheduler, device)
    try:  # whoever can write these replaces the tenants, keys and saved state: refused first
        ensure_private_dir(cfg.state_path)
        ensure_private_dir(state.state_dir())
    except OSError as exc:
        die(f"kvstrata up failed: {exc}")
    saved = read_state()
    if saved.get("address") and reachable(saved["address"]):
        die(f"kvstrata is already up at {saved['address']}; run `kvstrata down` first")
    for port, host, field in _fixed_ports(cfg):  # refused at once, not after the model loads
        if reachable(f"{host}:{port}", 0.5):
            die(f"port {port} on {host} is taken; set {field} in the config (0 = any free port)")
    started_ray = address is None
    temp_dir, token = "", None
    if started_ray:
        try:
            token = new_token_file(cfg.state_path)
            ray_port, temp_dir = _start_local_ray(cfg, token)
        except (RuntimeError, OSError) as exc:
            console.print(f"[red]kvstrata up failed:[/red] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(1) from None
        address = f"127.0.0.1:{ray_port}"
        use_token(token)
    try:
        ray.init(address=address, namespace=cfg.namespace, **RAY_QUIET)
        with console.status("loading the model on every cache node ..."):
            # a joined cluster (--address) binds the data plane on node IPs (it may span machines)
            services = start_services(cfg, None if started_ray else address)
    except Exception as exc:  # noqa: BLE001 -- leave nothing half-started behind, whatever failed
        if temp_dir:
            _stop_local_ray(temp_dir, ray_port)
            shutil.rmtree(temp_dir, ignore_errors=True)
        # a joined cluster: start_services killed what it created, by handle (_kill_placed). Not
        # by name here: that killed another deployment's actors in this namespace (review s37 r4 F1)
        console.print(f"[red]kvstrata up failed:[/red] {escape(failure_text(exc))}", soft_wrap=True)
        raise typer.Exit(1) from None
    if not started_ray and "://" not in address:  # `auto` -> the cluster's GCS address, for `down`
        address = ray.get_runtime_context().gcs_address
    cfg.state_path.mkdir(mode=0o700, parents=True, exist_ok=True)  # tenants, keys: the owner's alone
    state.state_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
    state.write_state({
        "ray_address": address, "started_ray": started_ray, "ray_temp_dir": temp_dir, "namespace": cfg.namespace,
        "state_dir": str(cfg.state_path), "ray_token_path": str(token) if token is not None else "",
        **gateway_state(cfg, services.address, services.http_address),
    })
    targets = None
    if services.metrics:  # Prometheus file_sd targets (deploy/prometheus.yml)
        from services.metrics.targets import TARGETS_FILE, write_targets

        targets = write_targets(services.metrics, cfg.state_path / TARGETS_FILE, cfg.namespace)
    for line in up_summary(services.config, services.address, services.http_address, services.metrics, targets):
        say(line)


def gateway_state(cfg: ServiceConfig, address: str, http_address: str) -> dict[str, object]:
    """What ``up`` saves (gateway.json) for later commands to reach the gateway (``cli.state``):
    ``address`` and ``http_address``, where a client dials it (``Services``: loopback for a
    wildcard ``gateway_host``), its message cap, and whether it serves TLS, with the CA and the
    certificate name (``tls_server_name``) to verify it with (``cli.state.client_tls``)."""
    return {"address": address, "http_address": http_address, "grpc_max_message_bytes": cfg.grpc_max_message_bytes,
            "tls": bool(cfg.tls_cert_file), "tls_ca_file": cfg.tls_ca_file, "tls_server_name": cfg.tls_server_name}


def up_summary(cfg: ServiceConfig, address: str, http_address: str, metrics: dict[str, str],
               targets: Path | None) -> list[str]:
    """What ``up`` prints once the services answer, one line per item so that no address is
    ever split: the gateway, the OpenAI API, what the nodes run (``cfg`` as started, its device
    and dtype resolved), the admin key file, then each ``/metrics`` address (``metrics``: actor
    name -> host:port) and the Prometheus targets file (``targets``; None without metrics).
    With TLS on, the gateway line says so (whether client certificates are required, and the
    certificate name clients verify when it is not the host dialed: ``tls_server_name``) and
    the API's URL is https; without it, a gateway bound beyond loopback gets a warning line."""
    node, tls = cfg.node, ServerTls.of(cfg)
    notes = ["TLS"] if tls is not None else []
    if tls is not None and tls.mutual:
        notes.append("client certificates required")
    if tls is not None and cfg.tls_server_name:
        notes.append(f"certificate name {cfg.tls_server_name}")
    lines = [f"gateway: [bold]{address}[/bold]" + (f" ({', '.join(notes)})" if notes else "")]
    if tls is None and not is_loopback(cfg.gateway_host):
        lines.append(f"[yellow]warning: no TLS on {cfg.gateway_host}: API keys cross the network in cleartext "
                     "(set tls_cert_file and tls_key_file)[/yellow]")
    if http_address:
        lines.append(f"OpenAI-compatible API: [bold]{http_scheme(tls)}://{http_address}/v1[/bold]")
    lines.append(f"scheduler: {cfg.scheduler} on {cfg.num_cache_nodes} cache node"
                 f"{'s' if cfg.num_cache_nodes != 1 else ''} ({node.device}, {node.dtype}); KV policy: "
                 "per tenant or request (default: full)")
    lines.append(f"admin key: {cfg.state_path / 'admin_key'} (or set KVSTRATA_ADMIN_KEY)")
    if metrics:
        lines.append("metrics (Prometheus /metrics):")
        width = max(map(len, metrics))
        lines += [f"  {name:<{width}}  http://{host}/metrics" for name, host in sorted(metrics.items())]
    if targets is not None:
        lines.append(f"prometheus targets: {targets} (deploy/prometheus.yml reads it when copied to "
                     "that directory)")
    return lines


SCHEDULER_ACTOR = "global_scheduler"
"""``services.launcher.SCHEDULER_NAME`` (not imported: the launcher imports every actor's module)."""

GATEWAY_ACTOR = "gateway"
"""``services.launcher.GATEWAY_NAME``."""

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
    return address if address and reachable(address) else None


def _service_actor_names(named: list[dict], namespace: str) -> list[str]:
    """kvstrata's actors among ``ray.util.list_named_actors(all_namespaces=True)``: those in
    ``namespace`` whose names ``start_services`` gives (gateway, scheduler, cache and spill
    nodes); anything else on the cluster is the user's."""
    return [a["name"] for a in named if a["namespace"] == namespace and SERVICE_ACTOR_NAME.fullmatch(a["name"])]


def _kill_services(namespace: str, gateway_address: str, timeout_s: float = 10.0) -> int:
    """Kill kvstrata's actors in ``namespace`` on the connected cluster and wait (up to
    ``timeout_s``) until the gateway's port no longer answers; the gateway's served-address
    record is deleted (``services.gateway_served.forget``: regression (s38), each one stayed in
    the cluster's GCS). Returns the number killed."""
    import ray

    from services.actor_refs import kill_gone
    from services.gateway_served import forget

    names = _service_actor_names(ray.util.list_named_actors(all_namespaces=True), namespace)
    if SCHEDULER_ACTOR in names:  # its usage counters and session routes since its last periodic store
        try:
            ray.get(ray.get_actor(SCHEDULER_ACTOR, namespace=namespace).flush_durable.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck scheduler: kill it anyway
            console.print(f"usage counters and session routes of the last seconds not stored: "
                          f"{escape(type(exc).__name__)}")
    if SCHEDULER_ACTOR in names:  # first, and gone before the others are listed again: its spill
        # watch creates a dead spill node again (services.spill_recreate). Regression (s38 review):
        # one it created after the list above outlived down (detached), its name and directory taken
        if not kill_gone(SCHEDULER_ACTOR, namespace, timeout_s):
            console.print(f"the global scheduler's process did not end within {timeout_s:g} s of its kill: a spill "
                          f"node it creates again meanwhile may outlive down (`kvstrata status` lists it)")
        names += [name for name in _service_actor_names(ray.util.list_named_actors(all_namespaces=True), namespace)
                  if name not in names]
    for name in names:
        with contextlib.suppress(ValueError):  # gone meanwhile
            handle = ray.get_actor(name, namespace=namespace)
            ray.kill(handle)
            if name == GATEWAY_ACTOR:
                try:
                    forget(handle)
                except Exception as exc:  # noqa: BLE001 - the GCS not answering: its record stays
                    console.print(f"the gateway's served-address record was not deleted: {escape(type(exc).__name__)}")
    deadline = time.monotonic() + timeout_s
    while gateway_address and reachable(gateway_address, 0.2) and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(names)


def down() -> None:
    """Stop the services started by `kvstrata up`.

    With `--address` at `up`: its actors on the Ray cluster it joined (that cluster keeps
    running); else the local Ray cluster it started (only that one)."""
    import ray

    saved = read_state()
    if not saved:
        (state.state_dir() / state.STATE_FILE).unlink(missing_ok=True)  # one that was no state (read_state)
        console.print("nothing to stop")
        return
    try:
        target = _ray_target(saved)
        if target is not None:
            if saved.get("ray_token_path"):  # the local cluster `up` started: its token
                use_token(saved["ray_token_path"])
            try:
                ray.init(address=target, namespace=saved["namespace"], **RAY_QUIET)
            except (ConnectionError, RuntimeError) as exc:
                console.print(f"Ray at {target} is not reachable ({escape(str(exc).splitlines()[0])}); "
                              "removing the stale state")
            else:
                killed = _kill_services(saved["namespace"], saved.get("address", ""))
                ray.shutdown()
                console.print(f"stopped {killed} kvstrata actors")
        else:
            console.print(f"Ray at {saved.get('ray_address')} is not reachable; removing the stale state")
    finally:
        if saved.get("started_ray") and saved.get("ray_temp_dir"):
            _stop_local_ray(saved["ray_temp_dir"], int(saved["ray_address"].rpartition(":")[2] or 0))
            shutil.rmtree(saved["ray_temp_dir"], ignore_errors=True)
            if saved.get("ray_token_path"):  # the cluster it opened is gone
                Path(saved["ray_token_path"]).unlink(missing_ok=True)
        elif saved.get("started_ray"):
            console.print("[yellow]state from an older kvstrata: its local Ray cluster was not stopped "
                          "(`ray stop` stops it, and every other Ray cluster of this user)[/yellow]")
        (state.state_dir() / state.STATE_FILE).unlink(missing_ok=True)
        if saved.get("state_dir"):  # its addresses are gone with the services
            from services.metrics.targets import TARGETS_FILE

            (Path(saved["state_dir"]) / TARGETS_FILE).unlink(missing_ok=True)
    console.print("stopped")


def status(gateway: str | None = GatewayOpt, integrity: bool = typer.Option(
        True, metavar="", help="check each node's block pool for consistency (waits for a step boundary); "
        "--no-integrity skips it")) -> None:
    """Per-node pool usage, queue and session counts."""
    with gateway_channel(gateway) as ch:
        try:
            resp = admin_pb2_grpc.AdminServiceStub(ch).Stats(
                admin_pb2.StatsRequest(check_integrity=integrity), metadata=admin_metadata(gateway), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    console.print(status_table(resp, integrity))
    spill = spill_table(resp)
    if spill is not None:
        console.print(spill)
    console.print(f"queued: {resp.queued}  sessions: {resp.sessions}")


def _health(node: dict) -> str:
    """A node's health cell from ``stats_json``: "ok", "ok (restarted N)" or "down: why"."""
    if node.get("healthy", True) is False:
        return f"[red]down: {escape(str(node.get('failure') or 'unknown'))}[/red]"
    restarts = node.get("restarts") or 0
    return f"ok (restarted {restarts})" if isinstance(restarts, int) and restarts > 0 else "ok"


def status_table(resp: admin_pb2.StatsResponse, integrity: bool) -> Table:
    """One row per node of a ``Stats`` answer; "health" says whether the node serves ("ok",
    "ok (restarted N)" after Ray restarted it, or "down: why"); "by sessions" and "by prefixes" are the used
    blocks idle sessions and stored compressed document prefixes hold (so blocks used with
    nothing running are explained); the integrity column says "ok", the error, or "skipped"
    when the check was not asked for (``--no-integrity``)."""
    table = Table("node", "health", "blocks", "used", "by sessions", "by prefixes", "cached", "free", "running",
                  "waiting", "integrity")
    try:
        health = {n["node_id"]: n for n in json.loads(resp.stats_json or "{}").get("nodes", [])}
    except (ValueError, AttributeError, TypeError, KeyError):
        health = {}
    for n in resp.nodes:
        check = ("ok" if n.integrity_ok else f"[red]{escape(n.integrity_error)}[/red]") if integrity else "skipped"
        table.add_row(n.node_id, _health(health.get(n.node_id, {})), str(n.num_blocks), str(n.used_blocks),
                      str(n.session_blocks), str(n.prefix_blocks), str(n.cached_blocks), str(n.free_blocks),
                      str(n.running), str(n.waiting), check)
    return table


def _printable(text: str) -> str:
    """``text`` with each control (non-printable) character as "?"."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def spill_table(resp: admin_pb2.StatsResponse) -> Table | None:
    """One row per spill node of a ``Stats`` answer (the scheduler's ``spill_nodes``, their
    ``text``: ``services.spill_watch.describe``): "serving", "waiting for its directory: held by its previous
    process / another store, pid P on H (owner)", "dead: why", "restarting", "not answering" or
    "unknown"; None when the answer names no spill node (none deployed, or an older scheduler).
    Names and texts are printed with their control characters as "?" and rich markup escaped:
    they come from lock files, nodes and Ray errors (regression, s37: ESC sequences reached the
    terminal)."""
    try:
        nodes = json.loads(resp.stats_json or "{}").get("scheduler", {}).get("spill_nodes") or {}
        rows = sorted((str(name), str(state.get("text") or state.get("state") or "unknown"))
                      for name, state in nodes.items() if isinstance(state, dict))
    except (ValueError, AttributeError, TypeError):
        return None
    if not rows:
        return None
    table = Table("spill node", "state")
    for name, text in rows:
        name, text = _printable(name), _printable(text)
        table.add_row(escape(name), text if text == "serving" else f"[red]{escape(text)}[/red]")
    return table
