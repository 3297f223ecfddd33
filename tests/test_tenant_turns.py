"""``services.tenant_turns.TenantTurns`` alone: an entry lives while its turn is held or waited
for and no longer, cancelled waiters leave nothing behind, and ``off_loop`` holds the turn until
its thread's work ends (the gateway's edges over it: ``test_tenant_turns_shared``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from services.tenant_turns import TenantTurns


def test_entries_go_once_no_holder_or_waiter_remains_cancelled_waiters_included() -> None:
    """1,000 tenants take and give back their turns: no entry is left. A tenant's turn held,
    5 waiters of it cancelled (one just as it was granted the turn) leave only the holder, the
    next waiter gets the turn in order, and the table is empty at the end."""
    async def run() -> None:
        turns = TenantTurns()
        for i in range(1000):
            async with turns.hold(f"tenant-{i}"):
                assert turns.users(f"tenant-{i}") == 1
        assert len(turns) == 0

        order: list[int] = []

        async def take(i: int) -> None:
            async with turns.hold("a"):
                order.append(i)

        held = turns.hold("a")
        await held.__aenter__()  # (this task holds "a"'s turn)
        waiters = [asyncio.ensure_future(take(i)) for i in range(1, 8)]
        await asyncio.sleep(0)
        assert turns.users("a") == 8
        for w in waiters[:5]:
            w.cancel()
        await asyncio.sleep(0)
        assert turns.users("a") == 3 and "a" in turns
        await held.__aexit__(None, None, None)  # the turn is granted to waiter 6 (1-5 cancelled) ...
        waiters[5].cancel()  # ... cancelled before it ran: the turn goes on to waiter 7
        await asyncio.gather(*waiters, return_exceptions=True)
        assert order == [7] and len(turns) == 0, (order, turns.users("a"))

    asyncio.run(run())


def test_off_loop_holds_the_turn_until_its_work_ends_even_for_a_cancelled_caller() -> None:
    """A caller cancelled while its work runs leaves the turn held until the work ends (the
    tenant's next piece, a waiter, runs after it, never beside it); a caller cancelled before
    its work started leaves it unrun; work that raises gives the turn back and its error to
    the caller; a shut pool's refusal gives the turn back too."""
    pool = concurrent.futures.ThreadPoolExecutor(2)
    gate, started = threading.Event(), threading.Event()
    running, peak, ran, guard = [0], [0], [], threading.Lock()

    def work(name: str) -> str:
        with guard:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        started.set()
        gate.wait(10)
        with guard:
            running[0] -= 1
            ran.append(name)
        return name

    async def run() -> None:
        turns = TenantTurns()
        first = asyncio.ensure_future(turns.off_loop("a", pool, lambda: work("first")))
        assert await asyncio.to_thread(started.wait, 10)
        second = asyncio.ensure_future(turns.off_loop("a", pool, lambda: work("second")))
        third = asyncio.ensure_future(turns.off_loop("a", pool, lambda: work("third")))
        await asyncio.sleep(0.05)
        first.cancel()
        third.cancel()  # (waiting: never run)
        await asyncio.sleep(0.1)
        assert turns.users("a") == 2 and ran == []  # "first" still runs, holding the turn; "second" waits
        gate.set()
        assert await asyncio.wait_for(second, 10) == "second"
        assert first.cancelled() and third.cancelled()
        assert len(turns) == 0 and ran == ["first", "second"] and peak[0] == 1

        def fails() -> None:
            raise ValueError("bad prompt")

        with pytest.raises(ValueError, match="bad prompt"):
            await turns.off_loop("a", pool, fails)
        assert len(turns) == 0
        pool.shutdown()
        with pytest.raises(RuntimeError):
            await turns.off_loop("a", pool, lambda: None)
        assert len(turns) == 0

    asyncio.run(run())
