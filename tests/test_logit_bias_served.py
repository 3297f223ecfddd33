"""``logit_bias`` (OpenAI's) and ``allowed_token_ids`` (vLLM's) served end to end, without Ray:
the real CacheNode, scheduler, gateway gRPC server and OpenAI app of ``test_logprobs_served``
(a tiny random Llama with SmolLM2's tokenizer and 49,152-token vocabulary). Forced, banned and
allowed tokens come out of both APIs, every choice of n > 1 honours them, and bad values are
INVALID_ARGUMENT / 400 naming their field: ids past the vocabulary (the gateway), biases out of
[-100, 100] or not finite, non-integer keys, too many entries, an empty allowed list. Before
these fields were served, ``logit_bias`` was a 400 "unsupported field" and gRPC had neither."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tests.test_logprobs_served import PROMPT, Served

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def _tokens(served: Served, **sampling: Any) -> list[int]:
    return [t for r in served.generate(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
            if r.WhichOneof("event") == "delta" for t in r.delta.token_ids]


def _word(served: Served, text: str) -> int:
    return served.tokenizer(text, add_special_tokens=False).input_ids[0]


def test_grpc_forces_bans_and_restricts_tokens(served: Served) -> None:
    """+100 on one id: every token is it, greedy and sampled; -100 on the greedy tokens: none of
    them comes out; allowed ids: every token is one of them, greedy and sampled; the log
    probabilities asked beside a bias are the raw ones (the forced token's is not 0)."""
    blue = _word(served, " blue")
    greedy = _tokens(served)
    assert _tokens(served, logit_bias={blue: 100.0}) == [blue] * MAX_TOKENS
    assert _tokens(served, logit_bias={blue: 100.0}, temperature=1.0, seed=5) == [blue] * MAX_TOKENS
    assert not set(_tokens(served, logit_bias=dict.fromkeys(greedy, -100.0))) & set(greedy)
    allowed = [_word(served, w) for w in (" red", " green", " blue")]
    assert set(_tokens(served, allowed_token_ids=allowed)) <= set(allowed)
    assert set(_tokens(served, allowed_token_ids=allowed, temperature=1.5, seed=9)) <= set(allowed)
    deltas = [r.delta for r in served.generate(max_tokens=2, ignore_eos=True, logit_bias={blue: 100.0}, logprobs=1)
              if r.WhichOneof("event") == "delta"]
    entries = [e for d in deltas for e in d.logprobs]
    assert len(entries) == 2 and all(e.logprob < -1.0 for e in entries)  # a random model: ~log(1/49152)


@pytest.mark.parametrize(("fields", "details"), [
    ({"logit_bias": {49152: 1.0}}, "logit_bias: token id 49152 is outside the model's vocabulary [0, 49152)"),
    ({"allowed_token_ids": [5, 10**6]}, ("allowed_token_ids: token id 1000000 is outside the model's vocabulary "
                                         "[0, 49152)")),
    ({"logit_bias": {5: 100.5}}, "sampling.logit_bias values must be finite numbers in [-100, 100], got 100.5"),
    ({"logit_bias": {5: float("nan")}}, "sampling.logit_bias values must be finite numbers in [-100, 100], got nan"),
    ({"logit_bias": {5: float("-inf")}}, "sampling.logit_bias values must be finite numbers"),
    ({"logit_bias": {i: 1.0 for i in range(4097)}}, "sampling.logit_bias holds more than 4096 elements"),
    ({"allowed_token_ids": list(range(4097))}, "sampling.allowed_token_ids holds more than 4096 elements"),
])
def test_grpc_bad_values_are_invalid_argument_naming_the_field(served: Served, fields: dict[str, Any],
                                                               details: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        served.generate(max_tokens=2, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(details), err.value.details()


def test_grpc_an_allowed_set_min_tokens_empties_is_invalid_argument(served: Served) -> None:
    """Only EOS allowed while min_tokens holds it off: refused by the node, naming the field."""
    eos = served.tokenizer.eos_token_id
    with pytest.raises(grpc.RpcError) as err:
        served.generate(max_tokens=4, min_tokens=2, allowed_token_ids=[eos])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("allowed_token_ids: every allowed token ends the request")


def test_http_both_endpoints_take_logit_bias_and_allowed_token_ids(served: Served) -> None:
    """``/v1/completions`` with ``logit_bias`` {"<id>": 100} writes that token each time;
    ``/v1/chat/completions`` with ``allowed_token_ids`` writes only allowed tokens (their
    completion token count is max_tokens: no EOS allowed), streamed the same."""
    blue = _word(served, " blue")
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "logit_bias": {str(blue): 100}})
    assert status == 200, body
    assert body["choices"][0]["text"] == served.tokenizer.decode([blue] * MAX_TOKENS)
    allowed = [_word(served, w) for w in (" red", " green", " blue")]
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 3, "allowed_token_ids": allowed, "logprobs": True}
    status, body = served.post("/chat/completions", chat)
    assert status == 200, body
    words = [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]]
    assert len(words) == MAX_TOKENS and set(words) <= {" red", " green", " blue"}
    status, chunks = served.post("/chat/completions", {**chat, "stream": True})
    assert status == 200
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        body["choices"][0]["message"]["content"]


