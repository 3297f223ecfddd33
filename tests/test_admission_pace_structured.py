"""A structured request's first token is a sample of its node's pace, its grammar's compile
taken out (review 31).

Structured requests (json_schema, required or named tool calls, strict auto tools) were no
samples at all (their TTFT holds the grammar's compile, the tenant's spec's cost), so a tenant
sending only those never had a pace of its own on a node: it was judged by another tenant's
pace and admitted on its probes alone, one per ``PACE_PROBE_S``, which gave no sample either
(review 29i F3's lockout again: 67 of 299 admitted behind a tenant whose first tokens came 8
times late, 299 of 299 unstructured). Now the node reports each structured request's grammar
wait (``grammar_wait_ms``, from its arrival to its grammar compiled) and ``NodePace`` takes it
out of the request's TTFT (``_grammar_paced``: the compile runs while the queue ahead drains;
the node's report: tests/test_grammar_wait_event.py).

The simulation is tests/test_admission_pace.py's two-tenant one over the real admission code,
tenant B's requests structured (``admit_and_submit``) and held back on the node until their
grammar compiled.
"""

from __future__ import annotations

import heapq
from collections import deque

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling.admission import (
    PACE_MIN_PREDICTED_S,
    PACE_MIN_SAMPLES,
    PACE_RANGE,
    NodePace,
)
from cache_node.structured_output import StructuredOutputSpec
from services import data_plane
from services.global_scheduler import GlobalScheduler
from services.node_request import NodeRequest
from tenants.model import TenantSpec
from tests.test_admission_pace import (
    METER_TOKENS_PER_S,
    STEP_S,
    _finished,
    _scheduler,
    prefill_evenly,
)

SCHEMA = StructuredOutputSpec("json_object", "")


def _submit(gs: GlobalScheduler, tenant: str, rid: str, structured: bool) -> str:
    req = NodeRequest(request_id=rid, tenant=tenant, cache_namespace="ns-" + tenant,
                      sampling=SamplingParams(structured_output=SCHEMA if structured else None),
                      token_ids=tuple(range(300)))
    return gs.admit_and_submit(req, "gw", []).code


