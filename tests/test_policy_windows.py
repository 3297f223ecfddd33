"""Window, sink and budget arithmetic of every KV policy: exactly which positions are kept,
for values including 0, 1 and the sequence length."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cache_node.policies import make_policy
from cache_node.policies.base import LayerView, Policy, protected_mask
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def expected_protected(positions: list[int], sink: int, window: int) -> set[int]:
    recent = sorted(positions)[max(0, len(positions) - window) :] if window else []
    return {p for p in positions if p < sink} | set(recent)


@st.composite
def positions_sink_window(draw):
    """Distinct positions in any order, and sink/window counts around 0, 1 and their length."""
    n = draw(st.integers(0, 40))
    positions = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n, unique=True))
    size = st.sampled_from([0, 1, 2, n - 1, n, n + 1]).filter(lambda v: v >= 0) | st.integers(0, n + 3)
    return positions, draw(size), draw(size)


@settings(max_examples=300, deadline=None)
@given(positions_sink_window())
@example(([5, 0, 9, 3], 0, 0))
@example(([5, 0, 9, 3], 0, 4))
@example(([5, 0, 9, 3], 1, 1))
def test_protected_mask_is_exactly_sinks_and_the_most_recent_window(case) -> None:
    """issue 18 fault 8: a window of 0 selected the whole sequence (a ``[-0:]`` slice)."""
    positions, sink, window = case
    mask = protected_mask(torch.tensor(positions, dtype=torch.long), sink, window)
    assert {p for p, m in zip(positions, mask.tolist()) if m} == expected_protected(positions, sink, window)


@dataclass
class ScoredBySupport(Policy):
    """A scoring policy whose scores are the view's ``support`` column (set by the test)."""

    name = "scored-by-support-test"

    def score(self, view: LayerView) -> torch.Tensor:
        return view.support


def view_of(positions: list[int], scores: list[float]) -> LayerView:
    n = len(positions)
    kv = torch.zeros((n, 1, 2))
    return LayerView(0, 1, kv, kv, torch.tensor(positions, dtype=torch.long), torch.arange(n),
                     torch.tensor(scores, dtype=torch.float32), None, 1.0)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(0, 41), st.integers(0, 41), st.integers(2, 45), st.randoms())
@example(n=10, sink=0, window=0, budget=2, rnd=None)
@example(n=10, sink=1, window=1, budget=10, rnd=None)
@example(n=10, sink=10, window=0, budget=11, rnd=None)
def test_scoring_plan_keeps_protected_then_the_best_scores_up_to_the_budget(n, sink, window, budget, rnd) -> None:
    """issue 18 fault 8: a scoring policy keeps exactly B = budget_tokens entries: the sinks,
    the window, then the highest scores; everything when n <= B."""
    policy = ScoredBySupport(budget=budget, sink_tokens=sink, window_tokens=window)
    b = policy.budget_tokens(n)
    assert b == max(sink + window + 1, budget)
    positions = list(range(n))
    order = list(range(n))
    if rnd is not None:
        rnd.shuffle(order)
    scores = [float(order[i]) for i in range(n)]  # distinct
    kept = set(policy.plan(view_of(positions, scores), b).keep.tolist())
    if n <= b:
        assert kept == set(range(n))
        return
    protected = expected_protected(positions, sink, window)
    rest = sorted(set(range(n)) - protected, key=lambda i: -scores[i])[: b - len(protected)]
    assert kept == protected | set(rest) and len(kept) == b


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(0, 61), st.integers(0, 61), st.integers(2, 70))
def test_streaming_keeps_the_sinks_and_the_most_recent_tokens(n, sink, window, budget) -> None:
    """issue 18 fault 8: StreamingLLM keeps positions < sink_tokens and the B - sinks most
    recent ones, for every sink/window/budget including 0, 1 and n."""
    policy = make_policy(f"streaming-{budget}-sink_tokens_{sink}-window_tokens_{window}")
    b = policy.budget_tokens(n)
    kept = set(policy.plan(view_of(list(range(n)), [0.0] * n), b).keep.tolist())
    sinks = set(range(min(sink, n)))
    recent = set(range(n - (b - len(sinks)), n)) if n > b else set()
    assert kept == (set(range(n)) if n <= b else sinks | recent)


