"""Stopping a deployment (``stop_services``) or undoing a failed start (``_kill_placed``) leaves
no spill node behind that the global scheduler's spill watch created again meanwhile.

Since b040d7b the scheduler creates a spill node with no live actor again
(``services.spill_recreate``; detached, as ``kvstrata up``'s). ``ray.kill`` returns before the
actor is dead, so a spill node the scheduler created after the launcher's kills of the spill
nodes, before it died itself, outlived the stop: its name and its directory's lock taken, the
next start there failed on the name. Here a stand-in scheduler (``tests.ray_actors.
WatchingScheduler``) creates ``spill_node_0`` again whenever no actor holds that name. Whether
it wins that race depends on which of two kills Ray carries out first, so each test also records,
at every ``ray.kill`` the stop makes (the real one, called through), whether the scheduler was
still alive: the scheduler is killed first and every other kill finds it dead. (Measured here,
``ray.get_actor`` raises for an actor at once after ``ray.kill`` returns: the window is that of
its process's exit.)
"""

from __future__ import annotations

import contextlib
import time

import ray

from services.config import ServiceConfig
from services.launcher import SCHEDULER_NAME, Services, _kill_placed, stop_services
from tests.ray_actors import NameHolder, WatchingScheduler

SETTLE_S = 1.0
"""How long after the stop a spill node created again meanwhile is looked for (the stand-in's
watch polls every 10 ms; its process, when alive, creates one within that)."""


def _deployment(namespace: str) -> tuple:  # type: ignore[type-arg]
    scheduler = WatchingScheduler.options(name=SCHEDULER_NAME, namespace=namespace,
                                          lifetime="detached").remote(namespace, "spill_node_0")
    spill = NameHolder.options(name="spill_node_0", namespace=namespace, lifetime="detached").remote()
    ray.get([scheduler.__ray_ready__.remote(), spill.ping.remote()], timeout=60)
    return scheduler, spill


class KillOrder:
    """``ray.kill``, called through, noting for each kill after the scheduler's whether the
    scheduler (``SCHEDULER_NAME`` of ``namespace``) was still alive then."""

    def __init__(self, namespace: str) -> None:
        self.namespace, self.kill, self.kills = namespace, ray.kill, []  # (name or actor id, scheduler alive)

    def __call__(self, actor, no_restart: bool = True) -> None:  # type: ignore[no-untyped-def]
        self.kills.append((actor._actor_id.hex(), self._scheduler_alive()))
        self.kill(actor, no_restart=no_restart)

    def _scheduler_alive(self) -> bool:
        try:
            ray.get_actor(SCHEDULER_NAME, namespace=self.namespace)
            return True
        except ValueError:
            return False

    def scheduler_first_then_dead(self, scheduler) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
        """The kills, marked as expected: the scheduler's first (``True``, alive), then each
        with the scheduler dead (``False``)."""
        return [(actor, i == 0 and actor == scheduler._actor_id.hex()) for i, (actor, _) in enumerate(self.kills)]


def _left(namespace: str) -> set[str]:
    time.sleep(SETTLE_S)
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def _clean(namespace: str) -> None:
    for name in (SCHEDULER_NAME, "spill_node_0"):
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace=namespace))


def test_stop_services_kills_a_spill_node_the_scheduler_created_again_meanwhile(
        ray_cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Regression (s38): ``stop_services`` killed the scheduler and, right after, the spill
    nodes by handle and by name; the scheduler, not dead yet, created ``spill_node_0`` again."""
    namespace = "kvstrata-stop-recreated"
    scheduler, spill = _deployment(namespace)
    gateway = NameHolder.options(namespace=namespace).remote()  # no stop(): the stop goes on
    services = Services(scheduler, {}, gateway, 0, "", ServiceConfig(namespace=namespace), [spill])
    order = KillOrder(namespace)
    monkeypatch.setattr(ray, "kill", order)
    try:
        stop_services(services)  # flush_durable starts the stand-in's watch
        assert order.kills == order.scheduler_first_then_dead(scheduler)
        assert _left(namespace) == set()
    finally:
        _clean(namespace)


def test_a_failed_start_kills_a_spill_node_the_scheduler_created_again_meanwhile(
        ray_cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Regression (s38): ``_kill_placed`` killed what the start placed by its handles; a spill
    node that died during the start and that the scheduler created again (another handle, the
    same name) lived on."""
    namespace = "kvstrata-failed-start-recreated"
    scheduler, spill = _deployment(namespace)
    ray.get(scheduler.watch.remote(), timeout=30)
    ray.kill(spill)  # died during the start: the stand-in's watch creates it again
    deadline = time.monotonic() + 30
    while ray.get(scheduler.recreated.remote(), timeout=30) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ray.get(ray.get_actor("spill_node_0", namespace=namespace).ping.remote(), timeout=30) == "other"
    order = KillOrder(namespace)
    monkeypatch.setattr(ray, "kill", order)
    try:
        _kill_placed({SCHEDULER_NAME: scheduler, "spill_node_0": spill}, namespace)
        assert order.kills == order.scheduler_first_then_dead(scheduler)
        assert _left(namespace) == set()
    finally:
        _clean(namespace)
