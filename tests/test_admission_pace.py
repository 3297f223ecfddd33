"""Admission's TTFT estimate tracks a node slower than its meter says (review 28b, open fault 1).

The fluid backlog drained at the node's metered speed (``prefill_tokens_per_s`` of its
``finished`` events: prefill and decode tokens per second of step time); a node busy decoding,
or slower than it says, served its queue slower, the backlog drained on paper while requests
waited, and admission under-estimated every TTFT and admitted a queue that missed the SLO.
The scheduler hears a request's first token only in its ``finished`` event (``ttft_ms``), and
``NodePace`` learns from it how much slower the queue runs (per tenant, the least pace of
them counting, within ``PACE_RANGE``).

The simulation drives the real admission code (a plain ``GlobalScheduler``, no Ray) with a
simulated node that serves its prefill queue FIFO at its real speed and releases each request
with the ``finished`` event a node sends.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Callable

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.admission import (
    PACE_MAX_TENANTS,
    PACE_MIN_SAMPLES,
    PACE_PROBE_S,
    PACE_RANGE,
    PACE_WINDOW_S,
    NodePace,
)
from cache_node.structured_output import StructuredOutputSpec
from services import global_scheduler_checks
from services.global_scheduler import GlobalScheduler
from services.node_request import NodeRequest
from tenants.model import TenantSpec

METER_TOKENS_PER_S = 1000.0
STEP_S = 0.05


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Outbox:
    """The nodes' command inboxes, for a simulation that plays the node itself."""

    def send(self, inbox: str, message: dict) -> None:
        pass


def _scheduler(tmp_path, specs: list[TenantSpec], nodes: tuple[str, ...] = ("n0",), outbox: bool = False
               ) -> tuple[GlobalScheduler, dict[str, str], Clock]:
    """A plain ``GlobalScheduler`` on a simulated clock, ``specs`` registered, each node metered
    at ``METER_TOKENS_PER_S`` and ``STEP_S``; with ``outbox``, its commands go to ``Outbox``
    (for ``admit_and_submit``)."""
    clock = Clock()
    gs = GlobalScheduler(str(tmp_path), {n: 64 for n in nodes}, queue_limit=1000, scheduler="kvstrata", clock=clock)
    if outbox:
        gs.commands, gs.node_inboxes = Outbox(), {n: "inbox-" + n for n in nodes}
    ids = {}
    for spec in specs:
        tenant, key = gs.register_tenant(spec)
        gs.authenticate(key)
        ids[spec.name] = tenant.tenant_id
    for node in gs.nodes.values():
        node.prefill.set(METER_TOKENS_PER_S)
        node.step_s.update(STEP_S)
    return gs, ids, clock


def _finished(ttft_s: float, prompt_tokens: int = 200, grammar_wait_s: float | None = None) -> dict:
    """A node's ``finished`` event as the gateway forwards it to ``release`` (with
    ``grammar_wait_ms`` for a structured request's)."""
    return {"type": "finished", "finish_reason": "stop", "prompt_tokens": prompt_tokens, "completion_tokens": 20,
            "cached_tokens": {}, "ttft_ms": ttft_s * 1000.0, "tpot_ms": 50.0, "preempted": False,
            "prefill_tokens_per_s": METER_TOKENS_PER_S, "step_s": STEP_S} | (
        {} if grammar_wait_s is None else {"grammar_wait_ms": grammar_wait_s * 1000.0})


def prefill_evenly(queues: dict[str, deque[list]], budget: float, prefilled: Callable[[str, str, float], None]
                   ) -> None:
    """The simulated node's prefill of ``budget`` tokens, shared evenly between the tenants with
    prompts waiting (water-filling: the node's VTC order; each tenant's own in order of arrival).
    ``queues`` maps a tenant to its ``[request id, tokens left, arrival]`` entries;
    ``prefilled(tenant, request id, arrival)`` is called for each prompt done."""
    while budget > 1e-9 and any(queues.values()):
        busy = [q for q in queues.values() if q]
        share = min(budget / len(busy), *(q[0][1] for q in busy))
        for name, q in queues.items():
            if q:
                q[0][1] -= share
                if q[0][1] <= 1e-9:
                    rid, _, arrival = q.popleft()
                    prefilled(name, rid, arrival)
        budget -= share * len(busy)


