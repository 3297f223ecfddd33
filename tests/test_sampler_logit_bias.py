"""OpenAI's ``logit_bias`` and vLLM's ``allowed_token_ids`` in the sampler and the engine: a
+100 bias forces its token and -100 bans it under greedy and sampling, the allowed ids are the
only ones drawn, the log probabilities stay the raw distribution's, vLLM V1's order (before
``min_tokens``' mask, the penalties, temperature and min-p), only the rows that ask pay, the
ranges, the node wire, the engine's vocabulary checks, and SmolLM2 through the engine.
Before these fields existed every test here failed (``SamplingParams`` took neither)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_node import sampler
from cache_node.outputs import InvalidRequestError
from cache_node.sampler import apply_token_constraints, draw, sample
from cache_node.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_SAMPLING_TOKEN_ID,
    SamplingParams,
)
from cache_node.sequence import Sequence
from tests.conftest import make_engine

VOCAB = 300


def _seq(seed: int | None = None, prompt: tuple[int, ...] = (1, 2, 3), output: tuple[int, ...] = (),
         **params: Any) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=64, seed=seed, **params))
    seq.output_token_ids = list(output)
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def _logits(seed: int, rows: int = 1, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_a_bias_of_100_forces_its_token_under_greedy_and_sampling() -> None:
    """+100 on the least probable token: greedy takes it, and so does every sampled draw
    (temperature 1 and 2, top-p 0.9, top-k 5: the biased token is the top one for each)."""
    logits = _logits(0)
    low = int(logits[0].argmin())
    assert sample(logits, [_seq(logit_bias={low: 100})]) == [low]
    for seed in range(40):
        for extra in ({"temperature": 1.0}, {"temperature": 2.0, "top_p": 0.9}, {"temperature": 1.5, "top_k": 5}):
            assert sample(logits, [_seq(seed, logit_bias={low: 100.0}, **extra)]) == [low], (seed, extra)


def test_a_bias_of_minus_100_bans_its_token_under_greedy_and_sampling() -> None:
    """-100 on the greedy token: greedy takes the second best; on the two most probable tokens
    of a sharp row (together ~all the mass), no sampled draw is either."""
    logits = _logits(1)
    first, second = logits[0].topk(2).indices.tolist()
    assert sample(logits, [_seq(logit_bias={first: -100})]) == [second]
    sharp = torch.full((1, VOCAB), -5.0)
    sharp[0, 7], sharp[0, 9] = 10.0, 9.0
    assert sample(sharp, [_seq(0, temperature=1.0)]) in ([7], [9])
    for seed in range(60):
        token = sample(sharp, [_seq(seed, temperature=1.0, logit_bias={7: -100, 9: -100.0})])[0]
        assert token not in (7, 9), seed


def test_allowed_token_ids_restrict_greedy_and_sampled_draws() -> None:
    """Greedy takes the best allowed id (not the row's argmax); sampled draws at temperature 2
    take only allowed ids, and each of them comes up."""
    logits = _logits(2)
    best = int(logits[0].argmax())
    allowed = [t for t in (3, 50, 120, 299) if t != best]
    want = max(allowed, key=lambda t: float(logits[0, t]))
    assert sample(logits, [_seq(allowed_token_ids=allowed)]) == [want]
    flat = torch.zeros(1, VOCAB)
    drawn = {sample(flat, [_seq(seed, temperature=2.0, allowed_token_ids=allowed)])[0] for seed in range(200)}
    assert drawn == set(allowed)


def test_the_constraints_leave_other_rows_and_the_allowed_logits_exact() -> None:
    """Row by row: an allowed id keeps its logit (plus its bias), every other id is -inf; a row
    asking nothing is its logits bit for bit."""
    logits = _logits(3, rows=3)
    seqs = [_seq(allowed_token_ids=[5, 6, 7], logit_bias={6: 2.5, 200: -1.0}), _seq(), _seq(logit_bias={0: 1.0})]
    got = apply_token_constraints(logits, seqs)
    want = torch.full((VOCAB,), float("-inf"))
    want[[5, 6, 7]] = logits[0, [5, 6, 7]]
    want[6] += 2.5
    assert torch.equal(got[0], want)  # 200's bias lands on -inf: still -inf
    assert torch.equal(got[1], logits[1])
    want = logits[2].clone()
    want[0] += 1.0
    assert torch.equal(got[2], want)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=6))
def test_the_batched_constraints_equal_a_row_by_row_reference(seed: int, asks: list[tuple[bool, bool]]) -> None:
    rng = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(asks), VOCAB, generator=rng)
    seqs, want = [], logits.clone()
    for row, (allow, bias) in enumerate(asks):
        ids = torch.randperm(VOCAB, generator=rng)[: 1 + seed % 40].tolist() if allow else None
        pairs = {t: float(torch.rand((), generator=rng)) * 200 - 100 for t in torch.randint(0, VOCAB, (seed % 9,),
                                                                                             generator=rng).tolist()}
        seqs.append(_seq(allowed_token_ids=ids, logit_bias=pairs if bias else {}))
        if ids is not None:
            mask = torch.ones(VOCAB, dtype=torch.bool)
            mask[ids] = False
            want[row, mask] = float("-inf")
        for token, value in (pairs.items() if bias else ()):
            want[row, token] += value
    assert torch.equal(apply_token_constraints(logits, seqs), want)


def test_logprobs_stay_the_raw_distributions_with_a_bias_and_an_allowed_set() -> None:
    """vLLM V1's raw_logprobs: the log_softmax of the model's logits before the bias and the mask,
    also for the forced token."""
    logits = _logits(4)
    low = int(logits[0].argmin())
    tokens, entries = draw(logits, [_seq(logit_bias={low: 100}, allowed_token_ids=[low, 4], logprobs=3)])
    raw = torch.log_softmax(logits[0], dim=-1)
    assert tokens == [low] and entries[0] is not None
    assert entries[0].logprob == pytest.approx(float(raw[low]), abs=1e-6)
    assert [t for t, _ in entries[0].top] == raw.topk(3).indices.tolist()
    assert [v for _, v in entries[0].top] == pytest.approx(raw.topk(3).values.tolist(), abs=1e-6)


def test_the_bias_applies_before_the_repetition_penalty_as_vllms() -> None:
    """vLLM V1: logit bias, then penalties. Token 10 (2.0, in the prompt) with +3 and
    repetition 2 is (2 + 3) / 2 = 2.5 < token 11's 3.0: greedy takes 11 (penalty first would
    make 10 2 / 2 + 3 = 4.0 and take it)."""
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 10], logits[0, 11] = 2.0, 3.0
    assert sample(logits, [_seq(prompt=(10,), logit_bias={10: 3.0}, repetition_penalty=2.0)]) == [11]
    assert sample(logits, [_seq(prompt=(10,), logit_bias={10: 3.0})]) == [10]


def test_the_bias_applies_before_temperature_and_min_p_as_vllms() -> None:
    """Two allowed tokens at 0, token 1 biased +1, temperature 0.5, min_p 0.2: scaled, token 2's
    probability is e^-2 = 0.135 of token 1's, under min_p, so it is never drawn (a bias added
    after temperature would leave e^-1 = 0.37 and draw it ~27% of the time)."""
    flat = torch.zeros(1, VOCAB)
    for seed in range(100):
        seq = _seq(seed, temperature=0.5, min_p=0.2, allowed_token_ids=[1, 2], logit_bias={1: 1.0})
        assert sample(flat, [seq]) == [1], seed


def test_min_tokens_masks_eos_even_when_biased_or_allowed() -> None:
    """The ``min_tokens`` mask comes after the bias (vLLM's processors: -inf stays -inf): EOS
    with +100, or EOS among the allowed ids, is not drawn before ``min_tokens``; after, it is."""
    logits = _logits(5).repeat(2, 1)
    eos = 0
    for params in ({"logit_bias": {eos: 100}}, {"allowed_token_ids": [eos, 42]}):
        early = _seq(min_tokens=2, output=(9,), **params)
        later = _seq(min_tokens=2, output=(9, 9), **params)
        got = sample(logits, [early, later], eos_token_ids=(eos,))
        assert got[0] != eos and got[1] == (eos if "logit_bias" in params else
                                            max((eos, 42), key=lambda t: float(logits[0, t])))
    assert sample(logits[:1], [_seq(min_tokens=2, allowed_token_ids=[eos, 42])], eos_token_ids=(eos,)) == [42]


def test_a_step_where_no_row_asks_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy, no index, no scatter: the logits themselves come back."""
    def refuse(*args: object) -> None:
        raise AssertionError("a step without logit_bias or allowed_token_ids built an index")

    monkeypatch.setattr(sampler, "_entries", refuse)
    logits = _logits(6, rows=3)
    assert apply_token_constraints(logits, [_seq(), _seq(temperature=1.0), _seq(top_k=3)]) is logits


def test_only_the_asking_rows_are_indexed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[int], list[list[int]]]] = []
    real = sampler._entries

    def spy(rows: list[int], columns: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((list(rows), [list(c) for c in columns]))
        return real(rows, columns, device)

    monkeypatch.setattr(sampler, "_entries", spy)
    seqs = [_seq(), _seq(logit_bias={4: 1.0, 2: -1.0}), _seq(), _seq(allowed_token_ids=[9, 8])]
    apply_token_constraints(_logits(7, rows=4), seqs)
    assert calls == [([0], [[8, 9]]), ([1], [[2, 4]])]  # the allowed rows by position among them


def _reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``apply_token_constraints`` written out row by row (ids past the vocabulary dropped)."""
    out = logits.float().clone()
    vocab = out.shape[1]
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if params.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[[t for t in params.allowed_token_ids if t < vocab]] = True
            out[i] = out[i].masked_fill(~keep, float("-inf"))
        for t, b in params.logit_bias:
            if t < vocab:
                out[i, t] += torch.tensor(b, dtype=torch.float32)
    return out


def test_each_requests_constraint_tensors_are_built_once_not_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 27c F3): every step rebuilt Python lists of every entry of every
    asking row (~1.4 ms per row per step at the bounds: 93 ms per step at 64 rows). Now each
    request's ids and biases become tensors on its first step and later steps reuse them:
    over 5 steps of 6 rows at the bounds (4 asking, one both) there are 4 builds, and every
    step's logits equal the row-by-row reference. The timing: ``python -m bench.sampler_constraints``."""
    builds: list[SamplingParams] = []
    real = sampler._build_constraints

    def spy(params: SamplingParams, vocab: int, device: torch.device) -> sampler.TokenConstraints:
        builds.append(params)
        return real(params, vocab, device)

    monkeypatch.setattr(sampler, "_build_constraints", spy)
    vocab, rng = 49_152, torch.Generator().manual_seed(3)
    ids = torch.randperm(vocab, generator=rng)
    bias = {int(t): float(b) for t, b in zip(ids[:MAX_LOGIT_BIAS_TOKENS], torch.randn(MAX_LOGIT_BIAS_TOKENS, generator=rng))}
    allowed = ids[-MAX_ALLOWED_TOKEN_IDS:].tolist()
    seqs = [_seq(), _seq(logit_bias=bias), _seq(allowed_token_ids=allowed), _seq(top_k=3),
            _seq(logit_bias=bias, allowed_token_ids=[*allowed[:5], *ids[:5].tolist()]), _seq(logit_bias={7: 1.5})]
    for step in range(5):
        logits = torch.randn(len(seqs), vocab, generator=rng)
        assert torch.equal(apply_token_constraints(logits, seqs), _reference(logits, seqs)), step
    assert [id(p) for p in builds] == [id(seqs[i].sampling_params) for i in (2, 4, 1, 5)]


def test_constraint_tensors_follow_the_params_and_the_vocabulary() -> None:
    """The tensors kept on a sequence are rebuilt when its parameters or the logits'
    vocabulary differ: a smaller vocabulary drops the ids past it."""
    seq = _seq(logit_bias={5: 100.0, 250: 100.0}, allowed_token_ids=[5, 250, 260])
    assert apply_token_constraints(torch.zeros(1, VOCAB), [seq]).argmax().item() in (5, 250)
    first = seq.token_constraints
    apply_token_constraints(torch.zeros(1, VOCAB), [seq])
    assert seq.token_constraints is first
    small = apply_token_constraints(torch.zeros(1, 200), [seq])
    assert small[0, 5] == 100.0 and torch.isinf(small[0, torch.arange(200) != 5]).all()
    assert seq.token_constraints.allowed.tolist() == [5] and seq.token_constraints.bias_ids.tolist() == [5]
    seq.sampling_params = SamplingParams(max_tokens=4, logit_bias={9: -3.0})
    out = apply_token_constraints(torch.zeros(1, VOCAB), [seq])
    assert out[0, 9] == -3.0 and out[0, 5] == 0.0 and bool(torch.isfinite(out).all())


@pytest.mark.parametrize(("params", "match"), [
    ({"logit_bias": {1: 100.5}}, r"logit_bias values must be finite numbers in \[-100, 100\]"),
    ({"logit_bias": {1: -101}}, "logit_bias values"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias values"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias values"),
    ({"logit_bias": {1: "1"}}, "logit_bias values"),
    ({"logit_bias": {1: True}}, "logit_bias values"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias must hold token ids"),
    ({"logit_bias": {MAX_SAMPLING_TOKEN_ID + 1: 1.0}}, "logit_bias must hold token ids"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias must hold token ids"),
    ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias names token id 1 twice"),
    ({"logit_bias": [(1, 1.0, 3)]}, "logit_bias entries"),
    ({"logit_bias": "x"}, "logit_bias must map"),
    ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}}, "logit_bias must hold at most 4096 token ids, got 4097"),
    ({"allowed_token_ids": []}, "allowed_token_ids must hold at least one"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must hold token ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids must hold token ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids must hold token ids"),
    ({"allowed_token_ids": "12"}, "allowed_token_ids must be a list"),
    ({"allowed_token_ids": [0] * (MAX_ALLOWED_TOKEN_IDS + 1)}, "allowed_token_ids must hold at most 4096 token ids, got 4097"),
])
def test_out_of_range_values_are_refused_naming_the_field(params: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)


def test_in_range_values_are_kept_sorted() -> None:
    params = SamplingParams(logit_bias={9: 100, 2: -100.0, 5: 0}, allowed_token_ids=[7, 3, 7])
    assert params.logit_bias == ((2, -100.0), (5, 0.0), (9, 100.0)) and params.allowed_token_ids == (3, 7)
    assert (SamplingParams().logit_bias, SamplingParams().allowed_token_ids) == ((), None)
    hash(params)  # frozen and hashable, as before
    full = SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS)},
                          allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)))
    assert len(full.logit_bias) == MAX_LOGIT_BIAS_TOKENS and len(full.allowed_token_ids or ()) == MAX_ALLOWED_TOKEN_IDS


