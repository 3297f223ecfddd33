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
import threading
import time

import numpy as np
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
        self.refuse_next = False

    async def report_events(self, holder_id: str, events: list, reset: bool = False) -> int:
        await asyncio.sleep(random.random() * 0.01)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the scheduler refused it")
        if self.refuse_next:  # as ``GlobalScheduler.report_events`` refuses a batch: nothing applied, 0
            self.refuse_next = False
            return 0
        self.calls.append((holder_id, events, reset))
        return len(events)

    def fail_once(self) -> None:
        self.fail_next = True

    def refuse_once(self) -> None:
        self.refuse_next = True

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
    report = Blocked(max_pending=3)
    report("n9", [])  # in flight, waiting
    deadline = time.monotonic() + 30  # (regression: on a loaded CI the sender had not taken it
    while not report._busy and time.monotonic() < deadline:  # yet, so it was one of the queued)
        time.sleep(0.01)
    for i in range(5):  # two holders' batches alternate: none extends another
        report(f"n{i % 2}", [("stored", bytes([i]) * 32, "device")])
    assert report.counters["dropped_events"] == 2 and report.needs_resync
    copy = pickle.loads(pickle.dumps(BlockReporter(Recorder.remote(), max_pending=3)))  # an actor's argument
    assert isinstance(copy, BlockReporter) and copy.max_pending == 3 and copy.counters["sent_calls"] == 0
    report.close()
    report.go.set()


def test_one_holders_batch_is_bounded_too_and_a_reset_alone_goes_whole() -> None:
    """Review s34 B F8: a holder's batches extend its last pending one, and only batches past
    the first were ever dropped, so a node's or spill node's reporter (one holder each) queued
    without bound while a call was in flight (24,500 events at a bound of 1,000). Now its one
    batch is dropped past the bound (a full report then asked for); a reset alone, what the
    holder holds, goes out whole."""
    report = Blocked(max_pending=3)
    report("n0", [])  # in flight, waiting
    deadline = time.monotonic() + 30
    while not report._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(10):
        report("n0", [("stored", bytes([i]) * 32, "device")])
        assert report._queued <= 3
    assert report.counters["dropped_events"] == 8 and report.needs_resync  # (4 at once, twice)
    full = [("stored", bytes([i]) * 32, "device") for i in range(5)]
    report("n0", full, reset=True)  # its full report, past the bound alone
    assert not report.needs_resync and report._queued == 5
    report.go.set()
    assert report.flush(30.0)
    assert report.sent[-1] == ("n0", full, True)
    report.close()


def test_a_batch_the_scheduler_refuses_asks_for_a_full_report() -> None:
    """Review s34 B F8: a batch ``report_events`` refused (0 applied: malformed, over capacity)
    counted as sent and left the index wrong; it is a lost batch now (``needs_resync``)."""
    recorder = Recorder.remote()
    ray.get(recorder.refuse_once.remote())
    report = BlockReporter(recorder)
    report("s0", [("stored", b"a" * 32, "spill_ram")])
    assert report.flush(30.0)
    assert report.needs_resync and report.counters["dropped_events"] == 1
    assert report.counters["sent_calls"] == 0
    report("s0", [], reset=True)  # an empty reset applies 0 events: not a refusal
    assert report.flush(30.0) and not report.needs_resync and report.counters["sent_calls"] == 1
    report.close()


class Blocked(BlockReporter):
    """A reporter whose calls wait for ``go`` (a slow or restarting scheduler) and may fail."""

    def __init__(self, fail: bool = False, max_pending: int = 1 << 20) -> None:
        super().__init__(None, max_pending=max_pending)
        self.go, self.fail, self.sent = threading.Event(), fail, []

    def _send(self, holder, events, reset):  # type: ignore[no-untyped-def]
        self.go.wait(30)
        if self.fail:
            raise RuntimeError("ActorDiedError: the scheduler is gone")
        self.sent.append((holder, list(events), reset))