def simulate(tmp_path, real_tokens_per_s: float, seconds: float = 60.0, every_s: float = 0.4,
             prompt_tokens: int = 200, decode_s: float = 1.0, decode_cost: float = 0.0) -> dict[str, float]:
    """One interactive tenant (TTFT SLO 1 s: refused past it) sends a ``prompt_tokens`` prompt
    every ``every_s``; the node serves its prefill FIFO at ``real_tokens_per_s`` while its meter
    says ``METER_TOKENS_PER_S``; a request's first token comes half a step after its prefill,
    and it ends ``decode_s`` later (``release`` with its ``finished`` event). A node busy
    decoding prefills slower: a request's prefill runs at ``real_tokens_per_s / (1 +
    decode_cost * d)``, ``d`` the requests decoding when it starts (its meter, counting
    prefill and decode tokens per second of step time, does not say so). Returns the
    admitted share, the share of the admitted whose TTFT met the SLO (within 10%: an
    estimate that tracks admits up to the limit), the p95 TTFT and the
    mean actual / estimated TTFT of the admitted (of the last half: past the learning)."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("t", "interactive", ttft_slo_ms=1000.0)])
    estimates: list[float] = []  # each admission's estimate (s), as admission computed it
    estimate_ttft_s = global_scheduler_checks.estimate_ttft_s

    def recording(*args, **kwargs) -> float:
        estimates.append(estimate_ttft_s(*args, **kwargs))
        return estimates[-1]

    global_scheduler_checks.estimate_ttft_s = recording
    try:
        return _run(gs, ids, clock, estimates, real_tokens_per_s, seconds, every_s, prompt_tokens, decode_s,
                    decode_cost)
    finally:
        global_scheduler_checks.estimate_ttft_s = estimate_ttft_s


def _run(gs, ids, clock, estimates, real_tokens_per_s, seconds, every_s, prompt_tokens, decode_s, decode_cost):
    free_at = clock.t  # when the node's prefill queue runs dry
    releases: list[tuple[float, str, float]] = []
    admitted, outcomes = 0, []  # (arrival, ttft, estimate)
    decodes: list[tuple[float, float]] = []  # each admitted request's (first token, end)
    n = int(seconds / every_s)
    for i in range(n):
        clock.t = 100.0 + i * every_s
        while releases and releases[0][0] <= clock.t:
            at, rid, ttft = heapq.heappop(releases)
            now, clock.t = clock.t, at
            gs.release(rid, _finished(ttft))
            clock.t = now
        rid = f"r{i}"
        adm = gs.admit(ids["t"], rid, prompt_tokens=prompt_tokens)
        if adm.code != "OK":
            assert adm.reason == "ttft_estimate"
            continue
        admitted += 1
        estimate_s = estimates[-1]
        start = max(free_at, clock.t)
        decoding = sum(first <= start < end for first, end in decodes)
        done = start + prompt_tokens * (1 + decode_cost * decoding) / real_tokens_per_s
        free_at = done
        ttft = done + STEP_S / 2 - clock.t
        outcomes.append((clock.t, ttft, estimate_s))
        decodes.append((clock.t + ttft, clock.t + ttft + decode_s))
        heapq.heappush(releases, (clock.t + ttft + decode_s, rid, ttft))
    late = [(ttft, est) for at, ttft, est in outcomes if at >= 100.0 + seconds / 2]
    ttfts = sorted(t for t, _ in late)
    return {"admitted": admitted / n,
            "met_slo": sum(t <= 1.1 for t, _ in late) / max(1, len(late)),
            "p95_ttft_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else 0.0,
            "actual_over_estimate": statistics.fmean(t / e for t, e in late) if late else 0.0}


def test_the_estimate_tracks_a_node_three_times_slower_than_its_meter(tmp_path) -> None:
    """The node prefills at 1/3 of what its meter says (500 tokens/s offered). Before: the
    backlog drained on paper at the meter's 1,000 tokens/s and every request was admitted; the
    real queue grew without end (second half: none within the SLO, p95 TTFT 29.6 s, actual
    TTFT 102x the estimate). Now the node's pace is learnt from the first tokens: the actual
    TTFT is the estimate's (1.00x), 58% is admitted (the node serves 333 of the 500 tokens/s)
    and all of it meets the SLO (p95 0.825 s)."""
    out = simulate(tmp_path, real_tokens_per_s=METER_TOKENS_PER_S / 3)
    assert out["met_slo"] >= 0.95, out
    assert out["p95_ttft_s"] <= 1.1, out
    assert out["actual_over_estimate"] == pytest.approx(1.0, abs=0.1), out
    assert 0.5 <= out["admitted"] <= 0.75, out  # about the 333 of 500 tokens/s the node serves


def test_the_estimate_tracks_a_node_busy_decoding(tmp_path) -> None:
    """The node is as fast as its meter says, but each request decoding (4 s each) slows its
    prefill by 20% (500 tokens/s offered). Before: the backlog drained at the meter's speed,
    every request was admitted, and in the second half none met the SLO (p95 TTFT 14.6 s,
    actual 50x the estimate). A pace without the load (the samples come a decode late, the
    load has changed since) left p95 at 2.1 s, 59% within the SLO. Now: p95 1.2 s, 88%."""
    out = simulate(tmp_path, real_tokens_per_s=METER_TOKENS_PER_S, decode_s=4.0, decode_cost=0.2)
    assert out["met_slo"] >= 0.85, out
    assert out["p95_ttft_s"] <= 1.3, out
    assert out["actual_over_estimate"] == pytest.approx(1.0, abs=0.15), out


def test_a_node_as_fast_as_its_meter_admits_as_before(tmp_path) -> None:
    """No regression where the meter is right: everything admitted, within the SLO."""
    out = simulate(tmp_path, real_tokens_per_s=METER_TOKENS_PER_S)
    assert out["admitted"] == 1.0 and out["met_slo"] == 1.0, out
    assert out["actual_over_estimate"] == pytest.approx(1.0, abs=0.1), out


def _pace_samples(gs: GlobalScheduler, clock: Clock, tenant: str, node: str, n: int, ttft_s: float,
                  prompt_tokens: int = 300, tag: str = "") -> None:
    """``n`` requests of ``tenant`` on ``node`` (each alone: released before the next) whose
    first tokens come ``ttft_s`` after admission."""
    for i in range(n):
        clock.t += 10.0
        rid = f"{tag}{tenant}-{node}-{i}"
        assert gs.admit(tenant, rid, prompt_tokens=prompt_tokens, routing_key=node).code == "OK"
        assert gs.requests[rid][1] == node
        gs.release(rid, _finished(ttft_s))


def test_a_lying_node_or_a_late_tenant_is_bounded(tmp_path) -> None:
    """A node's ``ttft_ms`` is its word: a huge one makes that node at most ``PACE_RANGE[1]``
    times slower, a zero one never faster than its meter; another node is untouched; and a
    tenant whose first tokens come late for its own reasons (a grammar to compile) slows no
    other tenant's estimates while that tenant's run at pace."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive"), TenantSpec("b", "interactive")],
                                nodes=("n0", "n1"))
    gs.routing_keys.put(ids["a"], "n0", "n0")
    gs.routing_keys.put(ids["a"], "n1", "n1")
    gs.routing_keys.put(ids["b"], "n0", "n0")
    n0, n1 = gs.nodes["n0"], gs.nodes["n1"]
    _pace_samples(gs, clock, ids["a"], "n0", PACE_MIN_SAMPLES, 1e9)  # 300 tokens: 0.3 s predicted
    assert n0.pace.factor(clock.t, 0) == PACE_RANGE[1]
    assert n1.pace.factor(clock.t, 0) == 1.0 and not n1.pace.tenants
    _pace_samples(gs, clock, ids["a"], "n1", PACE_MIN_SAMPLES, 0.0)
    assert n1.pace.factor(clock.t, 0) == 1.0  # never faster than the meter
    # tenant b's requests on n0 run at pace: a's late first tokens no longer slow n0
    _pace_samples(gs, clock, ids["b"], "n0", PACE_MIN_SAMPLES, 0.325)
    assert n0.pace.factor(clock.t, 0) == pytest.approx(1.0)
    # a node's pace is forgotten once no tenant's samples are recent, and learnt again
    clock.t += PACE_WINDOW_S + 1
    assert n1.pace.factor(clock.t, 0) == 1.0 and not n1.pace.tenants
    _pace_samples(gs, clock, ids["a"], "n1", PACE_MIN_SAMPLES, 3 * 0.3 + 0.025, tag="x")  # 3x: real
    assert n1.pace.factor(clock.t, 0) == pytest.approx(3.0)


