"""Per-token log probabilities and vLLM's ``min_p`` in the sampler (``cache_node.sampler.draw``):
the logprobs are the raw distribution's (log_softmax of the logits before penalties and
temperature, vLLM V1's ``raw_logprobs``), their top-k is the k largest in order, rows that do
not ask get None and a step where none asks computes nothing; ``min_p`` drops tokens under
``min_p`` times the top probability after temperature and before top-k/top-p, as vLLM; and the
engine streams them per token without changing any token it draws."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node import sampler
from cache_node.model_loader import tiny_llama
from cache_node.outputs import TokenLogprobs
from cache_node.sampler import draw, min_p_filter, sample
from cache_node.sampling_params import MAX_LOGPROBS, SamplingParams
from cache_node.sequence import Sequence
from tests.conftest import make_engine

VOCAB = 300


def _seq(name: str, seed: int | None = None, output: tuple[int, ...] = (), **params: object) -> Sequence:
    seq = Sequence(name, [1, 2, 3], SamplingParams(max_tokens=64, seed=seed, **params))  # type: ignore[arg-type]
    seq.output_token_ids = list(output)
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def _check_row(got: TokenLogprobs, row: torch.Tensor, token: int, k: int) -> None:
    """``got`` is ``row``'s raw log_softmax at ``token``, and its k largest, most probable first."""
    want = torch.log_softmax(row.float(), dim=-1)
    assert got.logprob == pytest.approx(float(want[token]), abs=1e-6)
    assert len(got.top) == k
    ids = [t for t, _ in got.top]
    values = [v for _, v in got.top]
    assert len(set(ids)) == k and values == sorted(values, reverse=True)
    assert values == pytest.approx(want.topk(k).values.tolist(), abs=1e-6)
    for token_id, value in got.top:
        assert value == pytest.approx(float(want[token_id]), abs=1e-6)


def test_logprobs_are_the_raw_log_softmax_of_each_asking_row_and_none_for_the_others() -> None:
    """Greedy and sampled rows, with penalties and a temperature: the chosen token's logprob and
    the top-k are those of the logits as the model gave them (raw), not of the penalized or
    scaled ones; rows with ``logprobs`` None get None; k 0 gives the chosen token's alone."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    top = int(logits[0].argmax())  # penalized away: the greedy row draws another token
    seqs = [
        _seq("greedy", logprobs=5, output=(top, top, 9), repetition_penalty=1.8, frequency_penalty=2.0),
        _seq("off"),
        _seq("sampled", seed=3, logprobs=MAX_LOGPROBS, temperature=1.7, top_k=40, top_p=0.9, presence_penalty=2.0),
        _seq("k0", seed=4, logprobs=0, temperature=0.5),
        _seq("off-sampled", seed=5, temperature=1.0),
    ]
    tokens, logprobs = draw(logits, seqs)
    assert logprobs[1] is None and logprobs[4] is None
    for i, k in ((0, 5), (2, MAX_LOGPROBS), (3, 0)):
        got = logprobs[i]
        assert got is not None
        _check_row(got, logits[i], tokens[i], k)
    penalized = sampler.apply_penalties(logits, seqs)
    assert tokens[0] == int(penalized[0].argmax()) != top
    raw = torch.log_softmax(logits[0], dim=-1)  # raw, not the penalized distribution's
    assert logprobs[0] is not None and logprobs[0].logprob != pytest.approx(
        float(torch.log_softmax(penalized[0], dim=-1)[tokens[0]]), abs=1e-3)
    assert logprobs[0].logprob == pytest.approx(float(raw[tokens[0]]), abs=1e-6)


def test_asking_for_logprobs_changes_no_token() -> None:
    """The same logits and seeds draw the same tokens with and without logprobs (greedy and
    sampled rows: computing them takes nothing from a request's generator)."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.7},
              {"temperature": 1.2, "min_p": 0.05}, {"temperature": 0.0, "min_p": 0.9}, {"temperature": 1.0, "top_k": 5}]
    plain = sample(logits, [_seq(str(i), seed=i, **p) for i, p in enumerate(params)])
    asked, logprobs = draw(logits, [_seq(str(i), seed=i, logprobs=3, **p) for i, p in enumerate(params)])
    assert asked == plain and all(lp is not None for lp in logprobs)
    assert plain[0] == int(logits[0].argmax())
    assert plain[4] == int(logits[4].argmax())  # min_p leaves a greedy row's token alone


