"""The global scheduler creates a spill node dead for good again (docs/architecture.md, 'Failure
handling': Spill node states).

Ray restarts a spill node that crashed (``create_spill_node``'s ``max_restarts``) but not one past
its restarts, one killed with ``no_restart``, nor one whose constructor raised: its actor is dead
for good and its shard of the spill tier lost until ``kvstrata down`` / ``up``. The spill watch
(``services.spill_watch``) sees it ``dead`` and, with a ``SpillRecreator``, creates it again from
the launcher's own ``SpillRecipe`` (same name, directory, budgets, resources, lifetime, metrics
endpoint, environment, lock owner), so the new node reopens its directory's store: the group
files whose checks pass are served again (their hashes go back to the index through its reset
push), the others are dropped as at any start.

Never two live stores on one directory: Ray refuses a second live actor of one name, and the new
node's store takes its directory's lock (``cache_node.tiers.spill_lock``) or waits for its holder
without serving (``waiting``). The scheduler owns the node it created: with ``detached`` off (the
node's lifetime as the launcher gave it) the node dies with the scheduler's process, and the
restarted scheduler's watch creates it again at once, neither backed off nor counted (Ray says
its owner died: ``spill_watch.died_with_owner``). Regression (s41): it was backed off and
counted, so ``max_per_window`` scheduler crashes left the spill tier dead for up to ``window_s``.
A node's own deaths are bounded: the first recreation is due ``backoff_s`` after the node was
first seen dead, each later one within ``window_s`` waits twice as long as the one before (at most
``BACKOFF_MAX_S``), and at most ``max_per_window`` happen per node within ``window_s`` (a node whose
constructor raises every time is not created for ever). Each one is logged; ``info`` is in
``kvstrata status``. When each recreation happened is kept in the tenant store
(``tenants.store_spill``) and a restarted scheduler starts from it: a spill node that crashes
in a loop together with the scheduler is still created at most ``max_per_window`` times per
window, with the backoff grown by the recreations before the restart.

Regression (s38): nothing recreated a spill node dead for good; its capacity was lost until a
manual ``kvstrata down`` / ``up``. Regression (s39): the recreations within the window lived in
the scheduler's memory only, so each scheduler restart reset the cap and the backoff.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cache_node.tiers.spill_format import BlockFormat
from services.actor_refs import ActorRef
from services.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 600.0
"""Longest wait between two recreations of one node."""


@dataclass(frozen=True)
class RecreatePolicy:
    """How often a dead spill node is created again: at most ``max_per_window`` times within
    ``window_s`` per node (0: never), the first ``backoff_s`` after it was seen dead, each next one
    twice as long after the one before (``ServiceConfig.spill_recreate_*``).

    Raises:
        ValueError: a negative count or wait, or a window that is not > 0."""

    max_per_window: int = 3
    window_s: float = 3600.0
    backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_per_window < 0 or self.backoff_s < 0 or not self.window_s > 0:
            raise ValueError(f"max_per_window and backoff_s must be >= 0 and window_s > 0, got "
                             f"{self.max_per_window}, {self.backoff_s}, {self.window_s}")


@dataclass(frozen=True)
class SpillRecipe:
    """How the launcher creates each spill node (``services.launcher._start_spill_nodes`` creates
    them with ``create``), so that a recreation is the same node: ``root_dirs`` maps each node's
    name to its directory; the other fields are ``create_spill_node``'s arguments."""

    root_dirs: tuple[tuple[str, str], ...]
    block_format: BlockFormat
    ram_bytes: int
    disk_bytes: int
    namespace: str
    scheduler: str
    resources: dict[str, float] = field(default_factory=dict)
    lifetime: str | None = None
    metrics: MetricsEndpoint | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    deployment: str = ""

    def create(self, name: str) -> Any:
        """Create spill node ``name`` (an actor handle; its constructor runs on its own).

        Raises:
            KeyError: ``name`` is no node of this recipe; ValueError: a live actor has the name."""
        from services.spill_node import create_spill_node  # imports the actor class (Ray)

        return create_spill_node(
            name, dict(self.root_dirs)[name], self.block_format, self.ram_bytes, self.disk_bytes,
            resources=dict(self.resources), lifetime=self.lifetime, namespace=self.namespace,
            scheduler=ActorRef(self.scheduler, self.namespace), metrics=self.metrics,
            env_vars=dict(self.env_vars) or None, num_spill_nodes=len(self.root_dirs), deployment=self.deployment)