def test_only_a_finished_request_with_a_number_is_a_sample(tmp_path) -> None:
    """An aborted or failed request, one the gateway accounts from its own count (no
    ``finished`` event), a ttft that is no finite number, and a request too short to say
    anything (``PACE_MIN_PREDICTED_S``) are no samples; each admitted request's record is
    taken out at its release, whatever it says (bounded by the requests in flight)."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive")])
    pace = gs.nodes["n0"].pace
    bad = [{**_finished(5.0), "finish_reason": "abort"}, {"prompt_tokens": 300, "completion_tokens": 1},
           {**_finished(5.0), "ttft_ms": float("nan")}, {**_finished(5.0), "ttft_ms": "5000"}, None]
    for i, usage in enumerate(bad):
        clock.t += 10.0
        assert gs.admit(ids["a"], f"r{i}", prompt_tokens=300).code == "OK"
        assert f"r{i}" in pace.pending
        gs.release(f"r{i}", usage)
    clock.t += 10.0
    assert gs.admit(ids["a"], "short", prompt_tokens=50).code == "OK"  # 0.05 s predicted
    gs.release("short", _finished(5.0))
    assert not pace.pending and not pace.tenants and pace.factor(clock.t, 0) == 1.0


def test_node_pace_follows_the_load_and_takes_the_least_tenant_pace() -> None:
    """Each tenant's pace is a line in the node's load (requests in flight at admission): the
    factor follows the load now; the least of the tenants' counts, a tenant with fewer than
    ``PACE_MIN_SAMPLES`` samples none; within ``PACE_RANGE``."""
    pace = NodePace()
    for i, load in enumerate([2, 4, 6, 8, 2, 4, 6, 8]):
        pace.admitted(f"a{i}", "a", 1.0, 0.0, load, 1000.0)
        pace.finished(f"a{i}", 1000.0 * (1.0 + 0.25 * load), float(i))  # 1 + L / 4
    assert pace.factor(8.0, 4) == pytest.approx(2.0)
    assert pace.factor(8.0, 12) == pytest.approx(4.0)  # the load now, not the samples'
    assert pace.factor(8.0, 0) == 1.0 and pace.factor(8.0, 100) == PACE_RANGE[1]
    for i in range(PACE_MIN_SAMPLES):  # b's requests run at 1.5x whatever the load
        pace.admitted(f"b{i}", "b", 1.0, 0.0, 4, 1000.0)
        pace.finished(f"b{i}", 1500.0, 8.0)
    assert pace.factor(8.0, 12) == pytest.approx(1.5) and pace.factor(8.0, 2) == pytest.approx(1.5)
    pace.admitted("c0", "c", 1.0, 0.0, 12, 1000.0)
    pace.finished("c0", 1000.0, 8.0)  # one sample: not yet counted
    assert pace.factor(8.0, 12) == pytest.approx(1.5)


class _Outbox:
    def send(self, inbox: str, message: dict) -> None:
        pass


def test_a_structured_request_without_its_grammar_wait_says_nothing_of_the_pace(tmp_path) -> None:
    """A structured request's first token waits for its grammar's compile on the node (seconds,
    the tenant's choice of grammar): released without the wait its node reports
    (``grammar_wait_ms``: tests/test_admission_pace_structured.py) it is no sample, so a tenant
    alone on a node with hard grammars makes no other tenant's later estimates there slower."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive")])
    gs.commands, gs.node_inboxes = _Outbox(), {"n0": "inbox-n0"}
    pace = gs.nodes["n0"].pace
    schema = StructuredOutputSpec("json_object", "")
    for i in range(2 * PACE_MIN_SAMPLES):
        clock.t += 10.0
        req = NodeRequest(request_id=f"r{i}", tenant=ids["a"], cache_namespace="ns",
                          sampling=SamplingParams(structured_output=schema if i % 2 else None),
                          token_ids=tuple(range(300)))
        assert gs.admit_and_submit(req, "gw", []).code == "OK"
        assert f"r{i}" in pace.pending and pace.pending[f"r{i}"][-1] == bool(i % 2)  # structured
        gs.release(f"r{i}", _finished(5.0 if i % 2 else 0.325))  # 5 s: the grammar's compile
    assert pace.factor(clock.t, 0) == pytest.approx(1.0)
    assert pace.tenants[ids["a"]].samples == PACE_MIN_SAMPLES


def simulate_two_tenants(tmp_path, a_late: float = 8.0, node_slow: float = 1.0, b_every_s: float = 5.0,
                         seconds: float = 300.0, decode_s: float = 1.0, slow_for_s: float | None = None
                         ) -> dict[str, float]:
    """Review 29i F3's scenario over the real admission code: tenant A (interactive, TTFT
    target 30 s) keeps 3 requests of 300 uncached tokens in flight; tenant B (interactive, 1 s)
    sends a 300-token prompt every ``b_every_s``. The node prefills at ``METER / node_slow``
    tokens/s, shared evenly between the tenants with prompts waiting (the node's VTC order;
    each tenant's own in order of arrival); a request's first token comes half a step after
    its prefill, an A request's ``a_late`` times later than that for A's own reasons (its queue
    time and prefill times ``a_late``); each ends ``decode_s`` after its first token (``release``
    with its ``finished`` event). With ``slow_for_s``, A is late and the node slow only for
    that long from the start (a transient), then both run at the meter's speed. Returns B's
    admitted share, the share of B's requests admitted and within its target (TTFT <= 1.1 s),
    B's first admission (s from the start, -1 for none), B's first admission within its target
    after the transient (s after its end, -1 for none) and the node's factor at the end."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive", ttft_slo_ms=30000.0),
                                           TenantSpec("b", "interactive", ttft_slo_ms=1000.0)])
    queues: dict[str, deque[list]] = {"a": deque(), "b": deque()}  # [request id, tokens left, arrival]
    releases: list[tuple[float, str, float]] = []
    in_flight_a = n_a = b_sent = b_admitted = b_within = 0
    b_first = b_back = -1.0
    tick, dt = 0.1, 0.01

    def prefilled(name: str, rid: str, arrival: float) -> None:
        nonlocal b_within, b_back
        ttft = (t0 + (sub + 1) * dt - arrival) * (a_late if name == "a" and transient else 1.0) + STEP_S / 2
        heapq.heappush(releases, (arrival + ttft + decode_s, rid, ttft))
        if name == "b":
            b_within += ttft <= 1.1
            if ttft <= 1.1 and b_back < 0 and slow_for_s is not None and arrival - 100.0 >= slow_for_s:
                b_back = arrival - 100.0 - slow_for_s

    for step in range(int(seconds / tick)):
        t0 = 100.0 + step * tick
        transient = slow_for_s is None or t0 - 100.0 < slow_for_s
        for sub in range(round(tick / dt)):
            prefill_evenly(queues, dt * METER_TOKENS_PER_S / (node_slow if transient else 1.0), prefilled)
        clock.t = t0
        while releases and releases[0][0] <= clock.t:
            at, rid, ttft = heapq.heappop(releases)
            now, clock.t = clock.t, at
            gs.release(rid, _finished(ttft))
            clock.t = now
            in_flight_a -= rid.startswith("a")
        while in_flight_a < 3:
            rid, n_a = f"a{n_a}", n_a + 1
            assert gs.admit(ids["a"], rid, prompt_tokens=300).code == "OK"
            queues["a"].append([rid, 300.0, clock.t])
            in_flight_a += 1
        if step % round(b_every_s / tick) == 0 and step > 0:
            b_sent += 1
            rid = f"b{step}"
            if gs.admit(ids["b"], rid, prompt_tokens=300).code == "OK":
                b_admitted += 1
                queues["b"].append([rid, 300.0, clock.t])
                b_first = clock.t - 100.0 if b_first < 0 else b_first
    node = gs.nodes["n0"]
    return {"b_admitted": b_admitted / b_sent, "b_within": b_within / b_sent, "b_first_s": b_first,
            "b_back_s": b_back, "factor": node.pace.factor(clock.t, len(node.in_flight))}


def test_another_tenants_late_first_tokens_lock_no_tenant_out(tmp_path) -> None:
    """Review 29i F3: A's first tokens come 8 times late for A's own reasons (the node serves
    everyone else at its meter's speed). B has no samples of its own, was estimated at A's
    pace, and a refused request is no sample: B was admitted 0 of 59 times in 300 s (59 of 59
    with the factor pinned to 1). Now a refused request of B, which has no pace of its own, is
    a probe once per ``PACE_PROBE_S`` (estimated at the meter's speed: admitted), and once its
    own first tokens count the node's factor is the least of A's and B's: B 59 of 59 admitted,
    all within its target (the old code: 1 of 59, the one before A's pace counted)."""
    out = simulate_two_tenants(tmp_path)
    assert out["b_within"] >= 0.9, out
    assert 0 <= out["b_first_s"] <= 5.0 + PACE_PROBE_S, out


def test_a_node_really_slow_for_everyone_still_refuses_a_new_tenant(tmp_path) -> None:
    """The other side: the node really is 8 times slower than its meter for every tenant. B
    without samples is estimated at A's pace, and the probes are what it pays to learn its
    own: one admitted (late) at a time, then none while its own samples, as slow, count or
    its few ones say it is slow (7 of 59 admitted in 300 s, all late: 2 before A's pace
    counted, and a probe about every 75 s; the old code 3 of 59)."""
    out = simulate_two_tenants(tmp_path, a_late=1.0, node_slow=8.0)
    assert out["b_admitted"] <= 0.25, out
    assert out["factor"] >= 4.0, out


def test_a_tenant_slowed_by_a_transient_is_admitted_again_once_the_node_is_fast(tmp_path) -> None:
    """The node is 8 times slower than its meter for everyone for 30 s, then as fast as it
    (B sends every second, A keeps requests ahead of B's). B's own pace is high after the
    transient and a refused request is no sample; A's requests, admitted, show the node fast
    again and the node's factor, the least pace, falls with them (or, with none admitted, every
    pace expires ``PACE_WINDOW_S`` after its last sample): B is admitted within its target
    again a bounded time after the cause is gone (8 s here)."""
    out = simulate_two_tenants(tmp_path, a_late=1.0, node_slow=8.0, b_every_s=1.0, seconds=180.0,
                               slow_for_s=30.0)
    assert 0 <= out["b_back_s"] <= PACE_WINDOW_S + PACE_PROBE_S + 10.0, out  # measured: 8 s
    assert out["b_within"] >= 0.6, out  # of all 179, the transient's 30 s included: 79%
    assert out["factor"] <= 1.5, out  # 1.09: the fluid model is not quite the node's interleave


def test_a_probe_is_due_only_to_a_tenant_without_a_pace_once_its_last_has_said() -> None:
    """``NodePace.probe``: only for a tenant with no counting pace of its own on a node whose
    factor (the others') is above the meter's; once per ``PACE_PROBE_S`` and not while its last
    probe's first token is still to come; at its own fewer samples' pace, the meter's without
    any; the tenants whose probes a node keeps are bounded."""
    pace = NodePace()
    assert pace.probe("b", 0.0, 0) is None  # the factor is the meter's: nothing to probe
    for i in range(PACE_MIN_SAMPLES):  # a's first tokens 8 times late
        pace.admitted(f"a{i}", "a", 1.0, 0.0, 0, 1000.0)
        pace.finished(f"a{i}", 8000.0, 1.0)
    assert pace.factor(1.0, 0) == PACE_RANGE[1]
    assert pace.probe("a", 1.0, 0) is None  # a's own pace refuses a
    assert pace.probe("b", 1.0, 0) == 1.0
    pace.probed("b", "b0", 1.0)
    pace.admitted("b0", "b", 1.0, 0.0, 0, 1000.0)
    assert pace.probe("b", 1.0 + PACE_PROBE_S / 2, 0) is None  # once per PACE_PROBE_S
    assert pace.probe("b", 1.0 + PACE_PROBE_S, 0) is None  # b0's first token is yet to come
    pace.finished("b0", 2000.0, 2.0)  # b0 ran at twice the meter's pace
    assert pace.probe("b", 1.0 + PACE_PROBE_S, 0) == pytest.approx(2.0)  # its own sample's pace
    for i in range(1, PACE_MIN_SAMPLES):
        pace.admitted(f"b{i}", "b", 1.0, 0.0, 0, 1000.0)
        pace.finished(f"b{i}", 2000.0, 2.0)
    assert pace.probe("b", 10.0, 0) is None and pace.factor(10.0, 0) == pytest.approx(2.0)
    for i in range(PACE_MAX_TENANTS + 10):
        pace.probed(f"t{i}", f"t{i}-0", 10.0)
    assert len(pace.probes) == PACE_MAX_TENANTS
