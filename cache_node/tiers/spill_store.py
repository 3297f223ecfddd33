"""SpillStore: a content-addressed KV block store in RAM, then on disk.

``put`` fills the RAM tier (byte budget); past the budget, blocks are demoted in batches to
disk group files (``spill_format``), kept by ``DiskTier`` (``spill_disk``: whole files
evicted, index rebuilt from file headers on construction, so a restart keeps disk hits). Both
tiers evict the least recently used of the tenant (cache namespace without its salt) holding
the most per unit of its weight first (``fair_lru``): one tenant streaming new blocks pushes
out its own, not another's, while it holds more per weight than they do. A tenant's weight
comes with its puts (its cache node's latest known, checked as untrusted input:
``fair_lru.check_weight``); a holder none of whose puts this store has seen since it started
(files rebuilt from disk) weighs 1. Disk hits are not promoted to RAM:
the caller keeps what it reads.

Every block keeps the token ids it was put with (RAM entry, group file header); a ``get``
that passes ``token_ids`` is served a block only when they are equal, as the device and host
tiers check tokens on every hit: a block key is a hash, and a hash is not proof of content.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cache_node.tiers import spill_format as fmt
from cache_node.tiers.fair_lru import FairLRU, HolderWeights, check_put_weight, holder_of
from cache_node.tiers.spill_disk import TIER_DISK, DiskTier, PendingRemoval, SpillDeletionNotDurable
from cache_node.tiers.spill_format import BlockFormat

TIER_RAM = "spill_ram"
EVENT_STORED = "stored"
EVENT_REMOVED = "removed"
_HITS: tuple[str, ...] = ("hits_spill_ram", "hits_spill_disk", "misses")
STAT_COUNTERS = _HITS + (
    "corrupt_reads", "corrupt_blocks", "quarantined_files", "io_errors", "io_retries", "missing_files",
    "skipped_files", "token_mismatches", "evicted_files", "events_dropped",
    "removed_unindexed_files", "removed_quarantined_files", "put_refused_dropped",
    "disk_full_writes", "disk_full_evicted_files", "unlink_errors", "dir_recreated", "tombstoned_files",
    "flushed_files",
)


MAX_DROPPED_HOLDERS = 65536
"""Holders dropped for good that a store remembers (``tenants.store.MAX_DELETED_TENANTS``: as many
as the deletions the sweep can learn of), so that a late put of theirs stores nothing."""

MAX_CALL_BLOCKS = 256
"""Most hashes one ``put``, ``get``, ``contains`` or ``match_prefix`` may name: what a cache node
asks in one call (``TierConfig.spill_put_batch_blocks`` / ``spill_get_batch_blocks``, 256 each:
a long prompt's blocks go in batches). A call naming more is refused (ValueError naming
``hashes``) before the store's lock is taken: its caller is a peer, and every byte from a peer
is untrusted. Regression (review 30b F2): unbounded, a ``get`` of 20,000 absent hashes reserved
13.7 GiB under the lock every put and get waits on, and one of 60,000 raised MemoryError."""

MAX_BLOCK_TOKEN_IDS = fmt.MAX_FILE_TOKENS // fmt.MAX_BLOCKS_PER_FILE
"""Most token ids one block's ``token_ids`` may hold (1,024): any group file of such blocks fits
``MAX_FILE_TOKENS``. A cache node's block holds ``block_size`` (16 by default)."""


