"""The gateway's refusals for size read as OpenAI's and vLLM's ("This model's maximum context
length is N tokens. However, you requested M tokens (P in the messages, K in the completion).
..."), with the numbers, through the real gRPC gateway and chat template (no node behind it)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.chat import ChatTemplater
from tests.gateway_harness import NODE_INFO, serve

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    return ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))


def test_context_overflow_is_worded_as_openais_with_its_numbers(tmp_path: Path, templater: ChatTemplater,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (oairev20 O4): these read "prompt (31 tokens) + max_tokens (9000) exceeds the
    context limit (8192 tokens)" and "prompt (5031 tokens) does not fit a cache node's KV pool,
    which holds 4368 tokens", so clients that recognise context overflow by OpenAI's phrase
    (LiteLLM's ``ContextWindowExceededError``) never did. Now: a chat's prompt + max_tokens past
    the model's context, past a tenant's lower ``max_context_tokens`` (named so), a token prompt
    and a chat past a node's KV pool."""
    monkeypatch.setitem(NODE_INFO, "pool_tokens", 512)  # the context stays 2048
    hi_tokens = len(templater.first_turn(HI))
    words = [{"role": "user", "content": " ".join(["hello"] * 600)}]
    words_tokens = len(templater.first_turn(words))
    assert 512 <= words_tokens < 2048
    with serve(tmp_path, templater) as gw, grpc.insecure_channel(gw.address) as ch:
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        admin = (("authorization", f"Bearer {gw.admin_key}"),)
        ann = tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="ann")),
                                     metadata=admin).api_key
        bob = tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(
            spec=tenant_pb2.TenantSpec(name="bob", max_context_tokens=100)), metadata=admin).api_key
        stub = inference_pb2_grpc.InferenceServiceStub(ch)

        def refusal(key: str, max_tokens: int, messages: list[dict] | None = None, ids: list[int] | None = None,
                    policy: str = "") -> str:
            prompt = ({"tokens": inference_pb2.TokenIds(ids=ids)} if ids is not None else
                      {"chat": inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in messages])})
            req = inference_pb2.GenerateRequest(**prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens),
                                                policy=policy)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {key}"),), timeout=30))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            return err.value.details()

        # past both the 2048-token context and the 512-token pool: the pool, the bound under a policy
        # that keeps every token, is named (review 25b R2: the context was, then, trimmed to it, the pool)
        assert refusal(ann, 3000, HI) == (
            "This model's maximum context length is 512 tokens on a cache node under a KV policy that keeps "
            f"every token (its KV pool holds 512 tokens). However, you requested {hi_tokens + 3000} tokens "
            f"({hi_tokens} in the messages, 3000 in the completion). Please reduce the length of the messages or "
            "completion.")
        # a compressing policy may outgrow the pool: the context is its bound
        assert refusal(ann, 3000, HI, policy="snapkv-0.5") == (
            f"This model's maximum context length is 2048 tokens. However, you requested {hi_tokens + 3000} tokens "
            f"({hi_tokens} in the messages, 3000 in the completion). Please reduce the length of the messages or "
            "completion.")
        assert refusal(bob, 200, HI) == (
            "This model's maximum context length is 100 tokens for this tenant (its max_context_tokens). However, "
            f"you requested {hi_tokens + 200} tokens ({hi_tokens} in the messages, 200 in the completion). Please "
            "reduce the length of the messages or completion.")
        assert refusal(ann, 4, ids=[1] * 600) == (
            "This model's maximum context length is 512 tokens on a cache node (its KV pool holds 512 tokens: the "
            "prompt and at least one generated token). However, you requested 600 tokens in the prompt. Please "
            "reduce the length of the prompt.")
        assert refusal(ann, 4, words) == (
            "This model's maximum context length is 512 tokens on a cache node (its KV pool holds 512 tokens: the "
            f"prompt and at least one generated token). However, you requested {words_tokens} tokens in the "
            "messages. Please reduce the length of the messages.")
        # prompt + completion past the pool, within the context (fresh-user trial 24: it went on
        # to admission, where an interactive tenant's early rejection answered RESOURCE_EXHAUSTED
        # with a retry hint as often as the node's INVALID_ARGUMENT did)
        for _ in range(3):
            assert refusal(ann, 400, ids=[1] * 300) == (
                "This model's maximum context length is 512 tokens on a cache node under a KV policy that keeps "
                "every token (its KV pool holds 512 tokens). However, you requested 700 tokens (300 in the prompt, "
                "400 in the completion). Please reduce the length of the prompt or completion.")
            assert refusal(ann, 400, [{"role": "user", "content": " ".join(["hello"] * 200)}]).startswith(
                "This model's maximum context length is 512 tokens on a cache node under a KV policy")
