"""bench.engine and bench.common: workload, statistics, and one tiny real-model run of the bench."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from bench import engine as bench_engine
from bench.common import median, percentile, percentiles, shared_document, wiki_chat_requests
from cache_node.model_loader import LoadedModel
from workloads.corpus import load_corpus

REQUIRED_KEYS = {
    "tokens_per_s", "speedup_vs_hf_generate", "speedup_vs_hf_continuous_batching",
    "prefix_hit_ttft_ratio", "greedy_match",
}


def test_percentile_interpolates_between_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert median(xs) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 25) == pytest.approx(1.75)
    assert percentiles([1.0, 2.0, 3.0], (50, 99)) == {"p50": 2.0, "p99": pytest.approx(2.98)}
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_greedy_match_counts_identical_requests() -> None:
    assert bench_engine.greedy_match([[1, 2], [3], [4, 5]], [[1, 2], [3, 9], [4, 5]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        bench_engine.greedy_match([[1]], [[1], [2]])


@pytest.mark.slow
def test_wiki_chat_requests_are_templated_varied_and_deterministic(real_model: LoadedModel) -> None:
    tok = real_model.tokenizer
    reqs = wiki_chat_requests(tok, load_corpus(), 9, seed=5, min_words=20, max_words=60)
    again = wiki_chat_requests(tok, load_corpus(), 9, seed=5, min_words=20, max_words=60)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]
    assert [len(r.titles) for r in reqs] == [1, 2, 3] * 3
    assert {r.kind for r in reqs} >= {"compare"} and {r.kind for r in reqs} & {"summarize", "question"}
    header = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                     tokenize=False).split("x")[0]
    for r in reqs:
        text = tok.decode(r.prompt_token_ids)
        assert text.startswith(header) and text.rstrip().endswith("assistant")
        assert all(f"## {t}\n" in r.user_text for t in r.titles)
    assert len({len(r.prompt_token_ids) for r in reqs}) >= 6  # varied lengths
    doc = shared_document(tok, load_corpus(), 300, seed=1)
    assert len(tok.encode(doc, add_special_tokens=False)) >= 300


@pytest.mark.slow
def test_bench_runs_all_systems_and_ends_with_the_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Two real-model requests through (a), (b), (c) and a one-round prefix case (< 60 s)."""
    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    try:
        bench_engine.main(["--num-requests", "2", "--max-tokens", "4", "--min-words", "10",
                           "--max-words", "20", "--prefix-doc-tokens", "64", "--prefix-rounds", "1",
                           "--prefix-hits-per-round", "1"])
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert REQUIRED_KEYS <= result.keys()
    assert set(result["tokens_per_s"]) == set(bench_engine.SYSTEMS)
    assert all(v > 0 for v in result["tokens_per_s"].values())
    gen = result["generated_tokens"]
    assert gen[bench_engine.HF_GENERATE] == gen[bench_engine.KVSTRATA] == gen[bench_engine.HF_CB] > 0
    assert result["greedy_match"] == 1.0 and result["greedy_match_hf_continuous_batching"] == 1.0
    assert result["prefix_hit_cached_tokens"] >= 64  # the hit reused at least the document's blocks
    assert 0 < result["prefix_hit_ttft_ratio"] < 1
    assert result["speedup_vs_hf_generate"] == pytest.approx(
        result["tokens_per_s"]["kvstrata"] / result["tokens_per_s"]["hf_generate"], rel=0.01)
