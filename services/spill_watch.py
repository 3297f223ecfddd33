"""The global scheduler's watch over its spill nodes: which serve, which wait (and for whom),
which are dead (docs/architecture.md, 'Failure handling').

Every ``poll_s`` the watch asks each spill node, by name (``services.actor_refs``), for its
``SpillNode.status`` within ``timeout_s`` and keeps one state per node:

- ``serving``: it serves its directory;
- ``waiting``: alive but not serving: another store holds its directory (``holder``: pid, host
  and owner; ``previous_process``: its own previous process, which it waits for) or its
  ``/metrics`` port is taken (``detail`` says which). Every data call it gets raises
  ``SpillDirLocked`` meanwhile, so its cache nodes' spill tier lacks it;
- ``restarting``: Ray is restarting it (a call failed with ``RayActorError``);
- ``dead``: Ray says it died for good (``ActorDiedError``: a constructor that raised, an actor
  past its ``max_restarts``, one killed with ``no_restart``) or no live actor has its name. Its
  blocks leave the global index (``on_dead``), and come back once it serves again (``on_back``);
  its cache nodes count each put to it as failed (the host tier's victims are then dropped:
  recomputed from tokens when needed) and each get as a miss. With a ``recreator``
  (``services.spill_recreate``) the watch creates it again, bounded, as the launcher did: the
  new node reopens its directory's store. A node that died because its owner died (the scheduler
  that created it, ``died_with_owner``) has ``owner_died`` and is created again at once,
  uncounted;
- ``recreated``: the watch created it again this round (its next answer says how it is);
- ``not answering``: no answer within ``timeout_s`` (hung, or not placed);
- ``unknown``: not asked yet.

``snapshot`` is the scheduler's ``stats()["spill_nodes"]`` (``kvstrata status`` prints it) and
``not_serving`` its ``health()["spill_down"]``, which the gateways' ``NodeMonitor`` reads: the
HTTP ``/health`` then answers ``"status": "degraded"`` naming them (names only: the reasons name
hosts, pids, paths and errors, for ``kvstrata status`` alone). Every text a node or Ray sent is
cut and its control characters replaced (``printable``): it reaches terminals. Regression (s37): a spill
node alive but not serving was visible only in its own log, its ``status()`` and its cache
nodes' failure counters; ``kvstrata status`` and the gateway's health said nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.actor_refs import ActorRef
from services.ray_errors import RayActorError, actor_died
from services.spill_recreate import SpillRecreator

log = logging.getLogger(__name__)

SPILL_POLL_S = 5.0
"""Pause between two rounds of the watch's ``status`` calls."""

