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
  past its ``max_restarts``) or no live actor has its name; nothing recreates it (``kvstrata
  down`` / ``up`` does: the new node reopens its directory's store). Its blocks leave the
  global index (``on_dead``); its cache nodes count each put to it as failed (the host tier's
  victims are then dropped: recomputed from tokens when needed) and each get as a miss;
- ``not answering``: no answer within ``timeout_s`` (hung, or not placed);
- ``unknown``: not asked yet.

``snapshot`` is the scheduler's ``stats()["spill_nodes"]`` (``kvstrata status`` prints it) and
``not_serving`` its ``health()["spill_down"]``, which the gateways' ``NodeMonitor`` reads: the
HTTP ``/health`` then answers ``"status": "degraded"`` naming them. Regression (s37): a spill
node alive but not serving was visible only in its own log, its ``status()`` and its cache
nodes' failure counters; ``kvstrata status`` and the gateway's health said nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.actor_refs import ActorRef
from services.ray_errors import RayActorError, actor_died

log = logging.getLogger(__name__)

SPILL_POLL_S = 5.0
"""Pause between two rounds of the watch's ``status`` calls."""

SPILL_TIMEOUT_S = 10.0
"""How long one ``status`` call may take before the node counts as not answering."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray's colours in an error's text

START_GRACE_S = 120.0
"""How long after the watch starts a name with no actor yet is taken for a node not created yet
(``unknown``), not a dead one: the launcher starts the scheduler before its spill nodes."""

MAX_DETAIL_CHARS = 300
"""Longest ``detail`` kept per node (a refusal's text names a path and an owner)."""


def state_of(answer: Any) -> dict[str, Any]:
    """A node's state from its ``SpillNode.status`` answer (untrusted: a malformed one is
    ``unknown``). Returns ``{"state", "detail"}`` and, for a held directory, ``holder``
    (``"pid <pid> on <host> (<owner>)"``) and ``previous_process``."""
    if not isinstance(answer, dict) or not isinstance(answer.get("serving"), bool):
        return {"state": "unknown", "detail": f"malformed status answer: {str(answer)[:100]}"}
    if answer["serving"]:
        return {"state": "serving", "detail": ""}
    out: dict[str, Any] = {"state": "waiting", "detail": str(answer.get("error", "starting"))[:MAX_DETAIL_CHARS]}
    if answer.get("holder_pid"):
        out["holder"] = (f"pid {answer['holder_pid']} on {answer.get('holder_host', '?')} "
                         f"({answer.get('holder_owner') or 'no owner'})")[:MAX_DETAIL_CHARS]
        out["previous_process"] = bool(answer.get("previous_process"))
    return out


def failed_state(exc: BaseException) -> dict[str, Any]:
    """A node's state from a ``status`` call (or name look-up) that failed with ``exc``."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    text = (lines or [type(exc).__name__])[0][:MAX_DETAIL_CHARS]
    if isinstance(exc, RayActorError) and "creation task" in text and len(lines) > 1:
        text = f"its constructor raised {lines[-1]}"[:MAX_DETAIL_CHARS]  # the error, not Ray's preamble
    if isinstance(exc, ValueError):  # ray.get_actor: no live actor has the name
        return {"state": "dead", "detail": f"no live actor of that name: {text}", "missing": True}
    if isinstance(exc, RayActorError):
        return {"state": "dead" if actor_died(exc) else "restarting", "detail": text}
    if isinstance(exc, asyncio.TimeoutError):
        return {"state": "not answering", "detail": "no status answer in time"}
    return {"state": "unknown", "detail": f"{type(exc).__name__}: {text}"}


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
        poll_s: pause between rounds (``SPILL_POLL_S``); timeout_s: one call's limit.
        on_dead: called with a node's name when it is first seen ``dead`` (the scheduler drops
            the blocks its index lists for that holder: a reset with none). Regression (s37):
            a dead spill node's blocks stayed in the global index for good, so admission
            counted their tokens as cached in the spill tier and routing steered by them,
            while every get of them was a miss.
    """

    def __init__(self, namespace: str, names: Sequence[str], poll_s: float = SPILL_POLL_S,
                 timeout_s: float = SPILL_TIMEOUT_S, on_dead: Callable[[str], Any] | None = None) -> None:
        if poll_s <= 0 or timeout_s <= 0:
            raise ValueError(f"poll_s and timeout_s must be > 0, got {poll_s}, {timeout_s}")
        self.refs = {name: ActorRef(name, namespace) for name in names}
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.states: dict[str, dict[str, Any]] = {name: {"state": "unknown", "detail": "not asked yet"}
                                                  for name in names}
        self._handles: dict[str, Any] = {}
        self.on_dead = on_dead
        self.started = time.monotonic()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """node name -> its state (``state_of``/``failed_state``), ``text`` (``describe``) and
        ``checked_s`` (wall time of the answer; absent before the first)."""
        return {name: state | {"text": describe(state)} for name, state in self.states.items()}

    def not_serving(self) -> dict[str, str]:
        """node name -> ``describe`` of each node that is known not to serve (not ``unknown``)."""
        return {name: describe(s) for name, s in self.states.items() if s["state"] not in ("serving", "unknown")}

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

    async def _ask(self, name: str) -> None:
        try:
            handle = self._handles.get(name)
            if handle is None:
                handle = self._handles[name] = await asyncio.to_thread(self.refs[name].resolve)
            state = state_of(await asyncio.wait_for(handle.status.remote(), self.timeout_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is a state
            self._handles.pop(name, None)  # looked up again: a recreated node has a new handle
            state = failed_state(exc)
        before = self.states[name]["state"]
        if state.get("missing") and before == "unknown" and \
                time.monotonic() - self.started < START_GRACE_S:
            return  # not created yet (the launcher starts the scheduler first): not dead yet
        if state["state"] != before:
            (log.info if state["state"] == "serving" else log.warning)(
                "spill node %s: %s (was %s)", name, describe(state), before)
        self.states[name] = state | {"checked_s": round(time.time(), 3)}
        if state["state"] == "dead" and before != "dead" and self.on_dead is not None:
            self.on_dead(name)
