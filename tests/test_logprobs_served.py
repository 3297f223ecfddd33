"""Log probabilities and ``min_p`` served end to end, without Ray: a real CacheNode (a tiny random
Llama with SmolLM2's tokenizer and vocabulary), the GlobalScheduler's admission server, the
gateway's real gRPC server (``create_server``) and its OpenAI app (uvicorn), on the real data
plane (CURVE keys), all on one event loop thread. The values each API reports are checked
against a transformers forward of the same checkpoint on the same prompt (raw logprobs: the
model's log_softmax), the greedy token's against its own top entry, and the token texts
against the tokenizer; bad values are 400 / INVALID_ARGUMENT naming their field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from bench.chaos_stack import tiny_checkpoint
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services.chat import ChatTemplater
from services.gateway_server import create_server
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.logprobs import TokenTexts
from tenants.model import TenantSpec
from tests.loop_plane import LoopPlane, call
from tests.test_openai_api_disconnect import Actor

PROMPT = [504, 3451, 314, 260, 2644, 282, 4649, 47, 1000, 2035, 30]
MAX_TOKENS = 6


class Served(LoopPlane):
    """One node, the scheduler, the gateway's gRPC server and its HTTP API."""

    def __init__(self) -> None:
        super().__init__(4, "kvstrata-logprobs-")
        info = self.node.describe()
        self.tokenizer = AutoTokenizer.from_pretrained(str(tiny_checkpoint()))
        handle = Actor(self.scheduler)
        self.server, port, _health, self.servicer, monitor = self.run(create_server(
            handle, {"n0": Actor(self.node)}, {"n0": info}, ChatTemplater(self.tokenizer), self.sched_address,
            security=self.keys.security("gateway")))
        monitor.stop()
        self.run(self.server.start())
        self.address = f"127.0.0.1:{port}"  # the gateway's gRPC address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.key = self.run(call(self.scheduler.register_tenant, TenantSpec(name="logprobs")))[1]
        self.model = info["model_id"].split("@", 1)[0]
        self.http = HttpServer(create_app(OpenAIEdge(self.servicer, info["model_id"], list, lambda: 1,
                                                     tokens=TokenTexts(self.tokenizer))))
        self.base = f"http://127.0.0.1:{self.run(self.http.start('127.0.0.1', 0))}/v1"

    def generate(self, **sampling: Any) -> list[inference_pb2.GenerateResponse]:
        request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROMPT),
                                                sampling=inference_pb2.SamplingParams(**sampling))
        return list(self.stub.Generate(request, metadata=(("authorization", f"Bearer {self.key}"),), timeout=60))

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Status and JSON body (a stream: its events' JSON, ``[DONE]`` left out)."""
        req = urllib.request.Request(f"{self.base}{path}", json.dumps({"model": self.model, **body}).encode(),
                                     {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                data = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
        if body.get("stream"):
            lines = [line[len("data: "):] for line in data.split("\n") if line.startswith("data: ")]
            assert lines[-1] == "[DONE]"
            return status, [json.loads(line) for line in lines[:-1]]
        return status, json.loads(data)

    async def close_gateways(self) -> None:
        await self.http.stop()
        await self.server.stop(0)
        self.servicer.streams.shutdown()

    def close(self) -> None:
        self.channel.close()
        super().close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference(served: Served) -> Any:
    """(greedy tokens, their raw log_softmax rows) of a transformers forward of the node's
    checkpoint over ``PROMPT`` + its greedy output."""
    responses = served.generate(max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [t for r in responses if r.WhichOneof("event") == "delta" for t in r.delta.token_ids]
    assert len(tokens) == MAX_TOKENS
    model = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint()), torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1: -1]
    assert rows.argmax(-1).tolist() == tokens  # the node's greedy tokens are the forward's
    return tokens, rows


def test_grpc_streams_each_tokens_logprobs_as_the_models_raw_distribution(served: Served, reference: Any) -> None:
    """``SamplingParams.logprobs`` 5: one ``TokenLogprobs`` per token id, the greedy token's the
    max of its top 5, every value the forward's log_softmax within 1e-3, top ids the forward's
    5 most probable in order; without it, the same tokens and no logprobs."""
    tokens, rows = reference
    deltas = [r.delta for r in served.generate(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
              if r.WhichOneof("event") == "delta"]
    got_tokens = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs]
    assert got_tokens == tokens and len(entries) == len(tokens)
    for d in deltas:
        assert len(d.logprobs) == len(d.token_ids)
    for step, (token, entry) in enumerate(zip(tokens, entries)):
        assert len(entry.top) == 5 and entry.top[0].token_id == token
        assert entry.logprob == max(t.logprob for t in entry.top) == entry.top[0].logprob
        assert entry.logprob == pytest.approx(float(rows[step, token]), abs=1e-3)
        want = rows[step].topk(5)
        assert [t.token_id for t in entry.top] == want.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(want.values.tolist(), abs=1e-3)
    plain = served.generate(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert all(not r.delta.logprobs for r in plain if r.WhichOneof("event") == "delta")


def test_grpc_min_p_one_keeps_the_top_token_alone(served: Served, reference: Any) -> None:
    """min_p 1 at temperature 1.5 with a seed: only the most probable token passes, so the
    sampled output is the greedy one; min_p 0 with the same seed samples something else."""
    tokens, _ = reference

    def drawn(**sampling: Any) -> list[int]:
        return [t for r in served.generate(max_tokens=MAX_TOKENS, ignore_eos=True, seed=7, temperature=1.5,
                                           **sampling) if r.WhichOneof("event") == "delta" for t in r.delta.token_ids]

    assert drawn(min_p=1.0) == tokens
    assert drawn() != tokens  # (a random tiny model: its distribution is nearly flat)


@pytest.mark.parametrize(("fields", "name"), [({"logprobs": 21}, "logprobs"), ({"min_p": 1.5}, "min_p"),
                                              ({"min_p": -0.25}, "min_p")])
def test_grpc_out_of_range_values_are_invalid_argument_naming_the_field(served: Served, fields: dict,
                                                                       name: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        served.generate(max_tokens=2, **fields)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"sampling.{name} must")


def test_a_text_completion_has_openais_logprobs_object(served: Served, reference: Any) -> None:
    """``logprobs`` 3 on ``/v1/completions``: ``tokens`` are the tokenizer's texts of the greedy
    ids, ``token_logprobs`` the forward's, each ``top_logprobs`` map the chosen token and the 3
    most probable (4 entries at most; the greedy token is among the top), ``text_offset`` the
    running length of the token texts; streamed, the chunks' entries join to the same."""
    tokens, rows = reference
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                "ignore_eos": True, "logprobs": 3})
    assert status == 200, body
    logprobs = body["choices"][0]["logprobs"]
    texts = [served.tokenizer.decode([t]) for t in tokens]
    assert logprobs["tokens"] == texts
    assert logprobs["token_logprobs"] == pytest.approx([float(rows[i, t]) for i, t in enumerate(tokens)], abs=1e-3)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs["text_offset"] == offsets
    for i, top in enumerate(logprobs["top_logprobs"]):
        want = {served.tokenizer.decode([t]): v for t, v in zip(*[x.tolist() for x in rows[i].topk(3)[::-1]])}
        assert set(top) == set(want) and texts[i] in top
        assert list(top.values()) == pytest.approx([want[k] for k in top], abs=1e-3)
        assert max(top.values()) == top[texts[i]] == logprobs["token_logprobs"][i]
    status, chunks = served.post("/completions", {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "ignore_eos": True, "logprobs": 3, "stream": True})
    assert status == 200
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"] is not None]
    joined = {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")}
    assert joined == logprobs
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]


def test_a_chat_completion_has_openais_logprobs_content(served: Served) -> None:
    """``logprobs`` true, ``top_logprobs`` 2 on ``/v1/chat/completions``, whole and streamed:
    one content entry per completion token, each with its token's text, its UTF-8 ``bytes``
    and its top 2 (most probable first; the greedy token's logprob their max); the stream's
    chunks carry the same entries in order (the role chunk none)."""
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    status, whole = served.post("/chat/completions", body)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == MAX_TOKENS
    # the tokens' bytes join to the text's UTF-8 (review 26c F1: the rule for split characters)
    assert b"".join(bytes(e["bytes"]) for e in content) == whole["choices"][0]["message"]["content"].encode()
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 2 and tops[0]["logprob"] >= tops[1]["logprob"]
        assert entry["logprob"] == tops[0]["logprob"] == max(t["logprob"] for t in tops)
        assert entry["token"] == tops[0]["token"] and entry["bytes"] == tops[0]["bytes"]
    status, chunks = served.post("/chat/completions", {**body, "stream": True})
    assert status == 200
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    _, plain = served.post("/chat/completions", {k: v for k, v in body.items() if k not in ("logprobs",
                                                                                             "top_logprobs")})
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == whole["choices"][0]["message"]  # greedy output unchanged


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 3}, "top_logprobs"),  # without logprobs true
    ("/chat/completions", {"logprobs": 1}, "logprobs"),  # a boolean on chat
    ("/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/chat/completions", {"min_p": -0.1}, "min_p"),
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"logprobs": -1}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),  # an integer on completions
    ("/completions", {"top_logprobs": 2}, "top_logprobs"),  # a chat field
    ("/completions", {"min_p": 2}, "min_p"),
])
def test_bad_values_are_400_naming_the_field(served: Served, path: str, fields: dict, param: str) -> None:
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if path == "/chat/completions"
              else {"prompt": PROMPT})
    status, body = served.post(path, {**prompt, "max_tokens": 2, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["message"].startswith(f"{param}:"), body


def test_min_p_and_top_logprobs_zero_are_taken(served: Served) -> None:
    """``min_p`` in range and ``top_logprobs`` 0 (with or without ``logprobs``) are served; with
    ``logprobs`` true and 0 alternatives each entry's ``top_logprobs`` is empty."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    status, body = served.post("/chat/completions", {**base, "min_p": 0.5, "top_logprobs": 0})
    assert status == 200 and body["choices"][0]["logprobs"] is None
    status, body = served.post("/chat/completions", {**base, "logprobs": True})
    assert status == 200 and [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[], []]


def test_the_official_openai_client_reads_the_logprobs(served: Served, reference: Any) -> None:
    """The unmodified ``openai`` package: a chat's ``choices[0].logprobs.content`` and a
    completion's ``choices[0].logprobs`` read as its own types, whole and streamed."""
    import openai

    tokens, rows = reference
    client = openai.OpenAI(base_url=served.base, api_key=served.key, max_retries=0)
    chat = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=4,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 4 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)
    assert b"".join(bytes(c.bytes) for c in content) == chat.choices[0].message.content.encode()
    streamed = [c for chunk in client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=4, stream=True, extra_body={"ignore_eos": True})
        if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    completion = client.completions.create(model=served.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [served.tokenizer.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([float(rows[i, t]) for i, t in enumerate(tokens)], abs=1e-3)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


def test_a_whole_response_past_the_logprobs_bound_is_400_before_it_runs(served: Served) -> None:
    """Review 26c F2, served: n 16 x top_logprobs 20 without max_tokens (the context's worth
    each) is a 400 naming top_logprobs, saying to stream (refused with the body, before any choice is admitted)."""
    status, body = served.post("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 16,
                                                     "logprobs": True, "top_logprobs": 20})
    assert status == 400, body
    assert body["error"]["param"] == "top_logprobs" and "stream it (stream: true)" in body["error"]["message"]
    status, body = served.post("/completions", {"prompt": PROMPT, "n": 16, "logprobs": 20, "max_tokens": 1000})
    assert status == 400 and body["error"]["param"] == "logprobs", body


def test_logprobs_past_the_vocabulary_are_invalid_argument_at_the_gateway(served: Served) -> None:
    """Review 26c F4: k over the model's vocabulary (a model under 20 tokens) ended its stream
    UNAVAILABLE, "a cache node sent a malformed event"; the gateway now refuses it first,
    INVALID_ARGUMENT naming logprobs (the node's own rule: ``tests/test_sampler_logprobs.py``)."""
    info = served.servicer.info
    vocab = info["vocab_size"]
    info["vocab_size"] = 4
    try:
        with pytest.raises(grpc.RpcError) as err:
            served.generate(max_tokens=2, logprobs=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "logprobs: asks for 5 alternatives per token; the model's vocabulary has 4 tokens"
        status, body = served.post("/completions", {"prompt": [1, 2], "max_tokens": 2, "logprobs": 5})
        assert status == 400 and body["error"]["param"] == "logprobs", body
    finally:
        info["vocab_size"] = vocab
