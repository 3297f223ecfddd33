"""A SentenceKV session turn decodes the same tokens however its prompt is chunked.

The turn prefills over its history's demoted sentences; the sentences its tokens attend are
selected span by span at fixed positions (``Policy.prompt_span``, ``cache_node.query_spans``)
and the scheduler never splits a span (``Sequence.chunk_tokens``), so neither the node's
``max_num_batched_tokens`` (multiples of the span or not) nor another request sharing the
turn's steps changes its output.

Regression (hangs review 20 W3): the recall selected once per prefill chunk from that chunk's
queries; with the turns below, five budgets gave four different third turns.
"""

from __future__ import annotations

import pytest

from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

POLICY = "sentencekv-64"
TURNS = [(81, 291, 14), (49, 457, 1), (72, 874, 12)]  # (new tokens, offset, max_tokens)


def prompt(n: int, off: int) -> list[int]:
    return [13 if i % 12 == 11 else (7 * i + off) % 400 + 20 for i in range(n)]  # 13 ends a sentence


def run_session(tiny, batched: int, neighbour: bool) -> list[tuple[int, ...]]:
    eng = make_engine(tiny, kv_pool_bytes=512 * 8192, max_num_batched_tokens=batched, max_num_seqs=4)
    eng.policy_env = PolicyEnv(frozenset({13}))
    hist: list[int] = []
    outs = []
    for t, (n, off, mx) in enumerate(TURNS):
        if neighbour and t == len(TURNS) - 1:  # another tenant's request decodes beside the turn
            eng.add_request(prompt(40, 5), SamplingParams(max_tokens=30, ignore_eos=True),
                            request_id="other", tenant="other")
            step_until(eng, lambda o: o.request_id == "other" and len(o.output_token_ids) >= 2)
        rid = eng.add_request(hist + prompt(n, off), SamplingParams(max_tokens=mx, ignore_eos=True),
                              request_id=f"t{t}", session_id="s", policy=POLICY)
        done = step_until(eng, lambda o, r=rid: o.finished and o.request_id == r)
        hist = eng.session_history("s")
        outs.append(tuple(done.output_token_ids))
    return outs


def step_until(eng: LLMEngine, hit):  # type: ignore[no-untyped-def]
    for _ in range(500):
        for o in eng.step():
            if hit(o):
                return o
    raise AssertionError("no such output")


@pytest.mark.parametrize(("batched", "neighbour"), [(23, False), (17, True)])
def test_turn_output_does_not_depend_on_chunking(tiny, batched: int, neighbour: bool) -> None:
    assert run_session(tiny, batched, neighbour) == run_session(tiny, 128, False)


class _Spans:
    compresses = False

    def prompt_span(self, state) -> int:  # type: ignore[no-untyped-def]
        return 16


def test_chunk_tokens_end_at_span_cuts() -> None:
    from types import SimpleNamespace

    from cache_node.sequence import Sequence

    seq = Sequence(request_id="r", prompt_token_ids=list(range(100)), sampling_params=SamplingParams())
    seq.kv = SimpleNamespace(policy=_Spans())
    # cuts at 100 - 16 k: 4, 20, 36, 52, 68, 84 and the prompt's end
    assert seq.chunk_tokens(37, 40, 40, 64) == 31  # back to the cut at 68
    assert seq.chunk_tokens(37, 5, 40, 64) == 15  # no cut within the share: the first within the step
    # none within the step: it takes its share anyway (never waits: review 21c, F1-F3), counted
    assert seq.chunk_tokens(37, 5, 5, 64) == 5 and seq.policy_stats["prefill_unaligned_chunks"] == 1
    assert seq.chunk_tokens(37, 5, 5, 10) == 5  # a span over the node's budget: cut anyway
    assert seq.chunk_tokens(80, 10, 10, 64) == 4 and seq.chunk_tokens(90, 6, 6, 64) == 6
    assert seq.chunk_tokens(99, 1, 1, 64) == 1 and seq.chunk_tokens(90, 10, 10, 64) == 10  # the end
    assert seq.policy_stats["prefill_unaligned_chunks"] == 3
    seq.kv = None
    assert seq.chunk_tokens(37, 5, 5, 64) == 5


def test_a_turn_never_waits_preempts_or_blocks_for_a_prompt_span(tiny) -> None:
    """Review 21c, F1-F3: while other requests' decodes left fewer tokens of the step than
    the turn's next 16-token span, the turn waited (a batch-class turn starved behind
    interactive decodes), its admission preempted batch-class requests for want of tokens
    (8 preemptions with 4,073 blocks free), and FCFS admission stopped behind it. It now
    starts in the first step (its chunk then not span-aligned, counted), preempting no one."""
    from cache_node.scheduling.base import TenantShare

    e = make_engine(tiny, kv_pool_bytes=4096 * 8192, max_num_batched_tokens=20, max_num_seqs=16,
                    scheduling_policy="priority")
    e.policy_env = PolicyEnv(frozenset({13}))
    e.scheduler.policy.set_tenant("A", TenantShare("interactive", ttft_slo_ms=1000.0, weight=4.0))
    e.scheduler.policy.set_tenant("B", TenantShare("batch", ttft_slo_ms=60000.0))

    def finish(rid: str) -> None:
        for _ in range(2000):
            if any(o.finished and o.request_id == rid for o in e.step()):
                return
        raise AssertionError(f"{rid} never finished")

    finish(e.add_request(prompt(81, 291), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t0",
                         session_id="s", policy="sentencekv-64", tenant="A"))
    hist = e.session_history("s")
    for i in range(6):
        e.add_request(prompt(10, 50 + i), SamplingParams(max_tokens=60, ignore_eos=True), request_id=f"b{i}",
                      tenant="B")
    for _ in range(40):
        e.step()
        if len(e.scheduler.running) == 6 and all(s.output_token_ids for s in e.scheduler.running):
            break
    before = e.scheduler.num_preemptions
    e.add_request(hist + prompt(31, 874), SamplingParams(max_tokens=4, ignore_eos=True), request_id="t1",
                  session_id="s", policy="sentencekv-64", tenant="A")
    e.step()
    assert "t1" in {s.request_id for s in e.scheduler.running}
    assert e.scheduler.num_preemptions == before
    finish("t1")