def test_a_step_where_no_row_asks_computes_no_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """No row asks: ``token_logprobs`` (the log_softmax and topk) is never called, every entry
    is None and the tokens are ``sample``'s."""

    def refuse(*args: object) -> None:
        raise AssertionError("logprobs computed for a step where no row asked")

    monkeypatch.setattr(sampler, "token_logprobs", refuse)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    seqs = [_seq("a"), _seq("b", seed=1, temperature=1.0), _seq("c", min_p=0.2, seed=2, temperature=0.9)]
    tokens, logprobs = draw(logits, seqs)
    assert logprobs == [None, None, None] and tokens[0] == int(logits[0].argmax())


def test_only_the_asking_rows_reach_the_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched computation sees the asking rows only (1 of 4 here), and the widest k."""
    seen: list[tuple[int, int]] = []
    real = sampler.token_logprobs

    def spy(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
        seen.append((len(rows), k))
        return real(logits, tokens, rows, k)

    monkeypatch.setattr(sampler, "token_logprobs", spy)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    _, logprobs = draw(logits, [_seq("a"), _seq("b", logprobs=2), _seq("c"), _seq("d")])
    assert seen == [(1, 2)] and [lp is None for lp in logprobs] == [True, False, True, True]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.lists(st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)), min_size=1,
                                                 max_size=6),
       scale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_logprobs_match_log_softmax_for_any_rows(seed: int, rows: list[int | None], scale: float) -> None:
    """Any mix of asking rows and k: each asking row's entry is the reference log_softmax's."""
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * scale
    seqs = [_seq(str(i), seed=seed + i, logprobs=k, temperature=1.0 if i % 2 else 0.0) for i, k in enumerate(rows)]
    tokens, logprobs = draw(logits, seqs)
    for i, k in enumerate(rows):
        if k is None:
            assert logprobs[i] is None
        else:
            got = logprobs[i]
            assert got is not None
            _check_row(got, logits[i], tokens[i], k)


def test_min_p_keeps_the_tokens_at_or_over_min_p_times_the_top_probability() -> None:
    """Probabilities 0.5, 0.25, 0.15, 0.1 and min_p 0.3: the bar is 0.15, so the last token
    alone goes (hand-computed); min_p 0 keeps all, 1 keeps the top token alone."""
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    kept = min_p_filter(logits, 0.3)
    assert torch.isinf(kept).tolist() == [False, False, False, True]
    assert torch.equal(kept[:3], logits[:3])
    assert torch.equal(min_p_filter(logits, 0.0), logits)
    assert torch.isinf(min_p_filter(logits, 1.0)).tolist() == [False, True, True, True]


def test_min_p_applies_after_temperature_and_before_top_p_as_vllms() -> None:
    """vLLM's order: temperature, min-p, top-k, top-p. Probabilities 0.4, 0.3, 0.2, 0.1:
    min_p 0.6 (bar 0.24) keeps tokens 0 and 1 (4/7, 3/7), after which top_p 0.5 keeps token 0
    alone (top-p first would keep 0 and 1): every draw is 0. At temperature 4 the same min_p
    keeps all four (probabilities flatten past the bar)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    seqs = [_seq(str(i), seed=i, temperature=1.0, min_p=0.6, top_p=0.5) for i in range(64)]
    assert set(sample(logits.expand(64, 4).clone(), seqs)) == {0}
    seqs = [_seq(str(i), seed=i, temperature=1.0, min_p=0.6) for i in range(64)]
    assert set(sample(logits.expand(64, 4).clone(), seqs)) == {0, 1}
    assert not torch.isinf(min_p_filter(logits / 4.0, 0.6)).any()
    seqs = [_seq(str(i), seed=i, temperature=4.0, min_p=0.6) for i in range(256)]
    assert set(sample(logits.expand(256, 4).clone(), seqs)) == {0, 1, 2, 3}


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.0), ("logprobs", "2"),
    ("min_p", 1.5), ("min_p", -0.1), ("min_p", math.nan), ("min_p", math.inf), ("min_p", True), ("min_p", "0.1"),
])
def test_out_of_range_logprobs_and_min_p_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_in_range_values_are_kept() -> None:
    params = SamplingParams(logprobs=MAX_LOGPROBS, min_p=1)
    assert (params.logprobs, params.min_p) == (MAX_LOGPROBS, 1.0) and isinstance(params.min_p, float)
    assert (SamplingParams().logprobs, SamplingParams().min_p) == (None, 0.0)


