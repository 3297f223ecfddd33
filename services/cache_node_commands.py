"""A cache node's data-plane command inbox (``services.data_plane``).

``submit`` and ``abort`` commands arrive on the node's ZeroMQ command inbox
(``open_data_plane``), sent by the gateway and the global scheduler; every message is checked,
and a malformed one is dropped and counted. ``abort`` stops a request at the next step boundary
and frees its blocks.

``Commands`` is a part of ``services.cache_node.CacheNode``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from services import data_plane
from tenants.model import own_namespace

if TYPE_CHECKING:
    from services.cache_node_streams import _Stream

log = logging.getLogger(__name__)

ABORTED_EARLY_MAX = 4096
"""Ids of aborts that arrived before their request, remembered (oldest dropped first)."""


OPS_BY_ROLE = {"gateway": ("abort",),
               "scheduler": ("submit", "abort", "abort_subscriber", "end_tenant", "close_session")}
"""The data-plane roles (``services.data_plane_auth``) and the command ops each may send."""


class Commands:
    """The command-inbox part of ``CacheNode``: serving commands, ``abort``."""

    async def open_data_plane(self) -> str:
        """Bind the command inbox (``services.data_plane``; CURVE, admitting the gateway and
        the scheduler only, with ``security``) and serve it on the running event loop; returns
        its address. Opening again replaces the previous inbox."""
        self.close_data_plane()
        ctx = data_plane.context(asyncio_=True)
        auth = self.security.start_authenticator(ctx) if self.security is not None else None
        self._key_names = self.security.key_names() if self.security is not None else {}
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
        """Run each command; a malformed one (any bytes at all) is dropped and counted.

        The loop is yielded after each command (pyzmq's ``recv`` of a queued message returns a
        done future, which does not yield): a backlog of commands no longer holds the node's
        loop, its outbox and its Ray calls, for the whole backlog (review s34 B F3)."""
        while True:
            frame = await sock.recv(copy=False)
            try:
                msg = data_plane.unpack(frame.bytes)
                self._check_sender(frame, msg)
                self._command(msg)
                self.commands_received += 1
            except Exception as exc:  # noqa: BLE001 - a bad message loses only itself
                self.bad_messages += 1
                log.warning("cache node %s: dropped a bad data-plane message: %s: %.200s",
                            self.node_id, type(exc).__name__, exc)
            await asyncio.sleep(0)  # the loop's other tasks run between two commands

    def _check_sender(self, frame: Any, msg: Any) -> None:
        """With CURVE keys, each op only from the role that sends it (``OPS_BY_ROLE``: the
        gateway sends aborts alone; submits, gateway-gone and tenant-deleted come from the
        scheduler). Regression: the gateway's key could submit past admission, with any
        namespace, or end any tenant's work.

        Raises:
            PermissionError: the sender's role may not send this op.
        """
        if self.security is None:
            return
        role = self._key_names.get(frame.get("User-Id"))  # ZAP's id: the sender's public key
        op = msg.get("op") if isinstance(msg, dict) else None
        if op not in OPS_BY_ROLE.get(role or "", ()):
            raise PermissionError(f"the {role or 'unknown'} role may not send {op!r}")

    def _command(self, msg: Any) -> None:
        """Run ``{"op": "submit", "req", "sub"}``, ``{"op": "abort", "id"}``,
        ``{"op": "abort_subscriber", "sub"}`` (the scheduler: that gateway is gone),
        ``{"op": "end_tenant", "tenant"}`` (the scheduler: that tenant was deleted) or
        ``{"op": "close_session", "session", "tenant", "turns"}`` (the scheduler: closed while
        this node was taken for down; ``turns`` as ``_closing``'s, optional).

        Raises:
            TypeError, ValueError: a malformed command (nothing was run).
        """
        if not isinstance(msg, dict):
            raise TypeError(f"a command must be a map, got {type(msg).__name__}")
        op = msg.get("op")
        if op == "submit" and isinstance(msg.get("sub"), str) and msg["sub"].startswith("tcp://"):
            try:
                req = data_plane.request_from_wire(msg.get("req"))
            except (TypeError, ValueError) as exc:  # its gateway must hear of it, or waits forever
                rid = msg["req"].get("request_id") if isinstance(msg.get("req"), dict) else None
                if isinstance(rid, str) and 0 < len(rid) <= data_plane.MAX_ID_CHARS:
                    self._outbox.append((msg["sub"], rid, {"type": "error", "code": "INVALID_ARGUMENT",
                                                           "message": f"malformed request: {exc}"}))
                    self._wake.set()
                raise
            self.submit(req, msg["sub"])
        elif op == "abort" and isinstance(msg.get("id"), str):
            self.abort(msg["id"])
        elif op == "abort_subscriber" and isinstance(msg.get("sub"), str):
            self.abort_subscriber(msg["sub"])
        elif op == "end_tenant" and isinstance(msg.get("tenant"), str):
            self.end_tenant(msg["tenant"])
        elif op == "close_session" and isinstance(msg.get("session"), str) and isinstance(msg.get("tenant"), str):
            turns = msg.get("turns", [])
            if not isinstance(turns, list) or len(turns) > ABORTED_EARLY_MAX or not all(
                    isinstance(t, str) and 0 < len(t) <= data_plane.MAX_ID_CHARS for t in turns):
                raise ValueError("close_session: turns must be a list of request ids")
            self._queue_for_steps(self._closing(msg["session"], msg["tenant"], turns), concurrent.futures.Future())
        else:
            raise ValueError(f"malformed command (op {op!r})")

    # ---- admin ----------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` at the next step boundary (its stream gets no more events).

        An abort can overtake its request (the gateway aborts, the scheduler submits): an
        unknown id is remembered, and a later ``submit`` of it is refused (CANCELLED).

        Taking the stream out of ``_streams`` is the abort's claim on the request; its last
        output claims it the same way on the step thread (``Streams._deliver_step``), and
        exactly one of the two gets it. A session turn the engine finished in the step that
        computed as the abort landed is undone there: the session's history and its kept
        messages both leave it out, as a turn aborted a step earlier. Regression (hangs review
        N1): the engine's history kept that turn and the node's kept messages did not.
        """
        stream = self._claim_id(request_id)
        if stream is None:
            self._refuse_on_arrival(request_id, "CANCELLED", "the request was cancelled before it reached the node")
            return False
        self._queue_abort(stream)
        return True

    def _queue_abort(self, stream: _Stream) -> None:
        """``stream`` was claimed (``Streams._claim``) by an abort: its request is aborted on
        the step thread at its next turn (``_run_aborts``; a no-op if it never started)."""
        self._aborts.append((stream.request.request_id, stream))
        self._wake.set()

    def _run_aborts(self) -> None:
        """Step thread: abort in the engine the request of each stream an abort claimed
        (``abort``, ``_end_stream``), if the engine holds that stream's request: one claimed
        before it started never starts (``_start_incoming``), and a later request of its id is
        not its to abort."""
        while self._aborts:
            request_id, stream = self._aborts.popleft()
            if self._engine_streams.get(request_id) is stream:
                self.engine.abort_request(request_id)

    def _refuse_on_arrival(self, request_id: str, code: str, message: str) -> None:
        """Event loop: a ``submit`` of ``request_id`` arriving later gets an error ``code``
        (the last ``ABORTED_EARLY_MAX`` ids are remembered)."""
        self._aborted_early[request_id] = (code, message)
        while len(self._aborted_early) > ABORTED_EARLY_MAX:
            self._aborted_early.popitem(last=False)

    def _closing(self, session_id: str, tenant: str, turns: Sequence[str] = ()) -> Callable[[], int]:
        """Event loop: begin closing ``tenant``'s session ``session_id``; returns the call that
        closes it on the step thread between steps, which returns the tokens freed: the
        session's (``_close_session``); 0 when it holds none here yet (a turn of it is pending
        here or named in ``turns``); -1 when there is no such session (or another tenant's).

        ``turns``: the ids of its turns the scheduler admitted before the close and had not
        released (``GlobalScheduler.close_session``): each not on this node yet is refused
        (ABORTED) when it arrives; those here end with the session.

        Regression: a first turn still on the data plane when the close reached its node
        opened the closed session there afterwards, with no route to it (held until its TTL),
        and the close answered NOT_FOUND for a session the client had opened."""
        for rid in turns:  # on the loop that runs ``submit``: none slips between check and mark
            if rid not in self._streams:
                self._refuse_on_arrival(rid, "ABORTED", "the session was closed")

        def close() -> int:
            owner = self.engine.sessions.sessions.get(session_id)
            if owner is None:  # its first turn may be on its way here: it ends, never opens it
                return 0 if self._end_pending_turns(session_id, tenant) or turns else -1
            if owner.tenant != tenant:
                return -1
            return self._close_session(session_id)

        return close

    def end_tenant(self, tenant: str) -> int:
        """``tenant`` (its id) was deleted: each of its streams gets an ABORTED error and its
        request is aborted (blocks freed at the next step boundary), and each of its sessions is
        closed there (regression: a deleted tenant's running request ran to its end and its
        sessions held their KV until their TTL, with no key left to close them). Then the cached
        KV of its own namespace (``own_namespace``, salted variants too) is dropped on every
        tier: device, host, stored compressed prefixes here, and the spill nodes' RAM and group
        files (``LLMEngine.drop_namespace``; the spill part on a thread of its own, off the step
        thread); so are the compiled grammars of that namespace, the tenant's claims on the
        others and its failed specs (``LLMEngine.forget_tenant_grammars``), and what the node's
        scheduling policy and tiers keep of the tenant (``LLMEngine.forget_tenant``). Regression (review
        23d, E): the deleted tenant's blocks stayed cached, and its prompts' token ids stayed
        in the spill files across restarts; (review 30b F1) its grammars stayed, and told which
        specs it had used to any tenant timing a request. A tenant whose spec names
        a shared ``cache_namespace`` never hashed a block under its own namespace: the shared
        namespace's blocks are the other tenants' too and stay. Returns the streams ended."""
        streams = [stream for stream in list(self._streams.values()) if stream.request.tenant == tenant]
        ended = sum(self._end_stream(stream, "ABORTED", "the tenant was deleted") for stream in streams)

        def close_sessions() -> int:
            ids = [sid for sid, sess in self.engine.sessions.sessions.items() if sess.tenant == tenant]
            for sid in ids:
                self._close_session(sid)
            self._drop_own_namespace(tenant)
            return len(ids)

        self._queue_for_steps(close_sessions, concurrent.futures.Future())  # (refused once stopped or failed)
        if ended:
            log.warning("cache node %s: ended %d requests of deleted tenant %s", self.node_id, ended, tenant)
        return ended

    def _drop_own_namespace(self, tenant: str) -> None:
        """Step thread, between steps: drop ``tenant``'s own namespace's cached KV here, then
        on the spill nodes from a thread (it may wait on them); while a request of the tenant
        is still in the engine (its abort lost the race with its last step, or has not run),
        put off to the next turn of the step loop (``_purges``), so that no block it frees
        later stays cached. Regression: a request ending after the drop left its 29 blocks
        cached (seen once in three clean-clone CI runs)."""
        self._run_aborts()  # its requests' aborts may have come after this step's: their blocks go free, then dropped
        if any(seq.tenant == tenant for seq in list(self.engine.requests.values())):
            self._purges.add(tenant)
            return
        self._purges.discard(tenant)
        namespace = own_namespace(tenant)
        dropped = self.engine.drop_namespace(namespace, spill=False)
        grammars = self.engine.forget_tenant_grammars(tenant, namespace)
        self.engine.forget_tenant(tenant)  # its share, fair-share counters and weights (s37)
        threading.Thread(target=self.engine.drop_spill_namespace, args=(namespace,),
                         name=f"drop-{namespace}", daemon=True).start()
        log.info("cache node %s: dropped %s cached blocks and %d grammars of deleted tenant %s", self.node_id, dropped,
                 grammars, tenant)

    def _end_stream(self, stream: _Stream, code: str, message: str) -> bool:
        """Abort ``stream``'s request (its blocks are freed at the next step boundary) and send
        the stream its last event, an error ``code``; False (nothing done) when another claimed
        the stream first (``Streams._claim``: its last output, an abort), whatever stream of
        its id opened since.

        The stream is claimed (taken out of ``_streams``) and its abort queued before the
        event is sent: a local consumer (``generate``) that sees its last event takes the
        stream out of ``_streams`` and, having seen the end, aborts nothing. Regression (review
        31, seen in a loaded clean-clone CI): the event went first and ``abort`` after it; when
        the consumer's loop ran first, ``abort`` found no stream, and the request of a deleted
        tenant (or of a drained node, a closed session) computed on to its ``max_tokens``,
        its blocks cached, the tenant's purge put off until then."""
        if not self._claim(stream):
            return False
        self._queue_abort(stream)
        event = {"type": "error", "code": code, "message": message}
        if stream.subscriber:
            self._outbox.append((stream.subscriber, stream.request.request_id, event))
        elif stream.loop is not None and stream.deliver is not None:
            stream.loop.call_soon_threadsafe(stream.deliver, event)
        return True

    def _end_pending_turns(self, session_id: str, tenant: str, before: str = "",
                           why: str = "the session was closed") -> int:
        """Step thread: end with ABORTED (message ``why``) the turns of ``tenant``'s session
        that reached this node and have not started (``_incoming``); with ``before`` (a
        request id) only those that reached it before that request; returns how many."""
        arrived = list(self._streams)  # (a C copy) in the order the streams opened
        earlier = set(arrived[: arrived.index(before)]) if before in arrived else None
        pending = {s.request.request_id: s for s in [*self._incoming, *list(self._rendering)]  # (C copies)
                   if s.request.session_id == session_id and s.request.tenant == tenant
                   and self._streams.get(s.request.request_id) is s  # one a stream (in both for a moment)
                   and (not before or (earlier is not None and s.request.request_id in earlier))}
        for stream in pending.values():  # each that stream alone (another of its id may open meanwhile)
            self._end_stream(stream, "ABORTED", why)
        return len(pending)

    def _close_session(self, session_id: str, before: str = "", why: str = "the session was closed") -> int:
        """Step thread, between steps: close a session. A turn running in it ends first with
        ABORTED (regression: a session closed during its turn answered "0 tokens freed", the turn
        ran on, and its blocks were freed only at its end), and so do its turns not started
        (with ``before``: those that reached the node before that request; ``why``: their
        error's message). Returns the tokens freed: the history's, or the running turn's (its
        prompt holds the history)."""
        sess = self.engine.sessions.sessions.get(session_id)
        if sess is None:
            return 0
        self._end_pending_turns(session_id, sess.tenant, before, why)
        self._session_messages.pop(session_id, None)
        turn = sess.active_request
        tokens = 0
        if turn is not None:
            seq = self.engine.requests.get(turn)
            tokens = seq.num_tokens if seq is not None else 0
            stream = self._engine_streams.get(turn)  # the turn's own (not a later request's of its id)
            if stream is not None:
                self._end_stream(stream, "ABORTED", why)
            self.engine.abort_request(turn)
        return max(tokens, self.engine.close_session(session_id))

    def abort_subscriber(self, subscriber: str) -> int:
        """The gateway whose event inbox is ``subscriber`` is gone: abort every stream whose
        events went to it (their blocks are freed at the next step boundary) and close the
        step thread's socket to it. Returns how many streams were aborted."""
        aborted = 0
        for stream in [stream for stream in list(self._streams.values()) if stream.subscriber == subscriber]:
            if self._claim(stream):  # (one whose last output claimed it meanwhile has ended)
                self._queue_abort(stream)
                aborted += 1
        self._gone_subscribers.append(subscriber)
        self._wake.set()
        if aborted:
            log.warning("cache node %s: aborted %d streams of gone gateway %s", self.node_id, aborted, subscriber)
        return aborted