def simulate_structured(tmp_path, a_late: float = 8.0, node_slow: float = 1.0, grammar_s: float = 0.2,
                        b_structured: bool = True, seconds: float = 300.0, decode_s: float = 1.0,
                        a_requests: int = 3) -> dict[str, float]:
    """Review 31's scenario: tenant A (interactive, TTFT target 30 s) keeps ``a_requests`` of 300
    uncached tokens in flight; tenant B (interactive, 1 s) sends a 300-token structured prompt
    every second, whose grammar compiles ``grammar_s`` after its arrival (the node passes it
    over until then). The node prefills at ``METER / node_slow`` tokens/s, shared evenly
    between the tenants with prompts ready (the node's VTC order; each tenant's own in order
    of arrival); a request's first token comes half a step after its prefill, an A request's
    ``a_late`` times later than that for A's own reasons; each ends ``decode_s`` after its
    first token (``release`` with its ``finished`` event, B's with its grammar wait). Returns
    B's admitted share, the share of B's requests admitted and within its target (TTFT <=
    1.1 s), and the node's factor at the end."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive", ttft_slo_ms=30000.0),
                                           TenantSpec("b", "interactive", ttft_slo_ms=1000.0)], outbox=True)
    queues: dict[str, deque[list]] = {"a": deque(), "b": deque()}  # [request id, tokens left, arrival]
    compiling: deque[list] = deque()  # B's requests whose grammar compiles, in order of arrival
    releases: list[tuple[float, str, float]] = []
    in_flight_a = n_a = b_sent = b_admitted = b_within = 0
    tick, dt = 0.1, 0.01

    def prefilled(name: str, rid: str, arrival: float) -> None:
        nonlocal b_within
        ttft = (t0 + (sub + 1) * dt - arrival) * (a_late if name == "a" else 1.0) + STEP_S / 2
        heapq.heappush(releases, (arrival + ttft + decode_s, rid, ttft))
        b_within += name == "b" and ttft <= 1.1

    for step in range(int(seconds / tick)):
        t0 = 100.0 + step * tick
        for sub in range(round(tick / dt)):
            while compiling and compiling[0][2] + grammar_s <= t0 + sub * dt + 1e-9:
                queues["b"].append(compiling.popleft())
            prefill_evenly(queues, dt * METER_TOKENS_PER_S / node_slow, prefilled)
        clock.t = t0
        while releases and releases[0][0] <= clock.t:
            at, rid, ttft = heapq.heappop(releases)
            now, clock.t = clock.t, at
            b = rid.startswith("b")
            gs.release(rid, _finished(ttft, 300, grammar_s if b and b_structured else None))
            clock.t = now
            in_flight_a -= not b
        while in_flight_a < a_requests:
            rid, n_a = f"a{n_a}", n_a + 1
            assert _submit(gs, ids["a"], rid, False) == "OK"
            queues["a"].append([rid, 300.0, clock.t])
            in_flight_a += 1
        if step % round(1.0 / tick) == 0 and step > 0:
            b_sent += 1
            rid = f"b{step}"
            if _submit(gs, ids["b"], rid, b_structured) == "OK":
                b_admitted += 1
                (compiling if b_structured else queues["b"]).append([rid, 300.0, clock.t])
    node = gs.nodes["n0"]
    return {"b_admitted": b_admitted / b_sent, "b_within": b_within / b_sent,
            "factor": node.pace.factor(clock.t, len(node.in_flight))}


def test_a_structured_tenant_is_not_locked_out_by_another_tenants_late_first_tokens(tmp_path) -> None:
    """A's first tokens come 8 times late for A's own reasons; B sends only structured
    requests (a 0.2 s compile each). Before: B's first tokens were no samples, B had no pace
    of its own and was admitted on its probes alone (69 of 299 here, the node's factor 5.8 at
    the end; review 31's run without the compile: 67 of 299); now its samples, the compile
    taken out, count and the node's factor is the least of A's and B's: B is admitted as an
    unstructured B is (measured: 299 of 299, all within its target, factor 1.19)."""
    out = simulate_structured(tmp_path)
    assert out["b_admitted"] >= 0.95, out
    assert out["b_within"] >= 0.9, out
    assert out["factor"] <= 1.5, out


def test_a_structured_tenant_on_a_node_slow_for_everyone_is_still_refused(tmp_path) -> None:
    """The other side: the node really is 8 times slower than its meter for every tenant.
    B's structured first tokens, the compile taken out, say so as A's do: B stays mostly
    refused (its requests would miss its target) and the node's factor stays high (measured:
    67 of 299 admitted, none within its target, factor 8; the old code 73 of 299)."""
    out = simulate_structured(tmp_path, a_late=1.0, node_slow=8.0)
    assert out["b_admitted"] <= 0.25, out
    assert out["factor"] >= 4.0, out


def test_hard_grammars_do_not_slow_the_node_for_the_others(tmp_path) -> None:
    """B, alone on the node, has grammars that take 3 s to compile (its own spec's cost; its
    1 s target is missed) while the node runs at its meter's pace: its samples, the compile
    taken out, say the node is at pace, so the node's factor, which every tenant's estimate
    there divides by, stays the meter's (measured: 1.0; its TTFT with the compile in it as the
    sample: 8, the most)."""
    out = simulate_structured(tmp_path, a_late=1.0, grammar_s=3.0, seconds=120.0, a_requests=0)
    assert out["b_admitted"] >= 0.95, out
    assert out["factor"] <= 1.2, out


def test_a_grammar_wait_is_taken_out_of_a_structured_requests_sample() -> None:
    """``NodePace.finished`` of a ``structured`` request: the pace at which its queue ahead and
    its own prefill, started once both that queue is done and its grammar compiled, took its
    TTFT (less promotion and step wait): a node 3 times slow reads 3 whether the compile
    ended during its queue's wait or after it; an unstructured request's reported wait is
    ignored."""
    cases = [  # (ahead s, own s, grammar wait s, ttft s of a node 3 times slow)
        (2.0, 0.1, 0.5, 3 * 2.1), (2.0, 0.1, 10.0, 10.0 + 3 * 0.1), (0.0, 0.3, 1.0, 1.0 + 3 * 0.3),
        (0.2, 0.3, 0.6, 0.6 + 3 * 0.3), (0.2, 0.3, 0.0, 3 * 0.5)]
    for i, (ahead, own, wait, ttft) in enumerate(cases):
        pace = NodePace()
        for j in range(PACE_MIN_SAMPLES):
            rid = f"s{i}-{j}"
            pace.admitted(rid, "b", ahead + own, 0.0, 0, 1000.0, own)
            pace.structured(rid)
            assert pace.finished(rid, 1000.0 * ttft, float(j), 1000.0 * wait), (ahead, own, wait)
        assert pace.factor(3.0, 0) == pytest.approx(3.0), (ahead, own, wait)
    pace = NodePace()  # unstructured: the whole TTFT is the node's, whatever wait it reports
    for j in range(PACE_MIN_SAMPLES):
        pace.admitted(f"u{j}", "b", 1.0, 0.0, 0, 1000.0, 0.5)
        assert pace.finished(f"u{j}", 4000.0, float(j), 3000.0)
    assert pace.factor(3.0, 0) == pytest.approx(4.0)


def test_a_bogus_grammar_wait_makes_no_sample() -> None:
    """The wait is the node's word: one that is no finite number, negative, or past the
    request's TTFT (its first token before its grammar: impossible) is no sample, nor is a
    structured request released without one; a wait that held the request past its queue
    and left under ``PACE_MIN_PREDICTED_S`` of its own prefill says too little. No sample is
    ever negative or past ``PACE_RANGE``."""
    bogus = [None, float("nan"), float("inf"), -1.0, -1e9, 2001.0, 1e12, "500", True]
    for wait in bogus:
        pace = NodePace()
        pace.admitted("r", "b", 1.0, 0.0, 0, 1000.0, 0.5)
        pace.structured("r")
        assert not pace.finished("r", 2000.0, 1.0, wait), wait
        assert not pace.pending and not pace.tenants
    pace = NodePace()
    pace.admitted("r", "b", 1.0, 0.0, 0, 1000.0, PACE_MIN_PREDICTED_S / 2)
    pace.structured("r")
    assert not pace.finished("r", 5000.0, 1.0, 4900.0)  # the wait held it past its queue: 0.1 s left
    # 0.2 s of promotion and step wait, 0.5 s queued ahead, 0.5 s its own prefill
    for ttft, wait, expect in [(2000.0, 2000.0, 0.0), (1000.0, 0.0, 0.8), (60000.0, 0.0, PACE_RANGE[1]),
                               (60000.0, 1000.0, PACE_RANGE[1])]:
        pace = NodePace()
        pace.admitted("r", "b", 1.0, 0.2, 0, 1000.0, 0.5)
        pace.structured("r")
        assert pace.finished("r", ttft, 1.0, wait)
        assert pace.tenants["b"].at(0) == pytest.approx(expect), (ttft, wait)
    # an own part out of [0, predicted] is held within it
    pace = NodePace()
    pace.admitted("r", "b", 1.0, 0.0, 0, 1000.0, 5.0)
    assert pace.pending["r"][5] == 1.0
    pace.admitted("q", "b", 1.0, 0.0, 0, 1000.0, -5.0)
    assert pace.pending["q"][5] == 0.0


def test_the_scheduler_takes_a_structured_requests_sample_with_its_grammar_wait(tmp_path) -> None:
    """Through ``admit_and_submit`` and ``release``: a structured request is pending as such,
    and its ``finished`` event's ``grammar_wait_ms`` is taken out (5 s of TTFT, 4.675 s of it
    the compile: the node at its meter's pace); one released without it is no sample."""
    gs, ids, clock = _scheduler(tmp_path, [TenantSpec("a", "interactive")], outbox=True)
    pace = gs.nodes["n0"].pace
    for i in range(PACE_MIN_SAMPLES):
        clock.t += 10.0
        assert _submit(gs, ids["a"], f"r{i}", True) == "OK"
        assert pace.pending[f"r{i}"][-1] is True
        gs.release(f"r{i}", _finished(5.0, 300, 4.675))
    assert pace.tenants[ids["a"]].samples == PACE_MIN_SAMPLES
    assert pace.own(ids["a"], clock.t, 0) == pytest.approx(1.0)
    clock.t += 10.0
    assert _submit(gs, ids["a"], "x", True) == "OK"
    gs.release("x", _finished(5.0, 300))
    assert pace.tenants[ids["a"]].samples == PACE_MIN_SAMPLES and not pace.pending


def test_a_finished_events_grammar_wait_is_checked_at_the_gateway() -> None:
    """``grammar_wait_ms`` crosses the data plane as the other times of a ``finished`` event:
    a finite number >= 0, or the event is refused (the scheduler holds it to [0, ttft_ms]
    besides)."""
    event = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 1,
             "ttft_ms": 40.0}
    assert data_plane.check_event({**event, "grammar_wait_ms": 12.5})["grammar_wait_ms"] == 12.5
    for bad in (-1.0, float("nan"), float("inf"), "12", None):
        with pytest.raises((TypeError, ValueError), match="grammar_wait_ms"):
            data_plane.check_event({**event, "grammar_wait_ms": bad})

