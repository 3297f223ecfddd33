"""Log probabilities on the real running stack (two-node Ray cluster, SmolLM2-135M), through
gRPC and the official ``openai`` package: each greedy token's logprob is the max of its top
entries, and the values are transformers' own forward's on the same prompt."""

from __future__ import annotations

import openai
import pytest
import torch

from kvstrata.v1 import inference_pb2
from tests.service_fixtures import Stack

pytestmark = pytest.mark.slow

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.register("logprobs-tenant")


def test_grpc_and_http_logprobs_are_the_real_models(stack: Stack, key: str, real_model) -> None:
    """A token prompt, greedy, 3 alternatives: gRPC's ``GenerateDelta.logprobs`` and
    ``/v1/completions``' ``logprobs`` give the same tokens, the greedy token first among its
    top 3 with their max logprob, and every value within 1e-3 of the log_softmax of
    transformers' float32 forward over the prompt and the output."""
    tok = real_model.tokenizer
    prompt = tok("The capital of France is").input_ids
    request = inference_pb2.GenerateRequest(
        tokens=inference_pb2.TokenIds(ids=prompt),
        sampling=inference_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3))
    deltas = [r.delta for r in stack.inference.Generate(request, metadata=(("authorization", f"Bearer {key}"),),
                                                        timeout=120) if r.WhichOneof("event") == "delta"]
    tokens = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in d.logprobs]
    assert len(tokens) == len(entries) == MAX_TOKENS
    reference = type(real_model.model).from_pretrained(real_model.model.name_or_path, dtype=torch.float32)
    reference.config._attn_implementation = "sdpa"
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1: -1]
    assert rows.argmax(-1).tolist() == tokens
    for step, (token, entry) in enumerate(zip(tokens, entries)):
        want = rows[step].topk(3)
        assert [t.token_id for t in entry.top] == want.indices.tolist() and entry.top[0].token_id == token
        assert entry.logprob == max(t.logprob for t in entry.top)
        assert [t.logprob for t in entry.top] == pytest.approx(want.values.tolist(), abs=1e-3)
    client = openai.OpenAI(base_url=f"http://{stack.services.http_address}/v1", api_key=key, max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=3, extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [tok.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([float(rows[i, t]) for i, t in enumerate(tokens)], abs=1e-3)
    for i, top in enumerate(logprobs.top_logprobs):
        assert max(top.values()) == top[logprobs.tokens[i]] == logprobs.token_logprobs[i]
