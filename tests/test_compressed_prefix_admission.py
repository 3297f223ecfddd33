"""Requests reusing a compressed document prefix go through the scheduler like any other
(review 26a, F1 and F2): the first one the scheduler starts computes the prefix, the others
wait only for a running computation, in the policy's order and their priorities, and each
takes its copy of the stored prefix when it starts, under admission's block checks; a
queued request holds no block. Real engine (tiny model); every answer is still the quality
harness's question-agnostic one, and every block comes back.
"""

from __future__ import annotations

from cache_node.engine import LLMEngine
from cache_node.outputs import RequestOutput
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.base import TenantShare
from cache_node.sequence import Sequence, SequenceStatus
from tests.conftest import make_engine
from tests.test_compressed_prefix import agnostic_answers, count_computed, doc_of, questions

SPEC = "snapkv-0.25"
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)
DOC = doc_of(300)
QS = questions(4)


def add_doc(eng: LLMEngine, rid: str, q: list[int], **kw: object) -> str:
    return eng.add_request(DOC + q, GREEDY, request_id=rid, policy=SPEC, prefix_tokens=len(DOC), **kw)


def add_busy(eng: LLMEngine, rid: str, k: int, tenant: str = "t") -> str:
    """A plain request of ``LONG`` tokens out (it holds a running slot for 40 steps)."""
    return eng.add_request([400 + k] * 20, LONG, request_id=rid, tenant=tenant)


def drain(eng: LLMEngine, first: dict[str, int] | None = None) -> dict[str, RequestOutput]:
    """Step to the end: the finished outputs by id; ``first``: the step of each id's first token."""
    final: dict[str, RequestOutput] = {}
    for step in range(5000):
        if not eng.has_unfinished_requests():
            return final
        for out in eng.step():
            if first is not None and out.new_token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("requests did not finish")


def prefix_blocks_of_waiting(eng: LLMEngine) -> list[int]:
    return [len(s.block_table) + len(s.kv.charge_blocks) for s in eng.scheduler.waiting if s.prefix_tokens]


def end_clean(eng: LLMEngine) -> None:
    """Every request done: nothing waits for a prefix, every block is free once the stored
    prefixes go, and the pool's invariants hold."""
    assert eng.stats()["compressed_prefix_parked"] == 0
    assert not eng.prefixes.keys and not eng.prefixes.members and not eng.prefixes.starts
    eng.prefixes.clear()
    assert eng.stats()["used_blocks"] == 0
    eng.check_integrity()


def test_a_waiter_scheduled_first_computes_the_prefix_by_priority(tiny) -> None:
    """Regression (review 26a, F1): a priority -1000 request parked behind its own tenant's
    priority 1000 request for the same document while that one was still queued (one slot,
    taken): the queued one ran first, the other waited for its prefix. Now both wait in the
    queue, holding nothing; the scheduler starts the priority -1000 one first, which computes
    the prefix, and the priority 1000 one forks it after."""
    eng = make_engine(tiny, kv_pool_bytes=4 << 20, max_num_seqs=1)
    counts = count_computed(eng)
    add_busy(eng, "busy", 0)
    eng.step()
    add_doc(eng, "late", QS[0], tenant="t", priority=1000)
    add_doc(eng, "urgent", QS[1], tenant="t", priority=-1000)
    assert [s.request_id for s in eng.scheduler.waiting] == ["urgent", "late"]
    assert prefix_blocks_of_waiting(eng) == [0, 0]
    first: dict[str, int] = {}
    out = drain(eng, first)
    assert first["busy"] < first["urgent"] < first["late"]
    assert counts["urgent"] == len(DOC) + len(QS[1]) + GREEDY.max_tokens - 1  # computed the prefix
    assert counts["late"] == len(QS[0]) + GREEDY.max_tokens - 1  # forked it
    assert (out["urgent"].num_cached_tokens, out["late"].num_cached_tokens) == (0, len(DOC))
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (1, 1)
    got = [list(out["late"].output_token_ids), list(out["urgent"].output_token_ids)]
    assert got == agnostic_answers(eng, DOC, [QS[0], QS[1]], SPEC, GREEDY.max_tokens, 64)
    end_clean(eng)


