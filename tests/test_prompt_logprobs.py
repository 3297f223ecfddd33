"""Prompt logprobs (``SamplingParams.prompt_logprobs``, ``cache_node.prompt_logprobs``): each
prompt token after the first gets its logprob, rank and top k at its position, equal to
transformers' own forward's log_softmax over the prompt (SmolLM2-135M, float32, within 1e-4),
whatever the chunking, with a warm prefix cache, after a preemption (none twice), on a session's
second turn, with the lm_head slices smaller than a chunk; bad values are refused naming the
field; asking changes no generated token."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cache_node import prompt_logprobs
from cache_node.outputs import InvalidRequestError, PromptLogprob
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is "
        "the capital of Germany. Water boils at one hundred degrees")


@pytest.fixture(scope="module")
def reference(real_model: Any) -> Any:
    """The same weights under transformers' own attention (sdpa, float32)."""
    model = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _want(reference: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]  # row i: prompt token i + 1


@pytest.fixture(scope="module")
def want(reference: Any) -> Callable[[list[int]], torch.Tensor]:
    """``prompt`` -> ``_want(reference, prompt)``, each prompt's forward once (~0.6 s of CPU;
    seven checks ask for ``TEXT``'s). Callers only read the rows."""
    rows: dict[tuple[int, ...], torch.Tensor] = {}

    def get(prompt: list[int]) -> torch.Tensor:
        if tuple(prompt) not in rows:
            rows[tuple(prompt)] = _want(reference, prompt)
        return rows[tuple(prompt)]

    return get


def _run(engine: Any, prompt: list[int], k: int | None, request_id: str = "r", **kw: Any) -> tuple[list, list[int], Any]:
    """Run one request to its end: its prompt logprobs (in output order), its tokens, its last output."""
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k),
                       request_id=request_id, **kw)
    entries: list[PromptLogprob] = []
    tokens: list[int] = []
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not (tokens and out.prompt_logprobs)  # all of them come by the first token
            entries.extend(out.prompt_logprobs)
            tokens.extend(out.new_token_ids)
            last = out
    return entries, tokens, last


def _check(entries: list[PromptLogprob], prompt: list[int], want: torch.Tensor, k: int) -> None:
    assert [e.token_id for e in entries] == prompt[1:]  # the first prompt token has none
    for i, entry in enumerate(entries):
        row = want[i]
        assert entry.logprob == pytest.approx(float(row[prompt[i + 1]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[i + 1]]).sum()) + 1
        top = row.topk(k)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_in_one_chunk_and_in_many(real_model, want) -> None:
    prompt = real_model.tokenizer(TEXT).input_ids
    assert len(prompt) > 30
    rows = want(prompt)
    one, tokens, _ = _run(make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=256), prompt, 5)
    _check(one, prompt, rows, 5)
    chunked, chunked_tokens, _ = _run(make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=7),
                                      prompt, 5)
    _check(chunked, prompt, rows, 5)
    assert chunked_tokens == tokens
    plain, plain_tokens, _ = _run(make_engine(real_model, kv_pool_bytes=32 << 20), prompt, None)
    assert plain == [] and plain_tokens == tokens  # asking changes no generated token


@pytest.mark.slow
def test_a_warm_prefix_cache_is_not_read_and_the_values_are_the_same(real_model, want) -> None:
    """The second identical request computes its whole prompt (no cached tokens) and gets the
    same values; one not asking reuses the cache as before."""
    prompt = real_model.tokenizer(TEXT).input_ids
    engine = make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=16)
    first, _, _ = _run(engine, prompt, 0, "a")
    second, _, last = _run(engine, prompt, 0, "b")
    assert last.num_cached_tokens == 0
    _check(second, prompt, want(prompt), 0)
    assert [(e.token_id, e.logprob, e.rank) for e in second] == [(e.token_id, e.logprob, e.rank) for e in first]
    assert _run(engine, prompt, None, "c")[2].num_cached_tokens > 0


