"""The cache node service: one engine, its step loop thread, and per-request token streams.

A plain class (testable without Ray); ``CacheNodeActor`` is the thin Ray wrapper. Each engine
step's events are handed from the step thread to the event loop in one batch, and reach a
request in one of two ways:

- ``generate`` (in-process callers): an async generator over the request's own queue; closing
  it aborts the request.
- the data plane (the gateway, ``services.data_plane``): ``submit`` and ``abort`` commands
  arrive on the node's ZeroMQ command inbox (``open_data_plane``), and the step thread pushes
  each step's events for a gateway to that gateway's event inbox in one message, so a step
  with ``n`` running streams costs one message, not ``n``. ``abort`` stops a request at the
  next step boundary and frees its blocks.

A request's ``started`` event is sent when the engine first schedules it, before that step's
forward pass, so the first token is not queued behind it.

Where its parts live: ``services.cache_node_streams``, ``services.cache_node_commands``,
``services.cache_node_health``, ``services.cache_node_admin`` and
``services.cache_node_requests`` (``SessionGone`` and ``SessionTextBudget``, re-exported
here). This module keeps ``CacheNode`` (the engine, describing the node, the step thread) and
the Ray actor ``CacheNodeActor`` (``CacheNodeRemote``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import ray

from cache_node.config import EngineConfig
from cache_node.tiers.spill_api import SpillBlockSpec, SpillClient
from services import data_plane
from services.actor_refs import ActorRef, NamedPeer, actor_restarts, resolve_or_none
from services.block_reports import BlockReporter
from services.cache_node_admin import Admin
from services.cache_node_commands import Commands
from services.cache_node_health import Health
from services.cache_node_requests import (  # noqa: F401 - SessionGone, SessionTextBudget re-exported
    Requests,
    SessionGone,
    SessionTextBudget,
)
from services.cache_node_streams import Event, SessionTexts, Streams, _Stream
from services.chat import ChatTemplater
from services.config import NodeConfig
from services.data_plane_auth import Security, secure_push
from services.metrics import MetricsEndpoint, MetricsServer, NodeMetrics
from services.metrics.server import serve_again
from services.peer_outbox import PeerOutbox

log = logging.getLogger(__name__)

FAILED_EXIT_DELAY_S = 0.5
"""A failed node actor's process lives this long after failing its streams, so their error
events and its health answer leave before it exits (and Ray restarts it)."""

SETTLE_WAIT_S = 0.002
"""An idle node's wait between ``settle_transfers`` calls while a paced demotion is still
pending (one lot of ``DeviceCopier.max_inflight_bytes``, 256 MiB, lands in ~5 ms)."""

WAITING_WAIT_S = 0.01
"""A node whose step scheduled nothing while requests wait steps again after this at the
latest; a compiled grammar or a landed prefetch wakes it at once (``LLMEngine.on_ready``)."""


class CacheNode(Streams, Commands, Health, Admin, Requests):
    """Owns one model replica and its KV pool; streams generations.

    Its parts, one concept each: ``Streams`` (``services.cache_node_streams``: opening
    streams, delivering each step's events), ``Commands`` (``services.cache_node_commands``:
    the data-plane command inbox, ``abort``), ``Health`` (``services.cache_node_health``:
    health, and the failed step loop), ``Admin`` (``services.cache_node_admin``: stats,
    flush, drain, closing a session), ``Requests`` (``services.cache_node_requests``:
    starting each opened stream's request in the engine, or refusing it). This class holds
    the engine and runs the step thread.

    Args:
        node_id: stable name of the node (also its Ray actor name).
        config: model and pool sizing.
        num_threads: torch CPU threads for this node (0 = all cores).
        event_sink: optional callable receiving ``(node_id, events)``, ``events`` a list of
            ``(event, block_hash, tier)`` for the device and host tiers (the global
            scheduler's ``report_events``), called from the step thread.
        scheduler: the engine's scheduling policy (``cache_node.scheduling``); a request's
            tenant promises arrive in ``NodeRequest.extra`` (``slo_class``, ``ttft_slo_ms``,
            ``min_tokens_per_s``, ``weight``, ``kv_quota_bytes``).
        security: the node's data-plane identity (``services.data_plane_auth``): its command
            inbox admits only the gateway and the scheduler, which alone may set a request's
            tenant, namespace and promises. None: plaintext on loopback (unit tests only).
    """

    def __init__(
        self, node_id: str, config: NodeConfig, num_threads: int = 0, event_sink: Any = None,
        session_ttl_s: float = 900.0, scheduler: str = "fcfs", spill: SpillClient | None = None,
        security: Security | None = None,
    ) -> None:
        # Regression: imported with this module, transformers' modeling (and torch._dynamo,
        # ~10 s of a 17-20 s import on a loaded machine) was paid by every process importing
        # it, the launcher included; only a node building its engine needs it. Likewise torch
        # and the engine's parts that import it (the launcher, ``kvstrata up``, imports no torch)
        import torch

        from cache_node.engine import LLMEngine
        from cache_node.model_loader import load_model
        from cache_node.policies.base import PolicyEnv
        from cache_node.tiers.manager import TierConfig

        if num_threads:
            torch.set_num_threads(num_threads)
        self.node_id = node_id
        self.config = config
        engine_config = EngineConfig(
            block_size=config.block_size,
            kv_pool_bytes=config.kv_pool_bytes,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            dtype=config.dtype,
            device=config.device,
            cuda_graphs=config.cuda_graphs,
            prefill_graph_max_tokens=config.prefill_graph_max_tokens,
            fused_kernels=config.fused_kernels,
            scheduling_policy=scheduler,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            grammar_compile_workers=config.grammar_compile_workers,
            grammar_compile_queue_per_tenant=config.grammar_compile_queue_per_tenant,
            grammar_cache_bytes=config.grammar_cache_bytes,
            grammar_worker_memory_bytes=config.grammar_worker_memory_bytes,
            grammar_step_budget_ms=config.grammar_step_budget_ms,
            grammar_max_active_per_tenant=config.grammar_max_active_per_tenant,
            grammar_request_budget_ms=config.grammar_request_budget_ms,
        ).resolved()
        lm = load_model(config.model_path, engine_config.torch_dtype, engine_config.torch_device)
        self.engine = LLMEngine(
            lm.model,
            engine_config,
            lm.model_id,
            lm.eos_token_ids,
            tier_config=TierConfig(host_bytes=config.host_bytes, prefetch_wait_s=config.prefetch_wait_s,
                                   spill_put_backlog_bytes=config.spill_put_backlog_bytes),
            spill=spill,
        )
        self.tokenizer = lm.tokenizer
        if lm.tokenizer is not None:
            self.engine.policy_env = PolicyEnv.from_tokenizer(lm.tokenizer)  # sentence boundaries
            self.engine.enable_structured_output(lm.tokenizer)  # off (requests refused) without xgrammar
        self.templater = ChatTemplater(lm.tokenizer) if lm.tokenizer is not None else None
        if self.templater is not None:
            _ = self.templater.max_token_chars  # once, here, not on the step thread
        self.event_sink = event_sink
        # hears ``(node_id, session_ids)`` of the sessions this node expired (the scheduler's
        # ``sessions_ended``), from the step thread
        self.session_sink: Callable[[str, list[str]], Any] | None = None
        self.session_ttl_s = session_ttl_s
        self._streams: dict[str, _Stream] = {}
        # taken by every change of ``_streams`` (the event loops' opens, aborts and consumers,
        # the step thread's last outputs and errors), so a compare-and-pop (``Streams._claim``)
        # is one step: a stream of the same id opened between its check and its pop is never
        # the one popped
        self._streams_lock = threading.Lock()
        self._drains: dict[str, asyncio.Event] = {}  # drain id -> set to cancel it (``Admin.cancel_drain``)
        self.security = security
        self._pusher = data_plane.PushSockets(secure_push(security, "gateway"))  # the step thread's
        self.commands_received = 0  # data-plane commands run
        self.bad_messages = 0  # data-plane messages dropped as malformed
        self._outbox: deque[tuple[str, str, Event]] = deque()  # (subscriber, request, event)
        self._inbox: tuple[Any, asyncio.Task[None]] | None = None
        self.data_address = ""  # the command inbox (open_data_plane)
        self._aborted_early: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (code, message)
        self._session_messages = SessionTexts()  # per session: its turns' messages
        # session turns whose conversation was rendered anew, not continued (other tools than
        # the history's, a reply kept as tool calls the template writes otherwise, ...)
        self.session_rerenders = 0
        # the step thread's: session turns the engine runs, by id, until their last output
        # (a turn an abort claimed as its last step computed is rewound: ``Streams._deliver_step``)
        self._session_turns: dict[str, _Stream] = {}
        # requests and aborts for the step thread: the event loop never waits on the engine's
        # lock, which a step holds for its whole forward pass
        self._incoming: deque[_Stream] = deque()
        # chat requests render here first, off the step thread (``Streams._open``)
        self._renderer = concurrent.futures.ThreadPoolExecutor(1, f"kvstrata-render-{node_id}")
        self._rendering: set[_Stream] = set()  # streams the renderer holds (not in ``_incoming`` yet)
        # per tenant: streams waiting for the renderer, taken round-robin (``Streams._render_next``)
        self._render_queue: dict[str, deque[_Stream]] = {}
        self._render_lock = threading.Lock()
        self._start_render_child()  # renders run in a child process (``Streams._render_templater``)
        # (request id, the stream an abort claimed) for the step thread (``Commands._run_aborts``)
        self._aborts: deque[tuple[str, _Stream]] = deque()
        # the step thread's: the stream whose request the engine holds under each id, from its
        # ``add_request`` until its last output (``Requests._start_incoming``): an id reused once
        # its request was aborted starts when the engine is done with the old one, and the old
        # one's outputs never reach the new stream (``Streams._owner``)
        self._engine_streams: dict[str, _Stream] = {}
        self._purges: set[str] = set()  # deleted tenants whose own namespace is still to drop
        self._gone_subscribers: deque[str] = deque()  # for the step thread: close sockets to them
        self._admin: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._stats: dict[str, Any] = {**self.engine.stats(), "time_s": time.monotonic()}  # ``stats``
        self._tenant_blocks: dict[str, dict[str, int]] = {}  # ``tenant_blocks``, with ``_stats``
        # Prometheus: the stats snapshot read at scrape time (served by ``serve_metrics``)
        self.metrics = NodeMetrics(node_id, lambda: self._stats, lambda: self.engine.scheduler.num_preemptions,
                                   self.engine.tiers.host.block_nbytes, self.engine.max_model_len,
                                   self.engine.grammar_stats)
        self.metrics_server: MetricsServer | None = None
        self._wake = threading.Event()
        self.engine.on_ready = self._wake.set  # a passed-over request became schedulable
        self._stopped = False
        self._steps_ended = False  # the step thread has exited: calls for it are refused (``Admin._refusal``)
        self.failure = ""  # why the step loop died ("" while it runs): the node is unhealthy
        self._fault_injected = False
        self._health_waiters: list[asyncio.Future[None]] = []
        # the step loop's heartbeat: monotonic time its latest turn began (``Health.stalled``)
        self.step_progress_s = time.monotonic()
        self._stall_noted = False  # a stall was logged (once per stall)
        self._thread = threading.Thread(target=self._run, name=f"{node_id}-steps", daemon=True)
        self._thread.start()

    # ---- description ----------------------------------------------------------------------
    def spill_block_spec(self) -> SpillBlockSpec:
        return self.engine.spill_block_spec()

    def describe(self) -> dict[str, Any]:
        """Identity needed to compute block hashes outside the node."""
        return {
            "node_id": self.node_id,
            "model_id": self.engine.model_id,
            "kv_format": self.engine.kv_format,
            "block_size": self.engine.pool.block_size,
            "max_num_seqs": self.engine.config.max_num_seqs,
            "max_model_len": self.engine.max_model_len,
            "pool_tokens": self.engine.pool.num_blocks * self.engine.pool.block_size,
            "vocab_size": self.engine.vocab_size,
            "pid": os.getpid(),
            "restarts": self.restarts(),
            "data_address": self.data_address,
            "metrics_address": self.metrics_address,
        }

    def serve_metrics(self, endpoint: MetricsEndpoint, previous_port: int = 0) -> str:
        """Serve this node's Prometheus ``/metrics`` at ``endpoint`` (once; with port 0, on
        ``previous_port`` while it is free: ``metrics.server.serve_again``); returns
        ``metrics_address``. Raises OSError when the port is taken."""
        if self.metrics_server is None:
            self.metrics_server = serve_again(self.metrics.registry, endpoint, previous_port)
        return self.metrics_address

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this node's ``/metrics`` ("" when it serves none)."""
        return self.metrics_server.address if self.metrics_server is not None else ""

    def pid(self) -> int:
        """This node's process id (fault tests and ``bench.chaos`` kill it)."""
        return os.getpid()

    def restarts(self) -> int:
        """How often this node was restarted (0 outside Ray)."""
        return 0

    def scheduler_unreachable(self) -> str:
        """Why the global scheduler cannot be called ("": it can, or none is named)."""
        return ""

    # ---- the step thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except BaseException as exc:  # any end but a stop fails the node (health)
            # Regression (s41 review r9): a BaseException (a queued call's) ended the loop with
            # ``failure`` empty: ``health`` said healthy while every call was refused and routed
            # requests never started.
            log.exception("cache node %s: the step loop failed", self.node_id)
            self._fail(f"cache node {self.node_id}: step loop failed: {type(exc).__name__}: {exc}")
        finally:  # stopped, failed and then stopped, or ended by a BaseException
            self._refuse_queued()

    def _forget_subscriber(self, subscriber: str) -> None:
        """Close the socket to a gone gateway's inbox, unless a stream registered since its
        streams were aborted (``abort_subscriber`` took them all out of ``_streams``) sends to
        it: that gateway attached again and the socket is in use. Regression: closing it then
        (linger 0) dropped the first events of a request admitted after the re-attach."""
        if not any(stream.subscriber == subscriber for stream in list(self._streams.values())):
            self._pusher.forget(subscriber)

    def _steps(self) -> None:
        last_expiry = time.monotonic()
        while not self._stopped:
            self.step_progress_s = time.monotonic()  # a turn (and the step before it) completed
            if self._fault_injected:
                raise RuntimeError("injected step fault (NodeConfig.fault_injection)")
            self._run_aborts()  # before new requests, which may reuse an aborted one's id
            while self._gone_subscribers:
                self._forget_subscriber(self._gone_subscribers.popleft())
            self._run_admin()
            for tenant in list(self._purges):  # once its last request has ended (``end_tenant``)
                self._drop_own_namespace(tenant)
            self._start_incoming()
            self._send_outbox()
            if not self.engine.has_unfinished_requests():
                settling = self.engine.settle_transfers()  # paced demotions move on without steps
                self._wake.wait(min(SETTLE_WAIT_S, self.config.step_idle_wait_s) if settling
                                else self.config.step_idle_wait_s)
                self._wake.clear()
            else:
                self._deliver_step(self.engine.step(self._announce))
                self.engine.release_undo()  # every turn that ended is delivered or undone now
                if self.engine.scheduled_nothing:
                    # every request waits (a grammar compiling, a prefetch in flight): wait for
                    # one to be ready (``LLMEngine.on_ready``) or a new command, not step again
                    # at once (regression: ~720 empty steps/s, ~12% of a core, while one
                    # request's grammar compiled)
                    settling = self.engine.settle_transfers()  # a demotion copy may hold blocks
                    self._wake.wait(SETTLE_WAIT_S if settling else WAITING_WAIT_S)
                    self._wake.clear()
                else:
                    # Python locks are not fair: leave the engine lock free for a moment so the
                    # transfer thread (spill prefetch) is not starved by back-to-back steps.
                    time.sleep(0.0005)
            self._flush_events()
            self._publish_stats()
            if time.monotonic() - last_expiry > min(5.0, self.session_ttl_s / 2):
                self._expire_sessions()
                last_expiry = time.monotonic()

    def _expire_sessions(self) -> None:
        """Close sessions idle for ``session_ttl_s`` and tell ``session_sink``."""
        expired = self.engine.expire_sessions(self.session_ttl_s)
        for sid in expired:
            self._session_messages.pop(sid, None)
        if expired and self.session_sink is not None:
            self.session_sink(self.node_id, expired)

    def shutdown(self) -> None:
        """Stop the step thread, the renderer and the data plane. Each in-process stream still
        open once the step thread stopped, or opened after (``Streams._open``), gets its last
        event, UNAVAILABLE. A gateway's stream gets none (no step thread sends it)."""
        with self._streams_lock:  # (``_open`` reads it there: none opens unseen by the sweep below)
            self._stopped = True
        self._wake.set()
        self._stop_renderer()  # (and its render child)
        self._thread.join(timeout=5.0)
        self._end_open_streams()
        self.close_data_plane()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if not self._thread.is_alive():  # its sockets and its engine's grammars are the step thread's alone
            self._pusher.close()
            # its transfer thread (queued spill puts written first) and its compiler processes
            # end now, not never and when it is collected: its tiers' memory is freed with it
            self.engine.close()
        else:  # a step still runs: the transfer thread ends all the same (later transfers are dropped)
            self.engine.tiers.close()

    def _end_open_streams(self) -> None:
        """``shutdown``, once the step thread stopped (or was waited for): claim each in-process
        stream still open and send it UNAVAILABLE (``Streams._end_shut_down``). Regression (s40):
        they got no event at all, and their ``generate`` callers (``bench.service``) waited for
        ever; so did a ``generate`` called after the shutdown."""
        for stream in [s for s in list(self._streams.values()) if not s.subscriber]:
            if self._claim(stream):  # (its last output, or its consumer leaving, may claim it first)
                self._end_shut_down(stream)



SCHEDULER_RELOOKUP_S = 5.0
"""Seconds between two look-ups of the global scheduler's name by a cache node (while it has no
live actor, and to find one created again under it)."""


class CacheNodeActor(CacheNode):
    """Ray actor: a CacheNode whose block events flow to the named GlobalScheduler."""

    def __init__(
        self, node_id: str, config: NodeConfig, num_threads: int = 0, scheduler: Any = None,
        session_ttl_s: float = 900.0, scheduling_policy: str = "fcfs",
        spill_nodes: list[Any] | None = None, spill_spec: SpillBlockSpec | None = None,
        security: Security | None = None, metrics: MetricsEndpoint | None = None,
    ) -> None:
        # the scheduler's ActorRef (the launcher's) is looked up on use, not here: one with no live
        # actor (dead for good, not created again yet) leaves this node serving, its calls to the
        # scheduler skipped until it is back. Regression (s39): ray.get_actor's ValueError here left
        # a cache node (re)started meanwhile dead for good (Ray restarts no actor whose constructor raised)
        self._scheduler = NamedPeer(scheduler, SCHEDULER_RELOOKUP_S) if scheduler else None
        # what this node tells it (expired sessions, its /metrics port) is sent until a scheduler
        # answers it: regression (s40), fire-and-forget calls to one that had died were lost
        self._tells = PeerOutbox(self._scheduler) if self._scheduler is not None else None
        spill_names = [node.name if isinstance(node, ActorRef) else f"spill node {i}"
                       for i, node in enumerate(spill_nodes or [])]
        spill_refs = list(spill_nodes or [])
        # a spill node with no live actor (dead for good, not yet created again: services.spill_recreate)
        # is None: its calls fail as a dead node's until its client finds it by name. Regression (s38):
        # ray.get_actor's ValueError here left a cache node (re)started meanwhile dead for good
        spill_nodes = [resolve_or_none(node) for node in spill_refs]
        for name, handle in zip(spill_names, spill_nodes):
            if handle is None:
                log.warning("cache node %s: no live actor named %s yet: its shard misses until it appears",
                            node_id, name)
        self._reporter = BlockReporter(scheduler) if scheduler else None  # (looks it up itself, again after a failure)
        sink = self._report_blocks if self._reporter is not None else None
        spill = None
        if spill_nodes and spill_spec is not None:
            from services.spill_client import RaySpillClient

            spill = RaySpillClient(spill_nodes, spill_spec.shape, spill_spec.dtype, names=spill_names,
                                   refs=[ref if isinstance(ref, ActorRef) else None for ref in spill_refs])
        super().__init__(node_id, config, num_threads, sink, session_ttl_s, scheduling_policy, spill, security)
        if spill_spec is not None and spill_spec != self.engine.spill_block_spec():
            raise RuntimeError(
                f"spill block format {spill_spec} differs from this node's {self.engine.spill_block_spec()}"
            )
        self._restarts = actor_restarts()
        handle = self._scheduler.handle() if self._scheduler is not None else None
        if metrics is not None:  # a restarted node serves its metrics again, on its port of before
            self.serve_metrics(metrics, _previous_metrics_port(handle, node_id) if self._restarts else 0)
            # (sent until a scheduler of the name answers: one missing now learns it once it is back)
            if self._tells is not None and metrics.port == 0 and self.metrics_server is not None:
                self._tells.tell("record_metrics_port", {"node_id": node_id, "port": self.metrics_server.port})
        if self._scheduler is not None:
            self.session_sink = self._sessions_ended

    def _sessions_ended(self, node_id: str, session_ids: list[str]) -> None:
        """Tell the scheduler of the sessions this node expired, until a scheduler of its name
        answers (``PeerOutbox``: while it has no live actor, or after a call to one that died,
        they are sent again; those still untold join the next expiry's). Each send leaves out
        the sessions this node holds again by then (a turn opened one anew under its id: its
        route is the new session's).

        Regression (s40): the call was fire-and-forget through a handle looked up every
        ``SCHEDULER_RELOOKUP_S``: to a scheduler that died after it was found it was lost, and
        while none had the name it was skipped (logged); a route the restarted scheduler had
        rebuilt for such a session stayed until ``session_ttl_s``, its next turn sent here, to
        a node without it."""
        assert self._tells is not None
        self._tells.tell("sessions_ended", {"node_id": node_id, "session_ids": list(session_ids)},
                         merge=_join_sessions, check=self._not_held)

    def _not_held(self, args: dict[str, Any]) -> dict[str, Any] | None:
        """``sessions_ended``'s arguments less the sessions this node holds now (None: none left)."""
        with self.engine._lock:  # (the step thread opens and ends sessions under it)
            left = [sid for sid in args["session_ids"] if sid not in self.engine.sessions.sessions]
        return {**args, "session_ids": left} if left else None

    def shutdown(self) -> None:
        super().shutdown()
        if self._tells is not None:
            self._tells.close()

    def scheduler_unreachable(self) -> str:
        """Why the global scheduler cannot be called ("" when it can: found by name, or no name
        given): its name has no live actor, as of the last look-up (never blocks: run on the
        event loop by ``stats``; a look-up due, every ``SCHEDULER_RELOOKUP_S``, runs on a
        background thread: ``NamedPeer.missing_now``)."""
        return "" if self._scheduler is None else self._scheduler.missing_now()

    def _report_blocks(self, node_id: str, events: list[tuple[str, bytes, str]]) -> None:
        """The step thread's block events, to the scheduler's index in order; after a lost
        report (``BlockReporter.needs_resync``) every block the device and host tiers hold,
        with ``reset``, instead (events after that snapshot still follow it), once due: after
        failed or refused calls it backs off (``BlockReporter.resync_due``)."""
        reporter = self._reporter
        assert reporter is not None
        if reporter.resync_due():
            reporter(node_id, [("stored", h, tier) for h, tier in self.engine.tier_block_hashes()], True)
        else:
            reporter(node_id, events)

    def restarts(self) -> int:
        return self._restarts

    def _after_failure(self) -> None:
        """Exit the process, so that Ray restarts the actor (``max_restarts``): wait for the
        failed streams' errors and the health answers to leave first."""
        time.sleep(FAILED_EXIT_DELAY_S)
        self._pusher.close(linger_s=FAILED_EXIT_DELAY_S)
        os._exit(1)


MAX_UNTOLD_SESSIONS = 1 << 16
"""Expired sessions waiting to be told to the scheduler at most; past it the oldest are
dropped (logged): their routes, if any, last ``session_ttl_s`` at most (``expire_unconfirmed``)."""


def _join_sessions(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """Two ``sessions_ended`` messages (arguments by name) as one: the sessions of both, oldest
    first, at most ``MAX_UNTOLD_SESSIONS`` (the newest)."""
    joined = list(dict.fromkeys([*older["session_ids"], *newer["session_ids"]]))
    if len(joined) > MAX_UNTOLD_SESSIONS:
        log.warning("cache node %s: %d expired sessions never told to the global scheduler (dropped)",
                    newer["node_id"], len(joined) - MAX_UNTOLD_SESSIONS)
        joined = joined[-MAX_UNTOLD_SESSIONS:]
    return {**newer, "session_ids": joined}


def _previous_metrics_port(scheduler: Any, node_id: str) -> int:
    """The port this node served ``/metrics`` on before its restart (the scheduler's
    ``metrics_port_of``; 0 when unknown or the scheduler does not answer within 5 s)."""
    if not scheduler:
        return 0
    try:
        return int(ray.get(scheduler.metrics_port_of.remote(node_id=node_id), timeout=5.0))
    except Exception as exc:  # noqa: BLE001 - any free port then
        log.warning("cache node %s: the port of its last /metrics is unknown: %s", node_id, exc)
        return 0


CacheNodeRemote = ray.remote(CacheNodeActor)
