"""Penalties, top-k and min_tokens (review 25b N4): the sampler against transformers' own
logits processors on random logits (OpenAI's presence/frequency penalties by their formula),
``SamplingParams``' ranges, and the engine's greedy output against transformers' ``generate``
with ``repetition_penalty`` on the tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
)

from cache_node.model_loader import tiny_llama
from cache_node.sampler import apply_penalties, sample, top_k_filter
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence
from tests.conftest import make_engine

VOCAB = 300


def _seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=64, **params))  # type: ignore[arg-type]
    seq.output_token_ids = list(output)
    return seq


def _ids(rng: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=rng).tolist()


def test_repetition_penalty_equals_transformers_processor() -> None:
    """Per row, over prompt + output (repeated ids included): transformers'
    ``RepetitionPenaltyLogitsProcessor`` on the same ids; a row with penalty 1 is untouched."""
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=rng) * 4
    penalties = [1.3, 0.7, 1.0, 2.0]
    seqs = [_seq(_ids(rng, 20 + 5 * i), _ids(rng, 7 * i), repetition_penalty=p) for i, p in enumerate(penalties)]
    got = apply_penalties(logits, seqs)
    for row, seq, penalty in zip(range(4), seqs, penalties):
        ids = torch.tensor([seq.prompt_token_ids + seq.output_token_ids])
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[row : row + 1].clone())[0]
        assert torch.allclose(got[row], want), penalty
    assert torch.equal(got[2], logits[2])
    assert not torch.equal(got[0], logits[0])


def test_presence_and_frequency_penalties_follow_openais_formula_over_output_tokens() -> None:
    """``logit -= frequency * count + presence * (count > 0)``, counting the output tokens only
    (a prompt token is not penalized), negative penalties too."""
    rng = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=rng)
    cases = [(0.5, 1.5), (-1.0, 0.0), (2.0, -2.0)]
    seqs = [_seq([5, 6, 7], [1, 2, 2, 9, 9, 9], presence_penalty=p, frequency_penalty=f) for p, f in cases]
    got = apply_penalties(logits, seqs)
    for row, (presence, frequency) in enumerate(cases):
        want = logits[row].clone()
        for token, count in {1: 1, 2: 2, 9: 3}.items():
            want[token] -= frequency * count + presence
        assert torch.allclose(got[row], want), (presence, frequency)
        assert got[row, 5] == logits[row, 5]  # a prompt token


def test_top_k_equals_transformers_warper() -> None:
    rng = torch.Generator().manual_seed(2)
    row = torch.randn(VOCAB, generator=rng)
    row[::7] = row[3]  # ties
    for k in (1, 5, 50, VOCAB - 1):
        want = TopKLogitsWarper(k)(torch.zeros(1, 1, dtype=torch.long), row[None].clone())[0]
        assert torch.equal(top_k_filter(row, k), want), k
    assert torch.equal(top_k_filter(row, 0), row) and torch.equal(top_k_filter(row, VOCAB + 5), row)


def test_min_tokens_equals_transformers_processor_and_masks_stop_token_ids() -> None:
    """Until ``min_tokens`` tokens were generated, EOS (transformers'
    ``MinNewTokensLengthLogitsProcessor``) and the request's stop_token_ids are -inf; EOS stays
    drawable under ``ignore_eos`` (it stops nothing), and nothing is masked from then on."""
    eos = [VOCAB - 1, 4]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    seqs = [_seq([1, 2], [3] * 2, min_tokens=3), _seq([1, 2], [3] * 3, min_tokens=3),
            _seq([1, 2], [], min_tokens=1, stop_token_ids=(10,)),
            _seq([1, 2], [], min_tokens=1, ignore_eos=True, stop_token_ids=(11,))]
    got = apply_penalties(logits, seqs, frozenset(eos))
    processor = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=eos)
    for row in (0, 1):
        ids = torch.tensor([seqs[row].prompt_token_ids + seqs[row].output_token_ids])
        assert torch.equal(got[row], processor(ids, logits[row : row + 1].clone())[0])
    assert torch.isinf(got[0, eos]).all() and torch.equal(got[1], logits[1])
    assert torch.isinf(got[2, [*eos, 10]]).all()
    assert torch.isinf(got[3, 11]) and torch.isfinite(got[3, eos]).all()
    assert int(sample(torch.zeros(1, VOCAB) + torch.nn.functional.one_hot(torch.tensor([VOCAB - 1]), VOCAB),
                      [_seq([1], [], min_tokens=2)], eos_token_ids=eos)[0]) != VOCAB - 1


def test_the_default_path_returns_the_logits_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_penalties(logits, [_seq([1], [2]) for _ in range(3)], frozenset({5})) is logits


def test_sampled_rows_apply_penalties_then_temperature_top_k_top_p() -> None:
    """A seeded sampled row draws only among its top_k after its penalties; a greedy row with a
    repetition penalty takes the argmax of the penalized logits (vLLM penalizes greedy too)."""
    logits = torch.linspace(0, 5, VOCAB)[None].repeat(2, 1)
    top = VOCAB - 1
    seqs = [_seq([top], [], repetition_penalty=2.0), _seq([top], [], temperature=1.0, top_k=3, seed=0,
                                                          frequency_penalty=2.0)]
    seqs[1].output_token_ids = [top - 1] * 3  # frequency 2 x 3 pulls it out of the top 3
    seqs[1].generator = torch.Generator().manual_seed(0)
    draws = set()
    for _ in range(50):
        greedy, drawn = sample(logits, seqs)
        draws.add(drawn)
        assert greedy == top - 1
    assert draws <= {top, top - 2, top - 3} and len(draws) > 1


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("repetition_penalty", 1e-50),
    ("repetition_penalty", "1.2"), ("top_k", -2), ("top_k", 2**31), ("top_k", 1.5), ("top_k", True),
    ("min_tokens", -1), ("min_tokens", 65), ("min_tokens", 2.0), ("frequency_penalty", True),
])
def test_out_of_range_fields_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=64, **{field: value})  # type: ignore[arg-type]


def test_vllms_top_k_minus_one_means_off_and_is_stored_as_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    p = SamplingParams(max_tokens=8, min_tokens=8, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01)
    assert (p.min_tokens, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (8, -2.0, 2.0, 0.01)


def test_engine_greedy_repetition_penalty_matches_transformers_generate(tiny) -> None:
    """On the tiny model, greedy output with repetition_penalty 1.5 differs from without and
    equals transformers' ``generate(repetition_penalty=1.5)`` token for token."""
    prompt = [3, 17, 99, 17, 250, 3, 8]
    eng = make_engine(tiny)
    plain, penalized = eng.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True,
                                                                        repetition_penalty=1.5)],
    )
    reference = tiny_llama(seed=0).model  # the same weights, with transformers' own attention
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        want_plain = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    assert list(plain.output_token_ids) == want_plain.tolist()
    assert list(penalized.output_token_ids) == want.tolist()
    assert list(penalized.output_token_ids) != list(plain.output_token_ids)


