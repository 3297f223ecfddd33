"""Start and stop the kvstrata services on a Ray cluster (embedded local one by default)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from cache_node.config import default_dtype_for
from cache_node.kv_format import kv_format_name
from cache_node.model_files import resolve_model_dir
from cache_node.model_geometry import kv_geometry
from cache_node.tiers.spill_api import SpillBlockSpec, numpy_dtype_name
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_lock import SpillDirLocked
from kvstrata.code_path import actor_runtime_env
from services.actor_refs import ActorRef, kill_gone
from services.cache_node import CacheNodeRemote
from services.config import NodeConfig, ServiceConfig
from services.data_plane_auth import LOOPBACK, DataPlaneKeys
from services.gateway_served import forget as forget_served
from services.gateway_server import GatewayActor
from services.gateway_stream_bounds import StreamLimits
from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerActor
from services.global_scheduler_recovery import RecoveryPeers
from services.grpc_bounds import GrpcLimits
from services.metrics import MetricsEndpoint
from services.openai_api.connections import ConnectionLimits
from services.openai_api.context import BodyLimits
from services.ray_auth import new_token_file, use_token
from services.spill_dirs import remove_retired_spill_dirs
from services.spill_node import await_serving, deployment_id
from services.spill_recreate import RecreatePolicy, SpillRecipe
from services.tls import ServerTls, dial_address
from tenants.keys import new_api_key, read_key_file, write_key_file

SCHEDULER_NAME = "global_scheduler"
GATEWAY_NAME = "gateway"
log = logging.getLogger(__name__)


@dataclass
class Services:
    """Handles of a running deployment."""

    scheduler: Any
    nodes: dict[str, Any]
    gateway: Any
    port: int
    admin_key: str = field(repr=False)  # (no secret in a log line or a traceback's locals)
    config: ServiceConfig
    spill_nodes: list[Any] = field(default_factory=list)
    data_plane_keys: DataPlaneKeys | None = None  # every role's keys (fault tests, bench.chaos)
    metrics: dict[str, str] = field(default_factory=dict)  # actor name -> its /metrics host:port
    http_address: str = ""  # host:port a client dials for the OpenAI-compatible API ("" when off)
    gateway_ip: str = ""  # the gateway's node address when it is not this machine's ("": here)

    def __post_init__(self) -> None:
        # the gateway says where it is bound
        self.http_address = dial_address(self.http_address, self.gateway_ip)

    @property
    def address(self) -> str:
        """``host:port`` a client on this machine dials for the gateway's gRPC port (for a
        wildcard ``gateway_host``: loopback, or the gateway's node address when Ray placed it
        on another machine: ``services.tls.dial_address``)."""
        return dial_address(f"{self.config.gateway_host}:{self.port}", self.gateway_ip)


def admin_key_path(config: ServiceConfig) -> Path:
    return config.state_path / "admin_key"


def _admin_key(config: ServiceConfig, scheduler: Any) -> str:
    """The admin key: read from ``admin_key_path`` when the scheduler accepts it, else made anew.

    A new key is written to the file atomically (``tenants.keys.write_key_file``, mode 0600)
    *before* its hash is committed, so a crash at any point leaves at worst a key file whose
    hash is missing; that, a missing, empty or garbled file, or a file that no longer matches
    the stored hash, is recovered by rotating the admin key (logged), never by a lockout.
    """
    path = admin_key_path(config)
    key = read_key_file(path)
    if key is not None and _answer(scheduler.verify_admin_key.remote(key=key), config,
                                   "the global scheduler's verify_admin_key"):
        return key
    key = new_api_key()
    write_key_file(path, key)
    if _answer(scheduler.set_admin_key.remote(key=key), config, "the global scheduler's set_admin_key"):
        log.warning("admin key file %s was missing or stale: rotated the admin key; the new one is in it", path)
    return key


def session_limits(config: ServiceConfig) -> dict[str, Any]:
    """The GlobalScheduler's session arguments from ``config``: its sessions per tenant, and
    the nodes' session TTL, for which it keeps the markers of sessions lost with a node.

    Regression: the TTL was not passed, so markers lasted the default 900 s whatever the
    nodes' ``session_ttl_s``."""
    return {"max_sessions_per_tenant": config.max_sessions_per_tenant, "session_ttl_s": config.session_ttl_s}


