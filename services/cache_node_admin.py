"""A cache node's admin calls: stats, flush, drain, closing a session, and the report a
restarted global scheduler rebuilds its state from.

Admin calls never take the engine lock on the caller's thread (a step holds it for its whole
forward pass, and on the actor that would stall its event loop): ``stats`` reads the snapshot
the step thread publishes; the others run on the step thread between steps (``_between_steps``).

``Admin`` is a part of ``services.cache_node.CacheNode``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from cache_node.tiers.spill_api import SpillFlushIncomplete
from services import data_plane

STATS_EVERY_S = 0.1
"""The step thread refreshes the ``stats`` snapshot at most this often (it walks every block)."""

DRAIN_POLL_S = 0.05
"""How often ``drain`` looks whether the requests it waits for have finished."""

HOLDING_QUERY_MAX = 4096
"""Request ids one ``holding`` call may ask about (the gateway's ``HOLDING_BATCH``)."""


class Admin:
    """The admin part of ``CacheNode``."""

    async def close_session(self, session_id: str, tenant: str, turns: Sequence[str] = ()) -> int:
        """Close ``tenant``'s session (a running turn in it ends with ABORTED, and so does each
        of ``turns``, its turns in flight as the scheduler knew them, even one that reaches this
        node after the close); the tokens freed, 0 when it holds none here yet, or -1 when it
        has no such session (``Commands._closing``)."""
        return await self._between_steps(self._closing(session_id, tenant, turns))

    def stats(self) -> dict[str, Any]:
        """Pool, queue and session counts as of the last step boundary, ``stats_age_s`` ago
        (never waits for a step)."""
        return self._node_stats(self._stats)

    async def integrity_stats(self) -> dict[str, Any]:
        """``stats`` taken fresh at the next step boundary, with the pool's integrity checked
        there (``integrity_ok``, ``integrity_error``)."""
        return self._node_stats(await self._between_steps(self._integrity_stats))

    def holding(self, subscriber: str, request_ids: Sequence[str]) -> list[str]:
        """Those of ``request_ids`` whose stream is open here for the gateway whose event inbox
        is ``subscriber``: from its arrival (``Streams._open``) until its end is claimed (its
        last output, an abort, an error event): rendering, compiling its grammar, queued,
        prefilling, running, preempted and waiting or recomputing all count. Read-only; never
        waits for a step. A gateway that cannot reach the scheduler asks it about its streams
        that got no event for a while (``NodeStreams.end_silent``): one not held here gets no
        event any more.

        Raises ValueError for more than ``HOLDING_QUERY_MAX`` ids or an id that is not a
        non-empty string of at most ``data_plane.MAX_ID_CHARS`` characters."""
        if not isinstance(request_ids, (list, tuple)) or len(request_ids) > HOLDING_QUERY_MAX:
            raise ValueError(f"holding: request_ids must be a list of at most {HOLDING_QUERY_MAX} ids")
        if not all(isinstance(rid, str) and 0 < len(rid) <= data_plane.MAX_ID_CHARS for rid in request_ids):
            raise ValueError("holding: each request id must be a non-empty string of at most "
                             f"{data_plane.MAX_ID_CHARS} characters")
        with self._streams_lock:
            return [rid for rid in request_ids
                    if (stream := self._streams.get(rid)) is not None and stream.subscriber == subscriber]

    def tenant_blocks(self, tenant: str) -> dict[str, int]:
        """Pool blocks ``tenant`` holds here as of the last stats snapshot (never waits for a
        step): ``requests``, its requests' (running or waiting, a policy's charge blocks
        included: ``LLMEngine.held_by_tenant``), and ``idle_sessions``, its idle sessions' (as
        ``stats``' ``session_blocks`` counts them). A block two of them share counts for each."""
        return dict(self._tenant_blocks.get(tenant, {"requests": 0, "idle_sessions": 0}))

    def _node_stats(self, engine: dict[str, Any]) -> dict[str, Any]:
        return {"node_id": self.node_id, "healthy": not self.failure, "failure": self.failure,
                "pid": os.getpid(), "restarts": self.restarts(), "metrics_address": self.metrics_address,
                "scheduler_unreachable": self.scheduler_unreachable(),
                **{k: v for k, v in engine.items() if k != "time_s"},
                "stats_age_s": time.monotonic() - engine["time_s"], "session_rerenders": self.session_rerenders,
                "data_plane": {"commands": self.commands_received, "bad_messages": self.bad_messages}}

    async def flush(self) -> int:
        """``flush_by_tier``'s blocks dropped, all tiers together.

        Raises:
            RuntimeError: a spill node may still hold blocks (``spill_unflushed``).
        """
        dropped = await self.flush_by_tier()
        if dropped.get("spill_unflushed"):
            raise RuntimeError(f"spill flush incomplete: {dropped['spill_unflushed']}")
        return sum(dropped[kind] for kind in ("device", "prefixes", "host", "spill"))

    async def flush_by_tier(self, spill_timeout_s: float | None = None) -> dict[str, Any]:
        """Drop every cached block not in use (device and host tiers and the stored compressed
        prefixes at the next step boundary, then the spill tier off the step thread); returns
        the blocks dropped per kind (``LLMEngine.flush_by_tier``: ``device``, ``prefixes``,
        ``host``, ``spill``; the spill nodes are shared by every cache node, so the first to
        flush them counts their blocks), and ``spill_unflushed`` (spill node name -> why) when
        a spill node did not confirm the flush: it may still hold its blocks.

        ``spill_timeout_s``: the whole call, counted from its start, ends within it (None: the
        spill client's timeouts), so that the caller (the gateway, which waits
        ``node_timeout_s`` for this node) hears which spill node was silent rather than timing
        this node out. The step boundary comes first (a stuck step loop is this node's silence).

        Regression (hardening review): the spill flush ran on the step thread, behind a spill
        put in progress; a stalled spill node froze every stream on the node for up to both
        timeouts (~60 s) while its health kept answering.
        Regression (session 30): a spill node that did not answer within the client's 30 s
        counted as 0 dropped and the flush as done, racing the gateway's own 30 s.

        Raises:
            ValueError: ``spill_timeout_s`` is negative or not finite.
        """
        if spill_timeout_s is not None and not (math.isfinite(spill_timeout_s) and spill_timeout_s >= 0):
            raise ValueError(f"spill_timeout_s must be a finite number >= 0, got {spill_timeout_s}")
        start = time.monotonic()
        dropped: dict[str, Any] = await self._between_steps(lambda: self.engine.flush_by_tier(spill=False))
        left = None if spill_timeout_s is None else max(0.0, spill_timeout_s - (time.monotonic() - start))
        try:
            return dropped | {"spill": await asyncio.to_thread(self.engine.flush_spill, left)}
        except SpillFlushIncomplete as exc:
            return dropped | {"spill": exc.dropped, "spill_unflushed": exc.unflushed}

    async def drain(self, timeout_s: float = 0.0, drain_id: str = "") -> int:
        """Let the requests running now finish for up to ``timeout_s`` seconds, then abort
        those still running (they end with finish reason ``abort``); returns how many. Those
        that reached the node but had not started end with UNAVAILABLE (retry elsewhere).
        ``drain_id`` (its gateway's, "" for none) names the drain for ``cancel_drain``: one
        cancelled while it waits aborts nothing and returns 0.

        Regression (hangs review): a request still queued for the step thread at the timeout
        was not aborted (the engine did not know it yet) and then ran to its end.

        Raises:
            ValueError: ``timeout_s`` is negative or not finite.
        """
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a finite number >= 0, got {timeout_s}")
        streams = list(self._streams.values())  # these streams, not later ones of their ids

        def running() -> list[Any]:
            return [s for s in streams if self._streams.get(s.request.request_id) is s]

        deadline = time.monotonic() + timeout_s
        cancelled = self._drains.setdefault(drain_id, asyncio.Event()) if drain_id else asyncio.Event()
        try:
            while running() and time.monotonic() < deadline and not cancelled.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(cancelled.wait(), min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))
        finally:
            if drain_id:
                self._drains.pop(drain_id, None)
        left = running()
        if not left or cancelled.is_set():
            return 0
        def abort_left() -> int:
            ended = 0
            for stream in left:
                rid = stream.request.request_id
                if self._engine_streams.get(rid) is stream and self.engine.abort_request(rid):
                    ended += 1  # the engine's request of this stream (its ``finished``/abort follows)
                elif self._end_stream(stream, "UNAVAILABLE", f"cache node {self.node_id} was drained "
                                      "before the request started; retry"):
                    ended += 1  # reached the node, not started: it never will
            return ended

        return await self._between_steps(abort_left)

    def cancel_drain(self, drain_id: str) -> bool:
        """Cancel the drain ``drain_id`` while it waits (its gateway's call ended: the admin key
        that started it was rotated away, or could not be confirmed): it aborts nothing.
        Returns whether one was waiting (False: none by that id, or it aborted already)."""
        cancelled = self._drains.get(drain_id)
        if cancelled is None:
            return False
        cancelled.set()
        return True

    async def recovery_report(self) -> dict[str, Any]:
        """What a restarted global scheduler re-learns from this node
        (``services.global_scheduler_recovery``): its health as ``health`` answers it
        (``healthy``, ``failure``, ``pid``, ``restarts``, ``data_address``), ``metrics_address``,
        and, taken together at the next step boundary, ``blocks`` (``(block_hash, tier)`` held
        on the device and in the host tier), ``sessions`` (``(session_id, tenant, kept)``,
        ``kept``: a turn of it finished here, so the node holds its history) and ``requests``
        (``(request_id, tenant, session_id, subscriber)`` of each request a gateway's data
        plane opened here that has not ended). A node whose step loop failed reports its
        health alone."""
        report = {"healthy": not self.failure, "failure": self.failure, "pid": os.getpid(),
                  "restarts": self.restarts(), "data_address": self.data_address,
                  "metrics_address": self.metrics_address}
        if self.failure:
            return report
        return report | await self._between_steps(self._held_now)

    def _held_now(self) -> dict[str, Any]:
        """Step thread: ``recovery_report``'s blocks, sessions and requests."""
        blocks = self.engine.tier_block_hashes()
        with self.engine._lock:  # an abort on another thread may end a session meanwhile
            sessions = [(s.session_id, s.tenant, bool(s.token_ids))
                        for s in self.engine.sessions.sessions.values()]
        requests = [(rid, stream.request.tenant, stream.request.session_id, stream.subscriber)
                    for rid, stream in list(self._streams.items()) if stream.subscriber]
        return {"blocks": blocks, "sessions": sessions, "requests": requests}

    def _between_steps(self, call: Callable[[], Any]) -> asyncio.Future[Any]:
        """``call()`` run by the step thread at its next step boundary, as an awaitable.

        Raises (when awaited): RuntimeError: the step loop has failed (``failure``), the node
        is shut down or shutting down, or its step thread ended before it ran ``call``
        (``_refusal``; a gateway counts the node as not answering: UNAVAILABLE).
        """
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue_for_steps(call, done)
        return asyncio.wrap_future(done)

    def _queue_for_steps(self, call: Callable[[], Any], done: concurrent.futures.Future[Any]) -> None:
        """Queue ``call`` for the step thread (``done`` gets its answer), or refuse it at once
        with RuntimeError (``_refusal``) once the node failed or stopped. The check and the
        append share ``_streams_lock`` with ``shutdown`` setting ``_stopped`` and with the step
        thread's exit (``_refuse_queued``): a call is either queued before the step thread
        empties the queue for the last time, or refused. Regression (s41 review of 73ff1b0):
        only ``failure`` was checked, and an admin call made after ``shutdown`` (or during it)
        waited for ever."""
        with self._streams_lock:
            why = self._refusal()
            if not why:
                self._admin.append((call, done))
        if why:
            done.set_exception(RuntimeError(why))
        else:
            self._wake.set()

    def _refusal(self) -> str:
        """Why a call for the step thread is refused now ("": it is queued)."""
        if self.failure:
            return self.failure
        if self._stopped:
            return f"cache node {self.node_id} is shut down; retry on another node"
        if self._steps_ended:
            return f"cache node {self.node_id}: its step loop has ended; retry on another node"
        return ""

    def _refuse_queued(self) -> None:
        """Step thread, as it exits: refuse every call still queued (``_refusal``), and each
        later one (``_steps_ended``)."""
        with self._streams_lock:
            self._steps_ended = True
            left = list(self._admin)
            self._admin.clear()
        for _, done in left:
            if not done.done():
                done.set_exception(RuntimeError(self._refusal()))

    def _run_admin(self) -> None:
        """Step thread: run the admin calls queued by ``_between_steps``, then refresh the
        ``stats`` snapshot, then answer them: a caller that closed a session (or flushed) and
        then asks ``tenant_blocks`` or ``stats`` sees what its call freed. Regression (s41
        new-user walkthrough): the answer went out first and the snapshot was refreshed only
        after the idle wait, so ``GetUsage`` right after ``CloseSession`` still counted the
        closed session's blocks.

        A call that raises a BaseException (not an Exception) gets RuntimeError naming it, the
        calls run before it get their answers, and the exception ends the step loop (the calls
        after it are refused as it exits: ``_refuse_queued``). Regression (s41 review of
        73ff1b0): the answers held until the refresh were never sent, their callers waited for
        ever."""
        answers: list[tuple[concurrent.futures.Future[Any], Any, BaseException | None]] = []
        try:
            while self._admin:
                call, done = self._admin.popleft()
                try:
                    answers.append((done, call(), None))
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    answers.append((done, None, exc))
                except BaseException as exc:
                    answers.append((done, None, RuntimeError(
                        f"cache node {self.node_id}: the call ended its step loop: {type(exc).__name__}: {exc}")))
                    raise
            if answers:
                self._publish_stats(force=True)
        finally:  # a failing call or refresh fails the step loop, never leaves a caller unanswered
            for done, result, error in answers:
                if error is None:
                    done.set_result(result)
                else:
                    done.set_exception(error)

    def _publish_stats(self, force: bool = False) -> None:
        """Step thread: refresh the ``stats`` snapshot (at most every ``STATS_EVERY_S`` unless
        ``force``)."""
        if force or time.monotonic() - self._stats["time_s"] >= STATS_EVERY_S:
            self._stats = {**self.engine.stats(), "time_s": time.monotonic(),
                           "session_rerenders": self.session_rerenders}
            self._tenant_blocks = self._blocks_by_tenant()

    def _blocks_by_tenant(self) -> dict[str, dict[str, int]]:
        """Step thread: ``tenant_blocks`` of every tenant holding blocks here."""
        out = {t: {"requests": held["blocks"], "idle_sessions": 0}
               for t, held in self.engine.held_by_tenant().items()}
        # under the engine's lock: an abort on another thread (``Streams.generate``'s end) may
        # delete a session meanwhile (review of 4a823ff, D6: "dictionary changed size during
        # iteration", which would have ended the step loop)
        with self.engine._lock:
            idle = [(s.tenant, s.num_held_blocks) for s in self.engine.sessions.sessions.values()
                    if s.active_request is None]
        for tenant, blocks in idle:
            out.setdefault(tenant, {"requests": 0, "idle_sessions": 0})["idle_sessions"] += blocks
        return out

    def _integrity_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {**self.engine.stats(), "time_s": time.monotonic()}
        try:
            self.engine.check_integrity()
            stats["integrity_ok"], stats["integrity_error"] = True, ""
        except RuntimeError as exc:
            stats["integrity_ok"], stats["integrity_error"] = False, str(exc)
        return stats