SPILL_TIMEOUT_S = 10.0
"""How long one ``status`` call may take before the node counts as not answering."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray's colours in an error's text

START_GRACE_S = 120.0
"""How long after the watch starts a name with no actor yet is taken for a node not created yet
(``unknown``), not a dead one, unless ``end_grace`` ends it sooner: the launcher starts the
scheduler before its spill nodes, and ends the grace once they serve (``attach_nodes``; its
bound is then ``start_timeout_s``, ``RecoveryPeers.start_grace_s``). Only on a first start: a
scheduler that Ray restarted watches nodes that exist already (``grace_s`` 0)."""

MAX_DETAIL_CHARS = 300
"""Longest ``detail`` kept per node (a refusal's text names a path and an owner)."""


def printable(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut at ``limit`` characters, each control (non-printable) character as "?": a
    node's answer, a lock file's words and Ray's error text reach terminals (``kvstrata
    status``), where an escape sequence would act. Regression (s37): ESC sequences written in a
    spill lock file's owner reached the terminal."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


def state_of(answer: Any) -> dict[str, Any]:
    """A node's state from its ``SpillNode.status`` answer (untrusted: a malformed one is
    ``unknown``). Returns ``{"state", "detail"}`` and, for a held directory, ``holder``
    (``"pid <pid> on <host> (<owner>)"``) and ``previous_process``."""
    if not isinstance(answer, dict) or not isinstance(answer.get("serving"), bool):
        return {"state": "unknown", "detail": f"malformed status answer: {printable(str(answer), 100)}"}
    if answer["serving"]:
        return {"state": "serving", "detail": ""}
    out: dict[str, Any] = {"state": "waiting", "detail": printable(str(answer.get("error", "starting")))}
    if answer.get("holder_pid"):
        out["holder"] = printable(f"pid {answer['holder_pid']} on {answer.get('holder_host', '?')} "
                                  f"({answer.get('holder_owner') or 'no owner'})")
        out["previous_process"] = bool(answer.get("previous_process"))
    return out


def failed_state(exc: BaseException) -> dict[str, Any]:
    """A node's state from a ``status`` call (or name look-up) that failed with ``exc``."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    text = printable((lines or [type(exc).__name__])[0])
    if isinstance(exc, RayActorError) and "creation task" in text and len(lines) > 1:
        text = printable(f"its constructor raised {lines[-1]}")  # the error, not Ray's preamble
    if isinstance(exc, ValueError):  # ray.get_actor: no live actor has the name
        return {"state": "dead", "detail": f"no live actor of that name: {text}", "missing": True}
    if isinstance(exc, RayActorError):
        return {"state": "dead" if actor_died(exc) else "restarting", "detail": text}
    if isinstance(exc, asyncio.TimeoutError):
        return {"state": "not answering", "detail": "no status answer in time"}
    return {"state": "unknown", "detail": f"{type(exc).__name__}: {text}"}


def died_with_owner(name: str, namespace: str) -> bool:
    """Whether Ray records that the newest dead actor named ``name`` in ``namespace`` died because
    its owner died (``ActorDiedErrorContext.OWNER_DIED``): a spill node the scheduler created
    again (``detached`` off) dies with the scheduler's process, through no fault of its own.
    Reads the GCS actor table's dead actors of this process's Ray job only (one call per dead
    spell of a node): a record of an earlier deployment's node of that name (``kvstrata down``
    kills the scheduler first, so a node it created again dies "owner died") is never read as
    this one's, and the read's cost does not grow with other jobs' dead actors. A table that
    cannot be read is False (the death counts as the node's own, as before). Blocks: run it off
    the loop."""
    try:
        import ray
        from ray._private.state import state as ray_state
        from ray.core.generated.common_pb2 import ActorDiedErrorContext
        from ray.core.generated.gcs_pb2 import ActorTableData

        job = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        dead = [ActorTableData.FromString(row)
                for row in ray_state._connect_and_get_accessor().get_actor_table(job, "DEAD")]
        mine = [row for row in dead if row.name == name and row.ray_namespace == namespace]
        if not mine:
            return False
        newest = max(mine, key=lambda row: row.end_time)
        return newest.death_cause.actor_died_error_context.reason == ActorDiedErrorContext.OWNER_DIED
    except Exception as exc:  # noqa: BLE001 - another Ray version, the GCS unreachable: counted as its own
        log.warning("why spill node %s died could not be read from Ray (%s: %s): counted as its own death",
                    name, type(exc).__name__, printable(str(exc)))
        return False


def describe(state: dict[str, Any]) -> str:
    """One line for ``state`` (``state_of``): "serving", "waiting for its previous process (pid
    ...)", "waiting: held by another store, pid ... (...)", "dead: why", ..."""
    kind = state.get("state", "unknown")
    if kind == "serving":
        return "serving"
    if kind == "waiting" and state.get("holder"):
        whose = "its previous process" if state.get("previous_process") else "another store"
        return f"waiting for its directory: held by {whose}, {state['holder']}"
    return f"{kind}: {state.get('detail') or '-'}"


