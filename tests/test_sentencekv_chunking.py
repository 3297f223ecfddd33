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
    assert seq.chunk_tokens(37, 5, 5, 64) == 0  # none within the step: it waits
    assert seq.chunk_tokens(37, 5, 5, 10) == 5  # a span over the node's budget: cut anyway
    assert seq.chunk_tokens(80, 10, 10, 64) == 4 and seq.chunk_tokens(90, 6, 6, 64) == 0
    assert seq.chunk_tokens(99, 1, 1, 64) == 1 and seq.chunk_tokens(90, 10, 10, 64) == 10  # the end
    seq.kv = None
    assert seq.chunk_tokens(37, 5, 5, 64) == 5
