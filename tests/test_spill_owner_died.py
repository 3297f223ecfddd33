"""A spill node that died only because its owner died (the global scheduler that created it again,
``detached`` off) is created again at once and not counted against ``spill_recreate_max``; a node
that dies on its own is still counted and capped (``services.spill_recreate``).

Regression (s41): the restarted scheduler met such a node as any dead one: created again after
the backoff and counted, so ``spill_recreate_max`` scheduler crashes within the window left the
spill tier dead for up to ``spill_recreate_window_s`` although the node itself never failed.
Real parts: a ``GlobalSchedulerActor`` Ray restarts (``max_restarts``), the spill node it
creates on its directory (a ``SpillNode`` actor it owns), Ray's record of why that node died.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from services.global_scheduler import IndexHolders
from services.global_scheduler_admission import GlobalSchedulerActor
from services.global_scheduler_recovery import RecoveryPeers
from services.spill_recreate import RecreatePolicy, SpillRecipe, SpillRecreator
from tests.test_spill_status import NAMESPACE, POLL_S, _indexed
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks


def _node_state(scheduler: Any, name: str, done: Any, within_s: float = 60.0) -> dict[str, Any]:
    """The scheduler's state of spill node ``name`` once ``done(state)``; fails at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = ray.get(scheduler.stats.remote(), timeout=30)["spill_nodes"][name]
        except ray.exceptions.RayActorError:  # being restarted
            state = {}
        if state and done(state):
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


