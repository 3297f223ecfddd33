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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import load_model
from cache_node.outputs import RequestOutput
from cache_node.policies.base import PolicyEnv
from cache_node.scheduling import TenantShare
from cache_node.tiers.manager import TierConfig
from cache_node.tiers.spill_api import SpillBlockSpec, SpillClient
from services.chat import ChatTemplater
from services import data_plane
from services.config import NodeConfig
from services.data_plane_auth import Security, secure_push
from services.node_request import NodeRequest

log = logging.getLogger(__name__)

Event = dict[str, Any]

ABORTED_EARLY_MAX = 4096
"""Ids of aborts that arrived before their request, remembered (oldest dropped first)."""

STATS_EVERY_S = 0.1
"""The step thread refreshes the ``stats`` snapshot at most this often (it walks every block)."""

DRAIN_POLL_S = 0.05
"""How often ``drain`` looks whether the requests it waits for have finished."""

FAILED_EXIT_DELAY_S = 0.5
"""A failed node actor's process lives this long after failing its streams, so their error
events and its health answer leave before it exits (and Ray restarts it)."""


@dataclass
class _Stream:
    """One request's stream: in-process (``deliver`` called on ``loop``) or, with a
    ``subscriber``, pushed by the step thread to that gateway's event inbox."""

    loop: asyncio.AbstractEventLoop | None
    deliver: Callable[[Event], None] | None
    request: NodeRequest
    prompt_tokens: int
    subscriber: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    started: bool = False


