"""Compressed prefixes: a document prefix compressed once under a KV policy, then forked by
every later request of the same cache namespace that starts with it (issue 22, build 1b).

A request names its reusable prefix with ``prefix_tokens`` (N): under a compressing policy
the engine prefills exactly its first N tokens (``Sequence.prefix_stop``: no step crosses
the boundary), compresses them with nothing after the boundary seen (question-agnostic, as
``bench.quality_probe.Probe.compress``: budget ``policy.budget_tokens(N)``, one
``compress``), stores a copy of the resulting state and continues from it. The state is the
policy's whole ``SequenceKV``: device part (the compacted blocks, the policy's extras and the
charge blocks paying for them) and host part (demoted sentences in host-tier slots or cold
codes). Another request with the same first N tokens, namespace and policy spec forks the
entry (its own copy of the device part; the host-tier sentences' slots shared, refcounted,
``TierHostKV.fork``) and prefills only its tokens after N,
which attend through the policy over the stored state; as a session's next turn
(``cache_node.sessions``), its budget is recomputed from its whole prompt at the prompt's
end, when it is compressed as any prefill is (the request that computed the prefix continues
the same way), so its answer is the question-agnostic path's: the document compressed before
any question, then the question asked as a new turn.

Every such request waits in the scheduler's queue like any other, holding nothing; what it
does is decided when the scheduler starts it (``Scheduler._fork_prefix``), in the policy's
order: it forks the stored entry, its copy taken then under admission's free-block checks
(``fork_blocks``: copy, charge blocks and its first chunk); or, while a request the scheduler
runs, of its SLO class or a higher one, is computing the prefix (``computing``), it is passed
over and forks the entry once stored; else it computes the prefix itself. So N tokens are
compressed once however many requests share them, no request waits for one the scheduler
has not started (still queued, or preempted: the first of them it starts computes), and no
queued request holds blocks. A prefix whose compression lost KV for want of room
(``Policy.lost_tokens``: SentenceKV sentences demoted to a full host tier) is not stored:
the request that computed it goes on from its own state, the requests waiting for it compute
it themselves (``alone``), and a later request computes it again.

A preempted request (its copy gone with its blocks) is decided again when the scheduler
restarts it: it forks the entry while one is stored, else recomputes its prompt up to the
prefix, compressed there as its first computation was (and stored again), then the rest
(``Sequence.restart``); a preempted session turn recomputes only its own tokens, over the
history KV its session kept (``cache_node.sessions``). A prefix of the whole prompt (N =
prompt length) is stored
but not forked by a request of that same length: it would have no token to sample from.

The stored prefixes (their key, the copies and their eviction) are
``cache_node.compressed_prefix_store``; this module holds the request side: what a request
names (``check_prefix_tokens``) and ``CompressedPrefixCache``, that store plus the bookkeeping
of the live requests that named a prefix (who computes it, who started, who waits).
"""

from __future__ import annotations

from cache_node.compressed_prefix_store import CompressedPrefixStore, PrefixEntry, PrefixKey
from cache_node.kv_cache_manager import KVCacheManager, cdiv
from cache_node.kv_pool import KVPool
from cache_node.outputs import InvalidRequestError
from cache_node.sequence import Sequence, SequenceStatus


def check_prefix_tokens(value: object, num_prompt_tokens: int) -> int:
    """``value`` as a request's ``prefix_tokens``.

    Raises:
        InvalidRequestError: not an int, or outside [0, ``num_prompt_tokens``].
    """
    if type(value) is not int:
        raise InvalidRequestError(f"prefix_tokens must be an integer, got {type(value).__name__}")
    if not 0 <= value <= num_prompt_tokens:
        raise InvalidRequestError(
            f"prefix_tokens must be in [0, {num_prompt_tokens}] (the prompt's tokens), got {value}"
        )
    return value


