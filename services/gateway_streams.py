"""The gateway's end of the data plane (``services.data_plane``): ``NodeStreams``.

It sends admissions to the global scheduler's admission socket and aborts to the nodes'
command inboxes, and routes the events nodes push to its event inbox to per-request queues
(``StreamBuffer``, bounded by ``StreamLimits``: ``services.gateway_stream_bounds``), each node's
in turn (``services.gateway_event_turns``: one node's flood cannot starve another's streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from services import data_plane
from services.data_plane_auth import Security
from services.gateway_event_turns import MAX_QUEUED_BYTES_PER_NODE, Behind, SenderTurns
from services.gateway_stream_bounds import (
    MAX_UNDELIVERED_BYTES,
    SILENT_STREAM_S,
    STREAM_IDLE_TIMEOUT_S,
    UNBOUND_STREAMS_HELD,
    StreamBuffer,
    event_bytes,
    past_bound,
)
from services.global_scheduler_checks import Admission
from services.loop_lag import LoopLag, wait_past_stall
from services.node_request import NodeRequest
from services.ray_errors import SchedulerRestarting

log = logging.getLogger(__name__)

OnEvent = Callable[[dict[str, Any]], None]

IDLE_SWEEP_S = 1.0
"""How often ``NodeStreams`` looks for idle streams (``expire_idle``), at most; a quarter of
the idle timeout when that is shorter."""

READ_BATCH = 256
"""Event messages ``NodeStreams`` reads off its inbox at most before the other tasks run (those
already there): its reading keeps up with the messages' arrival, so a flooding node's pile up
in its own queue (``SenderTurns``, bounded), not in ZeroMQ's, ahead of other nodes' messages."""

RECONCILE_S = 10.0
"""How often ``NodeStreams`` asks the global scheduler which of its bound streams' requests it
still counts as admitted from this gateway (``reconcile``): one it released without this gateway
hearing of it ends UNAVAILABLE within about two of these (two answers in a row missed it; plus
the queries' answers), never waits for ever."""

SILENT_RUNS = 3
"""``reconcile`` runs failed in a row (the scheduler unreachable, or not answering within
``RECONCILE_ASK_TIMEOUT_S``) after which ``end_silent`` asks the nodes about the streams silent
past ``silent_stream_s``: ``reconcile`` cannot end a released one while no answer comes."""

HOLDING_BATCH = 4096
"""Request ids one ``CacheNode.holding`` call asks about (its ``HOLDING_QUERY_MAX``)."""

HOLDING_ASK_TIMEOUT_S = 10.0
"""A node's ``holding`` answer not come by then: its silent streams are left as they are this
run (a node that does not answer is the health monitor's: ``NodeMonitor`` finds it down and
``fail_node`` ends its streams)."""

RECONCILE_ASK_TIMEOUT_S = 30.0
"""One ``ask_admitted`` query not answered by then fails its ``reconcile`` run (counted towards
``SILENT_RUNS``): a scheduler that hangs is as unreachable as one that refuses."""

RECONCILE_BATCH = 4096
"""Request ids one query of ``reconcile`` asks about (the scheduler's ``ADMITTED_QUERY_MAX``)."""

REVOKED_READ_S = 2.0
"""How long the reader of a stream ended for its key (``end_revoked``) may go on without taking
its error (stuck writing an earlier event to a client that does not read) before ``expire_idle``
stops it (``on_idle`` with the error's code, UNAUTHENTICATED or ABORTED): its call then ends at
once, not at ``stream_idle_timeout_s``, and stops counting against its tenant's
``max_streams_per_tenant``. The stalls of the gateway's own event loop meanwhile are not
counted (``LoopLag``), as for ``stream_idle_timeout_s``."""

REVOKED_CODES = ("UNAUTHENTICATED", "ABORTED", "UNAVAILABLE")
"""The codes ``end_revoked`` ends a stream with: its key was removed (rotated away), its
tenant was deleted (as its nodes' ``end_tenant`` ends it), or its key could not be confirmed
for ``StreamLimits.key_staleness_max_s`` (the scheduler's key directory unreachable:
``services.gateway_key_watch.KeyWatch``; retryable)."""


@dataclass
class _Entry:
    """An open stream: its node ("" until ``bind``), buffer, ``on_event`` and ``on_idle``
    (``open``)."""

    node_id: str
    buffer: StreamBuffer
    on_event: OnEvent | None
    on_idle: Callable[..., None] | None = None  # (message) idle; (message, code) revoked: ``REVOKED_CODES``
    ended_unread: bool = False  # ended here (``_end``): aborted on its node (at ``bind`` if not bound)
    idle: bool = False  # ended by ``expire_idle`` (once)
    key_id: str = ""  # the id of the API key that opened it ("": none watched; ``end_revoked``)
    tenant_id: str = ""  # its tenant's id: its request id's scope (``scoped_id``), "" for an unscoped id
    revoked: dict[str, Any] | None = None  # its ``end_revoked`` error (its key was removed)
    revoked_at: float | None = None  # when that error was put (``clock``; at ``bind`` when not bound then)
    finished: bool = False  # its ``finished`` event came: nothing runs on its node
    warned: bool = False  # a second ``started`` was logged (each one is counted)
    logprobs: int | None = None  # what its request's sampling asked (each delta is checked for it)
    prompt_logprobs: int | None = None  # likewise (``check_prompt_count`` too)
    prompt_left: int = -1  # prompt entries still due: its first ``started`` event's prompt tokens - 1
    tokens_seen: bool = False  # a delta with token ids came (no prompt entry may follow)
    prompt: tuple[int, ...] = ()  # its prompt's token ids when the gateway knows them (else empty)
    opened_at: float = 0.0  # when ``open`` made it (``clock``): its key was checked before then
    unadmitted: bool = False  # the scheduler's last ``reconcile`` answer did not count it admitted
    event_at: float = 0.0  # its node's last event here (``clock``; ``bind`` before any): ``end_silent``
    unheld: bool = False  # its node's last ``holding`` answer (``end_silent``) did not name it

    def check_prompt_count(self, event: dict[str, Any]) -> None:
        """A request asking for prompt logprobs gets at most one entry per prompt token after
        the first, after its ``started`` event and before its first token id. When its prompt's
        token ids are known (``prompt``), the ``started`` event must count them, entry i must be
        prompt token i + 1's, and all of them must have come by the first token id. Raises
        ValueError naming the event's field.

        Regression (review 28c F5): the count was the node's own ``prompt_tokens``, and a node
        skipping or repeating positions gave clients a short or shifted ``prompt_logprobs``."""
        if event["type"] == "started":
            if self.prompt_left < 0:  # (a second one, dropped by the buffer, counts nothing)
                if self.prompt and self.prompt_logprobs is not None and event["prompt_tokens"] != len(self.prompt):
                    raise ValueError(f"event.prompt_tokens {event['prompt_tokens']} is not its prompt's "
                                     f"{len(self.prompt)} tokens")
                self.prompt_left = max(0, event["prompt_tokens"] - 1)
        elif event["type"] == "delta":
            entries = event.get("prompt_logprobs") or ()
            n = len(entries)
            if n and (self.tokens_seen or n > self.prompt_left):
                raise ValueError("event.prompt_logprobs past its prompt's tokens (one entry per prompt token after "
                                 "the first, before the first token id)")
            if n and self.prompt:
                first = len(self.prompt) - self.prompt_left  # the prompt position of the first entry
                if any(int(e[0]) != self.prompt[first + i] for i, e in enumerate(entries)):
                    raise ValueError("event.prompt_logprobs: an entry's token_id is not its prompt position's token")
            self.prompt_left -= n
            if event["token_ids"] and not self.tokens_seen and self.prompt and self.prompt_logprobs is not None \
                    and self.prompt_left != 0:
                raise ValueError(f"event.prompt_logprobs: {self.prompt_left} of its prompt's entries missing before "
                                 "its first token id")
            self.tokens_seen = self.tokens_seen or bool(event["token_ids"])


@dataclass
class _Held:
    """The events of a stream whose node is not known yet, held for ``bind`` per sender (each a
    ``StreamBuffer``: deltas coalesced, one ``started``, nothing after an end), and the senders
    some of whose events were dropped past the bounds (``NodeStreams._hold``), or may have been
    (a message of theirs dropped unread: ``NodeStreams._sender_behind``)."""

    buffers: dict[str | None, StreamBuffer] = field(default_factory=dict)
    lost: set[str | None] = field(default_factory=set)
    behind: set[str | None] = field(default_factory=set)


async def _ids_answered(ask: Callable[[list[str]], Awaitable[Any]], ids: list[str], batch: int, timeout_s: float,
                        who: str) -> set[str]:
    """The request ids ``ask`` answers with when asked about ``ids``, ``batch`` ids a call
    (``reconcile``'s scheduler query, ``end_silent``'s node query). Raises whatever ``ask``
    raises, asyncio.TimeoutError for a call not answered within ``timeout_s``, and TypeError
    (naming ``who``) for an answer that is not a list; non-string ids in an answer are dropped."""
    answered: set[str] = set()
    for i in range(0, len(ids), batch):
        answer = await asyncio.wait_for(ask(ids[i:i + batch]), timeout_s)
        if not isinstance(answer, (list, tuple)):
            raise TypeError(f"{who} answered a {type(answer).__name__}, not a list")
        answered.update(rid for rid in answer if isinstance(rid, str))
    return answered


class NodeStreams:
    """The gateway's end of the data plane (``services.data_plane``).

    - ``admit``: a request's admission by the GlobalScheduler, which hands an admitted request
      straight to its node;
    - the event inbox: each node pushes every event of an engine step for this gateway's
      streams in one message, or in several in order where one would pass ``EVENT_LIMITS``
      (``data_plane.event_messages``), routed here to per-request queues (``open``);
    - ``abort``: straight to the node's command inbox.

    A node found down (``services.node_monitor.NodeMonitor`` calls ``fail_node``) ends each
    stream open on it, and any stream bound to it later, with an UNAVAILABLE error event, until
    it rejoins (``reconnect``, with its new command inbox).

    Args:
        nodes: node id -> CacheNode actor handle.
        node_inboxes: node id -> the node's command inbox address.
        scheduler_address: the GlobalScheduler's admission socket address.
        admit_timeout_s: an admission not answered by then fails with UNAVAILABLE. One whose
            wait spanned a stall of this gateway's own event loop (``LoopLag``: its reply may be
            waiting unread in the socket) is waited for once more, ``admit_timeout_s`` again
            (counted in ``admit_lag_waits``): a silent scheduler fails it after
            ``admit_timeout_s``, or ``2 * admit_timeout_s`` plus the stall when this gateway
            stalled meanwhile (one that is down fails it at once: ``scheduler_failed``).
        security: the gateway's data-plane identity (``services.data_plane_auth``): its event
            inbox admits only nodes. None: plaintext on loopback (unit tests only).
        max_undelivered_bytes: a stream holding more undelivered (``StreamBuffer``; its client
            reads too slowly or not at all; its end event counts on its own: ``past_bound``) is
            ended with RESOURCE_EXHAUSTED and its request aborted on its node; counted in
            ``overflows``. Events for a stream whose node is not known yet are held per sending
            node, at most this much a stream and ``UNBOUND_STREAMS_HELD`` times it in all (``_hold``).
        stream_idle_timeout_s: a bound stream whose reader has taken nothing this long without
            waiting for events (``StreamBuffer.idle_s``) is ended the same way, and its
            ``on_idle`` called; counted in ``idle_ends`` (``expire_idle``). The stalls of this
            gateway's own event loop (``LoopLag``) in that time are not the client's and do not
            count: the client's reads waiting unread in the socket meanwhile could not be seen.
        clock: seconds, monotonic (``time.monotonic``; tests pass their own: then no stall of
            this loop is taken off a stream's idle time, the test's clock being all there is).
        reconcile_s: seconds between two ``reconcile`` runs (``ask_admitted`` set: the
            gateway's scheduler query; none while it is None).
        silent_stream_s: once ``SILENT_RUNS`` runs in a row failed (the scheduler unreachable),
            the node of a bound stream that got no event from it this long (seconds) is asked
            whether it still holds its request (``ask_holding``); one it no longer holds in two
            answers in a row ends UNAVAILABLE (``end_silent``), counted in ``silent_ends``.

    Every message read is checked, values included (``data_plane.checked_event_items``,
    ``admission_reply``), and a bad one counted in ``bad_messages``: a bad event ends its own
    stream with UNAVAILABLE (its request aborted on its node: ``_attempt``), the others of its
    message are routed; a reply with bad admission fields fails its admission at once
    (UNAVAILABLE for that request); any other bad message is dropped. Each message is decoded
    within its socket's ``data_plane.MessageLimits`` (``EVENT_LIMITS``, ``REPLY_LIMITS``). A
    stream's second ``started`` event, and an event held before ``bind`` past its bound, are
    dropped and counted in ``bad_messages`` too.
    """

    def __init__(self, nodes: dict[str, Any], node_inboxes: dict[str, str], scheduler_address: str,
                 admit_timeout_s: float = 30.0, security: Security | None = None,
                 max_undelivered_bytes: int = MAX_UNDELIVERED_BYTES,
                 stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 max_queued_bytes_per_node: int = MAX_QUEUED_BYTES_PER_NODE,
                 reconcile_s: float = RECONCILE_S, silent_stream_s: float = SILENT_STREAM_S) -> None:
        self.security = security
        self._per_node_keys = security is not None and bool(security.node_clients)
        self._key_names = security.key_names() if security is not None else {}
        self._unbound: dict[str, _Held] = {}  # events before ``bind`` (``_hold``)
        self._unbound_bytes: Counter[str | None] = Counter()  # sender -> its events held (bytes)
        self.bad_messages = 0
        self.unopened_events = 0  # events for requests not open here, dropped unchecked (``_open_items``)
        self._unopened_senders: set[str | None] = set()  # senders already logged for them
        self.overflows = 0  # streams ended for holding over ``max_undelivered_bytes``
        self.idle_ends = 0  # streams ended for ``stream_idle_timeout_s`` without a take
        self.loop_lag = LoopLag()  # this gateway's own stalls (``start`` runs it)
        self.admit_lag_waits = 0  # admissions answered in their second wait (this loop stalled in the first)
        self.max_undelivered_bytes = max_undelivered_bytes
        self.max_unbound_bytes = UNBOUND_STREAMS_HELD * max_undelivered_bytes
        self.max_queued_bytes_per_node = max_queued_bytes_per_node
        self.behind_drops: Counter[str | None] = Counter()  # sender -> its messages dropped (``_sender_behind``)
        self._behind_scans: dict[str | None, int] = {}  # sender -> ``_opens`` at its last ``_sender_behind``
        self._opens = 0  # ``open`` and ``bind`` calls so far
        self.stream_idle_timeout_s, self.clock = stream_idle_timeout_s, clock
        self.nodes, self.node_inboxes = nodes, dict(node_inboxes)
        self.scheduler_address = scheduler_address
        self.admit_timeout_s = admit_timeout_s
        self.subscriber = ""  # this gateway's event inbox address (``start``)
        # awaited when the scheduler refuses an admission ``gateway_gone`` (it counts this
        # gateway as gone): True once this gateway is attached again, then the admission is sent
        # once more (``RayGateway`` re-attaches); None: the refusal stands
        self.on_gone: Callable[[], Awaitable[bool]] | None = None
        # the scheduler's ``admitted_from`` for this gateway's inbox: which of the request ids
        # given (at most ``RECONCILE_BATCH``) it counts as admitted from here (``reconcile``)
        self.ask_admitted: Callable[[list[str]], Awaitable[Any]] | None = None
        self.reconcile_s = reconcile_s
        self.reconciled_ends = 0  # streams ended by ``reconcile``
        self._reconcile_failures = 0  # ``reconcile`` runs failed in a row (logged at the first)
        self.silent_stream_s = silent_stream_s
        self.silent_ends = 0  # streams ended by ``end_silent``
        # node id, request ids (at most ``HOLDING_BATCH``) -> those the node still holds for
        # this gateway (``CacheNode.holding``; ``end_silent``)
        self.ask_holding: Callable[[str, list[str]], Awaitable[Any]] = self._node_holding
        self._holding_failed: set[str] = set()  # nodes whose last ``holding`` failed (logged once)
        self.down: dict[str, str] = {}  # node id -> why it is down (``fail_node``)
        self.on_disconnect: Callable[[str], Any] | None = None  # node id (``_connect_node``)
        self.on_scheduler_disconnect: Callable[[], Any] | None = None  # (``_connect_scheduler``)
        self._scheduler_tasks: list[asyncio.Task[None]] = []
        self._queues: dict[str, _Entry] = {}  # request id -> its open stream
        self._failures = 0  # ``fail_node`` calls so far
        self._opened_at: dict[str, int] = {}  # request id -> ``_failures`` when it was opened
        self._failed_at: dict[str, int] = {}  # node id -> ``_failures`` at its last failure
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.scheduler_failure = ""  # ``scheduler_failed``
        self._scheduler_error: type[RuntimeError] = RuntimeError
        self._next_id = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: dict[str, asyncio.Task[None]] = {}  # node id -> its connection watch
        self.closed = False  # ``shutdown`` ran (and no ``start`` since): helpers must not start

    async def start(self) -> None:
        """Bind the event inbox and connect to the scheduler and the nodes (on the running loop)."""
        self.closed = False
        self._context = ctx = data_plane.context(asyncio_=True)
        self._authenticator = self.security.start_authenticator(ctx) if self.security is not None else None
        inbox, self.subscriber = data_plane.serving_socket(ctx, zmq.PULL, self.security)
        self._commands = {}
        for node_id, address in self.node_inboxes.items():
            self._connect_node(node_id, address)
        loop = asyncio.get_running_loop()
        self._turns = SenderTurns(_event_items, self.max_queued_bytes_per_node)
        self._tasks = [loop.create_task(self._read_events(inbox)), loop.create_task(self._route_events()),
                       loop.create_task(self._sweep_idle()), loop.create_task(self.loop_lag.run()),
                       loop.create_task(self._reconcile_every())]
        self._connect_scheduler(self.scheduler_address)

    def _connect_scheduler(self, address: str) -> None:
        """A ``DEALER`` to the scheduler's admission socket at ``address``, its replies read by
        a task, and its connection watched: when the scheduler's process dies its TCP connection
        closes and ``on_scheduler_disconnect()`` hears of it at once (``NodeMonitor``)."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, data_plane.MAX_MESSAGE_BYTES)
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self.security is not None:
            self.security.connect_to(sock, "scheduler")
        sock.connect(address)
        self._admission, self.scheduler_address = sock, address
        loop = asyncio.get_running_loop()
        self._scheduler_tasks = [loop.create_task(self._read_admissions(sock)),
                                 loop.create_task(self._watch_scheduler_connection(sock, events))]

    async def _watch_scheduler_connection(self, sock: Any, events: Any) -> None:
        try:
            while True:
                event = parse_monitor_message(await events.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.on_scheduler_disconnect is not None:
                    self.on_scheduler_disconnect()
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            events.close(linger=0)

    def reconnect_scheduler(self, address: str) -> None:
        """The scheduler serves admissions at ``address`` (new after Ray restarted it): a new
        ``DEALER`` there; the old one, and what it still queued, is closed."""
        if address == self.scheduler_address:
            return
        for task in self._scheduler_tasks:
            task.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self._admission.disable_monitor()  # closing it is no news
        self._admission.close(linger=0)
        self._connect_scheduler(address)

    def scheduler_recovered(self) -> None:
        """The scheduler serves again (``NodeMonitor``): admissions are sent to it again."""
        self.scheduler_failure = ""

    def open_request_ids(self) -> list[str]:
        """The requests this gateway still waits for (opened and not closed), whatever their
        admission's state (a restarted scheduler releases the others it rebuilt:
        ``reconcile_gateway``)."""
        return list(self._queues)

    def _connect_node(self, node_id: str, address: str) -> None:
        """Connect the command socket to ``node_id``'s inbox, and watch the connection: when
        the node's process dies its TCP connection closes, and ``on_disconnect(node_id)``
        hears of it at once (Ray takes 1-2 s to fail calls to a killed actor)."""
        sock = self._context.socket(zmq.PUSH)
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self.security is not None:
            self.security.connect_to(sock, "node")
        sock.connect(address)
        self._commands[node_id] = sock
        self._connections[node_id] = asyncio.get_running_loop().create_task(
            self._watch_connection(node_id, sock, events))

    async def _watch_connection(self, node_id: str, sock: Any, events: Any) -> None:
        try:
            while True:
                event = parse_monitor_message(await events.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and self.on_disconnect is not None:
                    self.on_disconnect(node_id)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            events.close(linger=0)

    def cancel_at_shutdown(self, task: asyncio.Task[Any]) -> None:
        """``shutdown`` cancels ``task`` (a helper of these streams': the key watch) with its own;
        after ``shutdown`` (``closed``) it is cancelled now."""
        if self.closed:
            task.cancel()
            return
        self._tasks = [t for t in self._tasks if not t.done()] + [task]

    def shutdown(self) -> None:
        """Stop reading and close every socket (``closed``)."""
        self.closed = True
        for task in [*self._tasks, *self._scheduler_tasks, *self._connections.values()]:
            task.cancel()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)

    async def admit(self, req: NodeRequest, hashes: list[bytes], key_id: str = "", spec: str = "",
                    siblings: tuple[str, ...] = ()) -> Admission:
        """The scheduler's ``Admission`` for ``req`` (which it has handed on to the node when
        admitted); ``hashes`` are the prompt's block hashes for routing, ``key_id`` the id of
        the API key ``req`` was authenticated with (the scheduler refuses a removed one),
        ``spec`` the digest of the tenant spec ``req`` was prepared with
        (``tenants.model.spec_digest``; the scheduler refuses a stale one, ``tenant_changed``;
        "" = not said), ``siblings`` the request ids of the earlier choices of ``req``'s
        ``n`` > 1 body in flight (no work ahead of it: ``GlobalScheduler._own_body``). Refused
        ``gateway_gone`` while this gateway runs, it is sent once more after ``on_gone``.

        Raises:
            RuntimeError: the scheduler failed on it, or is down (``scheduler_failed``);
                TimeoutError: no answer in time.
        """
        adm = await self._admit_once(req, hashes, key_id, spec, siblings)
        if adm.reason == "gateway_gone" and self.on_gone is not None and await self.on_gone():
            adm = await self._admit_once(req, hashes, key_id, spec, siblings)  # refused before it ran: nothing to undo
        return adm

    def scheduler_failed(self, reason: str, restarting: bool = False) -> None:
        """The scheduler is down (``NodeMonitor``): every admission waiting for it, and every
        later one until ``scheduler_recovered``, fails at once with RuntimeError(``reason``)
        (``SchedulerRestarting``, which carries a retry hint, while Ray may restart it), not at
        its timeout: no reply to one sent to a dead process ever comes."""
        self.scheduler_failure = reason
        self._scheduler_error = SchedulerRestarting if restarting else RuntimeError
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._scheduler_error(reason))

    async def _admit_once(self, req: NodeRequest, hashes: list[bytes], key_id: str, spec: str,
                          siblings: tuple[str, ...] = ()) -> Admission:
        if self.scheduler_failure:
            raise self._scheduler_error(self.scheduler_failure)
        self._next_id += 1
        corr = self._next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        try:
            started = time.monotonic()
            await self._send_admission(fut, data_plane.pack({
                "id": corr, "req": data_plane.request_to_wire(req), "sub": self.subscriber,
                "hashes": hashes, "key": key_id, "spec": spec, "sibs": list(siblings)}))
            # Regression (helper 29h): a gateway paused past ``admit_timeout_s`` refused, on
            # resume, the admissions whose OK replies were waiting unread in its socket (the
            # deadline's timer ran first); the scheduler had admitted them (they were aborted
            # on the nodes and released: ``InferenceServicer._attempt``)
            left = max(0.0, self.admit_timeout_s - (time.monotonic() - started))
            reply, graced = await wait_past_stall(fut, left, self.loop_lag, self.admit_timeout_s)
        finally:
            self._pending.pop(corr, None)
        if graced:
            self.admit_lag_waits += 1
            log.warning("gateway data plane: an admission's wait passed admit_timeout_s while this gateway's event "
                        "loop was stalled; its reply came in the second wait")
        if "error" in reply:
            raise RuntimeError(f"the global scheduler failed to admit the request: {reply['error']}")
        return Admission(**reply["adm"])

    async def _send_admission(self, fut: asyncio.Future[dict[str, Any]], payload: bytes) -> None:
        """Hand ``payload`` (an admission; ``fut`` its reply) to the scheduler's ``DEALER``
        within ``admit_timeout_s``. A ``DEALER`` whose peer takes nothing queues ~1,000
        messages (its send high-water mark) and the kernel's buffers, and then makes a send
        wait: a send still waiting at the deadline is cancelled (never sent: pyzmq skips a
        cancelled send), and one waiting when ``scheduler_failed`` fails ``fut``, or when
        ``reconnect_scheduler`` closed the socket it waited on, ends at once.

        Raises:
            asyncio.TimeoutError: the scheduler took nothing for ``admit_timeout_s``;
            RuntimeError (``SchedulerRestarting``): the scheduler failed meanwhile, or was
                restarted (the request was never sent: a retry is safe).

        Regression (review s34 B F1): the send was awaited before the admission's deadline
        started, so with the scheduler's process hung (stopped, deadlocked: alive for Ray)
        every admission past the ~1,000th waited in it for as long as the hang lasted,
        holding its call and request body, and ``scheduler_failed`` did not end it."""
        sending = self._admission.send(payload)
        if not sending.done():
            try:
                await asyncio.wait({sending, fut}, timeout=self.admit_timeout_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waited_out = not sending.done()
                if waited_out:  # (no room in time, the scheduler failed, or this call was cancelled)
                    sending.cancel()  # never sent
            failed = fut.exception() if fut.done() and not fut.cancelled() else None
            if failed is not None:  # ``scheduler_failed``
                raise failed
            if waited_out:
                raise asyncio.TimeoutError
            if sending.cancelled():  # its socket closed under it (``reconnect_scheduler``)
                raise SchedulerRestarting("the global scheduler's admission socket was replaced (it restarted) "
                                          "before this request was sent; retry")
        sending.result()

    async def _read_admissions(self, sock: Any) -> None:
        while True:
            payload = await sock.recv()
            await asyncio.sleep(0)  # a queued message's recv does not yield (review s34 B F3)
            try:
                corr, body = data_plane.admission_reply(data_plane.unpack(payload, data_plane.REPLY_LIMITS),
                                                        self.node_inboxes)
            except data_plane.BadReply as exc:  # its admission fails now, not at its timeout
                self._drop("admission", exc)
                corr, body = exc.corr, f"a malformed admission reply: {exc}"
            except Exception as exc:  # noqa: BLE001 - any bytes at all: drop and count
                self._drop("admission", exc)
                continue
            fut = self._pending.get(corr)
            if fut is not None and not fut.done():
                fut.set_result({"error": body} if isinstance(body, str) else {"adm": body})

    def abort(self, node_id: str, request_id: str) -> None:
        """Tell ``node_id`` to stop ``request_id`` (fire and forget; a node this gateway does
        not know runs nothing of it: logged)."""
        sock = self._commands.get(node_id)
        if sock is None:
            log.warning("gateway data plane: no node %.100r to abort %.300s on", node_id, request_id)
            return
        sock.send(data_plane.pack({"op": "abort", "id": request_id}))

    def open(self, request_id: str, on_event: OnEvent | None = None,
             on_idle: Callable[..., None] | None = None, logprobs: int | None = None,
             prompt_logprobs: int | None = None, prompt: tuple[int, ...] = (), key_id: str = "") -> StreamBuffer:
        """A buffer for ``request_id``'s events; open it before the request reaches a node.
        ``on_event(event)`` sees each event as it arrives, whether or not the buffer's reader
        keeps up (a client that stops reading), and the RESOURCE_EXHAUSTED error that ends a
        stream its client does not read (``_end_unread``); ``on_idle(message)`` is called
        after that error when it was for ``stream_idle_timeout_s``: its reader, stuck writing
        to a client that takes nothing, takes no error, so whoever runs it must stop it.
        ``logprobs``: the request's ``SamplingParams.logprobs``; a delta whose log probabilities
        are not what it asked is a bad event (``data_plane.check_logprobs_asked``); likewise
        ``prompt_logprobs`` (and their count and tokens, against ``prompt``, its prompt's token
        ids when the gateway knows them: ``_Entry.check_prompt_count``). ``key_id``: the id of the
        API key the request was authenticated with (``key_streams``, ``end_revoked``: the stream
        ends when that key is removed); "" for none. Its tenant's id is read from
        ``request_id`` (``scoped_id``: ``<tenant id>/<client id>``; none without a ``/``).

        Raises:
            KeyError: ``request_id`` is open already (in flight on this gateway).
        """
        if request_id in self._queues:
            raise KeyError(request_id)
        buffer = StreamBuffer(self.clock)
        tenant_id = request_id.partition("/")[0] if "/" in request_id else ""
        self._queues[request_id] = _Entry("", buffer, on_event, on_idle, logprobs=logprobs,
                                          prompt_logprobs=prompt_logprobs, prompt=prompt, key_id=key_id,
                                          tenant_id=tenant_id, opened_at=self.clock())
        self._opened_at[request_id] = self._failures
        self._opens += 1
        return buffer

    def _put(self, request_id: str, entry: _Entry, event: dict[str, Any]) -> None:
        if event["type"] == "started" and not entry.buffer.takes(event):  # one a stream, never seen
            # by ``on_event`` (regression, review 25a C: each was kept, and not counted as held)
            if not entry.buffer.ended:
                self._drop("event", ValueError(f"a second started event for {request_id[:200]!r}"), not entry.warned)
                entry.warned = True
            return
        if entry.on_event is not None:
            entry.on_event(event)
        entry.finished = entry.finished or (event["type"] == "finished" and not entry.buffer.ended)
        if not entry.buffer.put_nowait(event):  # after its end
            return
        held = entry.buffer.undelivered_bytes
        if past_bound(held, event, event_bytes(event), self.max_undelivered_bytes):
            self.overflows += 1
            self._end_unread(request_id, entry, f"{held} bytes of it were waiting at the gateway "
                                                f"(at most {self.max_undelivered_bytes})")

    def _end_unread(self, request_id: str, entry: _Entry, why: str) -> str:
        """End a stream its client does not read with RESOURCE_EXHAUSTED (``_end``). The one
        path of both of its bounds, ``max_undelivered_bytes`` and ``stream_idle_timeout_s``;
        returns the message."""
        message = f"the client did not read this stream: {why}"
        self._end(request_id, entry, {"type": "error", "code": "RESOURCE_EXHAUSTED", "message": message})
        return message

    def _end(self, request_id: str, entry: _Entry, error: dict[str, Any]) -> None:
        """End a stream here: drop what it holds undelivered, end it with ``error``
        (``on_event`` sees it: the request is released) and abort its request on its node (at
        ``bind`` if not bound yet; once; not after it finished)."""
        aborted, entry.ended_unread = entry.ended_unread, True
        if entry.on_event is not None:
            entry.on_event(error)
        entry.buffer.end(error)
        if entry.node_id and not (entry.finished or aborted):
            self.abort(entry.node_id, request_id)

    def key_streams(self) -> list[tuple[str, str, str, object]]:
        """``(request id, key id, tenant id, the opening)`` of each open stream that an API key
        opened (``open``'s ``key_id``) and that has not ended: not ended for its key yet, and
        its end (``finished``, or an error: its node's ABORTED, UNAVAILABLE, RESOURCE_EXHAUSTED
        for an unread stream) not come yet (``_ended``). ``the opening`` tells ``end_revoked``
        this stream from a later one of the same id; its ``opened_at`` is when ``open`` made it.

        Regression (review R1 F1, session 36): ended streams were listed too, and
        ``end_revoked`` dropped a finished stream's unread output and its ``finished`` event
        (its usage already released in full) or replaced its node's ABORTED with
        UNAUTHENTICATED."""
        return [(rid, entry.key_id, entry.tenant_id, entry) for rid, entry in self._queues.items()
                if entry.key_id and entry.revoked is None and not _ended(entry)]

    def end_revoked(self, request_id: str, opening: object, message: str, code: str = "UNAUTHENTICATED") -> bool:
        """End ``request_id``'s stream, if it is still ``opening`` (``key_streams``) and has not
        ended, with ``code`` (``REVOKED_CODES``) and ``message``: UNAUTHENTICATED when the key
        that opened it was removed (rotated away), ABORTED when its tenant was deleted (as its
        nodes' ``end_tenant`` ends it). What it holds undelivered is dropped, the error is its
        last event (``on_event`` sees it: the request is released with the usage its events
        showed), and its request is aborted on its node, so its blocks go free there
        (``_end``). A stream whose admission is not answered yet ends so at ``bind`` (unless
        its end came first): a release sent before then could reach the scheduler before the
        admission (``InferenceServicer._abort_admitted``). A reader that does not take the
        error within ``REVOKED_READ_S`` is stopped (``expire_idle``). Returns whether it was
        ended now (False: closed, ended for its key already, or its end came already:
        ``finished`` or an error, which stays its last event).

        Raises:
            ValueError: ``code`` is not one of ``REVOKED_CODES``.
        """
        if code not in REVOKED_CODES:
            raise ValueError(f"code must be one of {REVOKED_CODES}, got {code!r}")
        entry = self._queues.get(request_id)
        if entry is not opening or entry is None or entry.revoked is not None or _ended(entry):
            return False
        entry.revoked = {"type": "error", "code": code, "message": message}
        if entry.node_id:
            entry.revoked_at = self.clock()
            self._end(request_id, entry, entry.revoked)
        return True

    def expire_idle(self) -> list[str]:
        """End each bound stream whose reader has taken nothing for ``stream_idle_timeout_s``
        without waiting for events (``StreamBuffer.idle_s``):
        ``_end_unread``, then its ``on_idle``. Returns their request ids. Run every
        ``IDLE_SWEEP_S`` at most by ``start``'s sweep; a stream is ended so at most once. The
        stalls of this gateway's own event loop during that time (``LoopLag``) are not counted:
        they are not the client's (a write its reader was stuck in may have been taken by the
        client meanwhile, its flow-control window update waiting unread in the socket).

        A stream ended for its key (``end_revoked``) whose reader has taken nothing, its error
        included, for ``REVOKED_READ_S`` since it was put (this gateway's loop stalls not
        counted, as above) has its ``on_idle(message, code)`` called with its error's (once;
        not counted in ``idle_ends``, not returned). Regression (review R1 F3, session 36):
        that wait counted the gateway's own stalls, so a reader that could not run during one
        was stopped as a client that does not read (an HTTP stream cut without its error).

        This covers every way a stream sits unread: its reader stuck writing an event, the
        stream's last included, with events pending here or none; events still coming (the
        request runs on its node: aborted there) or its end arrived (finished, or an error,
        the overflow's included) and was never taken, which held its tenant's stream until
        its client went.

        Regression (secrev18 B residue): nothing ended a stream whose client stopped reading
        (gRPC or HTTP flow control holding its writer): its request decoded on its node up to
        ``max_tokens``, and its buffer and its tenant's stream were held for as long as the
        client kept its connection open."""
        ended = []
        for request_id, entry in list(self._queues.items()):
            waited = entry.buffer.idle_s()
            if entry.revoked_at is not None:  # ended for its key: a reader that leaves its error is stopped sooner
                waited = min(waited, self.clock() - entry.revoked_at)
                if entry.idle or entry.buffer.empty() or waited < REVOKED_READ_S:
                    continue
                if self._lag_discounted(waited) >= REVOKED_READ_S:
                    entry.idle = True
                    if entry.on_idle is not None and entry.revoked is not None:
                        entry.on_idle(entry.revoked["message"], entry.revoked["code"])
                continue
            if entry.idle or not entry.node_id or waited < self.stream_idle_timeout_s:
                continue
            waited = self._lag_discounted(waited)
            if waited < self.stream_idle_timeout_s:
                continue
            entry.idle = True
            self.idle_ends += 1
            message = self._end_unread(request_id, entry, f"it took none of its events for {waited:.0f} s "
                                                          f"(stream_idle_timeout_s {self.stream_idle_timeout_s:g})")
            if entry.on_idle is not None:
                entry.on_idle(message)
            ended.append(request_id)
        return ended

    def _lag_discounted(self, waited: float) -> float:
        """``waited`` (seconds up to now) less this gateway's own loop stalls within them
        (``LoopLag``; with the real clock alone). Regression (helper 29h): a gateway paused
        past the timeout ended, on resume, the streams whose readers were mid-write to clients
        that were reading."""
        return waited - (self.loop_lag.since(time.monotonic() - waited) if self.clock is time.monotonic else 0.0)

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(min(IDLE_SWEEP_S, self.stream_idle_timeout_s / 4))
            try:
                self.expire_idle()
            except Exception:  # a callback's bug must not end the sweep
                log.exception("gateway data plane: ending idle streams failed")

    async def reconcile(self) -> list[str]:
        """End with UNAVAILABLE each stream bound to a node (admitted), not ended, whose request
        the scheduler no longer counts as admitted from this gateway (``ask_admitted``, asked
        about them all, ``RECONCILE_BATCH`` ids a query) in two runs in a row; returns their
        request ids, counted in ``reconciled_ends``. Two: a scheduler Ray restarted rebuilds
        only the requests its nodes still ran, and one that finished just before its node's
        report may have its ``finished`` event still on its way here; by the next run it has
        come (its answer is kept; a turn its session's history took is not retried). The scheduler releases a request of a live gateway only with its
        stop on its node, no event sent (it counted the gateway gone, or rebuilt after a restart
        without it), and tells the gateway (``RayGateway.counted_gone``) when it can; this ends
        the ones it could not tell. A stream bound was admitted before the question left (its
        admission's answer came first), and the gateway releases a request only once its
        stream ended or closed, so none still running is ended here. Its ``_attempt`` aborts
        it on its node and the client may retry (a retry hint). A stream closed, ended or
        opened anew meanwhile is left as it is.

        Raises whatever ``ask_admitted`` raises (the scheduler unreachable: nothing is ended
        here; ``end_silent`` bounds that), asyncio.TimeoutError for a query not answered within
        ``RECONCILE_ASK_TIMEOUT_S``, and TypeError for an answer that is not a list of ids.

        Regression (s40): nothing bounded such a stream's wait but the scheduler's tells,
        tried for up to ~6 minutes: a gateway stalled longer, or one the scheduler could not
        reach, kept the streams of its released requests waiting for ever (the client hung).
        """
        if self.ask_admitted is None:
            return []
        asked = {rid: entry for rid, entry in self._queues.items() if entry.node_id and not _ended(entry)}
        admitted = await _ids_answered(self.ask_admitted, list(asked), RECONCILE_BATCH, RECONCILE_ASK_TIMEOUT_S,
                                       "the scheduler's admitted_from")
        ended = []
        for rid, entry in asked.items():
            if rid in admitted:
                entry.unadmitted = False
                continue
            if self._queues.get(rid) is not entry or _ended(entry):
                continue
            if not entry.unadmitted:  # the first run that misses it: ended at the next
                entry.unadmitted = True
                continue
            self._put(rid, entry, _unavailable(
                f"the global scheduler no longer runs this request for this gateway (it released it, and "
                f"stopped it on cache node {entry.node_id}, while this gateway could not be told)"))
            ended.append(rid)
        if ended:
            self.reconciled_ends += len(ended)
            log.warning("gateway data plane: %d streams whose requests the scheduler released ended UNAVAILABLE "
                        "(reconcile)", len(ended))
        return ended

    async def end_silent(self) -> list[str]:
        """End with UNAVAILABLE ("retry the request") each stream bound to a node, not ended,
        that got no event from its node for ``silent_stream_s`` (``_Entry.event_at``; this
        gateway's own loop stalls not counted: ``_lag_discounted``) and whose request its node
        no longer holds for this gateway in two answers in a row (``ask_holding``:
        ``CacheNode.holding``, ``HOLDING_BATCH`` ids a call, each answered within
        ``HOLDING_ASK_TIMEOUT_S``), and abort it on its node (a no-op there, sent in case).
        Returns their request ids, counted in ``silent_ends``. ``_reconcile_every`` runs it
        once ``SILENT_RUNS`` runs in a row failed: with the scheduler unreachable,
        ``reconcile`` cannot end a request it released without an event (it counted this
        gateway gone and had its node stop it), and its stream would wait for as long as the
        scheduler stays away. Two answers: a request that ended just as its node answered has
        its last event on its way here (a stream that gets an event meanwhile is not silent
        any more). A request its node still holds keeps its stream open however long it is
        silent: queued, rendering, compiling its grammar, prefilling a long prompt (no event
        between ``started`` and its first token), preempted and waiting or recomputing. A
        node that fails to answer, or is down, is left to the health monitor (``NodeMonitor``
        finds it down or stalled and ``fail_node`` ends its streams).

        Regression (s41): a gateway that could never reach the scheduler kept such streams
        (and their clients, and their tenants' stream slots) open until it could; then
        (3522fbe, review r4) every stream silent ``silent_stream_s`` was ended and aborted,
        healthy ones too: a 1,400-token prompt prefilled in three 2 s chunks was aborted
        mid-prefill 3 s after ``started`` with a 3 s bound."""
        now = self.clock()
        silent: dict[str, dict[str, _Entry]] = {}  # node id -> its silent streams
        for rid, entry in list(self._queues.items()):
            if entry.node_id and not _ended(entry) and entry.node_id not in self.down \
                    and self._lag_discounted(now - entry.event_at) >= self.silent_stream_s:
                silent.setdefault(entry.node_id, {})[rid] = entry
        answers = await asyncio.gather(*(self._held_on(node_id, list(entries)) for node_id, entries in silent.items()),
                                       return_exceptions=True)
        ended = []
        for (node_id, entries), held in zip(silent.items(), answers):
            if isinstance(held, BaseException):
                if node_id not in self._holding_failed:
                    self._holding_failed.add(node_id)
                    log.warning("gateway data plane: asking cache node %s which of %d silent streams it still holds "
                                "failed (left to its health monitor): %s: %.200s", node_id, len(entries),
                                type(held).__name__, held)
                continue
            self._holding_failed.discard(node_id)
            now = self.clock()
            for rid, entry in entries.items():
                if self._queues.get(rid) is not entry or _ended(entry):
                    continue
                silent_s = self._lag_discounted(now - entry.event_at)
                if rid in held or silent_s < self.silent_stream_s:  # held, or an event came meanwhile
                    entry.unheld = False
                    continue
                if not entry.unheld:  # the first answer that misses it: ended at the next
                    entry.unheld = True
                    continue
                self._put(rid, entry, _unavailable(
                    f"cache node {node_id} no longer holds this request and sent no event for it for {silent_s:.0f} s, "
                    f"while the global scheduler could not be reached ({self._reconcile_failures} checks in a row "
                    f"failed)"))
                self.abort(node_id, rid)
                ended.append(rid)
        if ended:
            self.silent_ends += len(ended)
            log.warning("gateway data plane: %d streams whose nodes no longer hold their requests ended UNAVAILABLE "
                        "with the scheduler unreachable (%d reconcile runs in a row failed)", len(ended),
                        self._reconcile_failures)
        return ended

    async def _held_on(self, node_id: str, request_ids: list[str]) -> set[str]:
        """Those of ``request_ids`` that ``node_id`` still holds for this gateway
        (``ask_holding``, ``HOLDING_BATCH`` ids a call). Raises what ``ask_holding`` raises,
        asyncio.TimeoutError for a call not answered within ``HOLDING_ASK_TIMEOUT_S``, and
        TypeError for an answer that is not a list of ids."""
        return await _ids_answered(functools.partial(self.ask_holding, node_id), request_ids, HOLDING_BATCH,
                                   HOLDING_ASK_TIMEOUT_S, f"cache node {node_id}'s holding")

    async def _node_holding(self, node_id: str, request_ids: list[str]) -> Any:
        """``node_id``'s ``CacheNode.holding`` for this gateway's event inbox (``ask_holding``'s
        default): an actor call, its arguments by keyword. Raises LookupError for a node with
        no actor handle here, and whatever the call raises."""
        node = self.nodes.get(node_id)
        if node is None:
            raise LookupError(f"no actor handle for cache node {node_id}")
        return await node.holding.remote(subscriber=self.subscriber, request_ids=request_ids)

    async def _reconcile_every(self) -> None:
        """``reconcile`` every ``reconcile_s``; a failed run is logged at the first of a row, and
        from the ``SILENT_RUNS``-th in a row on each failed run ends the streams silent past
        ``silent_stream_s`` whose nodes no longer hold their requests (``end_silent``)."""
        while True:
            await asyncio.sleep(self.reconcile_s)
            try:
                await self.reconcile()
                self._reconcile_failures = 0
            except Exception as exc:  # noqa: BLE001 - the scheduler unreachable: the next run asks again
                self._reconcile_failures += 1
                if self._reconcile_failures == 1:
                    log.warning("gateway data plane: asking the scheduler which streams it still runs failed "
                                "(tried again every %g s): %s: %.200s", self.reconcile_s, type(exc).__name__, exc)
                if self._reconcile_failures >= SILENT_RUNS:
                    try:
                        await self.end_silent()
                    except Exception:  # a callback's bug must not end the runs
                        log.exception("gateway data plane: ending silent streams failed")

    def undelivered(self) -> tuple[int, int, int]:
        """(open streams, messages and bytes they hold undelivered)."""
        buffers = [entry.buffer for entry in self._queues.values()]
        return len(buffers), sum(b.qsize() for b in buffers), sum(b.undelivered_bytes for b in buffers)

    def bind(self, request_id: str, node_id: str) -> None:
        """Record the node serving ``request_id`` (its failure ends this stream; a node down
        already, or failed since the stream was opened, ends it at once).

        Regression (hangs review): a node that failed and rejoined between the scheduler's
        hand-over of a request and this bind had lost the request, but ``fail_node`` had ended
        only the streams bound to it then: this stream waited forever for events."""
        entry = self._queues.get(request_id)
        if entry is not None:
            entry.node_id, entry.event_at = node_id, self.clock()
            self._opens += 1
            if entry.ended_unread and not entry.finished:  # ended before its node was known
                self.abort(node_id, request_id)
            held = self._pop_unbound(request_id)
            if held is not None:
                for sender, buffer in held.buffers.items():  # in order, from it alone
                    if sender == node_id:
                        while not buffer.empty():
                            self._put(request_id, entry, self._counted(entry, buffer.get_nowait()))
                    else:
                        self._drop("event", PermissionError(f"{sender} sent {buffer.qsize()} events for a "
                                                            f"request on {node_id}"), count=buffer.qsize())
                if node_id in held.behind:
                    self._put(request_id, entry, self._behind_error(node_id))
                elif node_id in held.lost:
                    self._put(request_id, entry, _unavailable(
                        f"cache node {node_id} sent more of this request's events than the gateway holds "
                        f"before it knows the request's node ({self.max_undelivered_bytes} bytes a request, "
                        f"{self.max_unbound_bytes} a node); the ones past it were lost"))
            if node_id in self.down:
                self._put(request_id, entry, _unavailable(f"cache node {node_id} is down"))
            elif self._failed_at.get(node_id, -1) >= self._opened_at.get(request_id, 0):
                self._put(request_id, entry, _unavailable(f"cache node {node_id} failed while the request was on its way"))
            if entry.revoked is not None and entry.revoked_at is None and not _ended(entry):
                # its key went while it was admitted (an end that came with it stays: F1)
                entry.revoked_at = self.clock()  # its reader's time to take the error starts now
                self._end(request_id, entry, entry.revoked)

    def fail_node(self, node_id: str, reason: str) -> None:
        """``node_id`` is down (``reason``, kept in ``down`` for operators): end every stream
        bound to it with UNAVAILABLE, naming the node, not ``reason``. Regression (review s35
        C S1): ``reason`` (a node's health failure: its step loop's exception text, a Ray
        error) went to every tenant with a stream there."""
        self.down[node_id] = reason
        self._failed_at[node_id] = self._failures
        self._failures += 1
        for request_id, entry in list(self._queues.items()):
            if entry.node_id == node_id:
                self._put(request_id, entry, _unavailable(f"cache node {node_id} is down"))

    def fail_requests(self, request_ids: list[str], reason: str) -> int:
        """End the streams of ``request_ids`` with UNAVAILABLE (``reason``): the scheduler
        counted this gateway as gone, released them and had the nodes stop them without an
        event (a dead gateway hears nothing). Returns how many were open here."""
        ended = 0
        for request_id in request_ids:
            entry = self._queues.get(request_id)
            if entry is not None:
                self._put(request_id, entry, _unavailable(reason))
                ended += 1
        return ended

    def reconnect(self, node_id: str, address: str) -> None:
        """``node_id`` is up again with its command inbox at ``address`` (new after a restart),
        or up for the first time: a node down since the gateway started (its ``describe`` did
        not answer: ``NodeMonitor``'s ``down``) is connected now."""
        if address != self.node_inboxes.get(node_id):
            old = self._commands.pop(node_id, None)  # None: down since the start, never connected
            if old is not None:
                with contextlib.suppress(zmq.ZMQError):
                    old.disable_monitor()  # closing it is no news
                self._connections.pop(node_id).cancel()
                old.close(linger=0)
            self._connect_node(node_id, address)
            self.node_inboxes[node_id] = address
        self.down.pop(node_id, None)

    def close(self, request_id: str) -> None:
        """Stop routing ``request_id``'s events (later ones are dropped)."""
        self._queues.pop(request_id, None)
        self._pop_unbound(request_id)
        self._opened_at.pop(request_id, None)

    async def _read_events(self, inbox: Any) -> None:
        """Read the event inbox as fast as messages come, each into its sender's queue
        (``SenderTurns``; ``_route_events`` routes them); one past its sender's bound is dropped
        unread (``_sender_behind``)."""
        while True:
            frames = [await inbox.recv(copy=False)]
            with contextlib.suppress(zmq.Again):  # and those already here, up to READ_BATCH
                while len(frames) < READ_BATCH:
                    frames.append(await inbox.recv(flags=zmq.NOBLOCK, copy=False))
            for frame in frames:
                # with per-node keys, each event must come from the node serving its request
                # (regression: any node could write into any other node's tenants' streams)
                sender = self._key_names.get(frame.get("User-Id")) if self._per_node_keys else None
                if not self._turns.add(sender, frame.bytes):  # a ``BEHIND`` mark queued in its place
                    self._sender_behind(sender)
            await asyncio.sleep(0)  # a queued message's recv does not yield (review s34 B F3)

    def _sender_behind(self, sender: str | None) -> None:
        """A message of ``sender`` (a node id; None without per-node keys: any node) was dropped
        unread, past ``max_queued_bytes_per_node``: counted in ``behind_drops``, logged at the
        first drop of a sender. Its streams end when routing reaches the drop's ``BEHIND`` mark
        (``_fail_behind``), after the messages queued before it.

        Regression (s38 fault 2): one node's flood of events for its own streams (a faulty
        node, or anything holding its key) was routed a whole message (up to
        ``MAX_EVENTS_PER_MESSAGE`` events) at a time as read, ZeroMQ reading the nodes a message
        each in turn: another node had one message routed per flooding one, and fell seconds
        behind (``tests/test_gateway_event_turns``: 2.16 s at worst; now 0.04-0.11 s), its
        messages and the flood's piling up in ZeroMQ's queues (1,000 messages a peer, up to
        64 MiB each) with no bound of the gateway's own."""
        self.behind_drops[sender] += 1
        self.bad_messages += 1
        if self.behind_drops[sender] == 1:
            log.warning("gateway data plane: %s sends events faster than this gateway routes them (%d bytes "
                        "waiting, at most %d): its messages past that are dropped and its streams end UNAVAILABLE "
                        "(retried); counted in behind_drops", sender or "a cache node",
                        self._turns.queued_bytes(sender), self.max_queued_bytes_per_node)

    def _fail_behind(self, sender: str | None) -> None:
        """Routing reached the place of ``sender``'s dropped messages (a ``BEHIND`` mark): any
        stream of its not ended by then may have lost events. Each stream bound to it ends
        UNAVAILABLE (its request is aborted on the node and retried: ``InferenceServicer``), and
        each not bound yet ends so at ``bind`` if bound to it (the path of events lost before
        ``bind``). Streams opened or bound since its last mark are scanned once.

        Regression (s38): the streams were ended at the drop, before the sender's messages
        queued ahead of it were routed, so one whose ``finished`` event was among them failed
        UNAVAILABLE (retried, its answer complete)."""
        if self._behind_scans.get(sender) == self._opens:
            return  # every stream it could have is ended or marked already
        self._behind_scans[sender] = self._opens
        error = self._behind_error(sender)
        for request_id, entry in list(self._queues.items()):
            if _ended(entry):
                continue
            if sender is None or entry.node_id == sender:  # (without per-node keys: any stream)
                self._put(request_id, entry, error)
            elif not entry.node_id:
                self._unbound.setdefault(request_id, _Held()).behind.add(sender)

    def _behind_error(self, sender: str | None) -> dict[str, Any]:
        """The UNAVAILABLE error of a stream ``sender``'s dropped message may have had events of."""
        who = f"cache node {sender}" if sender else "a cache node"
        return _unavailable(f"{who} sent events faster than the gateway routes them (more "
                            f"than {self.max_queued_bytes_per_node} bytes waiting); events of this request were "
                            "lost")

    async def _route_events(self) -> None:
        """Route the queued event messages (``_read_events``), ``SenderTurns``' turns: each
        sender's events in the order sent, the senders in turn; the other tasks run between."""
        counted: set[str | None] = set()  # senders whose message being routed was counted bad
        while True:
            sender, items, first = await self._turns.take()
            if first:
                counted.discard(sender)
            if isinstance(items, Behind):
                self._fail_behind(sender)
            elif isinstance(items, BaseException):
                self._drop("event", items)
            elif await self._route(sender, items, sender in counted):
                counted.add(sender)
            await asyncio.sleep(0)

    async def _route(self, sender: str | None, items: list[tuple[str, Any]], counted: bool) -> bool:
        """Route ``items`` (``event_item_pairs``) from ``sender`` to their streams; a bad one
        counts its message in ``bad_messages`` unless ``counted`` (an earlier turn of it did).
        Returns whether the message is counted bad now."""
        checked_items, bad = self._open_items(items, sender)
        if bad is not None and not counted:
            self._drop("event", bad)
        for request_id, entry, checked in checked_items:
            if self._queues.get(request_id) is not entry:  # closed while this message was routed
                continue
            if isinstance(checked, dict):
                try:
                    data_plane.check_logprobs_asked(checked, entry.logprobs, entry.prompt_logprobs)
                except ValueError as exc:
                    self._drop("event", exc)
                    checked = exc
            event = checked if isinstance(checked, dict) else _malformed(checked)
            if self._per_node_keys and not entry.node_id:  # its node is not known yet: held
                self._hold(request_id, sender, event)  # for ``bind``
                continue
            if self._per_node_keys and sender != entry.node_id:
                self._drop("event", PermissionError(f"{sender or 'an unknown node'} sent an event "
                                                    f"for a request on {entry.node_id}"))
                continue
            event = self._counted(entry, event)
            entry.event_at = self.clock()
            self._put(request_id, entry, event)
            if event.get("prompt_logprobs"):
                # one step's prompt entries come as several deltas in one frame (~134 KB
                # each at 20 alternatives): let a waiting reader take each before the next,
                # so a reader that keeps up never holds the step's whole output at once.
                # Regression (review 28c F7): a 4,000-token chunk's ~1.07 MB passed the
                # stream's 1 MiB bound before the HTTP edge's reader ran, and the request
                # failed 429 "the client did not read this stream" after its prefill.
                await asyncio.sleep(0)
        return counted or bad is not None

    def _open_items(self, items: list[tuple[str, Any]], sender: str | None) -> tuple[
            list[tuple[str, _Entry, dict[str, Any] | TypeError | ValueError]], BaseException | None]:
        """The items of one event message (``event_item_pairs``) whose request is open here,
        each with its stream and its event checked (``check_event``; the error that refused
        it when bad), and the first error of the message (None: none), as before.

        An item for a request not open here (a stream already closed, or an id this gateway
        never had) is looked up first and dropped unchecked: counted in ``unopened_events``,
        logged once per sender (a node with per-node keys, else None), and counted as a bad
        message only when it is no event at all (``looks_like_event``). Regression (review s34
        B F6): every event was fully checked (~40 us) before its id was looked up, so one node's
        (buggy or compromised) flood of events for ids this gateway does not have stalled its
        loop for every tenant: 20 pairs of ~1.15 MB messages, 29 s."""
        queues, checked_items, bad, unopened = self._queues, [], None, 0
        for request_id, event in items:
            entry = queues.get(request_id)
            if entry is None:
                unopened += 1
                if bad is None and not data_plane.looks_like_event(event):
                    bad = TypeError(f"an event item for {request_id[:200]!r} holds no event")
                continue
            try:
                checked: dict[str, Any] | TypeError | ValueError = data_plane.check_event(event)
            except (TypeError, ValueError) as exc:
                checked = exc
                bad = exc if bad is None else bad
            checked_items.append((request_id, entry, checked))
        if unopened:
            self.unopened_events += unopened
            if sender not in self._unopened_senders:
                self._unopened_senders.add(sender)
                log.warning("gateway data plane: %s sent %d event(s) for requests not open here (dropped "
                            "unchecked; a few after a stream closed are normal, a flood is a faulty node); "
                            "counted in unopened_events, logged once per node", sender or "a cache node",
                            unopened)
        return checked_items, bad

    def _counted(self, entry: _Entry, event: dict[str, Any]) -> dict[str, Any]:
        """``event`` from the node serving the request, past ``_Entry.check_prompt_count``
        (which keeps count of the prompt's entries), else the malformed-event error. Counted
        only once its sender is known to be that node. Regression (review 28l F5): the count
        ran before the sender check, so another node's forged event, though dropped, moved it,
        and the serving node's correct entries then failed as malformed."""
        try:
            entry.check_prompt_count(event)
        except ValueError as exc:
            self._drop("event", exc)
            return _malformed(exc)
        return event

    def _hold(self, request_id: str, sender: str | None, event: dict[str, Any]) -> None:
        """Hold ``event`` from ``sender`` for ``request_id``'s ``bind``, bounded per sender (one
        node's events cannot crowd out another's): at most ``max_undelivered_bytes`` a request
        and ``max_unbound_bytes`` over all requests (``event_bytes``; deltas coalesce, one
        ``started``, nothing after an end). An event past a bound is dropped and counted
        (``bad_messages``); if its sender is the request's node, the stream ends UNAVAILABLE at
        ``bind`` (it lost events: the gateway aborts its request on its node and retries it).

        Regression (review 25a C): every event before ``bind`` was kept, without a bound."""
        held = self._unbound.setdefault(request_id, _Held())
        buffer = held.buffers.get(sender)
        if buffer is None:
            buffer = held.buffers[sender] = StreamBuffer(self.clock)
        if not buffer.takes(event):  # a second ``started``, or after its end
            self._drop("event", ValueError(f"a {event['type']} event for {request_id[:200]!r} after its "
                                           "started or end event"), False)
            return
        size = event_bytes(event)
        if (past_bound(buffer.undelivered_bytes + size, event, size, self.max_undelivered_bytes)
                or self._unbound_bytes[sender] + size > self.max_unbound_bytes):
            self._drop("event", ValueError(f"{sender or 'an unknown node'} sent more events for "
                                           f"{request_id[:200]!r} than are held before its node is known"),
                       sender not in held.lost)
            held.lost.add(sender)
            return
        buffer.put_nowait(event)
        self._unbound_bytes[sender] += size

    def _pop_unbound(self, request_id: str) -> _Held | None:
        """The events held for ``request_id`` (``_hold``), no longer counted."""
        held = self._unbound.pop(request_id, None)
        for sender, buffer in held.buffers.items() if held is not None else ():
            self._unbound_bytes[sender] -= buffer.undelivered_bytes
            if not self._unbound_bytes[sender]:
                del self._unbound_bytes[sender]
        return held

    def _drop(self, what: str, exc: BaseException, log_it: bool = True, count: int = 1) -> None:
        self.bad_messages += count
        if log_it:
            log.warning("gateway data plane: dropped a bad %s message: %s: %.200s", what, type(exc).__name__, exc)


def _ended(entry: _Entry) -> bool:
    """Whether ``entry``'s stream has its end: its ``finished`` event (nothing runs on its node,
    its usage released in full) or an error (its node's, or one put here), taken or not."""
    return entry.finished or entry.buffer.ended


def _event_items(message: bytes) -> list[tuple[str, Any]]:
    """A node's event message's ``(request id, event)`` items, shape-checked
    (``data_plane.event_item_pairs``), decoded within ``EVENT_LIMITS``. Raises on a bad one."""
    return data_plane.event_item_pairs(data_plane.unpack(message, data_plane.EVENT_LIMITS))


def _unavailable(reason: str) -> dict[str, Any]:
    return {"type": "error", "code": "UNAVAILABLE", "message": f"{reason}; retry the request"}


def _malformed(exc: BaseException) -> dict[str, Any]:
    """The UNAVAILABLE error that ends a stream a cache node sent a malformed event for."""
    return _unavailable(f"a cache node sent a malformed event for this request ({type(exc).__name__}: "
                        f"{str(exc)[:200]})")