@pytest.mark.slow
def test_a_preempted_request_sends_each_prompt_logprob_once(real_model, want) -> None:
    """Preempted mid-prompt (and again after its prompt), it recomputes from the prefix cache
    only the positions it took already, and sends no entry twice."""
    prompt = real_model.tokenizer(TEXT).input_ids
    engine = make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=16)
    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2), request_id="r")
    entries: list[PromptLogprob] = []
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            entries.extend(out.prompt_logprobs)
        steps += 1
        seq = engine.requests.get("r")
        if seq is not None and steps in (1, 3) and seq in engine.scheduler.running:
            assert (seq.num_computed_tokens < len(prompt)) == (steps == 1)
            engine.scheduler.preempt(seq)
    assert engine.scheduler.num_preemptions == 2
    _check(entries, prompt, want(prompt), 2)


@pytest.mark.slow
def test_a_session_turn_computes_its_history_again(real_model, want) -> None:
    prompt = real_model.tokenizer(TEXT).input_ids
    engine = make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=64)
    _, tokens, _ = _run(engine, prompt, None, "t1", session_id="s")
    turn = prompt + tokens + real_model.tokenizer(" and more").input_ids
    entries, _, last = _run(engine, turn, 1, "t2", session_id="s")
    assert last.num_cached_tokens == 0
    _check(entries, turn, want(turn), 1)


@pytest.mark.slow
def test_lm_head_slices_smaller_than_the_chunk_give_the_same(real_model, want, monkeypatch) -> None:
    monkeypatch.setattr(prompt_logprobs, "LOGIT_ROWS", 3)
    prompt = real_model.tokenizer(TEXT).input_ids
    entries, _, _ = _run(make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=64), prompt, 20)
    _check(entries, prompt, want(prompt), 20)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_out_of_range_prompt_logprobs_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]


def test_the_engine_refuses_prompt_logprobs_with_prefix_tokens(tiny) -> None:
    engine = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        engine.add_request([1, 2, 3, 4], SamplingParams(prompt_logprobs=0), prefix_tokens=2)
    assert not engine.requests


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny) -> None:
    entries, tokens, _ = _run(make_engine(tiny), [5], 3)
    assert entries == [] and len(tokens) == 3


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["snapkv-0.5", "quant-bits_4", "streaming-16"])
def test_under_a_kv_policy_they_are_those_of_the_forward_it_ran(real_model, want, policy: str) -> None:
    """Under these compressing and quantizing policies a prompt's KV stays full precision until
    its prefill ends (they compress then): its prompt logprobs are the full-precision forward's,
    in one chunk and in chunks of 8 (docs: a policy compacting mid-prompt would give those of
    the forward it ran)."""
    prompt = real_model.tokenizer(TEXT).input_ids
    rows = want(prompt)
    for chunk in (256, 8):
        entries, _, _ = _run(make_engine(real_model, kv_pool_bytes=32 << 20, max_num_batched_tokens=chunk),
                             prompt, 1, policy=policy)
        assert [e.token_id for e in entries] == prompt[1:]
        got = torch.tensor([e.logprob for e in entries])
        ref = rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert torch.isfinite(got).all()
        assert float((got - ref).abs().max()) <= 1e-4, (policy, chunk)


def test_a_request_that_would_skip_prompt_positions_fails_alone(tiny) -> None:
    """The guard: a sequence asked to compute past positions it has not taken (which admission
    never allows) fails with "error" alone; the request beside it runs on."""
    engine = make_engine(tiny, max_num_batched_tokens=8)
    engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2, prompt_logprobs=0), request_id="a")
    engine.add_request(list(range(40, 50)), SamplingParams(max_tokens=2), request_id="b")
    engine.step()
    engine.requests["a"].prompt_logprobs_done = 0  # as if positions had been skipped
    ends = {}
    while engine.has_unfinished_requests():
        ends.update({o.request_id: o.finish_reason for o in engine.step() if o.finished})
    assert ends == {"a": "error", "b": "length"}
