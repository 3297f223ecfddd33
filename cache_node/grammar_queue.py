"""The grammar compilations waiting for a compiler process, per tenant, served round-robin.

A compile's cost is its spec's to choose, up to the time limit; a queue in arrival order let
one tenant's burst of slow specs hold every compiler while other tenants' requests waited
behind it. Here each tenant (the request's tenant, else its cache namespace) has its own
queue; a free compiler takes the head of the next tenant in turn that has none compiling, so
a tenant has at most one compile running, and any other tenant's next compile starts within
one compile time limit of a compiler coming free. A tenant has at most ``max_per_tenant``
compiles queued or running (``put`` refuses more); a queued one no request waits on any more
is taken out (``remove``).

One job may be queued under several tenants (``put`` for each: several tenants' requests wait
on one compile). It counts once against each of their bounds while queued, is taken once, at
the earliest turn of any of them (``take`` then takes it out of the others' queues: it counts
only against the tenant whose turn ran it), so no tenant waits on another tenant's queue.
Regression (review 27c F2): a compile was queued under its first tenant only, and another
tenant's request for the same spec waited that tenant's whole queue (one tenant parked
``json_object`` behind 7 slow compiles: every other tenant's json_object waited 18.9 s with a
2 s limit).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairCompileQueue(Generic[T]):
    """Per-tenant FIFO queues served round-robin, one job running per tenant. Thread-safe."""

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()  # turn order: next first
        self._running: dict[str, int] = {}  # tenant -> jobs taken and not done (0 or 1)
        self._holders: dict[int, list[str]] = {}  # id(job) -> tenants whose queues hold it
        self._cond = threading.Condition()
        self._closed = False
        self._used = False  # a job was ever put

    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self, tenant: str) -> int:
        """``tenant``'s jobs queued or running."""
        with self._cond:
            return len(self._queues.get(tenant, ())) + self._running.get(tenant, 0)

    def counts(self) -> tuple[int, int]:
        """(jobs queued, each once however many tenants' queues hold it; jobs running)."""
        with self._cond:
            return len(self._holders), sum(self._running.values())

    def put(self, tenant: str, job: T) -> bool:
        """Queue ``job`` at the end of ``tenant``'s queue; False (not queued) when the tenant
        has ``max_per_tenant`` pending already, or the queue is closed. A job queued under
        other tenants already is queued under this one too (``join`` checks it still is);
        one queued under this tenant already is not queued again (True)."""
        with self._cond:
            if self._closed:
                return False
            if tenant in self._holders.get(id(job), ()):
                return True
            queue = self._queues.get(tenant)
            if len(queue or ()) + self._running.get(tenant, 0) >= self.max_per_tenant:
                return False
            if queue is None:
                queue = self._queues[tenant] = deque()
            queue.append(job)
            self._holders.setdefault(id(job), []).append(tenant)
            self._used = True
            self._cond.notify_all()
            return True

    def join(self, tenant: str, job: T) -> bool | None:
        """``put`` for a job already queued under another tenant: True (now queued under
        ``tenant`` too, or already was), False (``tenant``'s bound is reached, or the queue is
        closed), None (not queued any more: taken, so running or done, or removed; not put)."""
        with self._cond:
            if id(job) not in self._holders:
                return None
            return self.put(tenant, job)  # the condition's lock is reentrant

    def queued(self, job: T) -> list[str]:
        """The tenants whose queues hold ``job`` (none once it is taken)."""
        with self._cond:
            return list(self._holders.get(id(job), ()))

    def wait_used(self) -> bool:
        """Block until the first job is put (True) or the queue closes (False)."""
        with self._cond:
            while not (self._used or self._closed):
                self._cond.wait()
            return not self._closed

    def take(self) -> tuple[str, T] | None:
        """Block until a job can run, and give it with its tenant: the head of the first tenant
        in turn with none running (that tenant then goes last in the turn order). None once
        closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                picked = self._next()
                if picked is not None:
                    return picked
                self._cond.wait()

    def _next(self) -> tuple[str, T] | None:
        for tenant, queue in self._queues.items():
            if not self._running.get(tenant):
                job = queue.popleft()
                del self._queues[tenant]
                if queue:
                    self._queues[tenant] = queue  # back in line, last
                self._running[tenant] = 1
                for other in self._holders.pop(id(job)):
                    if other != tenant:  # taken once: out of every other queue holding it
                        self._unqueue(other, job)
                return tenant, job
        return None

    def _unqueue(self, tenant: str, job: T) -> bool:
        queue = self._queues.get(tenant)
        for i, queued in enumerate(queue or ()):
            if queued is job:
                del queue[i]  # type: ignore[union-attr]
                if not queue:
                    del self._queues[tenant]  # ``_next`` takes from non-empty queues only
                return True
        return False

    def remove(self, tenant: str, job: T) -> bool:
        """Take ``job`` (by identity) out of ``tenant``'s queue; False when it is not queued
        there (taken already: running or done, or never put)."""
        with self._cond:
            if not self._unqueue(tenant, job):
                return False
            holders = self._holders[id(job)]
            holders.remove(tenant)
            if not holders:
                del self._holders[id(job)]
            return True

    def done(self, tenant: str) -> None:
        """The job ``take`` gave for ``tenant`` ended: its next may run."""
        with self._cond:
            self._running.pop(tenant, None)
            self._cond.notify_all()

    def close(self) -> list[T]:
        """Stop: ``take`` returns None from now on. Returns the jobs still queued (each once)."""
        with self._cond:
            self._closed = True
            seen: set[int] = set()
            left = [job for queue in self._queues.values() for job in queue
                    if id(job) not in seen and not seen.add(id(job))]  # type: ignore[func-returns-value]
            self._queues.clear()
            self._holders.clear()
            self._cond.notify_all()
            return left
