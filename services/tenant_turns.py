"""Each tenant's one turn at a gateway's costly work (``TenantTurns``), shared by its edges.

A gateway parses bodies, renders and tokenizes prompts and builds whole responses for every
tenant on one event loop and a few worker threads (``InferenceServicer.off_loop``). Each
tenant does that work one piece at a time, on its turn, so a tenant's burst of requests queues
behind itself and every other tenant waits for at most one piece of each other tenant's work.

One table per gateway: the gRPC servicer (``InferenceServicer.turns``, its ``off_loop``) and the
HTTP edge (``OpenAIEdge.turn``, the same object) take the same turn, so a tenant calling both
APIs still has one piece of work running at a time.

Regressions (exhaustion hardening, s36):

- The HTTP edge's turns (``OpenAIEdge.turns``) and the servicer's (``_tokenizing``) were two
  tables of locks: one tenant posting to ``/v1/completions`` (its body parsed on the event loop
  on the edge's turn) and calling ``Generate`` (its prompt tokenized on a thread on the
  servicer's turn) held two turns at once.
- Neither table was ever pruned: a lock stayed for every tenant id ever seen, for the
  gateway's life. Here an entry lives only while a holder or a waiter of it remains, so the
  table holds at most one entry per request in flight, whichever tenants come and go. Keys
  are authenticated tenant ids only (every caller has its tenant from ``Authenticator``):
  nothing a client sends before its key is checked names an entry.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Turn:
    """One tenant's turn: ``lock`` held by its holder; ``users``: its holder and waiters."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class TenantTurns:
    """Tenant id -> its one turn, present while held or waited for (``len``: entries now).

    For one event loop (the gateway's): every method but ``off_loop``'s thread's release runs
    on it. Waiters get the turn in the order they asked (``asyncio.Lock``'s). A waiter
    cancelled (its client gone, its call cancelled) leaves no entry nor waiter behind, and a
    turn granted to it as it was cancelled goes to the next waiter.
    """

    def __init__(self) -> None:
        self._turns: dict[str, _Turn] = {}

    def __len__(self) -> int:
        return len(self._turns)

    def __contains__(self, tenant_id: object) -> bool:
        return tenant_id in self._turns

    def users(self, tenant_id: str) -> int:
        """``tenant_id``'s holder and waiters now (0: it has no entry)."""
        turn = self._turns.get(tenant_id)
        return 0 if turn is None else turn.users

    async def _acquire(self, tenant_id: str) -> _Turn:
        """Wait for ``tenant_id``'s turn and take it; returns its entry (for ``_release``).
        Cancelled while waiting: the wait is undone, the entry removed when no one else uses it."""
        turn = self._turns.get(tenant_id)
        if turn is None:
            turn = self._turns[tenant_id] = _Turn()
        turn.users += 1
        try:
            await turn.lock.acquire()
        except BaseException:
            self._leave(tenant_id, turn)
            raise
        return turn

    def _release(self, tenant_id: str, turn: _Turn) -> None:
        turn.lock.release()
        self._leave(tenant_id, turn)

    def _leave(self, tenant_id: str, turn: _Turn) -> None:
        turn.users -= 1
        if turn.users == 0 and self._turns.get(tenant_id) is turn:
            del self._turns[tenant_id]

    @contextlib.asynccontextmanager
    async def hold(self, tenant_id: str) -> AsyncIterator[None]:
        """Hold ``tenant_id``'s turn while the block runs (on the event loop), given back
        however the block ends. ``tenant_id``: an authenticated tenant's id."""
        turn = await self._acquire(tenant_id)
        try:
            yield
        finally:
            self._release(tenant_id, turn)

    async def off_loop(self, tenant_id: str, pool: concurrent.futures.Executor, work: Callable[[], T]) -> T:
        """Run ``work`` on a thread of ``pool`` on ``tenant_id``'s turn; returns its result,
        raises what it raised. The turn is held until ``work`` has ended, not until the caller
        stops waiting: a caller cancelled while ``work`` runs leaves the turn held by it (the
        tenant's next piece waits for the thread), and ``work`` not yet started is not run.
        ``tenant_id``: an authenticated tenant's id.

        Regression (diff review): a turn given back when a cancelled caller stopped waiting let
        a tenant that sent big prompts and hung up run one thread per call at once, filling the
        pool every tenant's work shares."""
        turn = await self._acquire(tenant_id)
        loop = asyncio.get_running_loop()
        try:
            done = pool.submit(work)
        except BaseException:
            self._release(tenant_id, turn)
            raise

        def ended(_: Any) -> None:  # (on the worker thread, or here when cancelled before it ran)
            try:
                loop.call_soon_threadsafe(self._release, tenant_id, turn)
            except RuntimeError:  # the loop is closed: nothing waits on it any more
                pass

        done.add_done_callback(ended)
        return await asyncio.wrap_future(done)