def test_engine_min_tokens_holds_off_eos(tiny) -> None:
    """The tiny model's EOS as a stop token: without min_tokens a stop token drawn early ends
    the request; with min_tokens the request runs at least that many tokens."""
    eng = make_engine(tiny)
    probe = eng.generate([[3, 17, 99]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    first = probe[0]
    short, held = eng.generate([[3, 17, 99], [3, 17, 99]], [
        SamplingParams(max_tokens=6, stop_token_ids=(first,)),
        SamplingParams(max_tokens=6, stop_token_ids=(first,), min_tokens=4),
    ])
    assert list(short.output_token_ids) == [first] and short.finish_reason == "stop"
    assert len(held.output_token_ids) >= 5 and first not in held.output_token_ids[:4]


# ---- the node request wire ----------------------------------------------------------------
def _wire(sampling: SamplingParams) -> dict:
    from services import data_plane_wire
    from services.node_request import NodeRequest

    return data_plane_wire.request_to_wire(NodeRequest(request_id="r", tenant="t", cache_namespace="ns",
                                                       token_ids=(1, 2), sampling=sampling))


def test_the_node_request_wire_carries_the_new_fields() -> None:
    import msgpack

    from services import data_plane_wire

    params = SamplingParams(max_tokens=9, top_k=40, min_tokens=3, presence_penalty=0.5, frequency_penalty=-1.25,
                            repetition_penalty=1.1)
    wire = msgpack.unpackb(msgpack.packb(_wire(params)))
    assert data_plane_wire.request_from_wire(wire).sampling == params


@pytest.mark.parametrize("bad", [
    {"top_k": "40"}, {"top_k": 4.0}, {"top_k": True}, {"top_k": -5}, {"min_tokens": None}, {"min_tokens": 99},
    {"presence_penalty": "0.5"}, {"presence_penalty": 3.0}, {"frequency_penalty": False},
    {"repetition_penalty": 0}, {"repetition_penalty": float("nan")}, {"repetition_penalty": [1.0]},
])
def test_the_node_request_wire_checks_the_new_fields(bad: dict) -> None:
    """Every byte off the network is untrusted: a mistyped or out-of-range field is a
    TypeError/ValueError naming it, never a SamplingParams that fails in the step."""
    from services import data_plane_wire

    wire = _wire(SamplingParams(max_tokens=9))
    with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
        data_plane_wire.request_from_wire({**wire, "sampling": {**wire["sampling"], **bad}})
