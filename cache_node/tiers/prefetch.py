"""The transfer worker: spill puts and prefetch gets on one background thread.

The step loop never waits on the spill tier. Host victims are queued here and written with
one ``put`` per namespace and batch; a prefetch reads a queued request's blocks with one
``get`` while steps run, then installs them into device blocks under the engine lock.
Prefetches run before puts, each kind in submission order. Queued puts hold a copy of their
KV in this process: ``SpillBacklog`` bounds them (``TierConfig.spill_put_backlog_bytes``) and
drops the largest holder's (per weight) oldest ones past it, counted in ``spill_put_dropped_blocks``.

Faults: any exception from the client, or a reply that fails validation, is a miss (get) or
a dropped write (put), counted in ``TierManager.counters``; a flush that a spill node did not
confirm raises ``SpillFlushIncomplete`` (its blocks may still be there). Timeouts are the client's (the
Ray client turns a timeout or a dead actor into an empty reply, and sends a spill node no put
while its last one timed out and still runs). ``flush`` bumps an epoch: jobs submitted
before it are dropped, and the spill flush waits for a call in progress. No device block is
held while a transfer is in flight, so cancelling a request mid-prefetch leaves nothing to
release: its rows are discarded when the copy ends.

``close`` ends the thread (an engine's ``close``): queued prefetches are dropped, and a running
one installs nothing more (its device blocks are freed with the engine); queued puts and the
one being written go out first, within the close's bound (the spill tier outlives the engine),
each counted as it lands; those left at the bound are dropped, counted in
``spill_put_dropped_blocks``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from cache_node.tiers.fair_lru import holder_of
from cache_node.tiers.host import Victims
from cache_node.tiers.spill_api import (
    SPILL_HASH_BYTES,
    SpillClient,
    SpillFlushIncomplete,
    from_numpy,
    leading_hits,
    to_numpy,
)
from cache_node.tiers.spill_backlog import SpillBacklog

if TYPE_CHECKING:
    from cache_node.sequence import Sequence
    from cache_node.tiers.manager import TierManager

logger = logging.getLogger(__name__)


class TransferWorker:
    """Runs spill transfers for one ``TierManager`` on a daemon thread (started lazily).

    Args:
        tiers: the tier manager whose counters and lock the worker uses.
        spill: the spill client.
        max_put_blocks: most victim blocks queued for puts, the batch being written included
            (``SpillBacklog``); more are dropped, counted in ``spill_put_dropped_blocks``.
    """

    def __init__(self, tiers: TierManager, spill: SpillClient, max_put_blocks: int) -> None:
        self.tiers = tiers
        self.spill = spill
        self.epoch = 0
        self.backlog = SpillBacklog(max_put_blocks, tiers.weights)
        self._prefetches: deque[tuple[Sequence, int]] = deque()  # (queued request, epoch)
        self._busy = False  # a job is running
        self._cond = threading.Condition()  # guards the backlog, the prefetches and ``_busy``
        self._io_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._close_by_s: float | None = None  # monotonic bound of ``close``'s drain (None: open)
        self.on_ready: Callable[[], None] = _nothing  # a prefetch ended: the engine's waiter

    def submit_put(self, victims: Victims) -> int:
        """Queue victims for a spill put; returns blocks dropped to keep the backlog bounded."""
        with self._cond:
            if self.closed:  # the engine is closing: nothing is written any more
                return sum(len(m.block_hash) == SPILL_HASH_BYTES for m in victims.metas)
            dropped = self.backlog.add(victims)
            self._wake()
        return dropped

    def submit_prefetch(self, seq: Sequence) -> None:
        with self._cond:
            if self.closed:
                seq.prefetch_until_s = 0.0
                return
            self._prefetches.append((seq, self.epoch))
            self._wake()

    @property
    def closed(self) -> bool:
        """``close`` was called: no job is taken any more but the puts it drains."""
        return self._close_by_s is not None

    def close(self, timeout_s: float = 5.0) -> bool:
        """End the worker thread, waiting ``timeout_s`` seconds at most; returns whether it
        ended (False: a spill call still runs past the bound; the thread ends when it returns).

        Queued prefetches are dropped (their requests are schedulable again) and a running one
        installs no more batches: its device blocks are freed with the engine. The put being
        written and the queued ones are written first, until ``timeout_s`` has passed, each
        counted in ``spill_put_blocks`` as it lands (the spill tier outlives this engine, and
        serves other nodes); the blocks still queued then are dropped, counted in
        ``spill_put_dropped_blocks``. Later submits are dropped too. Call it without the
        engine lock (a landing put takes it to count its blocks). Idempotent.

        Regression (s39): the thread waited for jobs forever, holding the tier manager (the
        host tier's memory, the KV pool) of an engine whose node had shut down."""
        with self._cond:
            if self._close_by_s is None:
                self._close_by_s = time.monotonic() + max(0.0, timeout_s)
            prefetches = [seq for seq, _ in self._prefetches]
            self._prefetches.clear()
            self._cond.notify_all()
        for seq in prefetches:
            seq.prefetch_until_s = 0.0
        if prefetches:
            self.on_ready()
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, timeout_s))
        return thread is None or not thread.is_alive()

    def _past_close(self) -> bool:
        """``close`` was called and its bound has passed (call under ``_cond`` or the io lock)."""
        return self._close_by_s is not None and time.monotonic() >= self._close_by_s

    def _wake(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def backlog_blocks(self) -> int:
        """Victim blocks queued for puts or being written."""
        with self._cond:
            return self.backlog.num_blocks

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until every submitted job has finished. False on timeout."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout_s)

    def _idle(self) -> bool:
        return not (self._busy or self._prefetches or self.backlog.num_blocks)

    def new_epoch(self) -> None:
        """Invalidate every queued or running job (call under the engine lock); queued puts
        are dropped at once (a flush, not counted as backlog drops)."""
        with self._cond:
            self.epoch += 1
            self.backlog.clear()
            self._cond.notify_all()

    def flush_spill(self, timeout_s: float | None = None) -> int:
        """Flush the spill client after any call in progress, all within ``timeout_s`` (None:
        no bound on the wait for that call, the client's own timeout on the flush). Returns
        blocks dropped.

        Raises:
            SpillFlushIncomplete: a spill node did not confirm the flush in time or failed (it
                may still hold its blocks: a dead one's group files are rebuilt when Ray
                restarts it), or the call in progress did not end in time (the flush was not
                sent: the client's ``pending`` nodes are named). Counted in
                ``spill_flush_errors``. Before, any failure was 0 blocks dropped and the flush
                done.
        """
        lock_wait = -1.0 if timeout_s is None else max(0.0, timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + lock_wait
        if not self._io_lock.acquire(timeout=lock_wait):
            self._count("spill_flush_errors", 1)
            raise SpillFlushIncomplete(0, self._unflushed_behind(lock_wait))
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return int(self.spill.flush() if left is None else self.spill.flush(timeout_s=left))
        except SpillFlushIncomplete as exc:
            logger.warning("%s", exc)
            self._count("spill_flush_errors", 1)
            raise
        except Exception as exc:  # a client fault: nothing says what the spill nodes still hold
            logger.warning("spill flush failed: %s", exc)
            self._count("spill_flush_errors", 1)
            raise SpillFlushIncomplete(0, {"the spill tier": f"the flush failed: {exc}"[:300]}) from exc
        finally:
            self._io_lock.release()

    def _unflushed_behind(self, timeout_s: float) -> dict[str, str]:
        """``SpillFlushIncomplete.unflushed`` of a flush not sent because the spill call in
        progress did not end within ``timeout_s``: the nodes that call waits on (the client's
        ``pending``, when it tells), then every other node the client names as not asked."""
        pending = getattr(self.spill, "pending", None)
        try:
            waited = list(pending()) if callable(pending) else []
        except Exception:  # noqa: BLE001 - only a name in a message: a fault of its own is no cause
            waited = []
        why = f"a call to it did not answer within {timeout_s:g} s, so the flush was not sent"
        unflushed = {str(name): why for name in waited}
        for name in getattr(self.spill, "names", ()):
            unflushed.setdefault(str(name), f"not asked: the flush waits for the spill call in progress "
                                            f"(on {', '.join(map(str, waited)) or 'the spill tier'})")
        return unflushed or {"the spill tier": f"the call in progress did not end within {timeout_s:g} s, so "
                                               "the flush was not sent"}

    def _run(self) -> None:
        while True:
            kind, payload, epoch = self._next_job()
            if kind == "closed":  # no put left to write, or the close's bound passed
                if payload:
                    logger.warning("closing: %d queued spill put blocks dropped, not written within the "
                                   "close's bound", payload)
                    self._count("spill_put_dropped_blocks", payload)
                return
            try:
                if kind == "put":
                    self._put(payload, epoch)
                else:
                    self._prefetch(payload, epoch)
            except Exception:
                logger.exception("transfer job %s failed", kind)
            finally:
                with self._cond:
                    self._busy = False
                    if kind == "put":
                        self.backlog.done()
                    self._cond.notify_all()
                if kind == "prefetch":  # landed, or given up: its request is schedulable again
                    self.on_ready()

    def _next_job(self) -> tuple[str, Any, int]:
        """(kind, payload, epoch) of the next job, waiting for one: prefetches first; ("closed",
        blocks dropped, 0) once closed and no put is left, or the close's bound has passed (the
        queued puts dropped, uncounted yet: ``_count`` takes the engine lock, never under this one)."""
        with self._cond:
            while True:
                if self._past_close():
                    dropped = self.backlog.clear()
                    self._cond.notify_all()
                    return "closed", dropped, 0
                if self._prefetches:
                    seq, epoch = self._prefetches.popleft()
                    self._busy = True
                    return "prefetch", seq, epoch
                victims = self.backlog.take()
                if victims is not None:
                    self._busy = True
                    return "put", victims, self.epoch
                if self.closed:
                    return "closed", 0, 0
                self._cond.wait()

    def _put(self, victims: Victims, epoch: int) -> None:
        by_namespace: dict[str, list[int]] = {}
        # victims leave in eviction order, each chain tail first: write them head first, so a
        # prefix is a run of consecutive blocks in a group file (one read per run)
        for i in reversed(range(len(victims.metas))):
            meta = victims.metas[i]
            if len(meta.block_hash) == SPILL_HASH_BYTES:
                by_namespace.setdefault(meta.namespace, []).append(i)
        step = self.tiers.config.spill_put_batch_blocks
        for namespace, rows in by_namespace.items():
            for k in range(0, len(rows), step):
                chunk = rows[k : k + step]
                hashes = [victims.metas[i].block_hash for i in chunk]
                tokens = [list(victims.metas[i].token_ids) for i in chunk]
                self._put_chunk(hashes, tokens, to_numpy(victims.blocks[chunk]), namespace, epoch)

    def _put_chunk(
        self, hashes: list[bytes], tokens: list[list[int]], rows: np.ndarray, namespace: str, epoch: int
    ) -> None:
        with self._io_lock:
            if epoch != self.epoch:
                return
            if self._past_close():  # closing, its bound passed: dropped, as the queued ones
                self._count("spill_put_dropped_blocks", len(hashes))
                return
            try:
                # its tenants' weights (a spill node sums them; PUT_TENANTS a put, in turns), else its own
                weight = self.tiers.weights.put_weight(holder_of(namespace))
                stored = self.spill.put(hashes, rows, namespace, tokens, weight)
            except Exception as exc:  # noqa: BLE001 - any client fault drops the write
                logger.warning("spill put of %d blocks failed: %s", len(hashes), exc)
                self._count("spill_put_errors", len(hashes))
                return
        # only the blocks the spill tier says it stored (review 30e F2: a put whose disk write
        # failed, or a node that failed or refused it, counted every block as written); the
        # answer is a peer's: anything but an int in [0, len(hashes)] counts none
        self._count("spill_put_blocks", stored if type(stored) is int and 0 <= stored <= len(hashes) else 0)

    def _prefetch(self, seq: Sequence, epoch: int) -> None:
        try:
            with self.tiers.lock:
                if seq.is_finished or epoch != self.epoch or self.closed:
                    return
                start, hashes = self.tiers.spill_candidates(seq)
                bs, prompt = self.tiers.kv.block_size, seq.all_token_ids
                tokens = [list(prompt[j * bs : (j + 1) * bs]) for j in range(start, start + len(hashes))]
            step = self.tiers.config.spill_get_batch_blocks
            for k in range(0, len(hashes), step):  # batches: a long prompt is never asked for at once
                rows, tiers = self._get(hashes[k : k + step], tokens[k : k + step], epoch)
                if not tiers:
                    return
                with self.tiers.lock:
                    if seq.is_finished or epoch != self.epoch or self.closed:  # closed: its blocks are freed
                        return
                    self.tiers.install(seq, start + k, from_numpy(rows, self.tiers.pool.kv.dtype), tiers)
                    if not self.tiers.blocks.num_free_blocks():  # the pool is full: the rest would not stay
                        return
                del rows  # not held while the next batch is fetched
                if len(tiers) < min(step, len(hashes) - k):  # a miss ends the prefix
                    return
        finally:
            seq.prefetch_until_s = 0.0

    def _get(
        self, hashes: list[bytes], tokens: list[list[int]], epoch: int
    ) -> tuple[np.ndarray, list[str]]:
        shape, dtype = self.tiers.block_shape, self.tiers.spill_np_dtype
        with self._io_lock:
            if epoch != self.epoch or self.closed:
                return np.empty((0, *shape), dtype), []
            try:
                reply = self.spill.get(hashes, tokens)
            except Exception as exc:  # noqa: BLE001 - any client fault is a miss
                logger.warning("spill get of %d blocks failed (a miss): %s", len(hashes), exc)
                self._count("spill_get_errors", 1)
                return np.empty((0, *shape), dtype), []
        rows, tiers = leading_hits(reply, hashes, shape, dtype)
        if not tiers and _claims_first(reply, hashes[0]):  # a hit on the first block, distrusted
            self._count("spill_bad_replies", 1)
        return rows, tiers

    def _count(self, name: str, n: int) -> None:
        with self.tiers.lock:
            self.tiers.counters[name] += n


def _claims_first(reply: Any, first: bytes) -> bool:
    """Whether a reply (of any shape: it crossed a process boundary) names ``first`` first."""
    try:
        return bool(len(reply.hashes)) and reply.hashes[0] == first
    except Exception:  # noqa: BLE001 - not a reply: malformed
        return True


def _nothing() -> None:
    """``TransferWorker.on_ready`` until an engine sets it."""
