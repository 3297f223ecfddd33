"""A restarted global scheduler goes on counting a spill node's recreations from the tenant store
(``services.spill_recreate``, ``tenants.store_spill``).

Regression (s39): the recreations within the window lived in the scheduler's memory only, so a
spill node that crashed in a loop together with scheduler restarts was created again without
bound: each restarted scheduler saw no recreation, no cap and the first backoff. Real parts: the
plain ``GlobalSchedulerService`` over its ``tenants.sqlite`` (its recreator is what the actor's
constructor makes), the store reopened as a restarted actor reopens it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.global_scheduler_admission import GlobalSchedulerService
from services.spill_recreate import RecreatePolicy, SpillRecreator
from tenants.store import TenantStore
from tenants.store_spill import MAX_RECREATIONS_KEPT


class _Recipe:
    """Records the nodes created instead of creating actors (the recreator's only use of it)."""

    def __init__(self) -> None:
        self.made: list[str] = []

    def create(self, name: str) -> None:
        self.made.append(name)


def _started(state_dir: Path, recipe: _Recipe, policy: RecreatePolicy,
             before: GlobalSchedulerService | None = None,
             restarts: int | None = None) -> tuple[GlobalSchedulerService, SpillRecreator]:
    """A scheduler (re)started on ``state_dir`` and its recreator; ``before``, the process it
    replaces, is gone first (its store closed). ``restarts``: Ray's count of the actor's
    restarts (``actor_restarts``, which the actor's constructor reads; None: 0 at a first start,
    1 after ``before``); 0 is a first start, ``kvstrata up``."""
    if before is not None:
        before.store.close()
    scheduler = GlobalSchedulerService(str(state_dir), {"n0": 1})
    scheduler.restarts = (0 if before is None else 1) if restarts is None else restarts
    return scheduler, scheduler._spill_recreator(recipe, policy)  # type: ignore[arg-type]


def test_a_restarted_scheduler_keeps_the_cap_and_the_backoff(tmp_path: Path) -> None:
    """Two recreations, a restart: the third is due after the grown backoff (5 * 2^2 s), not the
    first; a third, a restart: capped (due an hour after the first) and the node not created."""
    recipe, policy = _Recipe(), RecreatePolicy(3, 3600.0, 5.0)
    process, first = _started(tmp_path, recipe, policy)
    first.seen("spill_node_0", "dead")
    first.recreate("spill_node_0", "dead: test")
    first.recreate("spill_node_0", "dead: test")

    process, second = _started(tmp_path, recipe, policy, process)
    second.seen("spill_node_0", "dead")
    assert second.next_at("spill_node_0") == pytest.approx(time.monotonic() + 20.0, abs=2.0)
    second.recreate("spill_node_0", "dead: test")

    process, third = _started(tmp_path, recipe, policy, process)
    third.seen("spill_node_0", "dead")
    assert not third.due("spill_node_0")
    assert third.info("spill_node_0")["next_recreation_s"] == pytest.approx(3600.0, abs=5.0)
    assert third.info("spill_node_0")["recreations"] == 0  # ``recreations``: this process's own
    assert recipe.made == ["spill_node_0"] * 3
    assert third.next_at("spill_node_1") is None  # another node: nothing kept for it
    process.store.close()


def test_kvstrata_down_and_up_start_the_count_afresh(tmp_path: Path) -> None:
    """A node capped in one deployment, then ``kvstrata down`` and ``up`` (a first start, no
    restart by Ray): its next death is met with the first backoff, not the previous
    deployment's cap; a later restart of that scheduler does not bring the old rows back.

    Regression (s39 review): every scheduler start loaded the stored recreations, so after a
    human's ``down``/``up`` (README: the way to start a capped node now) one more crash left
    the node dead for the rest of the hour."""
    recipe, policy = _Recipe(), RecreatePolicy(1, 3600.0, 5.0)
    process, first = _started(tmp_path, recipe, policy)
    first.seen("spill_node_0", "dead")
    first.recreate("spill_node_0", "dead: test")
    assert first.info("spill_node_0")["next_recreation_s"] == pytest.approx(3600.0, abs=5.0)  # capped

    process, up = _started(tmp_path, recipe, policy, process, restarts=0)
    up.seen("spill_node_0", "dead")
    assert up.next_at("spill_node_0") == pytest.approx(time.monotonic() + 5.0, abs=2.0)

    process, restarted = _started(tmp_path, recipe, policy, process)
    restarted.seen("spill_node_0", "dead")
    assert restarted.next_at("spill_node_0") == pytest.approx(time.monotonic() + 5.0, abs=2.0)
    process.store.close()


def test_the_store_keeps_the_window_and_a_bounded_history(tmp_path: Path) -> None:
    """Rows older than the window asked for are dropped on load; at most
    ``MAX_RECREATIONS_KEPT`` rows per node are kept (the newest); they survive reopening."""
    store = TenantStore(tmp_path / "tenants.sqlite")
    now = time.time()
    store.add_spill_recreation("a", now - 4000.0)
    for i in range(MAX_RECREATIONS_KEPT + 3):
        store.add_spill_recreation("b", now - 100.0 + i)
    store.close()
    store = TenantStore(tmp_path / "tenants.sqlite")
    try:
        history = store.load_spill_recreations(now - 3600.0)
        assert list(history) == ["b"]
        assert history["b"] == [now - 100.0 + i for i in range(3, MAX_RECREATIONS_KEPT + 3)]
        assert store.load_spill_recreations(0.0) == history  # the old row was deleted, not hidden
    finally:
        store.close()


def test_a_recreation_the_store_cannot_keep_still_happens(tmp_path: Path) -> None:
    """A store write that fails (here: the store closed) is logged; the node is created all the
    same and counted in this process's window."""
    scheduler = GlobalSchedulerService(str(tmp_path), {"n0": 1})
    recipe = _Recipe()
    recreator = scheduler._spill_recreator(recipe, RecreatePolicy(1, 3600.0, 0.0))  # type: ignore[arg-type]
    scheduler.store.close()
    recreator.seen("spill_node_0", "dead")
    recreator.recreate("spill_node_0", "dead: test")
    assert recipe.made == ["spill_node_0"] and not recreator.due("spill_node_0")