def _generate(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[TokenLogprobs]]:
    """Run one request ``prompt`` to its end on ``engine``: its tokens and their entries (one
    per token when ``params.logprobs`` is set, none otherwise: checked at every step)."""
    engine.add_request(prompt, params, request_id="r")
    tokens: list[int] = []
    entries: list[TokenLogprobs] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            entries.extend(out.logprobs)
            assert len(out.logprobs) == (len(out.new_token_ids) if params.logprobs is not None else 0)
    return tokens, entries


def test_the_engine_streams_one_entry_per_token_and_draws_the_same_tokens(tiny) -> None:
    """On the tiny model: a greedy request asking for 4 logprobs gets one ``TokenLogprobs`` per
    step's token, whose logprob is the max of its top (greedy, no penalty) and equals a direct
    forward's log_softmax over prompt + output so far; the same request without logprobs gets
    the same tokens and no entries."""
    prompt = [5, 17, 42, 99, 7, 3]

    def run(logprobs: int | None) -> tuple[list[int], list[TokenLogprobs]]:
        return _generate(make_engine(tiny), prompt, SamplingParams(max_tokens=6, logprobs=logprobs, ignore_eos=True))

    tokens, entries = run(4)
    assert run(None) == (tokens, []) and len(entries) == 6
    reference = tiny_llama(seed=0).model  # the same weights, with transformers' own attention
    reference.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: -1]
    for step, (token, entry) in enumerate(zip(tokens, entries)):
        assert entry.top[0] == (token, pytest.approx(entry.logprob, abs=1e-6))
        assert entry.logprob == pytest.approx(float(reference[step, token]), abs=1e-3)
        assert [v for _, v in entry.top] == pytest.approx(reference[step].topk(4).values.tolist(), abs=1e-3)


def _wire(sampling: SamplingParams) -> dict:
    from services import data_plane_wire
    from services.node_request import NodeRequest

    return data_plane_wire.request_to_wire(NodeRequest(request_id="r", tenant="t", cache_namespace="ns",
                                                       token_ids=(1, 2), sampling=sampling))


def test_the_node_request_wire_carries_logprobs_and_min_p() -> None:
    import msgpack

    from services import data_plane_wire

    for params in (SamplingParams(max_tokens=9, logprobs=7, min_p=0.25), SamplingParams(max_tokens=9)):
        wire = msgpack.unpackb(msgpack.packb(_wire(params)))
        assert data_plane_wire.request_from_wire(wire).sampling == params


@pytest.mark.parametrize("bad", [
    {"logprobs": True}, {"logprobs": "3"}, {"logprobs": 3.0}, {"logprobs": 21}, {"logprobs": -1},
    {"min_p": "0.1"}, {"min_p": False}, {"min_p": 2.0}, {"min_p": None}, {"min_p": float("nan")},
])
def test_the_node_request_wire_checks_logprobs_and_min_p(bad: dict) -> None:
    """Every byte off the network is untrusted: a mistyped or out-of-range value is a
    TypeError/ValueError naming its field, never a SamplingParams that fails in the step."""
    from services import data_plane_wire

    wire = _wire(SamplingParams(max_tokens=9))
    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        data_plane_wire.request_from_wire({**wire, "sampling": {**wire["sampling"], **bad}})


