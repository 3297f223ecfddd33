"""The gateway's end of the data plane (``services.data_plane``): ``NodeStreams``.

It sends admissions to the global scheduler's admission socket and aborts to the nodes'
command inboxes, and routes the events nodes push to its event inbox to per-request queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from services import data_plane
from services.data_plane_auth import Security
from services.global_scheduler import Admission
from services.node_request import NodeRequest

log = logging.getLogger(__name__)

OnEvent = Callable[[dict[str, Any]], None]


class NodeStreams:
    """The gateway's end of the data plane (``services.data_plane``).

    - ``admit``: a request's admission by the GlobalScheduler, which hands an admitted request
      straight to its node;
    - the event inbox: each node pushes one message per engine step with every event for this
      gateway's streams, routed here to per-request queues (``open``);
    - ``abort``: straight to the node's command inbox.

    A node found down (``services.node_monitor.NodeMonitor`` calls ``fail_node``) ends each
    stream open on it, and any stream bound to it later, with an UNAVAILABLE error event, until
    it rejoins (``reconnect``, with its new command inbox).

    Args:
        nodes: node id -> CacheNode actor handle.
        node_inboxes: node id -> the node's command inbox address.
        scheduler_address: the GlobalScheduler's admission socket address.
        admit_timeout_s: an admission not answered by then fails with UNAVAILABLE.
        security: the gateway's data-plane identity (``services.data_plane_auth``): its event
            inbox admits only nodes. None: plaintext on loopback (unit tests only).

    Every message read is checked (``data_plane.event_items``, ``admission_reply``); a bad
    one is dropped and counted in ``bad_messages``.
    """

    def __init__(self, nodes: dict[str, Any], node_inboxes: dict[str, str], scheduler_address: str,
                 admit_timeout_s: float = 30.0, security: Security | None = None) -> None:
        self.security = security
        self._per_node_keys = security is not None and bool(security.node_clients)
        self._key_names = security.key_names() if security is not None else {}
        self._unbound: dict[str, list[tuple[str | None, dict[str, Any]]]] = {}  # events before ``bind``
        self.bad_messages = 0
        self.nodes, self.node_inboxes = nodes, dict(node_inboxes)
        self.scheduler_address = scheduler_address
        self.admit_timeout_s = admit_timeout_s
        self.subscriber = ""  # this gateway's event inbox address (``start``)
        self.down: dict[str, str] = {}  # node id -> why it is down (``fail_node``)
        self.on_disconnect: Callable[[str], Any] | None = None  # node id (``_connect_node``)
        # request id -> (its node, "" until ``bind``; its queue; called with each event as it
        # is routed, before the stream's reader takes it: ``open``)
        self._queues: dict[str, tuple[str, asyncio.Queue[dict[str, Any]], OnEvent | None]] = {}
        self._failures = 0  # ``fail_node`` calls so far
        self._opened_at: dict[str, int] = {}  # request id -> ``_failures`` when it was opened
        self._failed_at: dict[str, int] = {}  # node id -> ``_failures`` at its last failure
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: dict[str, asyncio.Task[None]] = {}  # node id -> its connection watch

    async def start(self) -> None:
        """Bind the event inbox and connect to the scheduler and the nodes (on the running loop)."""
        self._context = ctx = data_plane.context(asyncio_=True)
        self._authenticator = self.security.start_authenticator(ctx) if self.security is not None else None
        inbox, self.subscriber = data_plane.serving_socket(ctx, zmq.PULL, self.security)
        self._admission = ctx.socket(zmq.DEALER)
        self._admission.setsockopt(zmq.MAXMSGSIZE, data_plane.MAX_MESSAGE_BYTES)
        if self.security is not None:
            self.security.connect_to(self._admission, "scheduler")
        self._admission.connect(self.scheduler_address)
        self._commands = {}
        for node_id, address in self.node_inboxes.items():
            self._connect_node(node_id, address)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._read_events(inbox)), loop.create_task(self._read_admissions())]

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

    def shutdown(self) -> None:
        """Stop reading and close every socket."""
        for task in [*self._tasks, *self._connections.values()]:
            task.cancel()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.destroy(linger=0)

    async def admit(self, req: NodeRequest, hashes: list[bytes]) -> Admission:
        """The scheduler's ``Admission`` for ``req`` (which it has handed on to the node when
        admitted); ``hashes`` are the prompt's block hashes for routing.

        Raises:
            RuntimeError: the scheduler failed on it; TimeoutError: no answer in time.
        """
        self._next_id += 1
        corr = self._next_id
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        try:
            await self._admission.send(data_plane.pack({
                "id": corr, "req": data_plane.request_to_wire(req), "sub": self.subscriber,
                "hashes": hashes}))
            reply = await asyncio.wait_for(fut, self.admit_timeout_s)
        finally:
            self._pending.pop(corr, None)
        if "error" in reply:
            raise RuntimeError(f"the global scheduler failed to admit the request: {reply['error']}")
        return Admission(**reply["adm"])

    async def _read_admissions(self) -> None:
        while True:
            payload = await self._admission.recv()
            try:
                corr, body = data_plane.admission_reply(data_plane.unpack(payload))
            except Exception as exc:  # noqa: BLE001 - any bytes at all: drop and count
                self._drop("admission", exc)
                continue
            fut = self._pending.get(corr)
            if fut is not None and not fut.done():
                fut.set_result({"error": body} if isinstance(body, str) else {"adm": body})

    def abort(self, node_id: str, request_id: str) -> None:
        """Tell ``node_id`` to stop ``request_id`` (fire and forget)."""
        self._commands[node_id].send(data_plane.pack({"op": "abort", "id": request_id}))

    def open(self, request_id: str, on_event: OnEvent | None = None) -> asyncio.Queue[dict[str, Any]]:
        """A queue for ``request_id``'s events; open it before the request reaches a node.
        ``on_event(event)`` sees each event as it arrives, whether or not the queue's reader
        keeps up (a client that stops reading).

        Raises:
            KeyError: ``request_id`` is open already (in flight on this gateway).
        """
        if request_id in self._queues:
            raise KeyError(request_id)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[request_id] = ("", queue, on_event)
        self._opened_at[request_id] = self._failures
        return queue

    @staticmethod
    def _put(entry: tuple[str, asyncio.Queue[dict[str, Any]], OnEvent | None], event: dict[str, Any]) -> None:
        if entry[2] is not None:
            entry[2](event)
        entry[1].put_nowait(event)

    def bind(self, request_id: str, node_id: str) -> None:
        """Record the node serving ``request_id`` (its failure ends this stream; a node down
        already, or failed since the stream was opened, ends it at once).

        Regression (hangs review): a node that failed and rejoined between the scheduler's
        hand-over of a request and this bind had lost the request, but ``fail_node`` had ended
        only the streams bound to it then: this stream waited forever for events."""
        entry = self._queues.get(request_id)
        if entry is not None:
            self._queues[request_id] = entry = (node_id, entry[1], entry[2])
            for sender, event in self._unbound.pop(request_id, []):  # in order, from it alone
                if sender == node_id:
                    self._put(entry, event)
                else:
                    self._drop("event", PermissionError(f"{sender} sent an event for a request on {node_id}"))
            if node_id in self.down:
                self._put(entry, _unavailable(self.down[node_id]))
            elif self._failed_at.get(node_id, -1) >= self._opened_at.get(request_id, 0):
                self._put(entry, _unavailable(f"cache node {node_id} failed while the request was on its way"))

    def fail_node(self, node_id: str, reason: str) -> None:
        """``node_id`` is down: end every stream bound to it with UNAVAILABLE (``reason``)."""
        self.down[node_id] = reason
        self._failed_at[node_id] = self._failures
        self._failures += 1
        for entry in list(self._queues.values()):
            if entry[0] == node_id:
                self._put(entry, _unavailable(reason))

    def reconnect(self, node_id: str, address: str) -> None:
        """``node_id`` is up again with its command inbox at ``address`` (new after a restart)."""
        if address != self.node_inboxes.get(node_id):
            old = self._commands.pop(node_id)
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
        self._unbound.pop(request_id, None)
        self._opened_at.pop(request_id, None)

    async def _read_events(self, inbox: Any) -> None:
        while True:
            frame = await inbox.recv(copy=False)
            try:
                items = data_plane.event_items(data_plane.unpack(frame.bytes))
            except Exception as exc:  # noqa: BLE001 - any bytes at all: drop and count
                self._drop("event", exc)
                continue
            # with per-node keys, each event must come from the node serving its request
            # (regression: any node could write into any other node's tenants' streams)
            sender = self._key_names.get(frame.get("User-Id")) if self._per_node_keys else None
            for request_id, event in items:
                entry = self._queues.get(request_id)
                if entry is None:
                    continue
                if self._per_node_keys and not entry[0]:  # its node is not known yet: held
                    self._unbound.setdefault(request_id, []).append((sender, event))  # for ``bind``
                    continue
                if self._per_node_keys and sender != entry[0]:
                    self._drop("event", PermissionError(f"{sender or 'an unknown node'} sent an event "
                                                        f"for a request on {entry[0]}"))
                    continue
                self._put(entry, event)

    def _drop(self, what: str, exc: BaseException) -> None:
        self.bad_messages += 1
        log.warning("gateway data plane: dropped a bad %s message: %s: %.200s", what, type(exc).__name__, exc)


def _unavailable(reason: str) -> dict[str, Any]:
    return {"type": "error", "code": "UNAVAILABLE", "message": f"{reason}; retry the request"}