def _check_namespace(namespace: object) -> None:
    """A put's namespace is text a group file's header can record. Raises ValueError."""
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a string, got {type(namespace).__name__}")  # noqa: TRY004
    try:
        size = len(namespace.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError("namespace is not valid Unicode") from None
    if size > fmt.MAX_LABEL_BYTES:
        raise ValueError(f"a namespace of {size} bytes: at most {fmt.MAX_LABEL_BYTES}")


class SpillEvent(NamedTuple):
    """``event`` "stored"|"removed" in ``tier``; a demotion is removed/ram then stored/disk."""

    event: str
    block_hash: bytes
    tier: str


class SpillHits(NamedTuple):
    """Hits in request order; ``blocks``: ``(len(hashes), *shape)``, row i from ``tiers[i]``."""

    hashes: list[bytes]
    blocks: np.ndarray
    tiers: list[str]


@dataclass
class _RamEntry:
    block: np.ndarray  # (*block_format.shape,)
    namespace: str
    tokens: bytes  # spill_format.token_bytes of its token ids; b"" when unknown


class SpillStore:
    """Content-addressed block store: RAM tier, then disk tier.

    Reads never raise for data faults: missing, truncated, unreadable or corrupt files are
    misses. A block failing its checksum is dropped, its file's other blocks still served; a
    file corrupt as a whole is quarantined (moved aside; the newest few kept); a transient
    OSError is retried, then a miss that keeps the file (see ``spill_disk``). One lock guards all state, so a threaded
    actor may call it concurrently; disk I/O happens under that lock, except the unlinks of a
    ``flush`` or ``drop_namespaces`` (the files leave the index under it first: regression,
    review 30e F3, 5,000 unlinks under it held another tenant's get of one RAM block 5.8 s).

    Args:
        root_dir: directory of the group files (created if missing).
        block_format: shape, dtype and kv_format of every block.
        ram_bytes / disk_bytes: tier budgets in bytes (disk: bytes of every file in
            ``root_dir``, those it does not serve included; a disk budget of 0 drops demoted
            blocks).
        max_blocks_per_file: most blocks per group file.
        demote_low_watermark: past the RAM budget, demote down to this fraction of it.
        max_events: events kept for ``take_events``; older ones count as ``events_dropped``.
        lock_wait_s: how long to wait while another store holds ``root_dir`` (0: fail at once).
        lock_owner: who holds ``root_dir``'s lock, for the next opener's ``SpillDirLocked``
            (a spill node's ``"<ray namespace>/<actor name>"``; "": unnamed).

    One store per directory: the store locks ``root_dir`` (``spill_lock``) until ``close`` (or
    its process ends). Regression (review s35 D S2): two stores on one directory deleted each
    other's files and each rewrote the dropped holders' list with only its own.

    Raises ValueError for a negative budget or an option out of its range;
    ``spill_lock.SpillDirLocked`` (an OSError naming the directory and the holder's pid) when
    another store, in this process or another, holds ``root_dir`` past ``lock_wait_s``.
    """

    def __init__(
        self, root_dir: str | Path, block_format: BlockFormat, ram_bytes: int, disk_bytes: int,
        *,
        max_blocks_per_file: int = 64,
        demote_low_watermark: float = 0.75,
        max_events: int = 1_000_000,
        lock_wait_s: float = 0.0,
        lock_owner: str = "",
    ) -> None:
        if min(ram_bytes, disk_bytes) < 0 or min(max_blocks_per_file, max_events) < 1:
            raise ValueError("budgets must be >= 0, max_blocks_per_file and max_events >= 1")
        if not 0.0 <= demote_low_watermark <= 1.0:
            raise ValueError(f"demote_low_watermark must be in [0, 1], got {demote_low_watermark}")
        self.root_dir = Path(root_dir)
        self.block_format = block_format
        self.ram_budget_bytes = ram_bytes
        self.disk_budget_bytes = disk_bytes
        self.max_blocks_per_file = max_blocks_per_file
        self._demote_target_bytes = int(ram_bytes * demote_low_watermark)
        self._lock = threading.RLock()
        # Regression: one LRU over every tenant let a tenant streaming new blocks demote (and
        # on disk, delete) the others'; eviction takes the largest holder's LRU first, largest
        # per weight (regression: a weight-4 tenant kept no more than a weight-1 one).
        self.weights = HolderWeights()  # each holder's latest weight, from its puts
        self._ram: FairLRU[bytes, _RamEntry] = FairLRU(self.weights)
        self._events: deque[SpillEvent] = deque(maxlen=max_events)
        self._counters: Counter[str] = Counter()
        # holders dropped for good (``drop_namespaces``: deleted tenants' own namespaces), newest
        # last, at most MAX_DROPPED_HOLDERS: a later put of theirs is refused
        self._dropped: OrderedDict[str, None] = OrderedDict()
        with self._lock:
            self._disk = DiskTier(
                self.root_dir, block_format, disk_bytes, max_blocks_per_file, self._emit, self._counters,
                self.weights, lock_wait_s, lock_owner,
            )

    def put(
        self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str,
        token_ids: Sequence[Sequence[int]] | None = None, weight: float | Mapping[str, float] = 1.0,
    ) -> int:
        """Store ``blocks[i]`` under ``hashes[i]`` in RAM; returns how many were new.

        ``blocks``: ``(len(hashes), *block_format.shape)`` of the store's dtype;
        ``token_ids[i]``: block i's token ids (None: unknown, never served to a token-checked
        ``get``); ``namespace`` is recorded in file headers. A hash already held (either
        tier) is touched, not rewritten. May demote to disk and evict files. Nothing is
        stored for a namespace dropped for good (``drop_namespaces``: a deleted tenant's; its
        blocks counted in ``put_refused_dropped``). ``weight``: the weights of the tenants naming
        the namespace (tenant id -> weight, the sender's latest known: ``HolderWeights.tenants``),
        merged into what this store knows of them (its holder weighs their sum in both tiers'
        fair shares); or one weight for the holder as a whole, used only while the store knows
        none of its tenants' (a sender that knows none).
        Raises ValueError for more than ``MAX_CALL_BLOCKS`` hashes, a hash that is not 32 bytes,
        a wrong shape/dtype, a ``token_ids`` of another length than ``hashes`` or with a bad block
        (``_token_bytes``), a ``namespace`` that is not text of at most ``MAX_LABEL_BYTES`` UTF-8 bytes (what a file
        header records) or a ``weight`` that is not a positive finite number (a tenant spec's
        bounds) nor such a mapping (``fair_lru.check_put_weight``); nothing is stored then, and
        the holder's weight is unchanged.
        """
        self._check_hashes(hashes)
        weight = check_put_weight(weight)
        _check_namespace(namespace)
        want = ((len(hashes), *self.block_format.shape), self.block_format.np_dtype)
        if not isinstance(blocks, np.ndarray) or (blocks.shape, blocks.dtype) != want:
            got = (blocks.shape, blocks.dtype) if isinstance(blocks, np.ndarray) else type(blocks).__name__
            raise ValueError(f"blocks must be {want}, got {got}")
        tokens = self._token_bytes(hashes, token_ids)
        with self._lock:
            if holder_of(namespace) in self._dropped or self._disk.tombstoned(holder_of(namespace)):
                # a deleted tenant's, arriving late (before this store's restart too)
                self._counters["put_refused_dropped"] += len(hashes)
                return 0
            holder = holder_of(namespace)
            if isinstance(weight, dict):  # before the room is made
                self.weights.merge(holder, weight)
            elif not self.weights.tenants(holder):  # a sender's guess never replaces its tenants' own
                self.weights.set(holder, weight)
            new: dict[bytes, int] = {}  # each hash held in neither tier -> its first row
            for i, block_hash in enumerate(hashes):
                if not self._touch(block_hash):
                    new.setdefault(block_hash, i)
            rows = list(new.values())
            to_disk = 0
            if self._ram_bytes() + len(rows) * self.block_format.block_nbytes > self.ram_budget_bytes:
                # room first (RAM stays in budget), down to the low watermark after the put; the
                # batch counts as its holder's newest, and the rows picked of it go straight to disk
                to_disk = self._demote(self._demote_target_bytes, holder, len(rows))
            if to_disk:
                first = rows[:to_disk]  # the batch's first rows: a cache node writes heads first
                self._disk.write(namespace, [hashes[i] for i in first], blocks[first], [tokens[i] for i in first])
            for i in rows[to_disk:]:
                block = np.array(blocks[i], copy=True)
                self._ram.put(hashes[i], _RamEntry(block, namespace, tokens[i]), holder)
                self._emit(EVENT_STORED, hashes[i], TIER_RAM)
            self._demote_if_over_budget()
            return len(rows) - to_disk + sum(hashes[i] in self._disk for i in rows[:to_disk])

    def get(
        self, hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None = None
    ) -> SpillHits:
        """Return the held blocks among ``hashes`` (batched), touching them.

        With ``token_ids`` (block i's token ids for ``hashes[i]``) a block put with other or
        unknown token ids is a miss, counted in ``token_mismatches``. Blocks of a missing,
        truncated, unreadable or corrupt file are misses: never raises for data faults, never
        returns other bytes than were put. A transient read fault (retried, then counted in
        ``io_errors``) keeps the blocks held. Output memory is taken for the held blocks only
        (regression, review 30b F2: for every hash asked, held or not).
        Raises ValueError for more than ``MAX_CALL_BLOCKS`` hashes, a hash that is not 32 bytes
        or a ``token_ids`` of another length than ``hashes``.
        """
        self._check_hashes(hashes)
        asked = None if token_ids is None else self._token_bytes(hashes, token_ids)
        with self._lock:
            held: list[int] = []  # the rows asked that either tier holds (token-checked), in order
            in_ram: list[tuple[int, np.ndarray]] = []  # (row of ``out``, its RAM block)
            on_disk: list[int] = []  # rows of ``out`` read from disk
            for i, block_hash in enumerate(hashes):
                if asked is not None and not self._tokens_match(block_hash, asked[i]):
                    continue
                if block_hash in self._ram:
                    self._ram.touch(block_hash)
                    in_ram.append((len(held), self._ram[block_hash].block))
                elif block_hash in self._disk:
                    on_disk.append(len(held))
                else:
                    continue
                held.append(i)
            out = np.empty((len(held), *self.block_format.shape), self.block_format.np_dtype)
            tiers: list[str | None] = [None] * len(held)
            for row, block in in_ram:
                out[row] = block
                tiers[row] = TIER_RAM
            for row in self._disk.read([hashes[held[row]] for row in on_disk], out, on_disk):
                tiers[row] = TIER_DISK
            return self._hits(hashes, held, out, tiers)

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]:
        """Tier holding each hash (``"spill_ram"``, ``"spill_disk"`` or None); no touch.
        Raises ValueError as ``get`` does (``MAX_CALL_BLOCKS``, a hash's length)."""
        self._check_hashes(hashes)
        with self._lock:
            return [self._tier_of(h) for h in hashes]

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` held in either tier (a prefix hit length); no touch.
        Raises ValueError as ``get`` does (``MAX_CALL_BLOCKS``, a hash's length)."""
        self._check_hashes(hashes)
        with self._lock:
            for count, block_hash in enumerate(hashes):
                if self._tier_of(block_hash) is None:
                    return count
            return len(hashes)

    def flush(self, timeout_s: float | None = None) -> int:
        """Clear RAM, delete every group file in ``root_dir`` and every quarantined file;
        returns blocks dropped. ``timeout_s`` is the ``SpillClient`` protocol's (an in-process
        store answers or raises: unused).

        Once it returns, no restart serves a flushed block: the flush is recorded on disk
        before any file is unlinked (``DiskTier.flush``), and a file whose unlink fails is
        deleted by a later sweep or at the next restart, never indexed again.

        Raises:
            SpillDeletionNotDurable: some files could not be deleted and the record could not
                be written (a read-only or failing volume): a restart might serve them. Every
                block is out of both tiers meanwhile; flush again (a cache node's admin flush
                then fails naming this node, ``SpillFlushIncomplete``).
        """
        with self._lock:
            dropped = len(self._ram) + len(self._disk)
            for block_hash in self._ram:
                self._emit(EVENT_REMOVED, block_hash, TIER_RAM)
            self._ram.clear()
            pending = self._disk.flush()
        self._remove(pending)
        return dropped

    def drop_namespace(self, namespace: str) -> int:
        """Drop every block of ``namespace``'s holder (the namespace without its salt, so its
        salted variants ``<namespace>#salt=...`` too) from RAM, and delete its group files
        (their headers hold the blocks' token ids), and the files it does not serve whose
        verified header names it (unindexed, quarantined); "removed" events for each block.
        Other namespaces' blocks are untouched. Returns blocks dropped (a deleted tenant's own
        namespace: ``services.cache_node_commands.end_tenant``). Raises ValueError for a
        ``namespace`` a put would refuse (``_check_namespace``: it is remembered for good), and
        ``SpillDeletionNotDurable`` as ``drop_namespaces`` does."""
        _check_namespace(namespace)
        return self.drop_namespaces([namespace])

    def drop_namespaces(self, namespaces: Iterable[str]) -> int:
        """``drop_namespace`` of each of ``namespaces``, in one pass over what is held (a spill
        node's sweep of deleted tenants: ``services.spill_sweep.DeletedTenantSweep``), for good:
        a later ``put`` of one of them stores nothing (the last ``MAX_DROPPED_HOLDERS`` kept).

        Regression (review 24r F6): a deleted tenant's blocks offloaded by a cache node after
        the sweep had passed its deletion were stored, demoted to disk with their token ids, and
        never swept again (its cursor was past the deletion) until the node restarted.

        Raises ``SpillDeletionNotDurable`` when some of their files could not be deleted and the
        list of dropped holders could not be written (``DiskTier.save_dropped``): a restart
        might serve them (the blocks are out of both tiers meanwhile; a sweep's page is asked
        and dropped again). Regression (session 32): on a read-only volume such a drop was
        acknowledged, and a restart indexed and served the deleted tenant's blocks again."""
        holders = {holder_of(ns) for ns in namespaces}
        if not holders:
            return 0
        with self._lock:
            new = not holders <= self._dropped.keys()
            for holder in holders:
                self._dropped.pop(holder, None)
                self._dropped[holder] = None
                self.weights.forget(holder)
            while len(self._dropped) > MAX_DROPPED_HOLDERS:
                self._dropped.popitem(last=False)
            recorded = True
            if new or self._disk.tombstones_unsaved:  # before its files go: a restart then deletes
                recorded = self._disk.save_dropped(holders)  # those it finds, never serves them
            in_ram = [h for h in self._ram if self._ram.holder(h) in holders]
            for block_hash in in_ram:
                self._ram.pop(block_hash)
                self._emit(EVENT_REMOVED, block_hash, TIER_RAM)
            on_disk, pending = self._disk.drop_holders(holders)
            pending.recorded = recorded
        self._remove(pending)
        return len(in_ram) + on_disk

    def _remove(self, pending: PendingRemoval) -> None:
        """Unlink the files ``pending`` names, out of the lock (they left the index under it, and
        each name is unique: a file written since is never one of them); those that could not
        be deleted are counted and tried again (``DiskTier.unlink_failed``). A flush that
        deleted every file lets its record go (``DiskTier.flush_done``). Raises
        ``SpillDeletionNotDurable`` when some could not be deleted and ``pending`` is not
        recorded on disk."""
        failed = pending.run()
        with self._lock:
            if failed:
                self._disk.unlink_failed(failed)
            elif pending.flush_seq is not None and pending.complete:
                self._disk.flush_done(pending.flush_seq)
        if failed and not pending.recorded:
            size = sum(size for _, size, _ in failed)
            raise SpillDeletionNotDurable(
                failed[0][2].errno, f"{len(failed)} spill files of {self.root_dir} ({size} B) could not be deleted "
                f"({failed[0][2]}) nor the deletion recorded: a restart may serve them until a sweep deletes them")

    def expire_quarantine(self, now_ns: int | None = None) -> int:
        """Delete the quarantined files kept longer than ``spill_unserved.QUARANTINE_MAX_AGE_S``
        before ``now_ns`` (wall clock, ns; None: now); returns how many (a spill node calls it
        at every sweep, so an idle store keeps none past the limit either). Also tries again the
        deletions that failed (``DiskTier.expire_quarantine``)."""
        with self._lock:
            return self._disk.expire_quarantine(now_ns)

    def held(self) -> list[tuple[bytes, str]]:
        """``(block_hash, tier)`` of every block held now, tiers ``spill_ram`` and
        ``spill_disk``: what ``take_events`` has reported, summed up."""
        with self._lock:
            return [(h, TIER_RAM) for h in self._ram] + [(h, TIER_DISK) for h in self._disk.index]

    def stats(self) -> dict[str, int]:
        """Sizes, block counts per tier, files, hits per tier, misses and fault counters.

        ``disk_bytes``: the indexed files; ``unindexed_bytes``, ``quarantined_bytes`` and
        ``undeleted_bytes`` (files whose unlink failed, tried again): the files in ``root_dir``
        it does not serve (``spill_unserved``); the four together stay within
        ``disk_budget_bytes``."""
        with self._lock:
            sizes = {
                "ram_bytes": self._ram_bytes(),
                "disk_bytes": self._disk.bytes_used,
                "unindexed_bytes": self._disk.unserved.unindexed_bytes,
                "quarantined_bytes": self._disk.unserved.quarantined_bytes,
                "undeleted_bytes": self._disk.unserved.undeleted_bytes,
                "ram_budget_bytes": self.ram_budget_bytes,
                "disk_budget_bytes": self.disk_budget_bytes,
                "blocks_spill_ram": len(self._ram),
                "blocks_spill_disk": len(self._disk),
                "files": self._disk.num_files,
            }
            return sizes | {name: self._counters[name] for name in STAT_COUNTERS}

    def close(self) -> None:
        """Release the directory and its lock (idempotent): another store may open it then. RAM
        blocks are dropped with the store (``demote_to_disk`` first to keep them); a later
        call misses or fails (EBADF), never touching the directory."""
        with self._lock:
            self._disk.close()

    def take_events(self) -> list[SpillEvent]:
        """Return and clear the changes since the last call, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
            return events

    def _ram_bytes(self) -> int:
        return len(self._ram) * self.block_format.block_nbytes

    def demote_to_disk(self) -> int:
        """Write every RAM block to disk now (drain before maintenance; tests). Returns how many."""
        with self._lock:
            n = len(self._ram)
            self._demote(0)
            return n

    def _demote_if_over_budget(self) -> None:
        if self._ram_bytes() > self.ram_budget_bytes:
            self._demote(self._demote_target_bytes)

    def _demote(self, target_bytes: int, holder: str = "", incoming: int = 0) -> int:
        """Write RAM entries to disk, least recently used first (fair across holders per
        weight), until RAM holds at most ``target_bytes`` once ``incoming`` blocks of
        ``holder`` are in, counted as its newest (``FairLRU.plan``): one group file
        (``max_blocks_per_file`` blocks) at a time, its blocks written from the entries (no
        stacked copy) and let go once written. Returns how many of the incoming blocks were
        picked: they should go to disk, not RAM.

        Regression: an incoming batch did not count toward its holder's holding, so a holder
        at its share demoted another holder's blocks to make room for its own (two holders of
        weights 3 and 1 ended at 9:7 of a 16-block RAM tier instead of 12:4).

        Regression (review 23a): the whole batch (25% of the RAM budget) was stacked into one
        copy before the first write, so a 1 GiB RAM tier peaked at 1.44 GiB (with ``put``
        copying its blocks in before demoting); a spill node sized by ``spill_ram_bytes``
        could be OOM-killed, losing every tenant's spill-RAM blocks."""
        over = self._ram_bytes() + incoming * self.block_format.block_nbytes - target_bytes
        need = -(-over // self.block_format.block_nbytes) if over > 0 else 0
        plan = self._ram.plan(need, {holder: incoming} if incoming else None)
        by_namespace: dict[str, deque[tuple[bytes, _RamEntry]]] = {}
        for block_hash in plan.keys:
            entry = self._ram.pop(block_hash)
            self._emit(EVENT_REMOVED, block_hash, TIER_RAM)
            by_namespace.setdefault(entry.namespace, deque()).append((block_hash, entry))
        for namespace, group in by_namespace.items():
            while group:
                part = [group.popleft() for _ in range(min(self._disk.max_blocks_per_file, len(group)))]
                self._disk.write(namespace, [h for h, _ in part], [entry.block for _, entry in part],
                                 [entry.tokens for _, entry in part])
                del part  # its blocks go before the next file's are gathered
        return plan.refused.get(holder, 0)

    def _tokens_match(self, block_hash: bytes, asked: bytes) -> bool:
        """False (counted) when ``block_hash`` is held with other or unknown tokens."""
        if block_hash in self._ram:
            held = self._ram[block_hash].tokens
        elif block_hash in self._disk:
            held = self._disk.tokens[block_hash]
        else:
            return True  # not held: a plain miss
        if held and held == asked:
            return True
        self._counters["token_mismatches"] += 1
        return False

    @staticmethod
    def _token_bytes(
        hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None
    ) -> list[bytes]:
        """Each block's token ids as stored (``fmt.token_bytes``). Raises ValueError for
        another number of blocks than ``hashes``, a block of more than
        ``MAX_BLOCK_TOKEN_IDS`` ids, or ids that are not integers in [0, 2**31): they come
        from a peer. Regression (review 28a F3): unchecked, 4 blocks of 2,000,000 ids each
        took 167 MiB outside the RAM budget, and the demotion that wrote them failed inside
        another tenant's put."""
        if token_ids is None:
            return [b""] * len(hashes)
        if len(token_ids) != len(hashes):
            raise ValueError(f"token_ids has {len(token_ids)} blocks for {len(hashes)} hashes")
        out = []
        for ids in token_ids:
            if len(ids) > MAX_BLOCK_TOKEN_IDS:  # (counted before it is converted)
                raise ValueError(f"a block's token_ids holds {len(ids)} ids: at most {MAX_BLOCK_TOKEN_IDS}")
            arr = np.asarray(ids)
            if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= 1 << 31)):
                raise ValueError("token_ids must be lists of integers in [0, 2**31)")
            out.append(fmt.token_bytes(arr))
        return out

    def _touch(self, block_hash: bytes) -> bool:
        if block_hash in self._ram:
            self._ram.touch(block_hash)
        elif block_hash in self._disk:
            self._disk.touch(block_hash)
        return self._tier_of(block_hash) is not None

    def _tier_of(self, block_hash: bytes) -> str | None:
        if block_hash in self._ram:
            return TIER_RAM
        return TIER_DISK if block_hash in self._disk else None

    def _hits(self, hashes: Sequence[bytes], held: list[int], out: np.ndarray, tiers: list[str | None]) -> SpillHits:
        """``out[row]`` holds ``hashes[held[row]]``'s block, from ``tiers[row]`` (None: its read failed)."""
        found = [row for row, tier in enumerate(tiers) if tier is not None]
        found_tiers = [str(tiers[row]) for row in found]
        for tier in found_tiers:
            self._counters["hits_" + tier] += 1
        self._counters["misses"] += len(hashes) - len(found)
        rows = out if len(found) == len(out) else out[found]
        return SpillHits([hashes[held[row]] for row in found], rows, found_tiers)

    def _emit(self, event: str, block_hash: bytes, tier: str) -> None:
        if len(self._events) == self._events.maxlen:
            self._counters["events_dropped"] += 1
        self._events.append(SpillEvent(event, block_hash, tier))

    @staticmethod
    def _check_hashes(hashes: Sequence[bytes]) -> None:
        """At most ``MAX_CALL_BLOCKS`` hashes of ``HASH_BYTES`` bytes each (counted before any is
        looked at). Raises ValueError."""
        try:
            count = len(hashes)
        except TypeError:
            raise ValueError(f"hashes must be a list of block hashes, got {type(hashes).__name__}") from None
        if count > MAX_CALL_BLOCKS:
            raise ValueError(f"hashes names {count} blocks: at most {MAX_CALL_BLOCKS} per call "
                             "(a cache node asks in batches of spill_get_batch_blocks / spill_put_batch_blocks)")
        for block_hash in hashes:
            if not isinstance(block_hash, bytes) or len(block_hash) != fmt.HASH_BYTES:
                raise ValueError(f"block_hash must be {fmt.HASH_BYTES} bytes, got {block_hash!r:.80}")
