"""The global scheduler's ``close_data_plane`` stops the periodic tasks its admission socket
started (``_bind_admissions``: the usage flush and the session store), on the real class and
its SQLite store, without Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.global_scheduler_admission import GlobalSchedulerService


def _pending_others() -> list[str]:
    return sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks()
                  if t is not asyncio.current_task() and not t.done())


def test_close_data_plane_leaves_no_task_of_the_scheduler_pending(tmp_path: Path) -> None:
    """Regression (s40 diff review r4): ``close_data_plane`` cancelled only the admission
    server; ``_flush_durable_every`` and ``_store_sessions`` ran on (flushing a store the
    caller closes next) and, on a loop stopped after the close, were destroyed pending
    ("Task was destroyed but it is pending!" after every test on ``tests.loop_plane``). A
    data plane opened again starts them again."""
    async def go() -> tuple[list[str], list[str], list[str]]:
        sched = GlobalSchedulerService(str(tmp_path), {"n0": 4})
        try:
            await sched.open_data_plane()
            serving = _pending_others()
            sched.close_data_plane()
            for _ in range(3):  # the cancellations are delivered
                await asyncio.sleep(0)
            closed = _pending_others()
            await sched.open_data_plane()
            again = _pending_others()
            sched.close_data_plane()
            for _ in range(3):
                await asyncio.sleep(0)
            return serving, closed, again
        finally:
            sched.store.close()

    serving, closed, again = asyncio.run(go())
    ours = ["GlobalSchedulerService._flush_durable_every", "GlobalSchedulerService._serve_admissions",
            "GlobalSchedulerService._store_sessions"]
    assert [name for name in serving if name in ours] == ours
    assert closed == []
    assert [name for name in again if name in ours] == ours
