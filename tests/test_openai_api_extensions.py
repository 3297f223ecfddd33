"""kvstrata's request fields that reach the cache node, on a real running stack (two-node Ray
cluster, the real model), through gRPC and the unmodified ``openai`` package (issue 20):
``priority`` (vLLM's extension field) and ``stop`` strings, which the node enforces."""

from __future__ import annotations

import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service_fixtures import Stack, chat, collect

pytestmark = pytest.mark.slow

TENANT = "oai-extensions"


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.register(TENANT)


@pytest.fixture(scope="module")
def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{stack.services.http_address}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def gateway_counter(stack: Stack, name: str, **labels: str) -> float:
    """The gateway's counter ``name`` (``..._total`` sample) for this tenant and ``labels``."""
    with urllib.request.urlopen(f"http://{stack.services.metrics['gateway']}/metrics", timeout=10) as reply:
        families = text_string_to_metric_families(reply.read().decode())
        return sum(s.value for f in families for s in f.samples if s.name == f"{name}_total"
                   and all(s.labels.get(k) == v for k, v in {"tenant": TENANT, **labels}.items()))


def test_priority_reaches_the_node_from_both_apis(stack: Stack, key: str, client: openai.OpenAI,
                                                  model: str) -> None:
    """The node's engine queues the request with the priority sent (its started event echoes
    the value it queued), through gRPC and through the HTTP body's extension field."""
    md = (("authorization", f"Bearer {key}"),)
    assert collect(stack.inference.Generate(chat("hi", 2, priority=-3), metadata=md))["started"].priority == -3
    whole = client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, extra_body={"priority": 7})
    assert whole.model_extra["kvstrata"]["priority"] == 7
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=2,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"priority": -1000}))
    assert chunks[-1].model_extra["kvstrata"]["priority"] == -1000


def test_out_of_range_priority_is_invalid_argument_and_400(stack: Stack, key: str, client: openai.OpenAI,
                                                          model: str) -> None:
    md = (("authorization", f"Bearer {key}"),)
    with pytest.raises(grpc.RpcError) as info:
        collect(stack.inference.Generate(chat("hi", 2, priority=1001), metadata=md))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in info.value.details()
    with pytest.raises(openai.BadRequestError, match=r"priority must be in \[-1000, 1000\]"):
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, extra_body={"priority": -1001})
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, extra_body={"priority": "1"})
    assert bad.value.body["param"] == "priority"


def test_two_turn_session_under_a_stop_string(stack: Stack, client: openai.OpenAI, model: str) -> None:
    """Regression: stop strings were cut at the gateway, which aborted the node's request: the
    turn counted as cancelled, and the session's history was not the text the client saw. Now
    the second turn's prompt is the first prompt + the tokens up to the stop + the new message
    (what the same two turns without a stop string add for the new message), not more, and the
    turn finishes with reason "stop" in the response and the metrics."""

    def turns(session: str, stop: list[str] | None) -> tuple:
        first = client.chat.completions.create(model=model, messages=ask("Write a long story about a dragon."),
                                               max_tokens=16, temperature=0, stop=stop,
                                               extra_body={"session_id": session})
        second = client.chat.completions.create(model=model, messages=ask("And then?"), max_tokens=2,
                                                temperature=0, extra_body={"session_id": session})
        return first, second

    plain, plain_next = turns("stop-plain", None)
    text = plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length"
    new_message = plain_next.usage.prompt_tokens - plain.usage.prompt_tokens - plain.usage.completion_tokens
    start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].strip()
                 and text.index(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    stopped_before = gateway_counter(stack, "kvstrata:request_success", finished_reason="stop")
    cancelled_before = gateway_counter(stack, "kvstrata:requests", status="CANCELLED")
    cut, cut_next = turns("stop-cut", [stop])
    assert cut.choices[0].message.content == text[:start] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < plain.usage.completion_tokens
    assert gateway_counter(stack, "kvstrata:request_success", finished_reason="stop") == stopped_before + 1
    assert gateway_counter(stack, "kvstrata:requests", status="CANCELLED") == cancelled_before
    # the history holds the cut reply, not the stop string's tokens: the next turn's prompt is the
    # same conversation's sent without the session (29f6264, 4e2562d), fewer tokens than the
    # stopping token's history would give
    alone = client.chat.completions.create(
        model=model, messages=[*ask("Write a long story about a dragon."),
                               {"role": "assistant", "content": cut.choices[0].message.content}, *ask("And then?")],
        max_tokens=1, temperature=0)
    assert cut_next.usage.prompt_tokens == alone.usage.prompt_tokens
    assert cut_next.usage.prompt_tokens <= cut.usage.prompt_tokens + cut.usage.completion_tokens + new_message