def test_a_preempted_computation_is_taken_over_by_the_waiter_started_first(tiny) -> None:
    """The request computing the prefix is preempted: it computes nothing while it waits, so
    the request waiting for it is not left waiting; the scheduler's first pick (the tenant's
    priority -5 request, ahead of the preempted priority 5 one) computes the prefix now and
    the preempted one forks it (before: the waiter stayed parked behind the preempted one
    until that one was started again and reached its boundary)."""
    eng = make_engine(tiny, kv_pool_bytes=4 << 20)
    counts = count_computed(eng)
    add_doc(eng, "first", QS[0], tenant="t", priority=5)
    eng.step()
    add_doc(eng, "second", QS[1], tenant="t", priority=-5)
    eng.step()
    first_seq = eng.requests["first"]
    assert 0 < first_seq.num_computed_tokens < len(DOC)  # computing the prefix
    assert eng.stats()["compressed_prefix_parked"] == 1  # "second" waits for it
    eng.scheduler.preempt(first_seq)
    assert eng.stats()["compressed_prefix_parked"] == 0  # nothing computes the prefix now
    eng.step()
    assert [s.request_id for s in eng.scheduler.running] == ["second"]
    assert eng.stats()["compressed_prefix_parked"] == 1  # "first" waits for it now
    out = drain(eng)
    # "second" computed the prefix from where "first" had cached its blocks (2 steps of 64)
    assert out["second"].num_cached_tokens == 128
    assert counts["second"] == len(DOC) - 128 + len(QS[1]) + GREEDY.max_tokens - 1
    assert out["first"].num_preemptions == 1 and out["first"].num_cached_tokens == 0
    assert eng.prefixes.num_hits == 1 and eng.prefixes.num_stores == 1
    got = [list(out["first"].output_token_ids), list(out["second"].output_token_ids)]
    assert got == agnostic_answers(eng, DOC, [QS[0], QS[1]], SPEC, GREEDY.max_tokens, 64)
    end_clean(eng)


def interactive_first_token(tiny, with_batch_producer: bool) -> tuple[int, dict[str, RequestOutput], LLMEngine]:
    """kvstrata scheduling, two slots: batch tenant carol decodes twice, and, when
    ``with_batch_producer``, queues a request for the document in namespace "team"; then
    interactive tenant dave asks about the same document in "team". Returns dave's first
    token's step, counted from his arrival."""
    eng = make_engine(tiny, kv_pool_bytes=4 << 20, max_num_seqs=2, scheduling_policy="kvstrata")  # type: ignore[arg-type]
    eng.scheduler.policy.set_tenant("carol", TenantShare("batch", ttft_slo_ms=60_000.0))
    eng.scheduler.policy.set_tenant("dave", TenantShare("interactive", ttft_slo_ms=5_000.0))
    for k in range(2):
        add_busy(eng, f"carol{k}", k, tenant="carol")
    eng.step()
    if with_batch_producer:
        add_doc(eng, "carol_doc", QS[0], tenant="carol", cache_namespace="team", priority=1000)
        eng.step()
        assert eng.requests["carol_doc"] in eng.scheduler.waiting and prefix_blocks_of_waiting(eng) == [0]
    add_doc(eng, "dave", QS[1], tenant="dave", cache_namespace="team")
    first: dict[str, int] = {}
    out = drain(eng, first)
    return first["dave"], out, eng


def test_an_interactive_request_never_waits_for_a_queued_batch_request_of_its_prefix(tiny) -> None:
    """Regression (review 26a, F1): tenants sharing a cache namespace share compressed
    prefixes, and an interactive request parked behind a batch tenant's request for the same
    document while that one waited for a slot: 21.0 s instead of 1.83 s on the real service.
    Now dave starts exactly as without carol's queued request (the policy preempts a batch
    decode for him), computes the prefix, and carol's request forks it later."""
    control, _, _ = interactive_first_token(tiny, with_batch_producer=False)
    step, out, eng = interactive_first_token(tiny, with_batch_producer=True)
    assert step == control
    assert out["dave"].num_cached_tokens == 0 and out["carol_doc"].num_cached_tokens == len(DOC)
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (1, 1)
    end_clean(eng)