@pytest.mark.slow
def test_the_engine_logprobs_equal_transformers_on_the_real_model(real_model) -> None:
    """SmolLM2-135M: a greedy request asking for 5 logprobs; each token's entry equals the
    log_softmax of transformers' own forward (sdpa, float32) over the prompt and the output so
    far within 1e-3, the top 5 are its top 5 in order and the greedy token's logprob is their
    max; the tokens are transformers' greedy ones."""
    tok = real_model.tokenizer
    prompt = tok("The capital of France is").input_ids
    tokens, entries = _generate(make_engine(real_model, kv_pool_bytes=32 << 20), prompt,
                                SamplingParams(max_tokens=5, logprobs=5, ignore_eos=True))
    reference = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    reference.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: -1]
    assert rows.argmax(-1).tolist() == tokens and len(entries) == 5
    for step, (token, entry) in enumerate(zip(tokens, entries)):
        want = rows[step].topk(5)
        assert [t for t, _ in entry.top] == want.indices.tolist() and entry.top[0][0] == token
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=1e-3)
        assert entry.logprob == pytest.approx(float(rows[step, token]), abs=1e-3) == entry.top[0][1]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_row_of_non_finite_logits_sends_logprobs_the_gateway_accepts(bad: float) -> None:
    """Review 26c F5: a greedy row whose logits hold NaN or +inf (served its tokens without
    logprobs: a greedy row is not drawn) sent a NaN logprob, refused at the gateway as a
    malformed event (UNAVAILABLE, blaming the node). Its non-finite values are now -inf (the
    API's -9999.0), the finite rows' unchanged, and each entry passes the gateway's checks."""
    from services.data_plane_replies import check_event, check_logprobs_asked
    from services.node_request import logprobs_entry

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[0, 7] = bad  # log_softmax of the whole row is NaN
    logits[1, :5] = bad
    seqs = [_seq("one", logprobs=4), _seq("five", logprobs=4), _seq("finite", logprobs=4)]
    plain = sample(logits, [_seq(s.request_id) for s in seqs])
    tokens, logprobs = draw(logits, seqs)
    assert tokens == plain  # asking changes no token
    for i in (0, 1):
        got = logprobs[i]
        assert got is not None and got.logprob == -math.inf and len(got.top) == 4
        assert all(v == -math.inf for _, v in got.top) and len({t for t, _ in got.top}) == 4
    _check_row(logprobs[2], logits[2], tokens[2], 4)  # type: ignore[arg-type]
    for i, got in enumerate(logprobs):
        assert got is not None
        event = {"type": "delta", "text": "", "token_ids": [tokens[i]],
                 "logprobs": [logprobs_entry(got.logprob, got.top)]}
        check_logprobs_asked(check_event(event), 4)


def test_logprobs_past_the_vocabulary_are_refused_at_the_node(tiny) -> None:
    """Review 26c F4: a request asking for more alternatives than the vocabulary holds got
    the vocabulary's (the sampler's topk bound) and its stream ended UNAVAILABLE at the
    gateway, which wants exactly k. The rule is k <= vocabulary, refused InvalidRequestError
    naming logprobs (the gateway refuses it first, INVALID_ARGUMENT:
    ``tests/test_logprobs_served.py``)."""
    from cache_node.outputs import InvalidRequestError

    engine = make_engine(tiny)
    engine.vocab_size = 12  # a model with a vocabulary under MAX_LOGPROBS
    with pytest.raises(InvalidRequestError, match=r"^logprobs: asks for 13 alternatives per token; the "
                                                  r"model's vocabulary has 12 tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, logprobs=13), request_id="r")
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, logprobs=12), request_id="ok") == "ok"