def _restarted(scheduler: Any, within_s: float = 60.0) -> None:
    """Returns once the scheduler's restarted process answers."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if ray.get(scheduler.health.remote(), timeout=30)["restarts"] >= 1:
                return
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_a_spill_node_dead_with_its_scheduler_is_created_again_at_once_uncounted(
        tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """The launcher's node killed: the scheduler creates it again, counted, which spends the cap
    (1 per hour). The scheduler's process is killed and Ray restarts it: the node it owned died
    with it, and the restarted scheduler creates it again at once, its disk blocks served and
    indexed (``recreations`` 1: this process's own). Then the node itself is killed: capped, not created
    again. Before: the restarted scheduler left the node dead, capped ("next try in ~3600 s")."""
    name = f"spill-owner-{tmp_path.name}"[-60:]
    sched_name = f"sched-{name}"[-60:]
    recipe = SpillRecipe(((name, str(tmp_path / "spill" / "0")),), FMT, 0, DISK, NAMESPACE, sched_name)
    peers = RecoveryPeers(NAMESPACE, (name,), spill_recipe=recipe, spill_recreate=RecreatePolicy(1, 3600.0, 0.0),
                          start_grace_s=0.0)
    first = recipe.create(name)  # as the launcher's (owned by this driver), before the scheduler
    ray.get(first.ready.remote(), timeout=60)
    scheduler = GlobalSchedulerActor.options(name=sched_name, namespace=NAMESPACE, num_cpus=0, max_restarts=1).remote(
        str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={name: 1 << 12}), peers=peers,
        spill_poll_s=POLL_S)
    try:
        _node_state(scheduler, name, lambda s: s["state"] == "serving")
        assert ray.get(first.put.remote(hashes_of([1, 2]), make_blocks([1, 2]), "tenant:a"), timeout=30) == 2
        ray.kill(first, no_restart=True)  # the scheduler creates it again, counted: the cap (1) is spent
        _node_state(scheduler, name, lambda s: s["state"] == "serving" and s.get("recreations") == 1)
        node = ray.get_actor(name, namespace=NAMESPACE)  # owned by the scheduler's process

        ray.kill(scheduler, no_restart=False)  # its process dies; Ray restarts it
        _restarted(scheduler)
        state = _node_state(scheduler, name, lambda s: s["state"] == "serving", within_s=25.0)
        assert state.get("recreations") == 1 and "next_recreation_s" not in state, state
        again = ray.get_actor(name, namespace=NAMESPACE)
        assert again._actor_id != node._actor_id
        hits = ray.get(again.get.remote(hashes_of([1, 2])), timeout=30)
        assert hits.hashes == hashes_of([1, 2]) and (hits.blocks == make_blocks([1, 2])).all()
        assert _indexed(scheduler, 2, tier="spill_disk") == 2  # back in the restarted scheduler's index

        ray.kill(again, no_restart=True)  # its own death: counted; the cap (1) was spent before
        state = _node_state(scheduler, name, lambda s: s["state"] == "dead" and "next_recreation_s" in s)
        assert state["next_recreation_s"] > 3500, state
    finally:
        ray.kill(scheduler, no_restart=True)
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


def test_an_owners_death_is_due_at_once_and_uncounted_an_own_death_is_capped() -> None:
    """``SpillRecreator``: a node dead with its owner is due at once even past its cap (1 within
    the window, spent), its recreation neither counted nor stored; its next own death backs off
    and is capped as before. Before: ``seen`` took no cause, the node waited out the cap."""
    now = [100.0]
    made: list[str] = []
    stored: list[str] = []

    class Recipe:  # records instead of creating an actor
        def create(self, name: str) -> None:
            made.append(name)

    recreator = SpillRecreator(Recipe(), RecreatePolicy(1, 1000.0, 5.0), history={"s0": [time.time() - 10.0]},  # type: ignore[arg-type]
                               on_recreate=lambda name, _at: stored.append(name), clock=lambda: now[0])
    recreator.seen("s0", "dead", owner_died=True)
    assert recreator.due("s0") and recreator.next_at("s0") == 100.0
    recreator.recreate("s0", "dead: its owner died")
    assert made == ["s0"] and stored == []
    assert recreator.info("s0") == {"recreations": 1, "after_owner_died": 1, "next_recreation_s": 990.0}
    recreator.seen("s0", "serving")
    assert recreator.describe("s0") == "; recreated 1 times (1 after its owner died)"
    recreator.seen("s0", "dead")  # its own death: the stored one still caps it
    assert not recreator.due("s0") and recreator.next_at("s0") == pytest.approx(1090.0)
    never = SpillRecreator(Recipe(), RecreatePolicy(0, 1.0, 0.0))  # type: ignore[arg-type]
    never.seen("s0", "dead", owner_died=True)  # 0: never recreated, whatever the cause
    assert not never.due("s0")


def test_a_failed_try_after_an_owners_death_backs_off_uncapped() -> None:
    """A try to create a node dead with its owner that fails (Ray: the name still taken, the GCS
    unreachable) is retried as one after an owner's death: backed off (``backoff_s``, doubling),
    neither capped nor stored. Regression (s41 review r6): the failed try cleared the cause, and
    with the cap spent the next try was due in ~3600 s, the spill tier dead meanwhile."""
    now = [100.0]
    fail = [2]
    stored: list[str] = []

    class Recipe:  # fails its first ``fail[0]`` calls, as Ray refusing a name still taken
        def create(self, name: str) -> str:
            if fail[0]:
                fail[0] -= 1
                raise ValueError(f"The name {name} (namespace kv) is already taken")
            return f"handle of {name}"

    recreator = SpillRecreator(Recipe(), RecreatePolicy(1, 3600.0, 5.0), history={"s0": [time.time() - 10.0]},  # type: ignore[arg-type]
                               on_recreate=lambda name, _at: stored.append(name), clock=lambda: now[0])
    recreator.seen("s0", "dead", owner_died=True)
    for wait_s in (5.0, 10.0):  # each failure backs the next try off, doubling
        assert recreator.due("s0")
        with pytest.raises(ValueError):
            recreator.recreate("s0", "dead: its owner died")
        recreator.seen("s0", "dead")  # the watch's next rounds: still the same dead spell
        assert not recreator.due("s0") and recreator.next_at("s0") == now[0] + wait_s
        now[0] += wait_s
    assert recreator.due("s0") and recreator.recreate("s0", "dead: its owner died") == "handle of s0"
    assert stored == [] and recreator.info("s0")["after_owner_died"] == 3
    recreator.seen("s0", "serving")
    recreator.seen("s0", "dead")  # its own death: the stored recreation still caps it
    assert not recreator.due("s0") and recreator.next_at("s0") > now[0] + 3500


OTHER_JOB = """
import sys, time, ray
ray.init(address=sys.argv[1], namespace=sys.argv[2], logging_level="ERROR")

@ray.remote(num_cpus=0)
class Held:
    def ping(self):
        return 1

@ray.remote(num_cpus=0)
class Owner:
    def make(self, name):
        self.held = Held.options(name=name, lifetime=None).remote()
        return ray.get(self.held.ping.remote())

owner = Owner.remote()
ray.get(owner.make.remote(sys.argv[3]))
ray.kill(owner)  # its child, named like a spill node, dies "owner died"
for _ in range(100):
    try:
        ray.get_actor(sys.argv[3], namespace=sys.argv[2])
    except ValueError:
        break
    time.sleep(0.1)
"""


def test_another_jobs_owner_died_record_is_not_this_nodes(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A dead actor record of another Ray job (an earlier ``kvstrata up``: ``kvstrata down``
    kills the scheduler first, so a node it had created again dies "owner died") is never read
    as this deployment's node's: ``died_with_owner`` reads this job's dead actors only.

    Regression (s41 review r6): it read every job's dead actors, so the next deployment's watch
    met the name dead with the earlier one's record newest and created the node again at once,
    uncounted (and the read's cost grew with every job's dead actors)."""
    import subprocess
    import sys

    from services.spill_watch import died_with_owner

    name = f"spill_node_other_job_{time.monotonic_ns()}"
    namespace = f"{NAMESPACE}_other_job"
    address = ray.get_runtime_context().gcs_address
    script = tmp_path / "other_job.py"
    script.write_text(OTHER_JOB)
    done = subprocess.run([sys.executable, str(script), address, namespace, name],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not died_with_owner(name, namespace)
