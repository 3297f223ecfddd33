"""The gateway's watch over its cache nodes: who is healthy, and a restarted node's rejoining.

One task per node long-polls ``CacheNode.health(wait_s)``, which answers as soon as the node's
step loop fails. A node is down when it says it failed, when its data-plane connection closes
(its process died: ``NodeStreams.on_disconnect``, at once), when the call fails (Ray fails a
killed actor's calls 1-2 s later) or when no answer comes within ``poll_s + timeout_s`` (hung,
or being restarted: Ray queues calls to a restarting actor; a poll whose deadline passed while
this gateway's own loop stalled is asked again first: ``LoopLag``). On down: the GlobalScheduler stops
routing to it (``node_down``), then its open streams end with UNAVAILABLE. A node that answers
healthy again from a new process (Ray restarted it: ``max_restarts``) has a new data-plane
address: it is opened if needed, the gateway reconnects, and the scheduler routes to it again
(``node_up``). ``on_change`` hears the number of healthy nodes whenever it changes (gRPC health).

The monitor also polls the GlobalScheduler (``health``). It is unreachable when its admission
connection closes (its process died: ``NodeStreams.on_scheduler_disconnect``, at once), Ray fails
a poll (``RayActorError``: its process died or is being restarted), or it is alive but silent
(stopped, deadlocked: ``silent_polls`` polls in a row unanswered within their deadline, a poll
that fails with another error being no silence: ``_poll_failed``; a poll across a stall of this gateway's own loop left out; ``SCHEDULER_SILENT``, and every other
call the gateway awaits from it fails at once too: ``BoundedActor.silent``): then the gateway
serves nothing that needs it, ``num_healthy`` is 0 (gRPC health NOT_SERVING, the HTTP API's
/health 503) and the gateway's admissions, waiting or new, fail UNAVAILABLE at once with a retry
hint (``NodeStreams.scheduler_failed``), and it is polled every ``retry_s``. When it answers again (Ray restarted it, ``scheduler_max_restarts``, and it rebuilt
its state: ``services.global_scheduler_recovery``; or the same process is reachable again) the
gateway connects to its admission socket, attaches again and says which requests it still waits
for (``on_scheduler_back``), reports the nodes it holds down and rejoins those the scheduler
holds down, then serves again. Once Ray says it died for good (``ActorDiedError``:
``scheduler_max_restarts`` 0 or used up) it stays down (``SCHEDULER_DOWN``).
Regression (review 23b, F2): health stayed SERVING for ever, the first request waited the 30 s
admission timeout and was told to retry in 1 s, and every later call ended UNKNOWN with Ray's
``ActorDiedError`` text.

Every Ray answer the monitor reads is untrusted input, checked before use (``node_answer``,
``scheduler_answer``, ``down_map``, ``recovery_report.address``): a malformed node answer is a
failed poll (the node is down, "malformed health answer", counted in its ``bad_answers``), a
malformed scheduler answer is logged, counted in ``scheduler_bad_answers`` and asked again
after ``retry_s``. Whatever else fails in a turn of a watch is logged and the watch goes on:
none ends before ``stop()`` (but the scheduler's, once Ray says it died for good).
Regression (review 25a A): the answers were read outside the ``try`` blocks; one malformed
answer (a missing key, a non-dict, ``"restarts": "0"``) ended that watch for good: the node was
never reported down or up again, and after a later scheduler restart the gateway stayed
NOT_SERVING, refusing every tenant UNAVAILABLE until the gateway itself restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from services.data_plane_wire import MAX_ID_CHARS, _cut
from services.loop_lag import LAG_STALL_S, LAG_TICK_S, LoopLag  # noqa: F401 - the constants: named here before
from services.ray_errors import SCHEDULER_DOWN, SCHEDULER_RESTARTING, RayActorError, actor_died
from services.recovery_report import BadReport, address, int_field

log = logging.getLogger(__name__)

SCHEDULER_SILENT = ("the global scheduler has not answered for {seconds} s (alive but silent: stopped, "
                    "deadlocked or overloaded); retry shortly")
"""Why calls that need the scheduler fail at once (UNAVAILABLE with a retry hint) while it is
alive but answers no health poll (``NodeMonitor.silent_polls``); Ray reports no failure then.
Regression (trial 29k P5): gRPC health said SERVING and /health 200 while every call that
needed the scheduler waited its 30-s deadline for a 503 (92 s for an OpenAI client's retries),
and load balancers kept sending traffic."""

MAX_DOWN_NODES = 4096
"""Most entries the scheduler's map of down nodes (``health``'s ``down``, ``down_nodes``) may
hold: one per cache node it routes to."""


@dataclass
class NodeHealth:
    """What the gateway knows of one node. ``failure``: why it last went down ("" if never)."""

    healthy: bool = True
    failure: str = ""
    pid: int = 0
    restarts: int = 0
    bad_answers: int = 0  # malformed health answers it sent (each a failed poll)


class NodeMonitor:
    """Args:
        nodes: node id -> CacheNode actor handle.
        node_info: node id -> ``CacheNode.describe()`` at start (``pid``).
        streams: the gateway's ``NodeStreams`` (``fail_node``, ``reconnect``).
        scheduler: the GlobalScheduler actor handle (``node_down``, ``node_up``).
        on_change: called with the number of healthy nodes when it changes.
        poll_s: length of one long poll of a healthy node.
        timeout_s: silence past ``poll_s`` before a node counts as down (hung). Generous: a
            busy machine may answer late, and a killed or failed node is seen sooner anyway.
            A poll that timed out while this gateway's own event loop stalled (``LoopLag``) is
            no evidence against the node: it is asked once more, with a fresh ``timeout_s``,
            before it counts as down (a hung node is then down after at most
            ``poll_s + 2 * timeout_s`` plus the stall).
        retry_s: pause before asking a down node again.
        notify_s: longest wait for the scheduler's ``node_down`` before the streams end anyway.
        silent_polls: the scheduler's health polls (each ``poll_s + timeout_s``) unanswered in a
            row, a poll across a stall of this gateway's own loop left out, before the scheduler
            counts as unreachable (``SCHEDULER_SILENT``: about 30 s with the defaults).
        down: node id -> why it is down from the start (in ``nodes``, not in ``node_info``: its
            ``describe`` did not answer when the gateway started, ``Gateway.start``). Held as a
            node that went down while serving: ``start`` ends its streams UNAVAILABLE
            (``fail_node``), its watch tells the scheduler (``node_down``) and polls it every
            ``retry_s`` plus ``timeout_s``, and its first healthy answer rejoins it (``_rejoin``;
            its process unknown here: pid 0, restarts -1, so the scheduler goes by its own
            record of it, or with none keeps its sessions: ``node_up``). ``Gateway.start`` has
            told the scheduler before serving. Regression (review s34 B F4): a
            gateway could not start without every node's answer.
    """

    def __init__(self, nodes: dict[str, Any], node_info: dict[str, dict[str, Any]], streams: Any,
                 scheduler: Any, on_change: Callable[[int], Any] | None = None,
                 poll_s: float = 5.0, timeout_s: float = 10.0, retry_s: float = 0.5,
                 notify_s: float = 1.0, silent_polls: int = 2, down: dict[str, str] | None = None) -> None:
        self.nodes, self.streams, self.scheduler = nodes, streams, scheduler
        self.on_change = on_change
        self.poll_s, self.timeout_s, self.retry_s, self.notify_s = poll_s, timeout_s, retry_s, notify_s
        self.state = {nid: NodeHealth(pid=int_field(info, "pid", 0), restarts=int_field(info, "restarts", 0))
                      for nid, info in node_info.items()}
        self.down_at_start = dict(down or {})  # node id -> why (``down``)
        for nid, reason in self.down_at_start.items():
            self.state[nid] = NodeHealth(healthy=False, failure=reason, pid=0, restarts=-1)
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Task[None]] = set()
        self.scheduler_failure = ""  # why the scheduler is unreachable or down ("": it serves)
        self.scheduler_identity: tuple[int, int] | None = None  # its (pid, restarts) as last seen
        self.scheduler_bad_answers = 0  # malformed answers of the scheduler (each asked again)
        # spill node name -> why it does not serve, from the scheduler's latest health answer (HTTP /health)
        self.spill_down: dict[str, str] = {}
        self.spill_recreations: dict[str, int] = {}  # spill node name -> times the scheduler created it again
        self.scheduler_error_answers = 0  # health polls that failed with an error, not a timeout
        # awaited when the scheduler answers again (the gateway attaches again: ``RayGateway``)
        self.on_scheduler_back: Callable[[], Awaitable[Any]] | None = None
        self._poll_scheduler = asyncio.Event()
        self.stopped = False
        self.loop_lag = LoopLag()
        self.lag_retries = 0  # health polls asked again because this loop stalled during them
        self.silent_polls = silent_polls
        self._silent_polls = 0  # the scheduler's health polls unanswered in a row (stalls left out)
        self._silent_since: float | None = None  # when the first of them was sent (monotonic)

    def start(self) -> None:
        for nid, reason in self.down_at_start.items():
            self.streams.fail_node(nid, reason)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch(nid)) for nid in self.nodes]
        self._tasks.append(loop.create_task(self._watch_scheduler()))
        self._tasks.append(loop.create_task(self.loop_lag.run()))
        self.streams.on_disconnect = self._disconnected
        self.streams.on_scheduler_disconnect = self._scheduler_disconnected

    def _disconnected(self, node_id: str) -> None:
        reason = f"cache node {node_id}: its data-plane connection closed (the process died)"
        task = asyncio.get_running_loop().create_task(self._down(node_id, reason))
        self._pending.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._pending.discard)

    def stop(self) -> None:
        """Cancel every watch. Sticky: a task whose cancel Python 3.11's ``wait_for`` dropped (it
        landed as the call completed) ends at its next turn, as ``stopped`` is checked there."""
        self.stopped = True
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """``stop``, then wait until every watch has ended, cancelling again one that let a
        cancel pass (Python 3.11's ``wait_for`` drops a cancel that lands as its call
        completes: the task would poll on until its next turn)."""
        self.stop()
        while pending := [t for t in self._tasks if not t.done()]:
            await asyncio.wait(pending, timeout=0.05)
            for task in pending:
                task.cancel()

    def num_healthy(self) -> int:
        """Healthy nodes that can be routed to: 0 once the scheduler is down."""
        return 0 if self.scheduler_failure else sum(h.healthy for h in self.state.values())

    async def _watch_scheduler(self) -> None:
        """Poll the scheduler's ``health`` every ``poll_s`` (at once after its connection
        closed, then every ``retry_s`` while it is unreachable); see the module docstring.
        Ends at ``stop()``, or once Ray says the scheduler died for good."""
        while not self.stopped:
            try:
                if not await self._scheduler_turn():
                    return
            except Exception:  # one failed turn never ends the watch
                log.exception("a turn of the global scheduler's health watch failed; the watch goes on")
                await asyncio.sleep(self.retry_s)

    async def _scheduler_turn(self) -> bool:
        """One poll of the scheduler and what follows from its answer. False: it died for good."""
        t0 = time.monotonic()
        try:
            answer = scheduler_answer(
                await asyncio.wait_for(self.scheduler.health.remote(), self.poll_s + self.timeout_s))
        except asyncio.CancelledError:
            raise
        except RayActorError as exc:  # its process died: for good, or Ray restarts it
            self._silent_polls, self._silent_since = 0, None
            if actor_died(exc):
                self._scheduler_lost(SCHEDULER_DOWN, f"{_first_line(exc)}", restarting=False)
                return False
            self._scheduler_lost(SCHEDULER_RESTARTING, f"a health poll failed: {_first_line(exc)}")
            await asyncio.sleep(self.retry_s)
            return True
        except BadReport as exc:  # asked again, as an unanswered poll (but its process answers)
            self._silent_polls, self._silent_since = 0, None
            self.scheduler_bad_answers += 1
            log.warning("the global scheduler sent a malformed health answer: %.300s", exc)
            await asyncio.sleep(self.retry_s)
            return True
        except asyncio.TimeoutError as exc:  # no answer in time: a busy or silent scheduler
            self._unanswered(t0, exc)
            await asyncio.sleep(self.retry_s)
            return True
        except Exception as exc:  # noqa: BLE001 - an error for an answer: alive (review 29o F7)
            self._poll_failed(exc)
            await asyncio.sleep(self.retry_s)
            return True
        self._silent_polls, self._silent_since = 0, None
        self.spill_down, self.spill_recreations = answer["spill_down"], answer["spill_recreations"]
        identity = (answer["pid"], answer["restarts"])
        if self.scheduler_identity is None and not self.scheduler_failure:
            self.scheduler_identity = identity
        elif (self.scheduler_failure or identity != self.scheduler_identity) and \
                not await self._scheduler_back(answer, identity):
            await asyncio.sleep(self.retry_s)
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._poll_scheduler.wait(), self.poll_s)
        self._poll_scheduler.clear()
        return True

    def _unanswered(self, t0: float, exc: BaseException) -> None:
        """A health poll sent at ``t0`` got no answer in time. Not counted when this gateway's
        own loop stalled meanwhile for more than ``LoopLag.stall_s`` (its answer may be waiting
        unread: asked again); after ``silent_polls`` in a row the scheduler is unreachable
        (``scheduler_silence``)."""
        stalled = self.loop_lag.since(t0)
        if stalled > self.loop_lag.stall_s:
            self.lag_retries += 1
            log.warning("a health poll of the global scheduler timed out while this gateway's event loop was "
                        "stalled for %.1f s; not counted against the scheduler", stalled)
            return
        if self._silent_since is None:
            self._silent_since = t0
        self._silent_polls += 1
        silent_s = time.monotonic() - self._silent_since
        log.warning("the global scheduler did not answer a health poll (%d in a row, %.0f s): %s",
                    self._silent_polls, silent_s, _first_line(exc))
        if self._silent_polls >= self.silent_polls and not self.scheduler_failure:
            self._scheduler_lost(SCHEDULER_SILENT.format(seconds=round(silent_s)),
                                 f"{self._silent_polls} health polls in a row unanswered")

    def _poll_failed(self, exc: BaseException) -> None:
        """A health poll failed with an error that is not Ray's word on the actor's process
        (``RayActorError``): the scheduler's ``health`` raised (a task error), or the call was
        refused or lost on its way. The scheduler is no silent one (those answer nothing): the
        polls unanswered in a row start again from 0, the poll is logged, counted in
        ``scheduler_error_answers`` and asked again after ``retry_s``, as a malformed answer.
        Regression (review 29o F7): such a poll counted as unanswered, so a scheduler whose
        ``health`` failed at once was held silent ("has not answered for 1 s") within
        ``silent_polls * retry_s``, and every call that needed it was refused UNAVAILABLE."""
        self._silent_polls, self._silent_since = 0, None
        self.scheduler_error_answers += 1
        log.warning("a health poll of the global scheduler failed (asked again; not counted as unanswered): %s",
                    _first_line(exc))

    def scheduler_silence(self) -> str:
        """Why calls that need the scheduler fail at once while it is alive but does not answer
        (``SCHEDULER_SILENT``), "" otherwise (it answers, or Ray fails its calls itself:
        restarting or down). ``BoundedActor.silent``."""
        failure = self.scheduler_failure
        return failure if failure and failure not in (SCHEDULER_RESTARTING, SCHEDULER_DOWN) else ""

    def _scheduler_disconnected(self) -> None:
        """The admission connection closed: the scheduler's process died, or the link broke (no
        reply to an admission sent before can come back either way); poll it now."""
        self._scheduler_lost(SCHEDULER_RESTARTING, "its admission connection closed")
        self._poll_scheduler.set()

    def _scheduler_lost(self, reason: str, why: str, restarting: bool = True) -> None:
        """Fail what needs the scheduler (``reason``) until ``_scheduler_back``."""
        if self.scheduler_failure == reason:
            return
        self.scheduler_failure = reason
        log.error("%s (%s)", reason, why)
        self.streams.scheduler_failed(reason, restarting)
        self._changed()

    async def _scheduler_back(self, answer: dict[str, Any], identity: tuple[int, int]) -> bool:
        """The scheduler answers again (``answer``: checked, ``scheduler_answer``), or from a new
        process (its state rebuilt): connect to its admission socket, ``on_scheduler_back``,
        tell it which nodes this gateway holds down and take down those it holds down (they
        rejoin at their next healthy answer, ``_rejoin``), then serve again. False (retried)
        when a step fails."""
        try:
            self.streams.reconnect_scheduler(answer["data_address"] or address(
                await asyncio.wait_for(self.scheduler.open_data_plane.remote(), self.timeout_s),
                "the scheduler's open_data_plane answer"))  # (bounded: the monitor holds the plain handle)
            if self.on_scheduler_back is not None:
                await asyncio.wait_for(self.on_scheduler_back(), self.timeout_s)
            for node_id, state in self.state.items():
                if not state.healthy:
                    await asyncio.wait_for(self.scheduler.node_down.remote(node_id=node_id, reason=state.failure), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - it may have died again: retried
            log.warning("the global scheduler answered, but rejoining it failed: %s", _first_line(exc))
            return False
        for node_id, why in answer["down"].items():
            held = self.state.get(node_id)
            if held is not None and held.healthy:
                held.healthy, held.failure = False, why
        self.scheduler_identity = identity
        if self.scheduler_failure:
            self.scheduler_failure = ""
            self.streams.scheduler_recovered()
            log.warning("the global scheduler serves again (pid %d, restarts %d)", *identity)
        self._changed()
        return True

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """node id -> ``NodeHealth`` fields (Admin ``Stats`` JSON, ``health``)."""
        return {nid: asdict(h) for nid, h in self.state.items()}

    async def _watch(self, node_id: str) -> None:
        """Poll ``node_id`` until ``stop()``; see the module docstring."""
        if node_id in self.down_at_start:  # stop routing there first (``down``), as ``_down`` does
            try:
                await asyncio.wait_for(self.scheduler.node_down.remote(node_id=node_id, reason=self.state[node_id].failure),
                                       self.notify_s)
            except Exception:
                log.warning("could not tell the scheduler that %s is down", node_id, exc_info=True)
        try:
            await self._learn_down(node_id)
        except Exception:  # the first poll decides
            log.exception("cache node %s: learning whether the scheduler holds it down failed", node_id)
        while not self.stopped:
            try:
                await self._node_turn(node_id)
            except Exception:  # one failed turn never ends the watch
                log.exception("a turn of cache node %s's health watch failed; the watch goes on", node_id)
                await asyncio.sleep(self.retry_s)

    async def _node_turn(self, node_id: str) -> None:
        """One poll of ``node_id`` and what follows from its answer."""
        node, state = self.nodes[node_id], self.state[node_id]
        wait_s = self.poll_s if state.healthy else 0.0
        try:
            answer = node_answer(await self._ask_health(node_id, node, wait_s))
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            await self._down(node_id, f"cache node {node_id} did not answer within {wait_s + self.timeout_s:g} s")
            return
        except BadReport as exc:  # a failed poll: the node is down until it answers soundly
            state.bad_answers += 1
            log.warning("cache node %s sent a malformed health answer: %.300s", node_id, exc)
            await self._down(node_id, f"cache node {node_id}: malformed health answer")
            await asyncio.sleep(self.retry_s)
            return
        except Exception as exc:  # noqa: BLE001 - a dead or unreachable node is down
            await self._down(node_id, f"cache node {node_id} is unreachable: {_first_line(exc)}")
            await asyncio.sleep(self.retry_s)
            return
        if not answer["healthy"]:
            await self._down(node_id, answer["failure"] or f"cache node {node_id} says it failed")
            await asyncio.sleep(self.retry_s)
        elif _new_process(answer, state) or not state.healthy:
            await self._rejoin(node_id, answer)
        else:
            state.restarts = answer["restarts"]

    async def _ask_health(self, node_id: str, node: Any, wait_s: float) -> Any:
        """``node.health(wait_s)``'s answer within ``wait_s + timeout_s``; when that deadline
        passed while this process's loop stalled for more than ``LAG_STALL_S`` (the deadline
        ran on a clock that jumped; the answer may be waiting unread), once more with
        ``health(0)`` and a fresh ``timeout_s``.

        Raises:
            asyncio.TimeoutError: no answer (the second one, after a stall).
        """
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(node.health.remote(wait_s=wait_s), wait_s + self.timeout_s)
        except asyncio.TimeoutError:
            stalled = self.loop_lag.since(t0)
            if stalled <= self.loop_lag.stall_s:
                raise
        self.lag_retries += 1
        log.warning("cache node %s: a health poll timed out while this gateway's event loop was stalled for "
                    "%.1f s; asking it again before counting it down", node_id, stalled)
        return await asyncio.wait_for(node.health.remote(wait_s=0.0), self.timeout_s)

    async def _learn_down(self, node_id: str) -> None:
        """At start: a node the scheduler holds down (another gateway's monitor reported it, or
        this gateway's before a restart) rejoins at its first healthy answer (``_rejoin``),
        as one this monitor saw go down does.

        Regression (diff review): a gateway that reported a node down and died before its
        ``node_up`` came back with the node taken for healthy and never reported it up; the
        scheduler kept the node out of routing for good, and every turn of its sessions
        was refused ``session_node_down``."""
        try:
            down = down_map(await asyncio.wait_for(self.scheduler.down_nodes.remote(), self.timeout_s), "down_nodes")
        except BadReport as exc:  # the first poll decides
            self.scheduler_bad_answers += 1
            log.warning("the global scheduler sent a malformed down_nodes answer: %.300s", exc)
            return
        except Exception:  # the first poll decides, as before
            log.warning("could not ask the scheduler which cache nodes are down", exc_info=True)
            return
        if node_id in down and self.state[node_id].healthy:
            self.state[node_id].healthy, self.state[node_id].failure = False, down[node_id]
            self._changed()

    async def _down(self, node_id: str, reason: str) -> None:
        state = self.state[node_id]
        if not state.healthy:
            return
        state.healthy, state.failure = False, reason
        log.warning("%s", reason)
        try:  # first stop routing there, so that a client retrying its failed call goes elsewhere
            await asyncio.wait_for(self.scheduler.node_down.remote(node_id=node_id, reason=reason), self.notify_s)
        except Exception:
            log.exception("could not tell the scheduler that %s is down", node_id)
        self.streams.fail_node(node_id, reason)
        self._changed()

    async def _rejoin(self, node_id: str, answer: dict[str, Any]) -> None:
        """A healthy answer (checked: ``node_answer``) from a node known down or from a new
        process: (re)connect to its command inbox and let the scheduler route to it. A failure
        leaves it down (retried)."""
        node, state = self.nodes[node_id], self.state[node_id]
        if _new_process(answer, state):
            await self._down(node_id, state.failure or f"cache node {node_id} restarted")
        try:
            inbox = answer["data_address"] or address(await node.open_data_plane.remote(),
                                                      f"cache node {node_id}'s open_data_plane answer")
            self.streams.reconnect(node_id, inbox)
            await asyncio.wait_for(self.scheduler.node_up.remote(
                node_id=node_id, inbox=inbox, pid=answer["pid"], previous_pid=state.pid,
                restarts=answer["restarts"], previous_restarts=state.restarts),
                                   self.timeout_s)
        except Exception:
            log.exception("cache node %s could not rejoin", node_id)
            await asyncio.sleep(self.retry_s)
            return
        state.healthy, state.pid, state.restarts = True, answer["pid"], answer["restarts"]
        log.warning("cache node %s is back (pid %d, restarts %d)", node_id, state.pid, state.restarts)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.num_healthy())


def node_answer(answer: Any) -> dict[str, Any]:
    """A cache node's ``health`` answer (``CacheNode.health``), checked: a dict with ``healthy``
    a bool, ``failure`` a str (cut to ``MAX_TEXT_CHARS``), ``pid`` and ``restarts`` ints >= 0
    and ``data_address`` "" or a ``tcp://`` address. Returns those fields alone.

    Raises:
        BadReport: naming the bad field.
    """
    _check_dict(answer, ("healthy", "failure", "pid", "restarts", "data_address"), "a cache node's health answer")
    if type(answer["healthy"]) is not bool:
        raise BadReport(f"healthy must be a bool, got {type(answer['healthy']).__name__}")
    if not isinstance(answer["failure"], str):
        raise BadReport(f"failure must be a str, got {type(answer['failure']).__name__}")
    return {"healthy": answer["healthy"], "failure": _cut(answer["failure"]), "pid": int_field(answer, "pid", 0),
            "restarts": int_field(answer, "restarts", 0), "data_address": _inbox(answer["data_address"])}


def scheduler_answer(answer: Any) -> dict[str, Any]:
    """The GlobalScheduler's ``health`` answer, checked: a dict with ``pid`` and ``restarts``
    ints >= 0, ``data_address`` "" or a ``tcp://`` address and ``down`` a ``down_map``;
    ``spill_down`` (the spill nodes not serving, ``services.spill_watch``) a ``down_map`` too,
    ``{}`` when absent (a scheduler of the version before it), and ``spill_recreations`` a
    ``count_map`` (``{}`` when absent). Returns those fields alone.

    Raises:
        BadReport: naming the bad field.
    """
    _check_dict(answer, ("pid", "restarts", "data_address", "down"), "the scheduler's health answer")
    return {"pid": int_field(answer, "pid", 0), "restarts": int_field(answer, "restarts", 0),
            "data_address": _inbox(answer["data_address"]), "down": down_map(answer["down"], "down"),
            "spill_down": down_map(answer.get("spill_down", {}), "spill_down"),
            "spill_recreations": count_map(answer.get("spill_recreations", {}), "spill_recreations")}


def count_map(value: Any, key: str) -> dict[str, int]:
    """``value``, the scheduler's spill node name -> a count: a dict of at most ``MAX_DOWN_NODES``
    names of at most ``MAX_ID_CHARS`` characters, each to an int >= 0.

    Raises:
        BadReport: naming ``key``.
    """
    if not isinstance(value, dict) or len(value) > MAX_DOWN_NODES:
        raise BadReport(f"{key} must be a dict of at most {MAX_DOWN_NODES} entries")
    if not all(isinstance(k, str) and len(k) <= MAX_ID_CHARS and type(v) is int and v >= 0 for k, v in value.items()):
        raise BadReport(f"{key} must map node names of at most {MAX_ID_CHARS} characters to counts (int >= 0)")
    return dict(value)


def down_map(value: Any, key: str) -> dict[str, str]:
    """``value``, the scheduler's node id -> why it is down: a dict of at most
    ``MAX_DOWN_NODES`` ids of at most ``MAX_ID_CHARS`` characters, each to a str (cut to
    ``MAX_TEXT_CHARS``).

    Raises:
        BadReport: naming ``key``.
    """
    if not isinstance(value, dict) or len(value) > MAX_DOWN_NODES:
        raise BadReport(f"{key} must be a dict of at most {MAX_DOWN_NODES} entries")
    if not all(isinstance(k, str) and len(k) <= MAX_ID_CHARS and isinstance(v, str) for k, v in value.items()):
        raise BadReport(f"{key} must map node ids of at most {MAX_ID_CHARS} characters to reasons (str)")
    return {k: _cut(v) for k, v in value.items()}


def _check_dict(answer: Any, keys: tuple[str, ...], what: str) -> None:
    if not isinstance(answer, dict):
        raise BadReport(f"{what} must be a dict, got {type(answer).__name__}")
    missing = [k for k in keys if k not in answer]
    if missing:
        raise BadReport(f"{what} lacks {missing}")


def _inbox(value: Any) -> str:
    """A health answer's ``data_address``: "" (not open yet) or a ``tcp://`` address."""
    return "" if type(value) is str and not value else address(value, "data_address")


def _new_process(answer: dict[str, Any], state: NodeHealth) -> bool:
    """The node answers from another process than ``state`` knew (a pid may repeat in a new
    one, e.g. in a fresh container: Ray's restart count tells them apart)."""
    return answer["pid"] != state.pid or answer["restarts"] > state.restarts


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
