"""The gateway's render children (``services.gateway_render``) served end to end: a real node,
scheduler, gRPC gateway and HTTP edge (``test_logprobs_served.Served``), the gateway's
templater a ``GatewayTemplater`` that renders every chat in a child (bounds below any chat).

A chat's prompt tokens are the in-process templater's on every path (gRPC, a chat completion
with ``n`` 2, ``/tokenize``); a render past the child's memory cap is the request's refusal
(INVALID_ARGUMENT / 400 naming ``messages`` and the cap) and the next chat is served.
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2
from services.chat import ChatTemplater
from services.gateway_render import GatewayTemplater, RenderPool
from services.render_worker import MEMORY_BYTES
from tests.test_logprobs_served import Served

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour. é 日本"}]
MULTIPLYING = ("{% if messages[0]['content'] == 'boom' %}{% for i in range(12000) %}{{ messages[1]['content'] }}"
               "{% endfor %}{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A template that writes a chat's second message 12,000 times when its first says "boom"."""
BOOM = [{"role": "system", "content": "boom"}, {"role": "user", "content": "x" * 100_000}]  # 1.2 GB rendered


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    tokenizer = copy.deepcopy(s.tokenizer)
    tokenizer.chat_template = MULTIPLYING
    s.local = ChatTemplater(tokenizer)  # type: ignore[attr-defined]
    s.servicer.templater = GatewayTemplater(tokenizer, RenderPool(tokenizer, 2), -1, -1)
    yield s
    s.servicer.templater.close()
    s.close()


def _grpc_chat(s: Served, messages: list[dict[str, str]], **fields: Any) -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in messages]),
        sampling=inference_pb2.SamplingParams(max_tokens=2), **fields)
    return list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {s.key}"),), timeout=60))


def _tokenize(s: Served, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(s.base.removesuffix("/v1") + "/tokenize", json.dumps({"model": s.model, **body}).encode(),
                                 {"Authorization": f"Bearer {s.key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_chats_rendered_in_a_child_are_served_with_the_in_process_prompt(served: Served) -> None:
    templater = served.servicer.templater
    expected = served.local.first_turn(CHAT)  # type: ignore[attr-defined]
    before = templater.child_renders
    status, answer = _tokenize(served, {"messages": CHAT})
    assert status == 200 and answer["tokens"] == expected, answer
    status, body = served.post("/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == len(expected), body
    replies = _grpc_chat(served, CHAT)
    assert replies and replies[-1].finished.prompt_tokens == len(expected), replies[-1]
    assert templater.child_renders - before >= 3  # (each in a child)


def test_a_render_past_the_memory_cap_is_the_requests_refusal_on_every_path(served: Served) -> None:
    cap = f"({MEMORY_BYTES >> 20} MiB)"
    with pytest.raises(grpc.RpcError) as err:
        _grpc_chat(served, BOOM)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and cap in err.value.details(), err.value
    assert "more memory than the chat renderer may use" in err.value.details()
    status, body = served.post("/chat/completions", {"messages": BOOM, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages" and cap in body["error"]["message"], body
    status, body = _tokenize(served, {"messages": BOOM})
    assert status == 400 and cap in body["error"]["message"], body
    status, answer = _tokenize(served, {"messages": CHAT})  # the next render: a fresh child
    assert status == 200 and answer["tokens"] == served.local.first_turn(CHAT), answer  # type: ignore[attr-defined]


def test_a_render_child_failure_is_internal_on_grpc(served: Served) -> None:
    """A render the gateway's child could not do (``RenderFailed``: it ended, hung, answered
    out of protocol, or the gateway is stopping) is the gateway's fault: INTERNAL with its
    words, for a whole chat and for a session turn's size estimates; an HTTP chat completion's
    is a 500. Before: the exception left the gRPC handler, UNKNOWN (R1's kind)."""
    templater = served.servicer.templater
    stopped = GatewayTemplater(templater.tokenizer, RenderPool(templater.tokenizer, 1), -1, -1)
    stopped.close()
    served.servicer.templater = stopped
    try:
        for fields in ({}, {"session_id": "render-child-failure"}):
            with pytest.raises(grpc.RpcError) as err:
                _grpc_chat(served, CHAT, **fields)
            assert err.value.code() == grpc.StatusCode.INTERNAL and "stopping" in err.value.details(), err.value
        status, body = served.post("/chat/completions", {"messages": CHAT, "max_tokens": 2, "n": 2})
        assert status == 500, body
        # /tokenize too, in the error's words (diff review s36 R2 F5: "internal error (incident ...)")
        status, body = _tokenize(served, {"messages": CHAT})
        assert status == 500 and "stopping" in json.dumps(body) and "incident" not in json.dumps(body), body
    finally:
        served.servicer.templater = templater
    assert _grpc_chat(served, CHAT)[-1].finished.prompt_tokens == len(served.local.first_turn(CHAT))  # type: ignore[attr-defined]
