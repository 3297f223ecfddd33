"""A request's reusable prefix (``prefix_tokens`` / ``prefix_messages``, issue 22 build 1b)
through both APIs: bounded at the gateway (INVALID_ARGUMENT naming the field, real gRPC,
``tests.gateway_harness``), the chat prefix rendered by the model's chat template, the field
on the data plane's wire and in the OpenAI bodies."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.data_plane import request_from_wire, request_to_wire
from services.node_request import NodeRequest, resolve_prefix_tokens
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from tests.gateway_harness import NODE_INFO, serve


def test_bad_prefix_is_invalid_argument_at_the_gateway(tmp_path: Path) -> None:
    """Out-of-range or mistargeted prefix fields are INVALID_ARGUMENT with a precise message;
    a valid one passes the check (the request then fails on its length, as the harness has
    no node behind it)."""
    too_long = NODE_INFO["max_model_len"] + 1
    with serve(tmp_path) as gw, grpc.insecure_channel(gw.address) as ch:
        reg = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="ann")),
            metadata=(("authorization", f"Bearer {gw.admin_key}"),))
        stub = inference_pb2_grpc.InferenceServiceStub(ch)

        def generate(max_tokens: int = 2, chat: bool = False, **prefix: int) -> tuple[grpc.StatusCode, str]:
            prompt = ({"chat": inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content="hi")])}
                      if chat else {"tokens": inference_pb2.TokenIds(ids=[1, 2, 3])})
            req = inference_pb2.GenerateRequest(**prompt, policy="sentencekv-0.25",
                                                sampling=inference_pb2.SamplingParams(max_tokens=max_tokens), **prefix)
            try:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {reg.api_key}"),), timeout=10))
            except grpc.RpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""

        bad = [generate(prefix_tokens=4), generate(prefix_tokens=-1), generate(prefix_messages=1),
               generate(chat=True, prefix_tokens=1), generate(chat=True, prefix_messages=2),
               generate(chat=True, prefix_messages=1)]
        valid = generate(max_tokens=too_long, prefix_tokens=3)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert bad == [
        (invalid, "prefix_tokens must be in [0, 3] (the prompt's tokens), got 4"),
        (invalid, "prefix_tokens must be in [0, 3] (the prompt's tokens), got -1"),
        (invalid, "prefix_messages applies to chat prompts; a token prompt names prefix_tokens"),
        (invalid, "prefix_tokens applies to token prompts; a chat names prefix_messages"),
        (invalid, "prefix_messages must be an integer in [0, 1] (the chat's messages), got 2"),
        (invalid, "prefix_messages needs a chat the gateway renders: not a session turn"),  # no template here
    ]
    over = (f"This model's maximum context length is {too_long - 1} tokens. However, you requested {3 + too_long} "
            f"tokens (3 in the prompt, {too_long} in the completion). Please reduce the length of the prompt or "
            "completion.")  # OpenAI's and vLLM's words (oairev20 O4)
    assert valid == (invalid, over)


def test_chat_prefix_is_the_rendering_of_its_leading_messages() -> None:
    """``prefix_messages`` k: the tokens of the first k messages rendered without a generation
    prompt, checked to be a token prefix of the whole chat's rendering."""
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir
    from services.chat import ChatTemplater

    templater = ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    chat = [{"role": "system", "content": "Read the document."},
            {"role": "user", "content": "The Barents Sea is a marginal sea of the Arctic Ocean. " * 4},
            {"role": "user", "content": "Which ocean is it part of?"}]
    tokens = templater.first_turn(chat)
    n = resolve_prefix_tokens(0, 2, chat, tokens, templater)
    assert 0 < n < len(tokens)
    assert tokens[:n] == templater.encode(templater.render(chat[:2], add_generation_prompt=False))
    assert resolve_prefix_tokens(0, 0, chat, tokens, templater) == 0

    class Rewording:  # a template that renders a conversation's start differently alone
        def render(self, messages: list, add_generation_prompt: bool = True, tools: list | None = None) -> str:
            return "x" + templater.render(messages, add_generation_prompt, tools)

        def encode(self, text: str) -> list[int]:
            return templater.encode(text)

    with pytest.raises(ValueError, match=r"^prefix_messages=2: those messages rendered .* not a token prefix"):
        resolve_prefix_tokens(0, 2, chat, tokens, Rewording())


def test_prefix_tokens_on_the_wire_and_in_openai_bodies() -> None:
    """The node request carries ``prefix_tokens`` over the data plane (bounded there too), and
    the OpenAI bodies take ``prefix_tokens`` (completions) and ``prefix_messages`` (chat)."""
    req = NodeRequest(request_id="r", tenant="t", cache_namespace="ns", sampling=SamplingParams(max_tokens=2),
                      token_ids=(5, 6, 7), prefix_tokens=2)
    assert request_from_wire(request_to_wire(req)).prefix_tokens == 2
    for bad in (4, -1):
        with pytest.raises(ValueError, match=r"prefix_tokens must be in \[0, 3\]"):
            request_from_wire(request_to_wire(req) | {"prefix_tokens": bad})
    with pytest.raises(TypeError, match="prefix_tokens must be"):
        request_from_wire(request_to_wire(req) | {"prefix_tokens": "2"})
    with pytest.raises(ValueError, match="prefix_tokens applies to token prompts"):
        request_from_wire(request_to_wire(req) | {"token_ids": [], "messages": [{"role": "user", "content": "a"}]})
    done = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "prefix_tokens": 2}).to_input(None)
    assert (done.prefix_tokens, done.prefix_messages) == (2, 0)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                                 "prefix_messages": 1}).to_input()
    assert (chat.prefix_tokens, chat.prefix_messages) == (0, 1)
    with pytest.raises(ValueError, match="prefix_tokens"):
        CompletionRequest.model_validate({"model": "m", "prompt": [1], "prefix_tokens": "1"})