def run_until(eng, rid: str, num_outputs: int):
    while len(eng.requests[rid].output_token_ids) < num_outputs:
        eng.step()
    return eng.requests[rid]


def test_quant_window_zero_quantizes_all_but_the_sinks_and_compacts_once_per_block(tiny) -> None:
    """issue 18 fault 8: quant-bits_8-window_tokens_0 on a 100-token prompt kept all 119 tokens
    in full precision, quantized none and compacted on each of 20 decode steps."""
    eng = make_engine(tiny)
    rid = eng.add_request(prompt_of(100), SamplingParams(max_tokens=21, ignore_eos=True),
                          policy="quant-bits_8-window_tokens_0")
    seq = run_until(eng, rid, 20)  # 119 tokens computed: the prompt and 19 outputs
    kv = seq.kv
    # prefill: 100 > 4 + 0 + 16 -> positions 4..99 move to codes; decode: at 21 held -> 100..116
    assert kv.num_compactions == 2
    assert kv.positions.tolist() == [[0, 1, 2, 3, 117, 118]] * eng.pool.num_layers
    assert kv.extra["quant"].positions.tolist() == list(range(4, 117))
    eng.abort_request(rid)
    eng.step()
    eng.check_integrity()


@pytest.mark.parametrize(("sink", "window", "evict"), [
    (4, 0, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (4, 16, 16), (0, 39, 0), (2, 40, 0),
])
def test_quant_keeps_exactly_sinks_and_window_after_prefill(tiny, sink, window, evict) -> None:
    """issue 18 fault 8: after a 40-token prefill, full precision holds positions < sink and
    the window most recent; the codes hold the rest (nothing moves when all 40 fit)."""
    eng = make_engine(tiny)
    rid = eng.add_request(prompt_of(40), SamplingParams(max_tokens=2, ignore_eos=True),
                          policy=f"quant-sink_tokens_{sink}-window_tokens_{window}-evict_every_{evict}")
    kv = run_until(eng, rid, 1).kv
    if 40 <= sink + window + evict:
        full, coded = list(range(40)), []
    else:
        full = sorted(set(range(min(sink, 40))) | set(range(40 - window, 40)))
        coded = [p for p in range(40) if p not in full]
    assert kv.positions.tolist() == [full] * eng.pool.num_layers
    seg = kv.extra.get("quant")
    assert (seg.positions.tolist() if seg is not None else []) == coded
    assert kv.num_compactions == (1 if coded else 0)


@pytest.mark.parametrize(("sink", "window"), [(4, 0), (0, 0), (4, 1), (0, 1), (1, 3)])
def test_sentencekv_demotes_all_but_sinks_and_window(tiny, sink, window) -> None:
    """issue 18 fault 8: sentencekv keeps positions < sink and the window most recent in the
    pool and demotes exactly the rest, in order, for windows and sinks of 0 and 1."""
    eng = make_engine(tiny)
    rid = eng.add_request(prompt_of(100), SamplingParams(max_tokens=2, ignore_eos=True),
                          policy=f"sentencekv-64-sink_tokens_{sink}-window_tokens_{window}")
    kv = run_until(eng, rid, 1).kv
    full = list(range(sink)) + list(range(100 - window, 100))
    assert kv.positions.tolist() == [full] * eng.pool.num_layers
    demoted = torch.cat(kv.extra["sentences"].positions).tolist()
    assert demoted == list(range(sink, 100 - window))


def test_snapkv_rejects_an_even_pooling_kernel() -> None:
    """issue 18 fault 8: an even kernel pooled n + 1 scores for n entries (shifted by one)."""
    with pytest.raises(ValueError, match=r"kernel_size must be an odd number in \[1, 1023\]"):
        make_policy("snapkv-kernel_size_4")
    assert make_policy("snapkv-kernel_size_1").kernel_size == 1
