"""A holder whose block reports the scheduler keeps refusing backs off its full reports.

Regression: a refused batch (``GlobalScheduler.report_events`` over the holder's capacity bound)
sets ``BlockReporter.needs_resync``, and the holder answered with everything it held, with
``reset``, in each later batch: a refused holder of N blocks sent N events per batch for ever.
Now a resync after failed or refused full reports is due ``RESYNC_BACKOFF_S`` later, doubling
to ``RESYNC_BACKOFF_MAX_S``; the holder sends its plain events meanwhile (``resyncs_deferred``),
and an applied reset ends the back-off. Refused plain batches never lengthen it (diff review
s35 F1: they did, and a holder reporting more often than the back-off was never due a resync).

Real parts: a ``GlobalScheduler`` (its index and capacity bound) over a tmp state dir, a
``SpillNode`` over a ``SpillStore`` in tmp_path, and the reporter's own thread and queue; only
the Ray hop is left out (``_call`` calls ``report_events`` directly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.block_reports import RESYNC_BACKOFF_MAX_S, BlockReporter
from services.global_scheduler import GlobalScheduler, IndexHolders
from services.spill_node import SpillNode
from tests.test_spill_store import DISK, FMT, hashes_of, make_blocks

CAPACITY = 3


class Direct(BlockReporter):
    """A reporter whose calls reach the scheduler object itself (no Ray), counting what it offers."""

    def __init__(self, scheduler: GlobalScheduler, **kwargs: Any) -> None:
        super().__init__(None, **kwargs)
        self.gs, self.offered, self.calls = scheduler, 0, []

    def _send(self, holder, events, reset):  # type: ignore[no-untyped-def]
        self._handle = self.gs  # resolved (no ActorRef to look up)
        super()._send(holder, events, reset)

    def _call(self, holder: str, events: list, reset: bool) -> int:
        self.offered += len(events)
        self.calls.append((len(events), reset))
        return self.gs.report_events(holder, events, reset)


def setup(tmp_path: Path, **kwargs: Any) -> tuple[GlobalScheduler, Direct, SpillNode]:
    gs = GlobalScheduler(str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={"s0": CAPACITY}))
    report = Direct(gs, **kwargs)
    node = SpillNode(tmp_path / "spill", FMT, 1 << 30, DISK, node_id="s0", event_sink=report, lock_wait_s=0)
    assert report.flush(30.0)  # its start-up report (an empty reset) applied: the next batch is plain
    assert report.calls == [(0, True)]
    return gs, report, node


def put(node: SpillNode, report: Direct, i: int, n: int = 1) -> None:
    node.put(hashes_of(range(i, i + n)), make_blocks(range(i, i + n)), "tenant:a")
    assert report.flush(30.0)


def test_a_refused_holder_does_not_resend_all_it_holds_with_every_batch(tmp_path: Path) -> None:
    """5 blocks over a capacity of 3 are refused; 20 single-block puts followed. Before: each
    sent the whole store with ``reset`` (6, 7, ..., 25 events: 310 offered, every one refused).
    Now the plain events go (1 each) within the first back-off."""
    gs, report, node = setup(tmp_path)
    try:
        put(node, report, 0, 5)
        assert report.needs_resync and gs.refused_reports["over_capacity"] == 1
        offered = report.offered
        for i in range(5, 25):
            put(node, report, i)
        assert report.offered - offered < 60, report.calls
        assert report.counters["resyncs_deferred"] >= 10
    finally:
        report.close()
        node.close()


def test_resyncs_back_off_exponentially_to_a_cap_and_an_applied_reset_ends_it(tmp_path: Path) -> None:
    now = [0.0]
    gs, report, node = setup(tmp_path, clock=lambda: now[0])
    try:
        put(node, report, 0, 5)  # a plain batch refused: the next report is the reset, at once
        assert report.backoff_s() == 0.0 and report.resync_due()
        put(node, report, 5)  # all it holds (6, over capacity), refused: 1 failure
        assert report.calls[-1] == (6, True) and report.backoff_s() == 1.0 and not report.resync_due()
        put(node, report, 6)  # a plain batch meanwhile (1 event, within capacity: applied)
        assert report.calls[-1] == (1, False) and report.needs_resync
        waits = []
        for k in range(10):  # each due resync (the whole store, over capacity) is refused again
            now[0] += report.backoff_s()
            assert report.resync_due()
            put(node, report, 100 + k)
            assert report.calls[-1] == (8 + k, True)
            waits.append(report.backoff_s())
        assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0, 60.0, 60.0]
        assert RESYNC_BACKOFF_MAX_S == 60.0
        before = len(report.calls)
        now[0] += 59.0
        for k in range(5):  # not yet due: plain batches only
            put(node, report, 200 + k)
        assert all(not reset for _, reset in report.calls[before:])

        node.drop_namespace("tenant:a")  # the holder shrinks within capacity
        node.put(hashes_of([300]), make_blocks([300]), "tenant:b")
        assert report.flush(30.0)
        now[0] += report.backoff_s()
        node.put(hashes_of([301]), make_blocks([301]), "tenant:b")  # due: the whole store, applied
        assert report.flush(30.0)
        assert report.calls[-1] == (2, True)
        assert not report.needs_resync and report.backoff_s() == 0.0
        assert gs.index.pairs_after("s0", [], False) == 2
    finally:
        report.close()
        node.close()


def test_refused_plain_batches_do_not_put_off_the_resync_for_ever(tmp_path: Path) -> None:
    """Diff review s35 F1: one lost batch left the index over-counting a holder at its bound
    (4 of 4); each later plain batch was refused ``over_capacity``, and each refusal pushed the
    resync out again, so a holder reporting every 0.5 s never sent one in 10 minutes: its index
    stayed wrong and every event was refused (1,200 refusals). Before the back-off, the next
    batch was the reset; now too."""
    now = [0.0]
    gs = GlobalScheduler(str(tmp_path / "state"), {"n0": 1}, holders=IndexHolders(spill_blocks={"s0": 4}))

    class Flaky(Direct):
        fail_next = False

        def _call(self, holder: str, events: list, reset: bool) -> int:
            if self.fail_next:
                self.fail_next = False
                self.calls.append((len(events), reset))
                raise TimeoutError("transient: the scheduler call timed out")
            return super()._call(holder, events, reset)

    report = Flaky(gs, clock=lambda: now[0])
    node = SpillNode(tmp_path / "spill", FMT, 1 << 30, DISK, node_id="s0", event_sink=report, lock_wait_s=0)
    try:
        put(node, report, 0, 4)
        assert gs.index.pairs_after("s0", [], False) == 4
        report.fail_next = True
        node.drop_namespace("tenant:a")  # its 4 "removed" lost
        assert report.flush(30.0) and report.needs_resync
        first = len(report.calls)
        for k in range(240):  # 2 minutes of a holder of 0-1 blocks
            now[0] += 0.5
            node.put(hashes_of([100 + k]), make_blocks([100 + k]), f"tenant:b{k}")
            assert report.flush(30.0)
            node.drop_namespace(f"tenant:b{k}")
            assert report.flush(30.0)
        assert report.calls[first][1], report.calls[first:first + 3]  # the next call was the reset
        assert gs.index.pairs_after("s0", [], False) == 0 and not report.needs_resync
        assert gs.refused_reports["over_capacity"] == 0
    finally:
        report.close()
        node.close()
