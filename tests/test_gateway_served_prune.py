"""The served-address records of gateways that died for good on their own are pruned at the
next gateway start.

Since 10d420a each gateway keeps where it served in Ray's GCS (``gateway_served.ServedRecord``,
key ``gateway_served/<actor id>``), deleted by ``down`` / ``stop_services`` (s38). Regression
(s39): a gateway that died for good on its own (its restarts used up, its node lost) kept its
record until the Ray cluster stopped. Now every gateway start prunes the records whose actor Ray
lists DEAD (``gateway_served.prune_dead``), and only those: an alive one's, one Ray has no record
of (another cluster's), one whose state cannot be read and a key that is no actor id stay.

The real ``RayGateway`` in-process without Ray (as ``test_gateway_restart_start``): the GCS
store is the harness's ``ClusterKeyValues`` and Ray's actor table a map of states; the same
pruning against real Ray states is in ``test_gateway_served_forget``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from bench.chaos_stack import tiny_checkpoint
from services import gateway_served, gateway_server
from services.global_scheduler_admission import GlobalSchedulerService
from tests.gateway_harness import LocalActor, cluster_key_values
from tests.test_gateway_restart_start import GATEWAY_ID, FakeContext, FakeNode, free_port

pytestmark = pytest.mark.timeout(60)

STATES = {"a" * 32: "DEAD", "b" * 32: "ALIVE", "c" * 32: "RESTARTING", "d" * 32: ""}
"""Actor id -> Ray's state ("": no record of it); ``e`` * 32's state read fails."""


class LiveContext(FakeContext):
    """Ray's runtime context inside a gateway actor that was not restarted."""

    was_current_actor_reconstructed = False


def _state_of(actor_id: str) -> str:
    if actor_id not in STATES:
        raise RuntimeError("the GCS did not answer")
    return STATES[actor_id]


def test_a_gateway_start_prunes_the_records_of_gateways_ray_lists_dead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = cluster_key_values(monkeypatch)
    record = json.dumps({"grpc": "10.0.0.9:50051", "http": "", "metrics": ""}).encode()
    kept = [gateway_served.record_key(i) for i in ("b" * 32, "c" * 32, "d" * 32, "e" * 32)]
    kept += [b"gateway_served/not-an-actor-id", b"gateway_served/" + b"A" * 32]
    for key in (gateway_served.record_key("a" * 32), *kept):
        store.put(key, record)
    monkeypatch.setattr(gateway_served, "actor_state", _state_of, raising=False)  # (none before)
    monkeypatch.setattr(gateway_server.ray, "get_runtime_context", LiveContext)

    async def go() -> None:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 1})
        gw = gateway_server.RayGateway(LocalActor(sched), {"n0": LocalActor(FakeNode())}, str(tiny_checkpoint()))
        try:
            await asyncio.wait_for(gw.start("127.0.0.1", free_port()), 20)
            deadline = time.monotonic() + 10
            while gateway_served.record_key("a" * 32) in store and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            await gw.stop(0)
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())
    own = gateway_served.record_key(GATEWAY_ID)
    assert sorted(store) == sorted([*kept, own]), sorted(store)


def test_every_record_is_looked_at_past_the_first_page() -> None:
    """1,500 records, the first 1,100 of live gateways: the 400 behind them whose actors Ray
    lists DEAD are pruned too, and each record's state is read once. Regression
    (s40): only the first 1,024 records listed were looked at: the dead ones behind the live
    ones stayed for good."""
    from tests.gateway_harness import ClusterKeyValues

    store = ClusterKeyValues()
    states = {f"{i:032x}": "ALIVE" if i < 1100 else "DEAD" for i in range(1500)}
    for actor_id in states:
        store.put(gateway_served.record_key(actor_id), b"{}")
    read: list[str] = []

    def state_of(actor_id: str) -> str:
        read.append(actor_id)
        return states[actor_id]

    pruned = gateway_served.prune_dead(store, state_of)
    assert sorted(pruned) == sorted(i for i, s in states.items() if s == "DEAD")
    assert sorted(store) == sorted(gateway_served.record_key(i) for i, s in states.items() if s == "ALIVE")
    assert sorted(read) == sorted(states)


def test_pages_smaller_than_the_records_keep_the_same_rules() -> None:
    """``page_size`` 2 over the rules' cases (dead, alive, restarting, unknown, unreadable, not
    an actor id), the dead ones on either side of a page's end: only they go."""
    from tests.gateway_harness import ClusterKeyValues

    store = ClusterKeyValues()
    order = ["a" * 32, "b" * 32, "c" * 32, "f" * 32, "d" * 32, "e" * 32, "0" * 32]
    states = {**STATES, "f" * 32: "DEAD", "0" * 32: "DEAD"}
    for actor_id in order:
        store.put(gateway_served.record_key(actor_id), b"{}")
    store.put(b"gateway_served/not-an-actor-id", b"{}")

    def state_of(actor_id: str) -> str:
        if actor_id not in states:
            raise RuntimeError("the GCS did not answer")
        return states[actor_id]

    assert gateway_served.prune_dead(store, state_of, page_size=2) == ["a" * 32, "f" * 32, "0" * 32]
    assert sorted(store) == sorted([*(gateway_served.record_key(i) for i in ("b" * 32, "c" * 32, "d" * 32, "e" * 32)),
                                    b"gateway_served/not-an-actor-id"])
