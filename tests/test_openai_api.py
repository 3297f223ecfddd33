"""The OpenAI-compatible HTTP API on a real running stack (two-node Ray cluster, the real
model), driven with the unmodified official ``openai`` package (issue 20)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvstrata.v1 import admin_pb2
from tests.service_fixtures import Stack, chat, collect
from workloads.corpus import load_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.register("oai-tenant")


@pytest.fixture(scope="module")
def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{stack.services.http_address}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def plain_http(method: str, url: str, key: str = "") -> tuple[int, dict]:
    """A plain HTTP call (the routes the openai package has no method for): status, JSON body."""
    req = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def node_stats(stack: Stack) -> list:
    return list(stack.admin.Stats(admin_pb2.StatsRequest(check_integrity=True), metadata=stack.admin_md()).nodes)


def wait_idle(stack: Stack, base: list[int], timeout_s: float = 10.0) -> list:
    deadline = time.time() + timeout_s
    while True:
        stats = node_stats(stack)
        if ([s.used_blocks for s in stats] == base and all(s.running == 0 for s in stats)) or time.time() > deadline:
            return stats
        time.sleep(0.1)


def test_models_and_health(stack: Stack, client: openai.OpenAI, model: str) -> None:
    assert model == "smollm2-135m-instruct"  # the checkpoint directory name
    status, body = plain_http("GET", f"http://{stack.services.http_address}/health")
    assert status == 200 and body["healthy_nodes"] == 2


def test_chat_whole_and_streamed_agree(client: openai.OpenAI, model: str) -> None:
    messages = ask("What is the capital of France?")
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.object == "chat.completion"
    assert whole.choices[0].finish_reason in ("stop", "length")
    usage = whole.usage
    assert usage.completion_tokens <= 8 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert set(usage.prompt_tokens_details.model_extra["cached_tokens_per_tier"]) == {
        "device", "host", "spill_ram", "spill_disk"}
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_max_tokens_and_max_completion_tokens(client: openai.OpenAI, model: str) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        r = client.chat.completions.create(model=model, messages=ask("Write a long story about a dragon."),
                                           temperature=0, **{field: 3})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_no_max_tokens_fills_what_the_context_and_pool_leave(client: openai.OpenAI, model: str) -> None:
    """A fresh-user trial: every chat call without max_tokens got 400 ("prompt (33 tokens) +
    max_tokens (8159) needs 8192 tokens of KV at once; this node's KV pool holds 4368"), and
    every session turn without it exceeded max_context_tokens (the history was not counted).
    Now the node gives it what the context and its pool leave after the whole prompt."""
    for session in ("oai-fill",):  # a session turn: the history was not counted (every call
        # without a session asked the whole 8192 of a smaller pool: the first turn covers it)
        for turn in ("Count from 1 to 5, separated by commas.", "Now from 6 to 9."):
            r = client.chat.completions.create(model=model, messages=ask(turn), temperature=0, stop=["\n"],
                                               extra_body={"session_id": session} if session else None)
            assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    assert plain_http("DELETE", f"{client.base_url}sessions/oai-fill", client.api_key)[0] == 200


def test_stop_string_cuts_the_text(client: openai.OpenAI, model: str) -> None:
    """The stop string is not returned, finish_reason is "stop", streamed or not."""
    messages = ask("Write a long story about a dragon.")
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    cut = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                 stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_endpoint(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens <= 4
    streamed = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_n_seeded_choices_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    """n=3 with a seed (the official client; OpenAI's ``n``): three choices, index 0..2, each
    with its finish_reason; the same texts again (choice i seeded seed + i), different from
    each other; on one of the two nodes, choices 1 and 2 reusing choice 0's prompt KV; usage the
    prompt once. Streamed: each chunk one choice, a finish chunk per choice, each choice's text
    the whole response's, the usage chunk's completion tokens the whole response's."""
    kwargs = {"model": model, "messages": ask("Write one sentence about the sea."), "max_tokens": 10, "n": 3,
              "seed": 1234, "temperature": 1.0}
    whole = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    assert all(c.finish_reason in ("stop", "length") for c in whole.choices)
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts
    one = client.chat.completions.create(**{**kwargs, "n": 1, "seed": 1235})
    assert one.choices[0].message.content == texts[1] and whole.usage.prompt_tokens == one.usage.prompt_tokens
    assert 3 <= whole.usage.completion_tokens <= 30
    ran = whole.model_extra["kvstrata"]["choices"]
    assert len({c["node_id"] for c in ran}) == 1
    assert all(c["cached_tokens"] >= 16 for c in ran[1:]), ran  # choice 0's prompt blocks
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *deltas, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert all(len(c.choices) == 1 for c in deltas)
    assert ["".join(c.choices[0].delta.content or "" for c in deltas if c.choices[0].index == i)
            for i in range(3)] == texts
    assert sorted(c.choices[0].index for c in deltas if c.choices[0].finish_reason) == [0, 1, 2]


def test_two_turn_session_reports_cached_prompt_tokens(client: openai.OpenAI, model: str) -> None:
    doc = " ".join(a.extract for a in load_corpus()[100:102])
    first = client.chat.completions.create(model=model, messages=ask(doc + "\nSummarize."), max_tokens=6,
                                           temperature=0, extra_body={"session_id": "oai-s1"})
    second = client.chat.completions.create(model=model, messages=ask("Give one date from it."), max_tokens=4,
                                            temperature=0, extra_body={"session_id": "oai-s1"})
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens == history - 1 == details.model_extra["cached_tokens_per_tier"]["device"]
    assert second.usage.prompt_tokens > history
    status, closed = plain_http("DELETE", f"{client.base_url}sessions/oai-s1", client.api_key)
    assert status == 200 and closed["freed_tokens"] == second.usage.prompt_tokens + second.usage.completion_tokens
    assert plain_http("DELETE", f"{client.base_url}sessions/oai-s1", client.api_key)[0] == 404


def test_errors_in_openai_shape(stack: Stack, client: openai.OpenAI, model: str) -> None:
    wrong = openai.OpenAI(base_url=client.base_url, api_key="kvs_nope_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=ask("hi"), max_tokens=2)
    for kwargs, field in (({"n": 17}, "n"), ({"top_logprobs": 3}, "top_logprobs"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
                           "response_format.json_schema.name"),
                          # tool_choice "auto" (the default with tools) needs tool_call_parser, off here
                          ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, **kwargs)
        assert info.value.body["message"].startswith(f"{field}:")
    with pytest.raises(openai.BadRequestError, match="policy"):
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2,
                                       extra_body={"policy": "no-such-policy"})


def test_refused_admission_is_rate_limit_error_with_retry_after(stack: Stack, key: str, model: str) -> None:
    """2 nodes x 16 running slots + queue_limit 4: a burst of 40 streams overflows."""
    aclient = openai.AsyncOpenAI(base_url=f"http://{stack.services.http_address}/v1", api_key=key, max_retries=0)

    async def one(i: int) -> object:
        try:
            return await aclient.chat.completions.create(
                model=model, messages=ask(f"Write a long story number {i}."), max_tokens=16, stream=True)
        except openai.RateLimitError as exc:
            return exc

    async def burst() -> list[object]:
        out = await asyncio.gather(*(one(i) for i in range(40)))
        for r in out:
            if isinstance(r, openai.AsyncStream):
                await r.close()
        return out

    base = [s.used_blocks for s in node_stats(stack)]
    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert refused and len(results) - len(refused) >= 32
    assert all(int(r.response.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.body["type"] == "rate_limit_error" and "queue full" in r.body["message"] for r in refused)
    stats = wait_idle(stack, base)
    assert [s.used_blocks for s in stats] == base and all(s.running == 0 and s.waiting == 0 for s in stats)


def test_client_disconnect_mid_stream_frees_the_request(stack: Stack, client: openai.OpenAI, model: str) -> None:
    """A client gone mid-stream: its request is aborted on the node, no block is held."""
    base = [s.used_blocks for s in node_stats(stack)]
    stream = client.chat.completions.create(model=model, messages=ask("Write a very long essay."),
                                            max_tokens=400, stream=True)
    got = [c for _, c in zip(range(3), stream)]
    assert len(got) == 3 and any(s.running == 1 for s in node_stats(stack))
    stream.close()
    stats = wait_idle(stack, base)
    assert [s.used_blocks for s in stats] == base
    assert all(s.integrity_ok and s.running == 0 and s.waiting == 0 for s in stats)


def test_http_output_equals_grpc_output(stack: Stack, key: str, client: openai.OpenAI, model: str) -> None:
    text = "Name three rivers in Europe."
    grpc_out = collect(stack.inference.Generate(chat(text, 12), metadata=(("authorization", f"Bearer {key}"),)))
    http = client.chat.completions.create(model=model, messages=ask(text), max_tokens=12, temperature=0)
    assert http.choices[0].message.content == grpc_out["text"]
    assert http.usage.completion_tokens == grpc_out["finished"].completion_tokens


def test_cache_salt_partitions_the_tenants_cache(client: openai.OpenAI, model: str) -> None:
    """Same prompt: a reused salt hits the cache, another salt (or none) does not."""
    prompt = ask(" ".join(a.extract for a in load_corpus()[110:111]) + "\nWhat is this about?")

    def cached(salt: str) -> int:
        r = client.chat.completions.create(model=model, messages=prompt, max_tokens=1, temperature=0,
                                           extra_body={"cache_salt": salt, "prompt_cache_key": "salted"})
        return r.usage.prompt_tokens_details.cached_tokens

    first = cached("salt-a")
    assert first == 0  # nothing in this partition yet, not even the chat template's system prompt
    time.sleep(0.3)  # block events reach the global index
    assert cached("salt-a") >= 64 and cached("salt-b") == 0


def test_prompt_cache_key_keeps_its_node(stack: Stack, client: openai.OpenAI, model: str) -> None:
    """A key stays on the node it was first routed to, where least-loaded routing would move it."""
    base = [s.used_blocks for s in node_stats(stack)]
    busy = client.chat.completions.create(model=model, messages=ask("Write a very long essay."), max_tokens=400,
                                          stream=True)
    next(iter(busy))  # running on the least loaded node (the first, on a tie)

    def node(**extra: str) -> str:
        r = client.chat.completions.create(model=model, messages=ask("Say hi."), max_tokens=1, extra_body=extra)
        return r.model_extra["kvstrata"]["node_id"]

    keyed = node(prompt_cache_key="conversation-7")  # least loaded: the other node
    busy.close()
    wait_idle(stack, base)
    assert node() != keyed  # idle: least-loaded routing takes the first node again
    assert node(prompt_cache_key="conversation-7") == keyed


def test_client_gone_before_a_whole_response_frees_the_request(stack: Stack, key: str, model: str) -> None:
    """A non-streamed call whose client closes its connection while the reply is generated is
    aborted on its node (not run to max_tokens for nobody)."""
    base = [s.used_blocks for s in node_stats(stack)]
    host, port = stack.services.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": model, "messages": ask("Write a very long essay."), "max_tokens": 400}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    deadline = time.time() + 10
    while not any(s.running for s in node_stats(stack)) and time.time() < deadline:
        time.sleep(0.05)
    assert any(s.running == 1 for s in node_stats(stack))
    conn.close()
    stats = wait_idle(stack, base)
    assert [s.used_blocks for s in stats] == base
    assert all(s.running == 0 and s.waiting == 0 for s in stats)