def start_services(config: ServiceConfig, address: str | None = None) -> Services:
    """Place the scheduler, cache nodes and gateway as Ray actors and open the gRPC port.

    Args:
        config: service configuration.
        address: Ray cluster to join ("auto", "ray://..."); None starts/uses a local cluster.
            A local cluster this call starts (no ``address``, Ray not initialized: the demo's,
            the benches') runs with Ray's token authentication, its token a new one in the
            state directory (``services.ray_auth``): its ports listen on the machine's
            address, and one without authentication runs any connecting driver's tasks.
    """
    if not ray.is_initialized():
        if address is None:
            use_token(new_token_file(config.state_path))
        ray.init(address=address or "local", namespace=config.namespace, include_dashboard=False,
                 log_to_driver=False)
    node = resolve_node_config(config.node, ray.cluster_resources().get("GPU", 0))
    config = config.model_copy(update={"node": node})
    life = {"lifetime": "detached"} if config.detached else {}
    n = config.num_cache_nodes
    node_ids = [f"cache_node_{i}" for i in range(n)]
    state_dir = str(config.state_path)
    # every actor imports kvstrata from its installed location, not the driver's directory
    # (kvstrata.code_path: s41 trial F5)
    control = {"runtime_env": actor_runtime_env(config.control_env_vars)}
    # data-plane keys for this start, handed to each actor as a constructor argument (a
    # restarted actor gets the same ones); CURVE on every socket (services.data_plane_auth)
    keys, host = DataPlaneKeys.generate(tuple(node_ids)), data_plane_host(config, joined=address is not None)
    # a restarted scheduler (max_restarts) rebuilds its state from these peers, found by name
    spec = spill_block_spec(config)
    recipe = spill_recipe(config, spec)
    peers = RecoveryPeers(config.namespace, tuple(name for name, _ in recipe.root_dirs),
                          config.scheduler_report_timeout_s, spill_recipe=recipe,
                          spill_recreate=RecreatePolicy(config.spill_recreate_max, config.spill_recreate_window_s,
                                                        config.spill_recreate_backoff_s),
                          start_grace_s=config.start_timeout_s)  # attach_nodes ends it sooner
    scheduler = GlobalSchedulerActor.options(
        name=SCHEDULER_NAME, namespace=config.namespace, num_cpus=0, **life, **control,
        max_restarts=config.scheduler_max_restarts,
    ).remote(state_dir, {nid: config.node.max_num_seqs for nid in node_ids}, config.queue_limit,
             scheduler=config.scheduler, block_size=config.node.block_size,
             security=keys.security("scheduler", host), peers=peers, holders=index_holders(config, spec),
             **session_limits(config))
    threads = config.node.torch_threads or max(1, (os.cpu_count() or 2) // n)
    placed = {SCHEDULER_NAME: scheduler}  # name -> handle: killed again when this start fails (_kill_placed)
    try:
        spill_nodes = _start_spill_nodes(config, recipe, placed)
        # peers by name, not by handle: the restartable actors look them up themselves on each
        # (re)start (services.actor_refs: a handle in their arguments made Ray log an error)
        scheduler_ref = ActorRef(SCHEDULER_NAME, config.namespace)
        spill_refs = [ActorRef(f"spill_node_{i}", config.namespace) for i in range(len(spill_nodes))]
        nodes: dict[str, Any] = {}
        for nid in node_ids:  # each in ``placed`` once created: a later one's failure kills it too
            nodes[nid] = CacheNodeRemote.options(
                name=nid, namespace=config.namespace, num_cpus=0, max_concurrency=1000,
                max_restarts=config.cache_node_max_restarts,  # a failed or killed node comes back
                resources={config.cache_node_resource: 1}, num_gpus=1 if node.device == "cuda" else 0, **life,
                runtime_env=actor_runtime_env(config.node.env_vars),
            ).remote(nid, config.node, threads, scheduler_ref, config.session_ttl_s, config.scheduler,
                     spill_refs, spec if spill_nodes else None, keys.security("node", host, nid),
                     metrics=metrics_endpoint(config, config.node_metrics_port))
            placed[nid] = nodes[nid]
        # created now, while the nodes load their models: its process start and imports (~9 s of
        # a loaded 2-core host, torch and transformers among them) overlap their load; it serves
        # (``start``) only once their data planes are attached. Its constructor looks the nodes
        # up by name and calls none of them.
        gateway = GatewayActor.options(
            name=GATEWAY_NAME, namespace=config.namespace, num_cpus=0, **life, **control,
            max_restarts=config.gateway_max_restarts,  # serves again on its port (RayGateway)
        ).remote(
            scheduler_ref, {nid: ActorRef(nid, config.namespace) for nid in nodes}, config.node.model_path,
            keys.security("gateway", host), metrics_endpoint(config, config.gateway_metrics_port), config.http_port,
            config.http_forwarded_allow_ips, ConnectionLimits.of(config), StreamLimits.of(config),
            GrpcLimits.of(config), BodyLimits.of(config), ServerTls.of(config), config.tool_call_parser,
        )
        placed[GATEWAY_NAME] = gateway
        # wait until models are loaded
        _wait_placed([node.describe.remote() for node in nodes.values()], config, config.cache_node_resource,
                     "cache node")
        # the data plane (services.data_plane): node command inboxes, the scheduler's admissions
        inboxes = _answer([node.open_data_plane.remote() for node in nodes.values()], config,
                          "the cache nodes' open_data_plane")
        _answer(scheduler.attach_nodes.remote(inboxes=dict(zip(nodes, inboxes))), config,
                "the global scheduler's attach_nodes")
        _answer(scheduler.open_data_plane.remote(), config, "the global scheduler's open_data_plane")
        port = _answer(gateway.start.remote(host=config.gateway_host, port=config.gateway_port), config, "the gateway's start")
        gateway_ip = _answer(gateway.node_ip.remote(), config, "the gateway's node_ip")
        return Services(scheduler, nodes, gateway, port, _admin_key(config, scheduler), config, spill_nodes, keys,
                        metrics_addresses(gateway, nodes, spill_nodes, config.start_timeout_s),
                        _answer(gateway.http_address.remote(), config, "the gateway's http_address"),
                        gateway_ip if gateway_ip != ray.util.get_node_ip_address() else "")
    except BaseException:
        _kill_placed(placed, config.namespace)
        raise


KILL_WAIT_S = 10.0
"""How long stopping a deployment waits for the global scheduler's process to have exited before
it kills the spill nodes (``services.actor_refs.kill_gone``; Ray force-kills a process that does
not end on its own about 5 s after the kill)."""


def _kill_placed(placed: dict[str, Any], namespace: str) -> None:
    """Kill the actors a failed ``start_services`` created (``placed``: name -> handle, the
    scheduler's first; detached ones outlive their driver; the others held their names, and the
    gateway its port, until it exits), so that a start again does not fail on their names.
    Regression: a failed start left the scheduler and the nodes placed so far (``kvstrata up`` on
    a joined cluster killed them by name after it, review 23d H; a library caller had none killed).

    The scheduler goes first and is dead before the others are killed: its spill watch creates a
    spill node that died during the start again (``services.spill_recreate``), under a name this
    start created, so those names are killed again (another deployment's actors keep theirs).
    Regression (s38): one it created meanwhile outlived the failed start. A gateway placed has
    its served-address record deleted (``services.gateway_served.forget``)."""
    with contextlib.suppress(Exception):  # the cluster unreachable: nothing to kill
        kill_gone(SCHEDULER_NAME, namespace, KILL_WAIT_S)
    for handle in placed.values():
        try:
            ray.kill(handle)
        except Exception as exc:  # noqa: BLE001 - gone already, or the cluster unreachable: nothing to kill
            log.debug("failed start: could not kill %s: %s", handle, exc)
    _kill_spill_names([name for name in placed if name.startswith("spill_node_")], namespace)
    if GATEWAY_NAME in placed:
        _forget_gateway(placed[GATEWAY_NAME])


def _forget_gateway(gateway: Any) -> None:
    """Delete the served-address record of ``gateway``, stopped for good
    (``services.gateway_served.forget``); logged when the cluster's store does not answer."""
    try:
        forget_served(gateway)
    except Exception as exc:  # noqa: BLE001 - the cluster unreachable: its record goes with it
        log.warning("the served-address record of gateway %s was not deleted: %s", gateway, exc)


def _kill_spill_names(names: list[str], namespace: str) -> None:
    """Kill the actors now holding ``names`` (spill nodes the scheduler created again hold them
    with other handles than the launcher's)."""
    for name in names:
        with contextlib.suppress(Exception):  # none alive by that name, or the cluster unreachable
            ray.kill(ray.get_actor(name, namespace=namespace))


def index_holders(config: ServiceConfig, spec: SpillBlockSpec) -> IndexHolders:
    """Who reports block events to the scheduler's index, and the most blocks each holds: a
    cache node its device pool and host tier, each spill node (``spill_node_<i>``) its RAM and
    disk budgets, in blocks of the nodes' KV layout (``spec``: a device block, a host-tier slot
    and a spill block are the same bytes)."""
    block = BlockFormat(spec.shape, spec.dtype, spec.kv_format).block_nbytes
    spill = config.spill_ram_bytes // block + config.spill_disk_bytes // block
    return IndexHolders(config.node.kv_pool_bytes // block + config.node.host_bytes // block,
                        {f"spill_node_{i}": spill for i in range(config.num_spill_nodes)})


def metrics_endpoint(config: ServiceConfig, port: int) -> MetricsEndpoint | None:
    """Where an actor serves ``/metrics`` (None with ``metrics_enabled`` off)."""
    return (MetricsEndpoint(config.metrics_host, port, config.metrics_render_interval_s)
            if config.metrics_enabled else None)


def metrics_addresses(gateway: Any, nodes: dict[str, Any], spill_nodes: list[Any],
                      timeout_s: float | None = None) -> dict[str, str]:
    """Actor name -> ``host:port`` of its ``/metrics``, for those serving one (``kvstrata up``
    prints them; deploy/prometheus.yml scrapes them); within ``timeout_s`` (None: no bound).

    Raises:
        RuntimeError: an actor did not answer within ``timeout_s``."""
    refs = {GATEWAY_NAME: gateway.metrics_address.remote()}
    refs |= {nid: node.describe.remote() for nid, node in nodes.items()}
    refs |= {f"spill_node_{i}": h.metrics_address.remote() for i, h in enumerate(spill_nodes)}
    try:
        answers = dict(zip(refs, ray.get(list(refs.values()), timeout=timeout_s)))
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(_silent_message("the actors' metrics_address / describe", timeout_s or 0)) from None
    out = {name: a["metrics_address"] if isinstance(a, dict) else a for name, a in answers.items()}
    return {name: address for name, address in out.items() if address}


def resolve_node_config(node: NodeConfig, cluster_gpus: float) -> NodeConfig:
    """``node`` with a concrete device and dtype, as every cache node of this start runs it.

    ``device`` "auto" becomes "cuda" when the cluster offers GPUs (``cluster_gpus``, Ray's
    ``GPU`` resource) and "cpu" otherwise; ``dtype`` "auto" becomes bfloat16 on CUDA, float32
    on CPU. Resolved here, once, because the spill tier's block format (``spill_block_spec``)
    must match the nodes' KV dtype; a "cuda" node asks Ray for one GPU (``num_gpus=1``).
    """
    device = node.device
    if device == "auto":
        device = "cuda" if cluster_gpus >= 1 else "cpu"
    dtype = node.dtype if node.dtype != "auto" else default_dtype_for(device)
    return node.model_copy(update={"device": device, "dtype": dtype})


def data_plane_host(config: ServiceConfig, joined: bool) -> str:
    """Where data-plane sockets bind (``ServiceConfig.data_plane_bind``): "127.0.0.1", or ""
    for each Ray node's own IP. "auto" is loopback for a cluster this process did not join by
    address (the embedded one of ``kvstrata up``, or the caller's own) whose alive nodes all
    have the driver's IP; a joined cluster (``--address``), which may grow onto other
    machines, binds on node IPs."""
    if config.data_plane_bind == "loopback":
        return LOOPBACK
    if config.data_plane_bind == "node_ip" or joined:
        return ""
    here = ray.util.get_node_ip_address()
    ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return LOOPBACK if ips <= {here} else ""


def spill_block_spec(config: ServiceConfig) -> SpillBlockSpec:
    """One KV block's shape/dtype/format in the spill tier, from the model's config.json
    (``kv_geometry``: without torch or transformers, which this process does not import)."""
    layers, kv_heads, head_dim = kv_geometry(resolve_model_dir(config.node.model_path))
    shape = (layers, 2, config.node.block_size, kv_heads, head_dim)
    kv_format = kv_format_name(config.node.dtype, layers, kv_heads, head_dim)
    return SpillBlockSpec(shape, numpy_dtype_name(config.node.dtype), kv_format)


def spill_root(config: ServiceConfig) -> Path:
    """The spill nodes' root directory (``spill_dir``, else ``<state_dir>/spill``): node i's is ``<root>/<i>``."""
    return Path(config.spill_dir).expanduser() if config.spill_dir else config.state_path / "spill"


def spill_recipe(config: ServiceConfig, spec: SpillBlockSpec) -> SpillRecipe:
    """How this start creates its spill nodes (``spill_node_<i>`` on ``<spill root>/<i>``), and
    how the scheduler creates a dead one again (``services.spill_recreate``): the same actor
    options and arguments."""
    root = spill_root(config)
    return SpillRecipe(
        tuple((f"spill_node_{i}", str(root / str(i))) for i in range(config.num_spill_nodes)),
        BlockFormat(spec.shape, spec.dtype, spec.kv_format), config.spill_ram_bytes, config.spill_disk_bytes,
        config.namespace, SCHEDULER_NAME, resources={config.spill_node_resource: 1},
        lifetime="detached" if config.detached else None,
        metrics=metrics_endpoint(config, config.spill_metrics_port),
        env_vars=dict(config.control_env_vars),  # restores wait on it: normal priority
        deployment=deployment_id(config.state_path))  # another deployment's store is not its own


def _start_spill_nodes(config: ServiceConfig, recipe: SpillRecipe, placed: dict[str, Any] | None = None) -> list[Any]:
    """Spill node actors (``recipe``: ``spill_node`` resource), each with its own directory, reporting
    their block events to the GlobalScheduler's index (``SCHEDULER_NAME``, looked up by the
    node) under their names (``spill_node_<i>``).

    The directories of spill nodes this start does not run (``<root>/<j>``, j >=
    ``num_spill_nodes``: a start with fewer than the last) are deleted first, here and by each
    spill node on its own machine (``services.spill_dirs``). Regression (review 26b F4): they
    were kept for good, never swept nor budgeted, with tenants' prompt token ids.

    A node whose directory another process holds lives on and keeps trying
    (``services.spill_node``): its own previous process (a start right after a stop) is waited
    for within ``start_timeout_s``; another store (another deployment on this ``spill_dir``)
    fails the start with a message naming it (``await_serving``). Each node is appended to
    ``placed`` (by name) once created: ``start_services`` kills it when the start fails (``_kill_placed``),
    so it does not go on trying then (``kvstrata up`` stopped it after such a failure before
    too: its Ray cluster, or its actors by name).

    Measured (``start_services`` on a loaded 2-core host): created beside the cache nodes and
    the gateway instead of before them, the spill nodes were up after 11-16 s instead of 3-6 s,
    and the whole start took no less; they start alone, first."""
    remove_retired_spill_dirs(spill_root(config), config.num_spill_nodes)
    handles: list[Any] = []
    for name, _ in recipe.root_dirs:  # each in ``placed`` once created (review s37 r4 F2)
        handles.append(recipe.create(name))
        if placed is not None:
            placed[name] = handles[-1]
    try:
        _wait_placed([h.ready.remote() for h in handles], config, config.spill_node_resource, "spill node")
    except SpillDirLocked:  # ray.get raises a task's error as its cause's class too
        await_serving(handles, config.start_timeout_s)
    return handles


def _answer(refs: Any, config: ServiceConfig, what: str) -> Any:
    """``ray.get(refs)`` within ``config.start_timeout_s``: a clear error, not a start that
    waits for ever on an actor alive but silent (review s34 B F4: these calls had no timeout).

    Raises:
        RuntimeError: no answer in time, naming ``what``.
    """
    try:
        return ray.get(refs, timeout=config.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(_silent_message(what, config.start_timeout_s)) from None


def _silent_message(what: str, timeout_s: float) -> str:
    return (f"{what} did not answer within {timeout_s:g} s (the actor is alive but silent: stopped, "
            "deadlocked or overloaded); the deployment did not start. See its log (`ray logs`), stop what "
            "started (`kvstrata down`) and start again (`start_timeout_s` sets this bound)")


def _wait_placed(refs: list[Any], config: ServiceConfig, resource: str, what: str) -> None:
    """``ray.get(refs)``, but a clear error instead of a silent hang when no Ray node offers
    ``resource`` (an actor that cannot be placed waits forever).

    Raises:
        RuntimeError: the actors were not up within ``config.start_timeout_s``.
    """
    try:
        ray.get(refs, timeout=config.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        have = ray.cluster_resources().get(resource, 0)
        raise RuntimeError(
            f"{what} actors were not up within {config.start_timeout_s:g} s; the cluster offers "
            f"{have:g} units of the `{resource}` resource (each {what} needs 1). Start Ray with "
            f"`resources={{'{resource}': N}}` or set the count to 0 in the service config."
        ) from None


STOP_DRAIN_S = 5.0
"""At ``stop_services``, how long the scheduler waits for the releases of the calls the
gateway's stop ended before it stores usage (``GlobalSchedulerService.flush_durable``)."""


def stop_services(services: Services) -> None:
    """Stop the gateway, store the scheduler's usage counters and sessions (the next start
    refuses the turns of the sessions open now: their histories go with the nodes), and kill
    every actor of the deployment: the scheduler first, dead before the others are killed (its
    spill watch creates a dead spill node again, ``services.spill_recreate``; regression (s38):
    one it created after the spill nodes' kills outlived the stop, its name and directory taken).
    The gateway's served-address record is deleted (``services.gateway_served.forget``)."""
    drain_s = STOP_DRAIN_S
    try:
        ray.get(services.gateway.stop.remote(), timeout=10)
    except Exception as exc:  # noqa: BLE001 - best effort: the actor may already be gone
        log.debug("gateway stop: %s", exc)
        drain_s = 0.0  # no release is coming from a gateway that did not stop its calls
    try:
        # the gateway's cancelled calls' releases may still be on their way: waited for first
        ray.get(services.scheduler.flush_durable.remote(drain_s=drain_s), timeout=10 + drain_s)
    except Exception as exc:  # noqa: BLE001 - best effort: a crash loses at most USAGE_FLUSH_S of it
        log.warning("usage counters and session routes of the last seconds not stored at stop: %s", exc)
    kill_gone(SCHEDULER_NAME, services.config.namespace, KILL_WAIT_S)
    for handle in [services.gateway, *services.nodes.values(), services.scheduler, *services.spill_nodes]:
        ray.kill(handle)
    # one the scheduler created again has another handle
    _kill_spill_names([f"spill_node_{i}" for i in range(len(services.spill_nodes))], services.config.namespace)
    _forget_gateway(services.gateway)
