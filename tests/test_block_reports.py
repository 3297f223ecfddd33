"""BlockReporter: block events reach an async Ray actor in the order they happened.

Regression: cache and spill nodes called the GlobalScheduler's ``report_events`` fire-and-forget,
and Ray runs an async actor's calls in no guaranteed order. A spill node's start-up reset was
applied after its first stores and wiped them from the index: ``test_tier_ray``'s sharded round
trip saw 7 of 19 blocks indexed, for good, in about one run of three.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from services.block_reports import BlockReporter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_cluster):
    yield


@ray.remote(num_cpus=0)
class Recorder:
    """An async actor whose ``report_events`` takes a random while: calls in flight together
    finish in any order, as the scheduler's may run."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list, bool]] = []
        self.fail_next = False

    async def report_events(self, holder: str, events: list, reset: bool = False) -> int:
        await asyncio.sleep(random.random() * 0.01)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the scheduler refused it")
        self.calls.append((holder, events, reset))
        return len(events)

    def fail_once(self) -> None:
        self.fail_next = True

    def got(self) -> list[tuple[str, list, bool]]:
        return self.calls


def test_events_arrive_in_order_with_the_reset_first() -> None:
    recorder = Recorder.remote()
    report = BlockReporter(recorder)
    report("s0", [], reset=True)
    sent = [("stored", bytes([i]) * 32, "spill_ram") for i in range(200)]
    for event in sent:
        report("s0", [event])
    assert report.flush(30.0)
    calls = ray.get(recorder.got.remote())
    assert calls[0][2] and not any(reset for _, _, reset in calls[1:])  # the reset went first
    assert [tuple(e) for _, events, _ in calls for e in events] == sent  # every one, in order
    assert report.counters["failed_calls"] == 0 and report.counters["sent_events"] == 200
    report.close()


def test_a_reset_drops_what_was_queued_before_it_and_a_failed_call_is_dropped_alone() -> None:
    recorder = Recorder.remote()
    ray.get(recorder.fail_once.remote())
    report = BlockReporter(recorder)
    report("s0", [("stored", b"a" * 32, "spill_ram")])  # refused: dropped, counted
    assert report.flush(30.0)
    report("s0", [("stored", b"b" * 32, "spill_ram")])
    report("s0", [("stored", b"c" * 32, "spill_ram")], reset=True)
    assert report.flush(30.0)
    calls = ray.get(recorder.got.remote())
    assert calls[-1] == ("s0", [("stored", b"c" * 32, "spill_ram")], True)
    assert report.counters["failed_calls"] == 1 and report.counters["dropped_events"] == 1
    report.close()


def test_past_its_bound_the_oldest_batches_are_dropped_and_it_pickles_as_a_new_reporter() -> None:
    report = BlockReporter(Recorder.remote(), max_pending=3)
    report.close()  # nothing is sent: the queue is only filled
    for i in range(5):
        report("n0", [("stored", bytes([i]) * 32, "device")])
    assert report.counters["dropped_events"] == 2
    copy = pickle.loads(pickle.dumps(report))  # an actor's constructor argument
    assert isinstance(copy, BlockReporter) and copy.max_pending == 3 and copy.counters["sent_calls"] == 0
    copy.close()
