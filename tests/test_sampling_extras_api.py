"""OpenAI's penalties and vLLM's extra sampling parameters (``top_k``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``) on both front ends (review 25b N4): the OpenAI bodies
of both endpoints take them into ``SamplingParams``, gRPC's ``SamplingParams`` carries them
through ``services.convert``, and out-of-range values are refused naming the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services.convert import sampling_params_from_pb, sampling_params_to_pb
from services.openai_api.app import invalid
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": [1, 2, 3]}
EXTRAS = {"frequency_penalty": 0.5, "presence_penalty": -1.5, "top_k": 40, "min_tokens": 3,
          "repetition_penalty": 1.2, "ignore_eos": True}


def _input(chat: bool, **body: object):
    if chat:
        return ChatCompletionRequest.model_validate({**CHAT, **body}).to_input()
    return CompletionRequest.model_validate({**COMPLETION, **body}).to_input(lambda text: [1])


@pytest.mark.parametrize("chat", [True, False])
def test_both_endpoints_take_the_penalties_and_vllms_extras(chat: bool) -> None:
    """Before: frequency/presence_penalty other than 0 were a 400 ("only 0 is supported"), and
    top_k, min_tokens, repetition_penalty, ignore_eos undeclared fields (400)."""
    sampling = _input(chat, max_tokens=8, **EXTRAS).sampling
    assert sampling == SamplingParams(max_tokens=8, temperature=1.0, **EXTRAS)  # type: ignore[arg-type]
    default = _input(chat, max_tokens=8).sampling
    assert (default.top_k, default.min_tokens, default.repetition_penalty, default.ignore_eos) == (0, 0, 1.0, False)
    assert (default.presence_penalty, default.frequency_penalty) == (0.0, 0.0)
    assert _input(chat, max_tokens=8, top_k=-1).sampling.top_k == 0  # vLLM's "off"
    assert _input(chat, max_tokens=8, top_k=None, repetition_penalty=None, min_tokens=None).sampling == default


def test_min_tokens_without_max_tokens_leaves_the_size_to_the_gateway() -> None:
    """A chat without max_tokens is sized by the gateway (fill_context); min_tokens rides along
    (the placeholder max_tokens is at least min_tokens, and the gateway keeps it so)."""
    call = _input(True, min_tokens=50)
    assert call.fill_context and call.sampling.min_tokens == 50 and call.sampling.max_tokens >= 50


@pytest.mark.parametrize("chat", [True, False])
def test_min_tokens_over_max_tokens_is_refused_naming_it(chat: bool) -> None:
    with pytest.raises(ValueError, match=r"^min_tokens must be an integer in \[0, max_tokens \(4\)\], got 5"):
        _input(chat, max_tokens=4, min_tokens=5)


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 2.01), ("presence_penalty", -3), ("top_k", -2), ("top_k", 2**31), ("top_k", "5"),
    ("min_tokens", -1), ("min_tokens", 1.0), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("repetition_penalty", "1.1"), ("ignore_eos", 1), ("presence_penalty", True),
])
@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest])
def test_out_of_range_or_mistyped_extras_are_400_naming_the_field(kind: type, field: str, value: object) -> None:
    base = CHAT if kind is ChatCompletionRequest else COMPLETION
    with pytest.raises(ValidationError) as info:
        kind.model_validate({**base, field: value})
    error = json.loads(invalid(info.value).body)["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}:"), error


def test_grpc_sampling_params_carry_the_extras_both_ways() -> None:
    params = SamplingParams(max_tokens=8, **EXTRAS)  # type: ignore[arg-type]
    msg = sampling_params_to_pb(params)
    assert (msg.top_k, msg.min_tokens, msg.repetition_penalty) == (40, 3, pytest.approx(1.2))
    assert sampling_params_from_pb(inference_pb2.SamplingParams.FromString(msg.SerializeToString())) == params


def test_grpc_defaults_are_off_and_minus_one_top_k_is_off() -> None:
    """An older client sends none of the new fields: every one is off (repetition_penalty 0 is
    unset, 1.0, as top_p's 0)."""
    params = sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=4))
    assert params == SamplingParams(max_tokens=4)
    assert sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=4, top_k=-1)).top_k == 0


@pytest.mark.parametrize(("fields", "message"), [
    ({"presence_penalty": 2.5}, "sampling.presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "sampling.frequency_penalty must be a finite number"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty must be a finite number"),
    ({"repetition_penalty": 0.001}, "sampling.repetition_penalty must be in [0.01, 2]"),
    ({"top_k": -7}, "sampling.top_k must be an integer"),
    ({"min_tokens": 5}, "sampling.min_tokens must be an integer in [0, max_tokens (4)]"),
])
def test_grpc_out_of_range_extras_are_invalid_argument_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=4, **fields))
    assert str(info.value).startswith(message), info.value


def test_a_min_tokens_past_the_room_left_is_refused_for_size_through_the_gateway() -> None:
    """Without max_tokens the gateway sizes the request to the room the context leaves; a
    min_tokens past that room is a 400 naming ``min_tokens`` (the gateway's replace of
    max_tokens raised ValueError). Fresh-user trial 26d: it was ``context_length_exceeded``
    naming ``messages``, "N in the completion", where only a smaller min_tokens helps."""
    from tests.gateway_harness import NODE_INFO
    from tests.test_openai_api_nulls import _post

    status, out = _post("/v1/chat/completions", {**CHAT, "min_tokens": NODE_INFO["max_model_len"] + 1})
    assert status == 400 and (out["error"]["code"], out["error"]["param"]) == ("invalid_argument", "min_tokens"), out
    assert "lower min_tokens" in out["error"]["message"]