def test_queued_requests_hold_no_copy_of_a_stored_prefix(tiny) -> None:
    """Regression (review 26a, F2): a request forking a stored compressed prefix copied its
    blocks when it arrived, before the scheduler started it: three queued requests held a
    copy each, outside admission's block checks. Now they hold nothing while both slots are
    taken, the pool's free blocks do not move when they arrive, the stored prefix stays, and
    each takes its copy when it starts (forked: only its question computed)."""
    eng = make_engine(tiny, kv_pool_bytes=4 << 20, max_num_seqs=2)
    eng.generate([DOC + QS[0]], GREEDY, policy=SPEC, prefix_tokens=len(DOC))
    pool = eng.kv_manager.pool
    stored = eng.stats()["compressed_prefix_blocks"]
    assert stored > 0
    counts = count_computed(eng)
    for k in range(2):
        add_busy(eng, f"busy{k}", k)
    eng.step()
    free = pool.num_free_blocks()
    for k in (1, 2, 3):
        add_doc(eng, f"fork{k}", QS[k])
    assert pool.num_free_blocks() == free
    for _ in range(10):
        eng.step()
        assert prefix_blocks_of_waiting(eng) == [0, 0, 0]
        held = sum(s.num_held_blocks for s in eng.scheduler.running)
        assert eng.stats()["used_blocks"] == stored + held  # the running requests' and the prefix's
    out = drain(eng)
    assert [out[f"fork{k}"].num_cached_tokens for k in (1, 2, 3)] == [len(DOC)] * 3
    assert [counts[f"fork{k}"] for k in (1, 2, 3)] == [len(QS[k]) + GREEDY.max_tokens - 1 for k in (1, 2, 3)]
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (1, 3)
    assert [o.num_preemptions for o in out.values()] == [0] * 5
    got = [list(out[f"fork{k}"].output_token_ids) for k in (1, 2, 3)]
    assert got == agnostic_answers(eng, DOC, QS[1:], SPEC, GREEDY.max_tokens, 64)
    end_clean(eng)


def test_a_fork_that_does_not_fit_waits_for_blocks_and_keeps_its_prefix(tiny) -> None:
    """A fork whose copy does not fit the free blocks (a long prompt runs) waits for them
    like any other admission, holding nothing: the running request is not preempted and the
    stored prefix is not dropped for it (it is the queue's head: ``_release_idle_sessions``
    counts its copy, not its whole prompt); it forks once the blocks are back (before: it
    found no room for the copy at its arrival and computed the whole document itself)."""
    eng = make_engine(tiny, kv_pool_bytes=1 << 20)
    pool = eng.kv_manager.pool
    eng.generate([DOC + QS[0]], GREEDY, policy=SPEC, prefix_tokens=len(DOC))
    stored = eng.stats()["compressed_prefix_blocks"]
    assert stored > 2
    # a plain prompt that, running, leaves stored - 2 blocks free: fewer than the copy
    big = [300 + i % 50 for i in range((pool.num_blocks - 2 * stored + 2) * 16 - 8)]
    eng.add_request(big, SamplingParams(max_tokens=8, ignore_eos=True), request_id="big", cache_namespace="x")
    while eng.requests["big"].in_prefill:
        eng.step()
    assert pool.num_free_blocks() < stored
    add_doc(eng, "fork", QS[1])
    for _ in range(3):
        eng.step()
        assert eng.requests["fork"] in eng.scheduler.waiting and prefix_blocks_of_waiting(eng) == [0]
        assert eng.stats()["compressed_prefix_blocks"] == stored
    out = drain(eng)
    assert out["big"].num_preemptions == 0 and out["fork"].num_cached_tokens == len(DOC)
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (1, 1)
    assert [list(out["fork"].output_token_ids)] == agnostic_answers(eng, DOC, [QS[1]], SPEC, GREEDY.max_tokens, 64)
    end_clean(eng)