def _wire(sampling: SamplingParams) -> dict[str, Any]:
    from services import data_plane_wire
    from services.node_request import NodeRequest

    return data_plane_wire.request_to_wire(NodeRequest(request_id="r", tenant="t", cache_namespace="ns",
                                                       token_ids=(1, 2), sampling=sampling))


def test_the_node_request_wire_carries_both_as_flat_arrays() -> None:
    import msgpack

    from services import data_plane, data_plane_wire

    params = SamplingParams(max_tokens=9, logit_bias={7: 2.5, 3: -100}, allowed_token_ids=[3, 7, 8])
    wire = _wire(params)
    assert wire["sampling"]["logit_bias"] == [[3, 7], [-100.0, 2.5]]
    for sent in (params, SamplingParams(max_tokens=9)):
        unpacked = data_plane.unpack(msgpack.packb(_wire(sent)))
        assert data_plane_wire.request_from_wire(unpacked).sampling == sent


@pytest.mark.parametrize(("bad", "match"), [
    ({"logit_bias": [[1, 2], [1.0]]}, "logit_bias must be two arrays"),
    ({"logit_bias": [[1], [1.0], [2]]}, "logit_bias must be two arrays"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias"),
    ({"logit_bias": [["1"], [1.0]]}, "logit_bias ids"),
    ({"logit_bias": [[1], ["1"]]}, "logit_bias biases"),
    ({"logit_bias": [[True], [1.0]]}, "logit_bias ids"),
    ({"logit_bias": [[1], [300.0]]}, "logit_bias values"),
    ({"logit_bias": [[1, 1], [1.0, 2.0]]}, "logit_bias names token id 1 twice"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1 << 40]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
])
def test_the_node_request_wire_checks_both(bad: dict[str, Any], match: str) -> None:
    """Every byte off the network is untrusted: a mistyped or out-of-range value is a
    TypeError/ValueError naming its field, never a SamplingParams that fails in the step."""
    from services import data_plane_wire

    wire = _wire(SamplingParams(max_tokens=9))
    with pytest.raises((TypeError, ValueError), match=match):
        data_plane_wire.request_from_wire({**wire, "sampling": {**wire["sampling"], **bad}})


def _generate(engine: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    engine.add_request(prompt, params, request_id="r")
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason or reason
    return tokens, reason


def test_the_engine_draws_allowed_and_biased_tokens_on_the_tiny_model(tiny) -> None:
    """Greedy and sampled requests on the tiny model: each allowed set is all its tokens come
    from; +100 on one id makes every token it; -100 on the greedy tokens changes them."""
    prompt = [5, 17, 42, 99, 7, 3]
    plain, _ = _generate(make_engine(tiny), prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    for temperature in (0.0, 1.0):
        tokens, _ = _generate(make_engine(tiny), prompt, SamplingParams(
            max_tokens=6, ignore_eos=True, temperature=temperature, seed=3, allowed_token_ids=[11, 12, 13]))
        assert len(tokens) == 6 and set(tokens) <= {11, 12, 13}, temperature
        tokens, _ = _generate(make_engine(tiny), prompt, SamplingParams(
            max_tokens=6, ignore_eos=True, temperature=temperature, seed=3, logit_bias={77: 100}))
        assert tokens == [77] * 6, temperature
    banned, _ = _generate(make_engine(tiny), prompt, SamplingParams(
        max_tokens=6, ignore_eos=True, logit_bias=dict.fromkeys(plain, -100)))
    assert not set(banned) & set(plain)


def test_a_forced_eos_ends_the_request_and_min_tokens_holds_it_off(tiny) -> None:
    """+100 on EOS ends the request at its first token (finish "stop"); with min_tokens 3 the
    first three tokens are others and the fourth is EOS."""
    engine = make_engine(tiny)
    eos = min(engine.eos_token_ids)
    tokens, reason = _generate(engine, [5, 6, 7], SamplingParams(max_tokens=8, logit_bias={eos: 100}))
    assert (tokens, reason) == ([eos], "stop")
    tokens, reason = _generate(make_engine(tiny), [5, 6, 7], SamplingParams(max_tokens=8, min_tokens=3,
                                                                           logit_bias={eos: 100}))
    assert len(tokens) == 4 and eos not in tokens[:3] and tokens[3] == eos and reason == "stop"


@pytest.mark.parametrize(("params", "match"), [
    ({"logit_bias": {10**6: 1.0}}, r"logit_bias: token id 1000000 is outside the model's vocabulary \[0, "),
    ({"allowed_token_ids": [1, 10**6]}, r"allowed_token_ids: token id 1000000 is outside"),
])
def test_ids_past_the_vocabulary_are_refused_at_the_node(tiny, params: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        make_engine(tiny).add_request([1, 2, 3], SamplingParams(max_tokens=4, **params))


def test_an_allowed_set_that_min_tokens_empties_is_refused_at_the_node(tiny) -> None:
    """Only EOS and a stop id allowed while min_tokens holds them off: no token could be drawn
    (greedy would take id 0). Refused naming allowed_token_ids; with ignore_eos, or another id
    allowed, or no min_tokens, it is served."""
    engine = make_engine(tiny)
    eos = min(engine.eos_token_ids)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids: every allowed token ends the request"):
        engine.add_request([1, 2], SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[eos, 9],
                                                  stop_token_ids=(9,)))
    for params in ({"min_tokens": 1, "ignore_eos": True}, {"min_tokens": 1, "allowed_token_ids": [eos, 10]},
                   {"min_tokens": 0}):
        merged: dict[str, Any] = {"allowed_token_ids": [eos], **params}
        make_engine(tiny).add_request([1, 2], SamplingParams(max_tokens=4, **merged))


@pytest.mark.slow
def test_the_engine_honours_both_on_the_real_model(real_model) -> None:
    """SmolLM2-135M, "The capital of France is": transformers' own greedy next token is banned
    by -100 (the engine then takes transformers' second best), forced by +100 on another id,
    and an allowed set gives its best member by transformers' logits; the log probabilities are
    the raw forward's throughout."""
    tok = real_model.tokenizer
    prompt = tok("The capital of France is").input_ids
    reference = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    with torch.no_grad():
        raw = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    first, second = raw.topk(2).indices.tolist()

    def first_token(**params: Any) -> tuple[int, Any]:
        engine = make_engine(real_model, kv_pool_bytes=32 << 20)
        engine.add_request(prompt, SamplingParams(max_tokens=1, logprobs=2, **params), request_id="r")
        outs = [out for _ in range(8) if engine.has_unfinished_requests() for out in engine.step()]
        return outs[-1].new_token_ids[0], outs[-1].logprobs[0]

    assert first_token()[0] == first
    token, entry = first_token(logit_bias={first: -100})
    assert token == second
    assert entry.logprob == pytest.approx(float(raw[second]), abs=1e-3)  # raw, not biased
    assert [t for t, _ in entry.top] == [first, second]
    forced = tok(" London", add_special_tokens=False).input_ids[0]
    assert first_token(logit_bias={forced: 100}, temperature=1.0, seed=1)[0] == forced
    allowed = tok([" Berlin", " London", " Rome"], add_special_tokens=False).input_ids
    allowed = [ids[0] for ids in allowed]
    assert first_token(allowed_token_ids=allowed)[0] == max(allowed, key=lambda t: float(raw[t]))
    drawn = {first_token(allowed_token_ids=allowed, temperature=1.5, seed=seed)[0] for seed in range(6)}
    assert drawn <= set(allowed)