def test_http_every_choice_of_n_honours_them(served: Served) -> None:
    """n 4, sampled with a seed: each choice's tokens come from the allowed set, and each choice
    of a +100 bias is that token alone."""
    allowed = [_word(served, w) for w in (" red", " green", " blue")]
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 4, "seed": 1,
                                                "temperature": 1.5, "allowed_token_ids": allowed, "logprobs": 0})
    assert status == 200, body
    assert len(body["choices"]) == 4
    for choice in body["choices"]:
        assert set(choice["logprobs"]["tokens"]) <= {" red", " green", " blue"}
    blue = _word(served, " blue")
    status, body = served.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 3,
                                                     "max_tokens": 3, "logit_bias": {str(blue): 100}})
    assert status == 200, body
    assert [c["message"]["content"] for c in body["choices"]] == [served.tokenizer.decode([blue] * 3)] * 3


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"logit_bias": {"blue": 1}}, "logit_bias", "keys must be token ids (non-negative integers, as strings)"),
    ({"logit_bias": {"-5": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias", "keys must be token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "values must be numbers in [-100, 100], got 101 for token id 5"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "values must be numbers"),
    ({"logit_bias": {"5": True}}, "logit_bias", "values must be numbers"),
    ({"logit_bias": [5]}, "logit_bias", "must be an object mapping token ids to biases"),
    ({"logit_bias": {str(i): 1 for i in range(4097)}}, "logit_bias", "holds 4097 token ids; at most 4096"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "token id 49152 is outside the model's vocabulary [0, 49152)"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias", "token id 99999999999 is past the largest token id"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must hold at least one token id"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "token ids must be integers in [0, 2147483647]"),
    ({"allowed_token_ids": [1 << 40]}, "allowed_token_ids", "token ids must be integers in [0, 2147483647]"),
    ({"allowed_token_ids": list(range(4097))}, "allowed_token_ids", "holds 4097 token ids; at most 4096"),
    ({"allowed_token_ids": [5, 49152]}, "allowed_token_ids", "token id 49152 is outside the model's vocabulary"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids.0", "Input should be a valid integer"),
])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_http_bad_values_are_400_naming_the_field(served: Served, path: str, fields: dict[str, Any], param: str,
                                                  message: str) -> None:
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if path == "/chat/completions"
              else {"prompt": PROMPT})
    status, body = served.post(path, {**prompt, "max_tokens": 2, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert body["error"]["message"].startswith(f"{param.split('.')[0]}") and message in body["error"]["message"], body


def test_the_official_openai_client_sends_logit_bias_and_allowed_token_ids(served: Served) -> None:
    """The unmodified ``openai`` package: ``logit_bias`` as its own parameter, ``allowed_token_ids``
    in ``extra_body`` (as vLLM documents its extra parameters)."""
    import openai

    client = openai.OpenAI(base_url=served.base, api_key=served.key, max_retries=0)
    blue = _word(served, " blue")
    completion = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=3, temperature=0,
                                           logit_bias={str(blue): 100})
    assert completion.choices[0].text == served.tokenizer.decode([blue] * 3)
    red = _word(served, " red")
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, extra_body={"allowed_token_ids": [red]})
    assert chat.choices[0].message.content == served.tokenizer.decode([red] * 3)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, logit_bias={"x": 1})
    assert err.value.body["param"] == "logit_bias"  # type: ignore[index]