def test_a_queued_forks_prefix_is_not_dropped_to_make_room_for_another_queued_request(tiny) -> None:
    """A fork takes its copy only when it starts, so the stored prefix it waits for must stay
    while it waits: when the queue's head (another tenant's request) finds fewer free blocks
    than its need, the idle state dropped for it is the other stored prefix, though the
    fork's is the least recently used. (Without that, seen on the real service: a queued
    fork's prefix was dropped for the head and the fork computed 1,000 tokens again.)"""
    eng = make_engine(tiny, kv_pool_bytes=1 << 20, max_num_seqs=2)
    pool = eng.kv_manager.pool
    other_doc = [(5 * i) % 450 + 2 for i in range(300)]
    eng.generate([DOC + QS[0]], GREEDY, policy=SPEC, prefix_tokens=len(DOC))
    eng.generate([other_doc + QS[0]], GREEDY, policy=SPEC, prefix_tokens=len(other_doc))
    (doc_key, entry), _ = eng.prefixes.entries.items()  # least recently used first
    stored = len(entry.seq.block_table)
    assert eng.stats()["compressed_prefix_blocks"] == 2 * stored
    busy = SamplingParams(max_tokens=40, ignore_eos=True)
    blocks_each = (pool.num_blocks - 2 * stored - 6) // 2  # at their ends, 6 blocks are left free
    for k in range(2):
        eng.add_request([200 + k] * (blocks_each * 16 - 40), busy, request_id=f"busy{k}", cache_namespace="b")
    while any(eng.requests[f"busy{k}"].in_prefill for k in range(2)):
        eng.step()
    assert pool.num_free_blocks() < pool.num_blocks // 10  # the head's need: idle state goes for it
    eng.add_request([9] * 20, GREEDY, request_id="head", tenant="other", cache_namespace="b")
    add_doc(eng, "fork", QS[1])
    eng.step()
    assert [s.request_id for s in eng.scheduler.waiting] == ["head", "fork"]
    assert list(eng.prefixes.entries) == [doc_key]  # the other prefix went for "head"
    out = drain(eng)
    assert out["fork"].num_cached_tokens == len(DOC)
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (2, 1)
    end_clean(eng)


class CountingStatus:
    """``Sequence.status`` as a descriptor that counts its reads (``reads``)."""

    def __init__(self) -> None:
        self.reads = 0

    def __get__(self, obj: Sequence | None, owner: type | None = None) -> SequenceStatus:
        if obj is None:
            return SequenceStatus.WAITING
        self.reads += 1
        return obj.__dict__["status"]

    def __set__(self, obj: Sequence, value: SequenceStatus) -> None:
        obj.__dict__["status"] = value


def test_the_work_per_step_grows_linearly_with_the_requests_waiting_for_one_prefix(tiny, monkeypatch) -> None:
    """Regression (review 26e, F2): ``computing`` scanned every live request of the prefix
    for each waiting one, in admission, slot preemption, the urgent check and the stats:
    quadratic in the requests waiting for one prefix (a kvstrata step 16.7 ms with 256
    waiters, the stats 59 ms with 800). Counted here as reads of a request's status: with 96
    waiters on one running computation, one kvstrata step read 18,432 and the stats 9,216
    (2n² and n²); now at most 2 and 1 per waiter. The waiters still wait for the
    computation, then fork it one by one."""
    counter = CountingStatus()
    monkeypatch.setattr(Sequence, "status", counter)
    eng = make_engine(tiny, kv_pool_bytes=16 << 20, max_num_seqs=1, scheduling_policy="kvstrata")  # type: ignore[arg-type]
    eng.scheduler.policy.set_tenant("t", TenantShare("interactive", ttft_slo_ms=5_000.0))
    add_doc(eng, "r", QS[0], tenant="t")
    eng.step()
    n = 96
    for k in range(n):
        eng.add_request(DOC + QS[k % 4] + [k + 1], GREEDY, request_id=f"w{k}", policy=SPEC,
                        prefix_tokens=len(DOC), tenant="t")
    counter.reads = 0
    eng.step()
    assert counter.reads <= 2 * n + 16
    counter.reads = 0
    assert eng.stats()["compressed_prefix_parked"] == n
    assert counter.reads <= n + 8
    assert [s.request_id for s in eng.scheduler.running] == ["r"] and 0 < eng.requests["r"].num_computed_tokens
    out = drain(eng)
    assert [out[f"w{k}"].num_cached_tokens for k in range(n)] == [len(DOC)] * n
    assert (eng.prefixes.num_stores, eng.prefixes.num_hits) == (1, n)
    end_clean(eng)
