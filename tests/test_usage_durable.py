"""Usage counters survive the scheduler (``GetUsage`` after a crash or ``kvstrata down``/``up``).

Regression: ``UsageLedger`` lived only in the GlobalScheduler actor's memory, so a restarted
scheduler (``scheduler_max_restarts``) or a restarted service answered every tenant's usage
from zero. Now the scheduler stores the counters changed since its last flush in the tenant
store every ``USAGE_FLUSH_S`` (and ``stop_services`` flushes), and loads them at start.
Real parts: ``GlobalScheduler`` over its SQLite store in a state dir, reopened as a restart does.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec
from tenants.usage import COUNTERS, UsageLedger


def _scheduler(state: Path) -> GlobalScheduler:
    return GlobalScheduler(str(state), {"n0": 4})


def test_a_restarted_scheduler_answers_the_stored_usage(tmp_path: Path) -> None:
    """Before: the second scheduler on the same state dir answered zeros."""
    first = _scheduler(tmp_path)
    ann, _ = first.register_tenant(TenantSpec("ann"))
    bob, _ = first.register_tenant(TenantSpec("bob"))
    first.usage.record_request(ann.tenant_id)
    first.usage.record_prompt(ann.tenant_id, prompt_tokens=100, cached_tokens={"device": 64, "spill_disk": 16})
    first.usage.record_completion_tokens(ann.tenant_id, 42)
    first.usage.record_preempted(ann.tenant_id)
    first.usage.record_rejected(bob.tenant_id)
    first.usage.set_blocks_held(ann.tenant_id, 7)  # a gauge: not stored
    assert first.flush_usage() == 2 and first.flush_usage() == 0  # nothing changed since
    first.usage.record_completion_tokens(ann.tenant_id, 8)  # after the last flush: lost with the process
    expected = first.usage.snapshot(ann.tenant_id)
    first.store.close()

    second = _scheduler(tmp_path)
    usage = second.usage.snapshot(ann.tenant_id)
    assert (usage.requests, usage.prompt_tokens, usage.completion_tokens, usage.preempted) == (1, 100, 42, 1)
    assert usage.cached_tokens == expected.cached_tokens and usage.blocks_held == 0
    assert second.usage.snapshot(bob.tenant_id).rejected == 1
    second.usage.record_completion_tokens(ann.tenant_id, 1)  # counting goes on from there
    assert second.flush_usage() == 1
    second.store.close()
    assert _scheduler(tmp_path).usage.snapshot(ann.tenant_id).completion_tokens == 43


def test_a_deleted_tenants_usage_goes_with_it(tmp_path: Path) -> None:
    sched = _scheduler(tmp_path)
    ann, _ = sched.register_tenant(TenantSpec("ann"))
    sched.usage.record_request(ann.tenant_id)
    sched.flush_usage()
    sched.usage.record_request(ann.tenant_id)  # changed, then deleted before the next flush
    sched.delete_tenant("ann")
    assert sched.flush_usage() == 0
    assert sched.store.load_usage() == {}
    again, _ = sched.register_tenant(TenantSpec("ann"))  # a new tenant of that name starts at zero
    assert sched.usage.snapshot(again.tenant_id).requests == 0


def test_a_failed_write_is_retried_at_the_next_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sched = _scheduler(tmp_path)
    ann, _ = sched.register_tenant(TenantSpec("ann"))
    sched.usage.record_request(ann.tenant_id)

    def full(rows):  # type: ignore[no-untyped-def]
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as m:
        m.setattr(sched.store, "save_usage", full)
        with pytest.raises(sqlite3.OperationalError):
            sched.flush_usage()
    assert sched.flush_usage() == 1 and sched.store.load_usage()[ann.tenant_id]["requests"] == 1


def test_bad_stored_rows_are_skipped_whole(tmp_path: Path) -> None:
    """The store's file is ours, but a row that is not counters (edited, or from a later
    version) is never half applied: unreadable rows are set aside, unknown keys left out."""
    sched = _scheduler(tmp_path)
    ids = [sched.register_tenant(TenantSpec(n))[0].tenant_id for n in ("a", "b", "c", "d")]
    sched.store.save_usage({ids[0]: {"requests": 3}, ids[1]: {"requests": -1}, ids[2]: {"bogus": 1}})
    with sched.store._conn:
        sched.store._conn.execute("INSERT INTO usage VALUES (?, ?, 0)", (ids[3], "[1, 2]"))
    ledger = UsageLedger()
    assert ledger.restore(sched.store.load_usage()) == 2  # ids[2]: its known counters (none) are 0
    assert ledger.snapshot(ids[0]).requests == 3 and ledger.snapshot(ids[1]).requests == 0
    assert sorted(t for t, _, _ in sched.store.unread_usage()) == sorted([ids[1], ids[3]])


ROWS = {
    "later_counter": json.dumps({"requests": 1000, "prompt_tokens": 50000, "cached_tokens_remote": 7}),
    "float_count": json.dumps({"requests": 1000, "prompt_tokens": 50000.0}),
    "negative_count": json.dumps({"requests": 1000, "prompt_tokens": -1}),
    "bad_json": '{"requests": 1000, "prompt_tokens": 50000',
    "not_an_object": "[1000, 50000]",
}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_a_row_the_restart_could_not_read_is_not_overwritten_by_counts_from_zero(tmp_path: Path, kind: str) -> None:
    """Regression (review s35 D C1): a stored row the restarted scheduler skipped (a later
    version's counter, a count that is not a non-negative int, JSON it cannot parse) was
    replaced at the tenant's next flush by counts from zero: 1,000 stored requests became 1.
    Now a later version's keys are carried through (its known counters restored), and a row
    this code cannot read is moved whole to ``usage_unread``."""
    first = _scheduler(tmp_path)
    ann, _ = first.register_tenant(TenantSpec("ann"))
    with first.store._conn:
        first.store._conn.execute("INSERT INTO usage VALUES (?, ?, 0)", (ann.tenant_id, ROWS[kind]))
    first.store.close()

    second = _scheduler(tmp_path)  # the restart
    second.usage.record_request(ann.tenant_id)  # one more request, then the periodic flush
    assert second.flush_usage() == 1
    stored = json.loads(second.store._conn.execute("SELECT counters_json FROM usage WHERE tenant_id = ?",
                                                   (ann.tenant_id,)).fetchone()[0])
    if kind == "later_counter":
        assert stored["requests"] == 1001 and stored["prompt_tokens"] == 50000
        assert stored["cached_tokens_remote"] == 7 and second.store.unread_usage() == []
    else:
        assert stored["requests"] == 1 and stored["prompt_tokens"] == 0
        assert [(t, text) for t, text, _ in second.store.unread_usage()] == [(ann.tenant_id, ROWS[kind])]
    second.store.close()
    third = _scheduler(tmp_path)  # restarted again: the same, nothing moved twice
    assert third.usage.snapshot(ann.tenant_id).requests == (1001 if kind == "later_counter" else 1)
    assert len(third.store.unread_usage()) == (0 if kind == "later_counter" else 1)
    third.delete_tenant("ann")  # the set-aside row goes with its tenant
    assert third.store.unread_usage() == []


def test_counters_round_trip() -> None:
    ledger = UsageLedger()
    ledger.record_request("t", prompt_tokens=10, cached_tokens={"host": 3})
    ledger.record_completion_tokens("t", 5)
    row = ledger.take_dirty()["t"]
    assert set(row) == set(COUNTERS) and row["cached_tokens_host"] == 3
    other = UsageLedger()
    other.restore({"t": row})
    assert other.snapshot("t") == ledger.snapshot("t") and other.take_dirty() == {}


def test_overlapping_flushes_store_the_newest_counts(tmp_path: Path) -> None:
    """Review 24r F5: the periodic flush and stop's ran in two worker threads at once; the
    older snapshot committed last (5 requests in memory, 2 stored), and stop's flush found
    nothing dirty and returned while the periodic write was still under way. Now the second
    flush waits for the first, then stores what changed meanwhile."""
    import threading

    sched = _scheduler(tmp_path)
    ann, _ = sched.register_tenant(TenantSpec("ann"))
    for _ in range(2):
        sched.usage.record_request(ann.tenant_id)
    save, entered, release = sched.store.save_usage, threading.Event(), threading.Event()

    def slow_save(rows):  # type: ignore[no-untyped-def]
        if not entered.is_set():  # the periodic flush's write, held up
            entered.set()
            assert release.wait(10)
        return save(rows)

    sched.store.save_usage = slow_save  # type: ignore[method-assign]
    periodic = threading.Thread(target=sched.flush_usage)
    periodic.start()
    assert entered.wait(10)
    for _ in range(3):
        sched.usage.record_request(ann.tenant_id)
    stopping = threading.Thread(target=sched.flush_usage)  # stop's flush, while the first writes
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive()  # it waits for the first (before: returned, or wrote first)
    release.set()
    periodic.join(10)
    stopping.join(10)
    assert sched.store.load_usage()[ann.tenant_id]["requests"] == 5


def test_stops_flush_waits_for_the_releases_still_on_their_way(tmp_path: Path) -> None:
    """Review s35 D S1: ``stop_services`` stops the gateway (its calls in flight are cancelled,
    each sending ``release`` with its usage, fire-and-forget) and then has the scheduler flush;
    Ray orders no calls of two callers, so a release applied after the flush was killed with
    the process and the request's tokens were never stored. ``flush_durable(drain_s)`` waits
    (bounded) until nothing is in flight. Here the release lands 0.3 s after the flush began."""
    import asyncio

    from services.global_scheduler_admission import GlobalSchedulerService

    sched = GlobalSchedulerService(str(tmp_path), {"n0": 4})

    async def stop() -> tuple[str, float, float]:
        ann, _ = await sched.register_tenant(TenantSpec("ann"))
        adm = sched.admit(ann.tenant_id, "r1", prompt_tokens=10)
        assert adm.code == "OK" and sched.nodes["n0"].in_flight == {"r1"}
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, sched.release, "r1", {"prompt_tokens": 10, "completion_tokens": 7})
        started = loop.time()
        await sched.flush_durable(drain_s=5.0)
        waited = loop.time() - started
        started = loop.time()
        await sched.flush_durable(drain_s=5.0)  # nothing in flight: no wait
        return ann.tenant_id, waited, loop.time() - started

    tenant_id, waited, again = asyncio.run(stop())
    assert 0.25 < waited < 4.0 and again < 1.0
    stored = sched.store.load_usage()[tenant_id]
    assert (stored["requests"], stored["completion_tokens"], stored["prompt_tokens"]) == (1, 7, 10)


def test_stops_drain_ends_soon_for_a_request_no_release_is_coming_for(tmp_path: Path) -> None:
    """Diff review s35 S2: a request whose release never comes (its gateway gone) held every
    stop's flush for the whole ``drain_s``; the drain ends ``DRAIN_IDLE_S`` after the last release."""
    import asyncio

    from services.global_scheduler_admission import DRAIN_IDLE_S, GlobalSchedulerService

    sched = GlobalSchedulerService(str(tmp_path), {"n0": 4})

    async def stop() -> float:
        ann, _ = await sched.register_tenant(TenantSpec("ann"))
        for rid in ("orphan", "r1"):
            assert sched.admit(ann.tenant_id, rid, prompt_tokens=10).code == "OK"
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, sched.release, "r1", {"prompt_tokens": 10, "completion_tokens": 7})
        started = loop.time()
        await sched.flush_durable(drain_s=30.0)
        return loop.time() - started

    waited = asyncio.run(stop())
    assert 0.3 + DRAIN_IDLE_S - 0.1 < waited < 0.3 + DRAIN_IDLE_S + 3.0