class CacheNode:
    """Owns one model replica and its KV pool; streams generations.

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
        if num_threads:
            torch.set_num_threads(num_threads)
        self.node_id = node_id
        self.config = config
        lm = load_model(config.model_path, getattr(torch, config.dtype))
        self.engine = LLMEngine(
            lm.model,
            EngineConfig(
                block_size=config.block_size,
                kv_pool_bytes=config.kv_pool_bytes,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                dtype=config.dtype,
                scheduling_policy=scheduler,
            ),
            lm.model_id,
            lm.eos_token_ids,
            tier_config=TierConfig(host_bytes=config.host_bytes, prefetch_wait_s=config.prefetch_wait_s),
            spill=spill,
        )
        self.tokenizer = lm.tokenizer
        if lm.tokenizer is not None:
            self.engine.policy_env = PolicyEnv.from_tokenizer(lm.tokenizer)  # sentence boundaries
        self.templater = ChatTemplater(lm.tokenizer) if lm.tokenizer is not None else None
        self.event_sink = event_sink
        # hears ``(node_id, session_ids)`` of the sessions this node expired (the scheduler's
        # ``sessions_ended``), from the step thread
        self.session_sink: Callable[[str, list[str]], Any] | None = None
        self.session_ttl_s = session_ttl_s
        self._streams: dict[str, _Stream] = {}
        self.security = security
        self._pusher = data_plane.PushSockets(secure_push(security, "gateway"))  # the step thread's
        self.commands_received = 0  # data-plane commands run
        self.bad_messages = 0  # data-plane messages dropped as malformed
        self._outbox: deque[tuple[str, str, Event]] = deque()  # (subscriber, request, event)
        self._inbox: tuple[Any, asyncio.Task[None]] | None = None
        self.data_address = ""  # the command inbox (open_data_plane)
        self._aborted_early: OrderedDict[str, bool] = OrderedDict()
        self._session_messages: dict[str, list[dict[str, str]]] = {}
        # requests and aborts for the step thread: the event loop never waits on the engine's
        # lock, which a step holds for its whole forward pass
        self._incoming: deque[_Stream] = deque()
        self._aborts: deque[str] = deque()
        self._gone_subscribers: deque[str] = deque()  # for the step thread: close sockets to them
        self._admin: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._stats: dict[str, Any] = {**self.engine.stats(), "time_s": time.monotonic()}  # ``stats``
        self._wake = threading.Event()
        self._stopped = False
        self.failure = ""  # why the step loop died ("" while it runs): the node is unhealthy
        self._fault_injected = False
        self._health_waiters: list[asyncio.Future[None]] = []
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
            "pid": os.getpid(),
            "data_address": self.data_address,
        }

    def ping(self) -> bool:
        """True while the step loop runs; False once it has failed (see ``health``)."""
        return not self.failure

    def pid(self) -> int:
        """This node's process id (fault tests and ``bench.chaos`` kill it)."""
        return os.getpid()

    def restarts(self) -> int:
        """How often this node was restarted (0 outside Ray)."""
        return 0

    async def health(self, wait_s: float = 0.0) -> dict[str, Any]:
        """The node's health, answered at once or, with ``wait_s`` > 0, as soon as the step
        loop fails and at the latest after ``wait_s`` seconds (a gateway's long poll).

        Returns:
            ``healthy`` (bool), ``failure`` (why not, "" when healthy), ``pid``, ``restarts``
            and ``data_address`` (the command inbox, "" until ``open_data_plane``).
        """
        if wait_s > 0 and not self.failure:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._health_waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except asyncio.TimeoutError:
                pass
            finally:
                self._health_waiters.remove(waiter)
        return {"healthy": not self.failure, "failure": self.failure, "pid": os.getpid(),
                "restarts": self.restarts(), "data_address": self.data_address}

    def inject_step_fault(self) -> None:
        """Test hook: the step loop raises at its next iteration, as a bug in a step would.

        Raises:
            PermissionError: ``NodeConfig.fault_injection`` is off (the default).
        """
        if not self.config.fault_injection:
            raise PermissionError("fault injection is off (NodeConfig.fault_injection)")
        self._fault_injected = True
        self._wake.set()

    # ---- streaming generation -------------------------------------------------------------
    def _open(self, stream: _Stream) -> None:
        """Register a stream and hand it to the step thread, which queues its request in the
        engine before its next step (``_start_incoming``); a refusal (INVALID_ARGUMENT,
        PERMISSION_DENIED) arrives as an error event on the stream."""
        self._streams[stream.request.request_id] = stream
        self._incoming.append(stream)
        self._wake.set()

    def _start_incoming(self) -> None:
        """Step thread: queue every newly opened stream's request in the engine."""
        while self._incoming:
            stream = self._incoming.popleft()
            req = stream.request
            if self._streams.get(req.request_id) is not stream:
                continue  # aborted before it started
            error = None
            try:
                prompt = self._prompt(req)
                if req.max_context_tokens and len(prompt) + req.sampling.max_tokens > req.max_context_tokens:
                    raise ValueError(
                        f"prompt ({len(prompt)}) + max_tokens ({req.sampling.max_tokens}) exceeds the "
                        f"tenant's max_context_tokens ({req.max_context_tokens})"
                    )
                self._set_tenant_share(req)
                stream.prompt_tokens = len(prompt)
                self.engine.add_request(
                    prompt, req.sampling, request_id=req.request_id, cache_namespace=req.cache_namespace,
                    session_id=req.session_id or None, tenant=req.tenant, policy=req.policy,
                    prefetch=req.prefetch,
                )
            except PermissionError as exc:
                error = {"type": "error", "code": "PERMISSION_DENIED", "message": str(exc)}
            except (ValueError, KeyError, TypeError) as exc:  # bad values, e.g. in ``extra``
                text = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                error = {"type": "error", "code": "INVALID_ARGUMENT", "message": text}
            if error is not None:
                self._dispatch([(stream, error)])

    async def generate(self, req: NodeRequest) -> AsyncIterator[Event]:
        """Run one request; yields event dicts (see services.node_request). Closing the
        generator before its last event aborts the request."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._open(_Stream(asyncio.get_running_loop(), queue.put_nowait, req, 0))
        done = False
        try:
            while not done:
                event = await queue.get()
                done = event["type"] in ("finished", "error")
                yield event
        finally:
            self._streams.pop(req.request_id, None)
            if not done:
                self.engine.abort_request(req.request_id)

    def submit(self, req: NodeRequest, subscriber: str) -> None:
        """Start ``req``; its events go to ``subscriber`` (a gateway's event inbox address).

        A request refused at once (INVALID_ARGUMENT, PERMISSION_DENIED), cancelled before it
        arrived (``abort``), or whose id is running here already (ALREADY_EXISTS; ids are scoped
        to their tenant by the gateway), gets its error event pushed like any other event.
        """
        error = None
        if self._aborted_early.pop(req.request_id, None) is not None:
            error = ("CANCELLED", "the request was cancelled before it reached the node")
        elif req.request_id in self._streams:
            error = ("ALREADY_EXISTS", "a request with this id is running already")
        if error is not None:  # the running stream of that id is not touched
            self._outbox.append((subscriber, req.request_id, {"type": "error", "code": error[0], "message": error[1]}))
            self._wake.set()
            return
        self._open(_Stream(None, None, req, 0, subscriber))

    async def open_data_plane(self) -> str:
        """Bind the command inbox (``services.data_plane``; CURVE, admitting the gateway and
        the scheduler only, with ``security``) and serve it on the running event loop; returns
        its address. Opening again replaces the previous inbox."""
        self.close_data_plane()
        ctx = data_plane.context(asyncio_=True)
        auth = self.security.start_authenticator(ctx) if self.security is not None else None
        sock, address = data_plane.serving_socket(ctx, data_plane.zmq.PULL, self.security)
        self._inbox = (sock, asyncio.get_running_loop().create_task(self._serve_commands(sock)), auth)
        self.data_address = address
        return address

    def close_data_plane(self) -> None:
        if self._inbox is not None:
            sock, task, auth = self._inbox
            with contextlib.suppress(RuntimeError):  # its event loop may be gone already
                task.cancel()
                if auth is not None:
                    auth.stop()
            sock.context.destroy(linger=0)
            self._inbox = None

    async def _serve_commands(self, sock: Any) -> None:
        """Run each command; a malformed one (any bytes at all) is dropped and counted."""
        while True:
            payload = await sock.recv()
            try:
                self._command(data_plane.unpack(payload))
                self.commands_received += 1
            except Exception as exc:  # noqa: BLE001 - a bad message loses only itself
                self.bad_messages += 1
                log.warning("cache node %s: dropped a bad data-plane message: %s: %.200s",
                            self.node_id, type(exc).__name__, exc)

    def _command(self, msg: Any) -> None:
        """Run ``{"op": "submit", "req", "sub"}``, ``{"op": "abort", "id"}`` or
        ``{"op": "abort_subscriber", "sub"}`` (the scheduler: that gateway is gone).

        Raises:
            TypeError, ValueError: a malformed command (nothing was run).
        """
        if not isinstance(msg, dict):
            raise TypeError(f"a command must be a map, got {type(msg).__name__}")
        op = msg.get("op")
        if op == "submit" and isinstance(msg.get("sub"), str) and msg["sub"].startswith("tcp://"):
            self.submit(data_plane.request_from_wire(msg.get("req")), msg["sub"])
        elif op == "abort" and isinstance(msg.get("id"), str):
            self.abort(msg["id"])
        elif op == "abort_subscriber" and isinstance(msg.get("sub"), str):
            self.abort_subscriber(msg["sub"])
        else:
            raise ValueError(f"malformed command (op {op!r})")

    def _set_tenant_share(self, req: NodeRequest) -> None:
        extra = req.extra
        if "slo_class" not in extra:
            return
        quota_blocks = int(extra.get("kv_quota_bytes", 0)) // self.engine.pool.bytes_per_block
        self.engine.scheduler.policy.set_tenant(req.tenant, TenantShare(
            extra["slo_class"], float(extra["ttft_slo_ms"]), float(extra.get("min_tokens_per_s", 0)),
            float(extra.get("weight", 1)), quota_blocks,
        ))

    def _prompt(self, req: NodeRequest) -> list[int]:
        history = self.engine.session_history(req.session_id) if req.session_id else None
        if req.token_ids:
            return (history or []) + list(req.token_ids)
        if self.templater is None:
            raise ValueError("this node's model has no tokenizer; send token ids")
        if history:
            past = self._session_messages.get(req.session_id, [])
            return self.templater.continuation(past, history, req.messages)
        return self.templater.first_turn(req.messages)

    # ---- the step thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._steps()
        except Exception as exc:  # noqa: BLE001 - any failure of a step ends the loop: say so
            log.exception("cache node %s: the step loop failed", self.node_id)
            self._fail(f"cache node {self.node_id}: step loop failed: {type(exc).__name__}: {exc}")

    def _steps(self) -> None:
        last_expiry = time.monotonic()
        while not self._stopped:
            if self._fault_injected:
                raise RuntimeError("injected step fault (NodeConfig.fault_injection)")
            while self._aborts:  # before new requests, which may reuse an aborted one's id
                self.engine.abort_request(self._aborts.popleft())
            while self._gone_subscribers:
                self._pusher.forget(self._gone_subscribers.popleft())
            self._run_admin()
            self._start_incoming()
            self._send_outbox()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self.config.step_idle_wait_s)
                self._wake.clear()
            else:
                self._deliver_step(self.engine.step(self._announce))
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

    def _fail(self, reason: str) -> None:
        """Step thread, after the loop died: mark the node unhealthy, wake ``health`` waiters,
        then end every stream (open or arriving later) with UNAVAILABLE until ``shutdown``;
        ``_after_failure`` runs once the first streams are failed."""
        self.failure = reason
        for waiter in list(self._health_waiters):
            waiter.get_loop().call_soon_threadsafe(_set_done, waiter)
        first = True
        while not self._stopped:
            self._incoming.clear()  # their streams are in ``_streams`` too
            self._aborts.clear()
            while self._admin:
                self._admin.popleft()[1].set_exception(RuntimeError(reason))
            error = {"type": "error", "code": "UNAVAILABLE", "message": reason}
            self._dispatch([(stream, dict(error)) for stream in list(self._streams.values())])
            self._send_outbox()
            if first:
                first = False
                self._after_failure()
            self._wake.wait(self.config.step_idle_wait_s)
            self._wake.clear()

    def _after_failure(self) -> None:
        """Hook run once a failed node has failed its streams (the actor exits here)."""

    def _send_outbox(self) -> None:
        while self._outbox:
            subscriber, request_id, event = self._outbox.popleft()
            self._pusher.send(subscriber, [[request_id, event]])

    def _announce(self, batch: list[tuple[Any, int]]) -> None:
        """Step thread, after scheduling and before the forward pass: a ``started`` event for
        each request scheduled for the first time."""
        now = time.monotonic()
        events = []
        for seq, _ in batch:
            stream = self._streams.get(seq.request_id)
            if stream is None or stream.started:
                continue
            stream.started = True
            events.append((stream, {
                "type": "started", "request_id": seq.request_id, "node_id": self.node_id,
                "prompt_tokens": seq.num_prompt_tokens,
                "cached_tokens": dict(self.engine.tiers.cached_tokens_by_tier(seq)),
                "queue_ms": (now - seq.arrival_time_s) * 1000.0,
            }))
        self._dispatch(events)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Turn one step's outputs into events and send them on: one message per gateway, one
        call per in-process event loop."""
        events = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                events.extend((stream, event) for event in self._events(out, stream))
        self._dispatch(events)

    def _dispatch(self, events: list[tuple[_Stream, Event]]) -> None:
        pushed: dict[str, list[list[Any]]] = {}
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Event]]] = {}
        for stream, event in events:
            if not stream.subscriber:
                batches.setdefault(stream.loop, []).append((stream, event))
                continue
            if event["type"] in ("finished", "error"):
                self._streams.pop(stream.request.request_id, None)
            pushed.setdefault(stream.subscriber, []).append([stream.request.request_id, event])
        for subscriber, items in pushed.items():
            self._pusher.send(subscriber, items)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[tuple[_Stream, Event]]) -> None:
        for stream, event in batch:
            if event["type"] in ("finished", "error"):
                self._streams.pop(stream.request.request_id, None)
            stream.deliver(event)

    def _events(self, out: RequestOutput, stream: _Stream) -> list[Event]:
        events: list[Event] = []
        if out.new_token_ids:
            stream.token_ids.extend(out.new_token_ids)
            text = self.tokenizer.decode(stream.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            delta, stream.text = text[len(stream.text):], text
            events.append({"type": "delta", "token_ids": list(out.new_token_ids), "text": delta})
        if out.finished and out.finish_reason == "rejected":
            events.append({"type": "error", "code": "INVALID_ARGUMENT",
                           "message": "the request can never fit this node's KV pool "
                                      f"({self.engine.scheduler.pool_tokens} tokens)"})
        elif out.finished:
            self._end_session_turn(stream, out)
            events.append(self._finished_event(out, stream))
        return events

    def _end_session_turn(self, stream: _Stream, out: RequestOutput) -> None:
        req = stream.request
        if not req.session_id or out.finish_reason == "abort" or not req.messages:
            return
        history = self._session_messages.setdefault(req.session_id, [])
        history.extend(req.messages)
        history.append({"role": "assistant", "content": stream.text})

    def _finished_event(self, out: RequestOutput, stream: _Stream) -> Event:
        now = time.monotonic()
        ttft_ms = (out.ttft_s or 0.0) * 1000.0
        n = out.num_output_tokens
        total_ms = (now - stream.request.arrival_time_s) * 1000.0 if stream.request.arrival_time_s else 0.0
        tpot = (total_ms - ttft_ms) / (n - 1) if n > 1 and total_ms else 0.0
        return {
            "type": "finished", "finish_reason": out.finish_reason,
            "prompt_tokens": out.num_prompt_tokens, "completion_tokens": n,
            "cached_tokens": _tiers(out),
            "ttft_ms": ttft_ms, "tpot_ms": tpot, "preempted": out.num_preemptions > 0,
            "prefill_tokens_per_s": self.engine.scheduler.prefill_speed.tokens_per_s,
            "step_s": self.engine.scheduler.step_s.value,
        }

    def _flush_events(self) -> None:
        if self.event_sink is None:
            return
        events = self.engine.take_tier_events()
        if events:  # plain tuples: the scheduler need not import the cache node's types
            self.event_sink(self.node_id, [(e.event, e.block_hash, e.tier) for e in events])

    # ---- admin ----------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` at the next step boundary (its stream gets no more events).

        An abort can overtake its request (the gateway aborts, the scheduler submits): an
        unknown id is remembered, and a later ``submit`` of it is refused (CANCELLED).
        """
        stream = self._streams.pop(request_id, None)
        if stream is None:
            self._aborted_early[request_id] = True
            while len(self._aborted_early) > ABORTED_EARLY_MAX:
                self._aborted_early.popitem(last=False)
            return False
        self._aborts.append(request_id)  # for the step thread (a no-op if it never started)
        self._wake.set()
        return True

    def abort_subscriber(self, subscriber: str) -> int:
        """The gateway whose event inbox is ``subscriber`` is gone: abort every stream whose
        events went to it (their blocks are freed at the next step boundary) and close the
        step thread's socket to it. Returns how many streams were aborted."""
        ids = [rid for rid, stream in list(self._streams.items()) if stream.subscriber == subscriber]
        for rid in ids:
            self.abort(rid)
        self._gone_subscribers.append(subscriber)
        self._wake.set()
        if ids:
            log.warning("cache node %s: aborted %d streams of gone gateway %s", self.node_id, len(ids), subscriber)
        return len(ids)

    # Admin calls never take the engine lock on the caller's thread (a step holds it for its
    # whole forward pass, and on the actor that would stall its event loop): ``stats`` reads
    # the snapshot the step thread publishes; the others run on the step thread between steps.
    async def close_session(self, session_id: str, tenant: str) -> int:
        """Close ``tenant``'s session; its history tokens freed, or -1 when it has no such session."""

        def close() -> int:
            owner = self.engine.sessions.sessions.get(session_id)
            if owner is None or owner.tenant != tenant:
                return -1
            self._session_messages.pop(session_id, None)
            return self.engine.close_session(session_id)

        return await self._between_steps(close)

    def stats(self) -> dict[str, Any]:
        """Pool, queue and session counts as of the last step boundary, ``stats_age_s`` ago
        (never waits for a step)."""
        return self._node_stats(self._stats)

    async def integrity_stats(self) -> dict[str, Any]:
        """``stats`` taken fresh at the next step boundary, with the pool's integrity checked
        there (``integrity_ok``, ``integrity_error``)."""
        return self._node_stats(await self._between_steps(self._integrity_stats))

    def _node_stats(self, engine: dict[str, Any]) -> dict[str, Any]:
        return {"node_id": self.node_id, "healthy": not self.failure, "failure": self.failure,
                "pid": os.getpid(), "restarts": self.restarts(),
                **{k: v for k, v in engine.items() if k != "time_s"},
                "stats_age_s": time.monotonic() - engine["time_s"],
                "data_plane": {"commands": self.commands_received, "bad_messages": self.bad_messages}}

    async def flush(self) -> int:
        """Drop every cached block not in use (next step boundary); returns blocks dropped."""
        return await self._between_steps(self.engine.flush)

    async def drain(self, timeout_s: float = 0.0) -> int:
        """Let the requests running now finish for up to ``timeout_s`` seconds, then abort
        those still running (they end with finish reason ``abort``); returns how many.

        Raises:
            ValueError: ``timeout_s`` is negative or not finite.
        """
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s}")
        ids = list(self._streams)
        deadline = time.monotonic() + timeout_s
        while any(rid in self._streams for rid in ids) and time.monotonic() < deadline:
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))
        left = [rid for rid in ids if rid in self._streams]
        if not left:
            return 0
        return await self._between_steps(lambda: sum(self.engine.abort_request(rid) for rid in left))

    def _between_steps(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """``call()`` run by the step thread at its next step boundary, as an awaitable.

        Raises (when awaited): RuntimeError: the step loop has failed (``failure``).
        """
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.failure:
            done.set_exception(RuntimeError(self.failure))
        else:
            self._admin.append((call, done))
            self._wake.set()
        return asyncio.wrap_future(done)

    def _run_admin(self) -> None:
        """Step thread: run the admin calls queued by ``_between_steps``."""
        while self._admin:
            call, done = self._admin.popleft()
            try:
                done.set_result(call())
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                done.set_exception(exc)

    def _publish_stats(self) -> None:
        """Step thread: refresh the ``stats`` snapshot (at most every ``STATS_EVERY_S``)."""
        if time.monotonic() - self._stats["time_s"] >= STATS_EVERY_S:
            self._stats = {**self.engine.stats(), "time_s": time.monotonic()}

    def _integrity_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {**self.engine.stats(), "time_s": time.monotonic()}
        try:
            self.engine.check_integrity()
            stats["integrity_ok"], stats["integrity_error"] = True, ""
        except RuntimeError as exc:
            stats["integrity_ok"], stats["integrity_error"] = False, str(exc)
        return stats

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        self.close_data_plane()
        if not self._thread.is_alive():  # its sockets are the step thread's alone
            self._pusher.close()


def _set_done(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _tiers(out: RequestOutput) -> dict[str, int]:
    """Cached prompt tokens per tier (device/host/spill_ram/spill_disk)."""
    return dict(out.num_cached_tokens_by_tier) or {"device": out.num_cached_tokens}


def _event_sink(scheduler: Any) -> Any:
    def sink(node_id: str, events: list[tuple[str, bytes, str]]) -> None:
        scheduler.report_events.remote(node_id, events)

    return sink


class CacheNodeActor(CacheNode):
    """Ray actor: a CacheNode whose block events flow to the named GlobalScheduler."""

    def __init__(
        self, node_id: str, config: NodeConfig, num_threads: int = 0, scheduler: Any = None,
        session_ttl_s: float = 900.0, scheduling_policy: str = "fcfs",
        spill_nodes: list[Any] | None = None, spill_spec: SpillBlockSpec | None = None,
        security: Security | None = None,
    ) -> None:
        sink = _event_sink(scheduler) if scheduler else None
        spill = None
        if spill_nodes and spill_spec is not None:
            from services.spill_client import RaySpillClient

            spill = RaySpillClient(spill_nodes, spill_spec.shape, spill_spec.dtype)
        super().__init__(node_id, config, num_threads, sink, session_ttl_s, scheduling_policy, spill, security)
        if spill_spec is not None and spill_spec != self.engine.spill_block_spec():
            raise RuntimeError(
                f"spill block format {spill_spec} differs from this node's {self.engine.spill_block_spec()}"
            )
        self._restarts = _actor_restarts()
        if scheduler:
            self.session_sink = lambda node_id, ids: scheduler.sessions_ended.remote(node_id, ids)

    def restarts(self) -> int:
        return self._restarts

    def _after_failure(self) -> None:
        """Exit the process, so that Ray restarts the actor (``max_restarts``): wait for the
        failed streams' errors and the health answers to leave first."""
        time.sleep(FAILED_EXIT_DELAY_S)
        self._pusher.close(linger_s=FAILED_EXIT_DELAY_S)
        os._exit(1)


def _actor_restarts() -> int:
    """How often Ray restarted the current actor (its GCS record; 0 or 1 when that is unreadable)."""
    context = ray.get_runtime_context()
    try:
        from ray._private import state  # no public API reads an actor's restart count

        return int(state.actors(context.get_actor_id()).get("NumRestarts", 0))
    except Exception:  # noqa: BLE001 - an internal API: fall back to the public flag
        return int(context.was_current_actor_reconstructed)


CacheNodeRemote = ray.remote(CacheNodeActor)