class SpillWatch:
    """Polls the spill nodes ``names`` (Ray namespace ``namespace``) for their state.

    Args:
        namespace, names: the spill nodes' actor names (``RecoveryPeers.spill_nodes``).
        poll_s: pause between rounds (``SPILL_POLL_S``); timeout_s: one call's limit (a name
            look-up's too: ``ray.get_actor``, on the watch's own two threads).
        grace_s: how long after the start a name with no live actor stays ``unknown``
            (``START_GRACE_S``; 0 for a scheduler Ray restarted). Regression (s37): a node dead
            before a restarted scheduler's watch began read "unknown" for 120 s (``/health``
            "ok").
        on_dead: called with a node's name when it is first seen ``dead`` (the scheduler drops
            the blocks its index lists for that holder: a reset with none). Regression (s37):
            a dead spill node's blocks stayed in the global index for good, so admission
            counted their tokens as cached in the spill tier and routing steered by them,
            while every get of them was a miss.
        on_back: awaited with a node's name and handle when a node ``on_dead`` was called for
            serves again, until it returns (a failure is logged and retried next round): the
            scheduler puts the blocks it holds back in the index (``report_held``). Regression
            (s37 review F6): once marked dead, a node that served again (no reset push of its
            own: not recreated) never had its blocks indexed again.
        recreator: creates a node seen ``dead`` again when its policy says it is due (None:
            never; ``services.spill_recreate``). Regression (s38): nothing did.
    """

    def __init__(self, namespace: str, names: Sequence[str], poll_s: float = SPILL_POLL_S,
                 timeout_s: float = SPILL_TIMEOUT_S, on_dead: Callable[[str], Any] | None = None,
                 grace_s: float = START_GRACE_S,
                 on_back: Callable[[str, Any], Awaitable[Any]] | None = None,
                 recreator: SpillRecreator | None = None) -> None:
        if poll_s <= 0 or timeout_s <= 0 or grace_s < 0:
            raise ValueError(f"poll_s and timeout_s must be > 0 and grace_s >= 0, got {poll_s}, {timeout_s}, {grace_s}")
        self.namespace = namespace
        self.refs = {name: ActorRef(name, namespace) for name in names}
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.states: dict[str, dict[str, Any]] = {name: {"state": "unknown", "detail": "not asked yet"}
                                                  for name in names}
        self._handles: dict[str, Any] = {}
        self._pending: dict[str, asyncio.Future[Any]] = {}  # a look-up or status call still running
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="spill-watch")  # not the loop's default pool
        self.on_dead, self.on_back = on_dead, on_back
        self._forgotten: set[str] = set()  # nodes on_dead was called for, not back yet
        self.grace_s, self.started = grace_s, time.monotonic()
        self.recreator = recreator

    def end_grace(self) -> None:
        """From now on a name with no live actor is ``dead`` (the launcher's spill nodes serve)."""
        self.grace_s = 0.0

    def _text(self, name: str, state: dict[str, Any]) -> str:
        """``describe(state)`` and, with a recreator, its recreations of ``name``."""
        return describe(state) + (self.recreator.describe(name) if self.recreator is not None else "")

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """node name -> its state (``state_of``/``failed_state``), ``text`` (``describe``, with the
        recreations), ``checked_s`` (wall time of the answer; absent before the first) and, with
        a recreator, ``recreations`` and ``next_recreation_s`` (``SpillRecreator.info``)."""
        recreator = self.recreator
        return {name: state | (recreator.info(name) if recreator is not None else {}) | {"text": self._text(name, state)}
                for name, state in self.states.items()}

    def not_serving(self) -> dict[str, str]:
        """node name -> ``describe`` of each node that is known not to serve (not ``unknown``)."""
        return {name: self._text(name, s) for name, s in self.states.items()
                if s["state"] not in ("serving", "unknown")}

    async def run(self) -> None:
        """Poll until cancelled; a failed round is logged and the watch goes on."""
        while True:
            try:
                await self.poll()
            except Exception:  # the watch never ends before its cancel
                log.exception("a round of the spill nodes' watch failed; the watch goes on")
            await asyncio.sleep(self.poll_s)

    async def poll(self) -> None:
        """One round: every node asked at once; a state that changes is logged."""
        await asyncio.gather(*(self._ask(name) for name in self.refs))

    async def _answer(self, name: str, start: Callable[[], Any]) -> Any:
        """The answer of ``name``'s pending call, else of ``start()``'s, within ``timeout_s``.
        A call that times out stays pending and is awaited again next round, never sent again:
        Regression (s37): each round sent a new ``status`` to a hung node, and the calls piled
        up in its queue (a hung ``ray.get_actor`` held a thread of the loop's shared pool).

        Raises:
            asyncio.TimeoutError: no answer yet; whatever the call raised."""
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = asyncio.ensure_future(start())
        try:
            return await asyncio.wait_for(asyncio.shield(pending), self.timeout_s)
        finally:
            if pending.done():  # answered or failed: the next round sends a new call
                self._pending.pop(name, None)

    async def _ask(self, name: str) -> None:
        try:
            handle = self._handles.get(name)
            if handle is None:
                loop = asyncio.get_running_loop()
                handle = self._handles[name] = await self._answer(
                    name, lambda: loop.run_in_executor(self._lookups, self.refs[name].resolve))
            state = state_of(await self._answer(name, lambda: _awaited(handle.status.remote())))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a state
            if not isinstance(exc, asyncio.TimeoutError):
                self._handles.pop(name, None)  # looked up again: a recreated node has a new handle
            state = failed_state(exc)
        before = self.states[name]["state"]
        if state.get("missing") and before == "unknown" and \
                time.monotonic() - self.started < self.grace_s:
            return  # not created yet (the launcher starts the scheduler first): not dead yet
        if state["state"] == "dead" and before != "dead" and self.recreator is not None and \
                await self._died_with_owner(name):
            state = state | {"owner_died": True, "detail": f"its owner died; {state.get('detail', '')}"}
        if state["state"] != before:
            (log.info if state["state"] == "serving" else log.warning)(
                "spill node %s: %s (was %s)", name, describe(state), before)
        self.states[name] = state | {"checked_s": round(time.time(), 3)}
        if state["state"] == "dead" and before != "dead" and self.on_dead is not None:
            self._forgotten.add(name)
            self.on_dead(name)
        if state["state"] == "serving" and name in self._forgotten:
            await self._back(name, handle)
        if self.recreator is not None:
            self.recreator.seen(name, state["state"], owner_died=bool(state.get("owner_died")))
            if state["state"] == "dead" and self.recreator.due(name):
                await self._recreate(name, state)

    async def _died_with_owner(self, name: str) -> bool:
        """``died_with_owner`` for ``name``, on the watch's threads within ``timeout_s`` (False
        when it takes longer)."""
        try:
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._lookups, died_with_owner, name, self.namespace), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("why spill node %s died was not read from Ray in time: counted as its own death", name)
            return False

    async def _recreate(self, name: str, state: dict[str, Any]) -> None:
        """Create dead node ``name`` again (``SpillRecreator.recreate``, on the watch's threads
        within ``timeout_s``); its state is ``recreated`` until its next answer. A failure is
        logged and its state says so; the next try backs off."""
        why = describe(state)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                self._lookups, self.recreator.recreate, name, why), self.timeout_s)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - a name still taken, Ray unreachable: tried again later
            log.error("spill node %s could not be created again: %s: %s", name, type(exc).__name__,
                      printable(str(exc)))
            self.states[name] = state | {"detail": printable(f"{state.get('detail', '')}; its recreation "
                                                              f"failed: {type(exc).__name__}: {exc}")}
            return
        self._handles.pop(name, None)
        self.states[name] = {"state": "recreated", "detail": f"created again after: {why}",
                             "checked_s": round(time.time(), 3)}

    async def _back(self, name: str, handle: Any) -> None:
        """``on_back(name, handle)``; ``name`` is forgotten no more once it returned."""
        try:
            if self.on_back is not None:
                await self.on_back(name, handle)
            self._forgotten.discard(name)
        except Exception:  # retried next round
            log.warning("spill node %s serves again but its blocks could not be indexed again; retried",
                        name, exc_info=True)


async def _awaited(ref: Any) -> Any:
    """``ref`` (a Ray ``ObjectRef``) awaited, as a coroutine ``asyncio.ensure_future`` takes."""
    return await ref