class CompressedPrefixCache(CompressedPrefixStore):
    """The node's compressed prefixes (``CompressedPrefixStore``) and the live requests that
    named one.

    Not thread-safe: the engine calls it under its lock.
    """

    def __init__(self, pool: KVPool, kv_manager: KVCacheManager) -> None:
        super().__init__(pool, kv_manager)
        self.keys: dict[str, PrefixKey] = {}  # request id -> the prefix it named (live requests)
        self.members: dict[PrefixKey, dict[str, Sequence]] = {}  # live requests per prefix, by id
        # the members the scheduler started short of their boundary, by request id (``started``):
        # those of them still running there are computing the prefix (``computing``)
        self.starts: dict[PrefixKey, dict[str, Sequence]] = {}
        # waiting requests that compute their prefix themselves: a computation they waited
        # for stored nothing (``store``), so they no longer wait for one another
        self.alone: set[str] = set()

    # ---- arrival, admission, boundary, finish -----------------------------------------------
    def admit(self, seq: Sequence, n: int) -> None:
        """Note a new request's prefix (its key; ``prefix_stop`` at ``n``): nothing is taken
        and nothing waits here. The scheduler decides, when it starts the request, whether it
        forks the stored prefix (``fork``), waits for a running request computing it
        (``computing``) or computes it itself. A request without a compressing policy, with
        ``n`` 0 or continuing a session's blocks is left alone.

        Regression (review 26a, F2): the fork of a stored prefix was copied here, at arrival,
        before the scheduler saw the request: queued requests held a copy each (~57 blocks),
        outside the scheduler's free-block checks and the running requests' accounting, so
        the pool went to 0 free, stored prefixes were evicted and running requests preempted."""
        if n <= 0 or seq.kv is None or seq.block_table or seq.num_computed_tokens:
            return
        seq.prefix_tokens = seq.prefix_stop = n
        key = self.key(seq, n)
        self.keys[seq.request_id] = key
        self.members.setdefault(key, {})[seq.request_id] = seq

    def _pending(self, seq: Sequence) -> PrefixKey | None:
        """The key of the prefix ``seq`` may fork: a request that named one, holds no KV yet
        (new, or restarted) and has a token past it."""
        key = self.keys.get(seq.request_id)
        if key is None or seq.block_table or seq.num_computed_tokens or key[1] >= seq.num_prompt_tokens:
            return None
        return key

    def computing(self, seq: Sequence) -> list[Sequence]:
        """The requests the scheduler runs that are computing the prefix waiting ``seq`` may
        fork (short of their boundary, or compressing there): [] when none, or when ``seq``
        computes it itself (a computation it waited for stored nothing). Only started
        requests count: one still waiting, or preempted, computes nothing.

        Regression (review 26a, F1): a request was parked, outside the scheduler, behind
        whichever request had arrived first with the same prefix, also while that one still
        waited for a slot: an interactive tenant waited 21.0 s (1.83 s without it) behind a
        batch tenant's queued request for the same document, and a priority -1000 request
        behind its own tenant's queued priority 1000 one."""
        key = self._pending(seq)
        if key is None or seq.request_id in self.alone:
            return []
        starts = self.starts.get(key)
        if not starts:
            return []
        found = []
        for rid, s in list(starts.items()):
            if s.status is SequenceStatus.RUNNING and s.prefix_stop:
                if s is not seq:
                    found.append(s)
            else:  # preempted (``started`` notes it again when restarted), or past its boundary
                del starts[rid]
        if not starts:
            del self.starts[key]
        return found

    def started(self, seq: Sequence) -> None:
        """The scheduler started ``seq`` (the only way a request comes to run): short of its
        prefix's boundary, it computes the prefix while it runs (``computing``).

        Regression (review 26e, F2): ``computing`` scanned every live request of the prefix
        for each waiting one, several times a step (admission, slot preemption, the urgent
        check, the stats): quadratic in the requests waiting for one prefix, 59 ms for the
        stats with 800 waiters, 16.7 ms for a kvstrata ``schedule()`` with 256. It now looks
        only at the requests started on the prefix, which the scheduler runs (few)."""
        key = self.keys.get(seq.request_id)
        if key is not None and seq.prefix_stop:
            self.starts.setdefault(key, {})[seq.request_id] = seq

    def stored_entry(self, seq: Sequence) -> PrefixEntry | None:
        """The stored prefix waiting ``seq`` forks when the scheduler starts it (None: it
        computes its prefix, or has none)."""
        key = self._pending(seq)
        return None if key is None else self.entries.get(key)

    def fork_blocks(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Pool blocks a fork of the stored prefix takes for waiting ``seq`` with
        ``num_new_tokens`` more tokens laid out past the prefix: the copy of the entry's
        blocks, the charge blocks its policy state pays (``SequenceKV.settle_charge``) and the
        blocks the new tokens need past the copy's last slot. None when ``seq`` forks
        nothing (``stored_entry``)."""
        entry = self.stored_entry(seq)
        if entry is None:
            return None
        src = entry.seq
        phys = src.num_computed_tokens - src.num_evicted_tokens
        charge = len(src.kv.charge_blocks) + src.kv.charge_debt if src.kv is not None else 0
        return charge + max(len(src.block_table), cdiv(phys + num_new_tokens, self.kv_manager.block_size))

    def fork(self, seq: Sequence) -> bool:
        """Give waiting ``seq`` its copy of the stored prefix (``stored_entry``): the scheduler
        starts it now, its free-block checks passed (``Scheduler._fork_prefix``). False, with
        nothing held, when there is none or the copy failed (the pool short, or the policy's
        ``fork`` raised): ``seq`` then computes the prefix itself."""
        entry = self.stored_entry(seq)
        if entry is None or not self.fork_into(entry, seq):
            return False
        seq.prefix_stop = 0
        return True

    def unfork(self, seq: Sequence) -> None:
        """Undo ``fork``: the scheduler could not start ``seq`` after all (its first chunk did
        not fit beside the copy). Its copy, charge blocks and shared host slots go back
        (``SequenceKV.reset``), and it waits with no KV, as before."""
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.policy_stats.pop("inherited_dropped_tokens", None)
        seq.prefix_stop = seq.prefix_tokens
        entry = self.entries.get(self.keys[seq.request_id])
        if entry is not None:
            entry.num_hits -= 1
        self.num_hits -= 1

    def store(self, seq: Sequence) -> None:
        """``seq`` computed its prefix (``num_computed_tokens == prefix_stop``): compress it
        (question-agnostic) unless its prompt ended there (the engine's ``after_step`` did)
        and store a copy, unless one is stored already (another request computed it first).
        The requests waiting for it fork it when the scheduler starts them; when nothing could
        be stored, those waiting now compute it themselves, side by side (``alone``). A state
        whose policy lost KV for want of room (``Policy.lost_tokens``: SentenceKV sentences
        demoted to a full host tier) is not stored (``num_lossy_skipped``): the next request
        computes the prefix again.

        Regression (hangs review 20 W5): a prefix compressed while the host tier was full was
        stored with its sentences dropped, and every later request forked it, decoding other
        tokens than on a node that had room and reporting nothing in its ``policy_stats``."""
        key = self.keys.get(seq.request_id) or self.key(seq, seq.prefix_stop)
        boundary, seq.prefix_stop = seq.prefix_stop, 0
        kv = seq.kv
        if kv.budget is None:
            # a compression that raises fails ``seq`` (the engine's ``_fail``): it then runs no
            # more, and those waiting for it go on (``computing``); regression: they hung
            kv.budget = kv.policy.budget_tokens(seq.num_computed_tokens)
            kv.policy.compress(kv)
            kv.settle_charge()
            kv.budget = None  # the rest of the prompt is a new turn's (recomputed at its end)
            if kv.compaction_due:  # ``can_rewrite`` found the pool too full
                # Regression (hangs review R1b): a compression the pool had no free blocks
                # for was skipped for good: the request prefilled its question over the whole
                # document, compressed it question-aware at its end (other tokens than alone)
                # and stored nothing. It now stays at its boundary until the compression runs
                # (the scheduler retries it before the request's next step: ``retry``).
                seq.prefix_stop = boundary
                return
        if key in self.entries:
            self.entries.move_to_end(key)
        elif kv.compacted and kv.policy.lost_tokens(kv):
            self.num_lossy_skipped += 1
        elif kv.compacted and self.put(key, seq):
            self.num_stores += 1
        if key not in self.entries:  # those waiting for it must not wait for one another now
            self.alone.update(rid for rid, s in self.members.get(key, {}).items()
                              if s.status is SequenceStatus.WAITING)

    def on_finish(self, seq: Sequence) -> None:
        """``seq`` ended (any reason): forget its prefix. Those waiting for its computation
        (``computing``) go on: one of them computes it when the scheduler starts it."""
        key = self.keys.pop(seq.request_id, None)
        self.alone.discard(seq.request_id)
        starts = self.starts.get(key) if key is not None else None
        if starts is not None:
            starts.pop(seq.request_id, None)
            if not starts:
                del self.starts[key]  # type: ignore[arg-type]
        members = self.members.get(key) if key is not None else None
        if members is not None:
            members.pop(seq.request_id, None)
            if not members:
                del self.members[key]  # type: ignore[arg-type]