class SpillRecreator:
    """When each dead spill node is due to be created again (``RecreatePolicy``), and does it.

    Args:
        recipe: how the nodes are created; policy: how often.
        history: node name -> when it was created again before (wall-clock seconds, oldest
            first: ``TenantStore.load_spill_recreations``); those within the window count
            against its cap and backoff as this process's own do.
        on_recreate: called with (node name, wall-clock seconds) at each recreation, before the
            node is created (``TenantStore.add_spill_recreation``); an error it raises is logged
            and the recreation goes on.
        clock / wall_clock: monotonic and wall-clock seconds (tests)."""

    def __init__(self, recipe: SpillRecipe, policy: RecreatePolicy,
                 history: Mapping[str, Sequence[float]] | None = None,
                 on_recreate: Callable[[str, float], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.recipe, self.policy, self.clock, self.wall_clock = recipe, policy, clock, wall_clock
        self.on_recreate = on_recreate
        self.totals: dict[str, int] = {}  # recreations per node since the scheduler started
        # the handle of each node created: Ray ends a named actor that is not detached once no
        # handle to it is left (its owner, this scheduler, holds it)
        self.handles: dict[str, Any] = {}
        # their times within the window (monotonic), the stored ones' moved onto this clock
        to_monotonic = self.clock() - self.wall_clock()
        self._recent: dict[str, deque[float]] = {
            name: deque(sorted(at_s + to_monotonic for at_s in times)) for name, times in (history or {}).items()}
        self._dead_since: dict[str, float] = {}
        self._capped_logged: set[str] = set()
        # dead only because their owner died -> when due (monotonic): at once, and after a failed try
        # backed off as any (``_owner_failures`` of them), never capped nor counted
        self._owner_died: dict[str, float] = {}
        self._owner_failures: dict[str, int] = {}
        self.uncounted: dict[str, int] = {}  # of ``totals``, those after an owner's death

    def seen(self, name: str, state: str, owner_died: bool = False) -> None:
        """The watch saw ``name`` in ``state``: a node that serves ends its dead spell. A dead
        node with ``owner_died`` (Ray: its owner died, ``spill_watch.died_with_owner``) is due at
        once and its next recreation is not counted against the cap."""
        if state == "dead":
            self._dead_since.setdefault(name, self.clock())
            if owner_died:
                self._owner_died.setdefault(name, self.clock())
        elif state == "serving":
            self._dead_since.pop(name, None)
            self._capped_logged.discard(name)
            self._owner_died.pop(name, None)
            self._owner_failures.pop(name, None)

    def _window(self, name: str) -> deque[float]:
        recent = self._recent.setdefault(name, deque())
        while recent and recent[0] <= self.clock() - self.policy.window_s:
            recent.popleft()
        return recent

    def next_at(self, name: str) -> float | None:
        """When ``name`` is next due (monotonic seconds), or None: not dead, or never (``max_per_window``
        0)."""
        if name not in self._dead_since or self.policy.max_per_window == 0:
            return None
        if name in self._owner_died:
            return self._owner_died[name]
        recent = self._window(name)
        if len(recent) >= self.policy.max_per_window:
            return recent[0] + self.policy.window_s
        since = max(self._dead_since[name], recent[-1] if recent else 0.0)
        return since + min(self.policy.backoff_s * 2 ** len(recent), BACKOFF_MAX_S)

    def due(self, name: str) -> bool:
        """Whether dead node ``name`` is to be created again now; a node past its cap is logged once
        per dead spell."""
        at = self.next_at(name)
        if at is None:
            return False
        if name in self._owner_died:
            return self.clock() >= at
        if len(self._window(name)) >= self.policy.max_per_window and name not in self._capped_logged:
            self._capped_logged.add(name)
            log.error("spill node %s died again after %d recreations within %g s: not created again for "
                      "%.0f s (its log says why; `kvstrata down` and `up` start it now)", name,
                      self.policy.max_per_window, self.policy.window_s, at - self.clock())
        return self.clock() >= at

    def recreate(self, name: str, why: str) -> Any:
        """Create ``name`` again (counted, logged); returns its handle. Blocks on Ray's name
        registration: the watch runs it on its own threads.

        Raises:
            whatever ``SpillRecipe.create`` raised (counted as a recreation all the same: the next
            try backs off; after an owner's death it is neither counted nor capped, and the next
            try is still one after an owner's death, backed off: regression (s41 review r6), a
            failed try there made the next one capped, the tier dead for up to ``window_s``)."""
        self.totals[name] = self.totals.get(name, 0) + 1
        if name in self._owner_died:  # not the node's fault: neither capped nor backed off
            self.uncounted[name] = self.uncounted.get(name, 0) + 1
            log.warning("spill node %s died with its owner (%s): creating it again on its directory now, not "
                        "counted against the %d recreations allowed within %g s", name, why,
                        self.policy.max_per_window, self.policy.window_s)
            try:
                self.handles[name] = self.recipe.create(name)
            except Exception:
                failures = self._owner_failures[name] = self._owner_failures.get(name, 0) + 1
                self._owner_died[name] = self.clock() + min(self.policy.backoff_s * 2 ** (failures - 1), BACKOFF_MAX_S)
                raise
            self._owner_died.pop(name, None)
            self._owner_failures.pop(name, None)
            return self.handles[name]
        self._window(name).append(self.clock())
        if self.on_recreate is not None:
            try:
                self.on_recreate(name, self.wall_clock())
            except Exception as exc:  # noqa: BLE001 - not kept: a restart counts it not, the node is still due
                log.warning("recreation of spill node %s not stored (%s: %s): a restarted scheduler will not "
                            "count it", name, type(exc).__name__, exc)
        log.warning("spill node %s is dead (%s): creating it again on its directory (%d of at most %d within %g s)",
                    name, why, len(self._window(name)), self.policy.max_per_window, self.policy.window_s)
        self.handles[name] = self.recipe.create(name)
        return self.handles[name]

    def info(self, name: str) -> dict[str, Any]:
        """``recreations`` (since the scheduler started), of those ``after_owner_died`` (not
        counted against the cap; present when > 0) and, while ``name`` is dead and another
        recreation is due, ``next_recreation_s`` (seconds from now)."""
        out: dict[str, Any] = {"recreations": self.totals.get(name, 0)}
        if self.uncounted.get(name):
            out["after_owner_died"] = self.uncounted[name]
        at = self.next_at(name)
        if at is not None:
            out["next_recreation_s"] = round(max(at - self.clock(), 0.0), 1)
        return out

    def describe(self, name: str) -> str:
        """"" or "; recreated N times (M after its owner died), next try in S s" for ``kvstrata
        status``."""
        info = self.info(name)
        if not info["recreations"] and "next_recreation_s" not in info:
            return ""
        text = f"; recreated {info['recreations']} times" if info["recreations"] else ";"
        if info.get("after_owner_died"):
            text += f" ({info['after_owner_died']} after its owner died)"
        if "next_recreation_s" in info:
            text += f"{',' if info['recreations'] else ''} next try in {info['next_recreation_s']:g} s"
        return text