def test_what_queues_behind_a_slow_call_goes_out_as_one_call_without_rejoining() -> None:
    """Review 25c (2): batches queued behind one slow call were joined anew at each take under
    the lock the step thread waits on (O(n^2): 9.2 s stalls at 30k batches). Each batch now
    extends the one it follows as it is queued."""
    report = Blocked()
    report("n0", [("stored", b"0" * 32, "device")])  # in flight, waiting
    deadline = time.monotonic() + 30
    while not report._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(1, 30_001):
        report("n0", [("stored", i.to_bytes(32, "big"), "device")])
    assert len(report._pending) == 1 and report._queued == 30_000
    report.go.set()
    assert report.flush(30.0)
    assert [len(events) for _, events, _ in report.sent] == [1, 30_000]
    report.close()


def test_a_lost_report_asks_for_a_full_one_and_failures_are_logged_sparingly(caplog) -> None:
    """Review 25c (3, 4): the index caps each holder at its capacity, so a lost batch of
    removals left entries that made the holder's honest batches refused for as long as it
    lived. A loss now sets ``needs_resync`` until the holder reports everything with
    ``reset``; a dead scheduler's failures are logged the 1st, 2nd, 4th, ... time."""
    report = Blocked(fail=True)
    report.go.set()
    with caplog.at_level("WARNING", logger="services.block_reports"):
        for i in range(8):
            report("n0", [("removed", bytes([i]) * 32, "device")])
            assert report.flush(30.0)
    assert report.needs_resync and report.counters["failed_calls"] == 8
    assert report.counters["dropped_events"] == 8
    assert len([r for r in caplog.records if "not reported" in r.getMessage()]) == 4  # 1, 2, 4, 8
    report.fail = False
    report("n0", [("stored", b"k" * 32, "device")], reset=True)
    assert not report.needs_resync and report.flush(30.0)
    assert report.sent == [("n0", [("stored", b"k" * 32, "device")], True)]
    report.close()


def test_a_spill_node_answers_a_lost_report_with_all_it_holds(tmp_path) -> None:
    """The spill node's side of review 25c (3): after a loss its next push is its whole store,
    with ``reset``."""
    from cache_node.tiers.spill_format import BlockFormat
    from services.spill_node import SpillNode

    class Sink:
        needs_resync = False

        def __init__(self) -> None:
            self.calls: list = []

        def __call__(self, holder, events, reset=False):  # type: ignore[no-untyped-def]
            self.calls.append((holder, events, reset))
            if reset:
                self.needs_resync = False

    fmt = BlockFormat((2, 2, 4, 1, 8), "float32", "fp32")
    sink = Sink()
    node = SpillNode(tmp_path / "spill", fmt, 1 << 20, 1 << 22, node_id="s0", event_sink=sink)
    blocks = np.zeros((3, *fmt.shape), dtype=np.float32)
    node.put([bytes([i]) * 32 for i in range(3)], blocks, "tenant:a")
    assert sink.calls[-1][2] is False and len(sink.calls[-1][1]) == 3
    sink.needs_resync = True  # the reporter lost a call
    node.put([b"\x09" * 32], blocks[:1], "tenant:a")
    _, events, reset = sink.calls[-1]
    assert reset and sorted(h for _, h, _ in events) == sorted([bytes([i]) * 32 for i in (0, 1, 2, 9)])
    assert {e for e, _, _ in events} == {"stored"}


def test_a_cache_node_answers_a_lost_report_with_its_device_and_host_blocks() -> None:
    """The cache node's side of review 25c (3): after a loss, the step thread's next report is
    every block of its device and host tiers (``LLMEngine.tier_block_hashes``), with ``reset``."""
    from services.cache_node import CacheNodeActor

    class Engine:
        def tier_block_hashes(self) -> list[tuple[bytes, str]]:
            return [(b"d" * 32, "device"), (b"h" * 32, "host")]

    node = object.__new__(CacheNodeActor)  # its reporting alone: no model, no Ray
    node.engine, node._reporter = Engine(), Blocked()
    node._reporter.go.set()
    node._report_blocks("n0", [("stored", b"x" * 32, "device")])
    node._reporter.needs_resync = True
    node._report_blocks("n0", [("removed", b"x" * 32, "device")])
    assert node._reporter.flush(30.0)
    assert node._reporter.sent[-1] == ("n0", [("stored", b"d" * 32, "device"), ("stored", b"h" * 32, "host")], True)
    node._reporter.close()
