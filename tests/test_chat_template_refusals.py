"""A chat template that refuses the messages (``raise_exception``, as Llama-2's, Mistral's and
Gemma's "Conversation roles must alternate user/assistant/user/assistant/...") is the
request's fault: a 400 / INVALID_ARGUMENT naming ``messages`` with the template's words, on
every path that renders a chat (the gateway's ``first_turn`` for a chat completion and the
gRPC API, ``/tokenize``, the node's render of a session turn), and nothing else is
affected. Regression: the template's ``jinja2`` ``TemplateError`` was no ``ValueError``, so
the gateway answered 500 / UNKNOWN (an HTTP client was told the server failed) and a session
turn the node renders ended INTERNAL ("the node failed")."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from kvstrata.v1 import inference_pb2
from services.chat import ChatTemplater
from tests.test_logprobs_served import Served

ALTERNATING = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TWO_USERS = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Hello again."}]
WORDS = "Conversation roles must alternate"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    tokenizer = copy.deepcopy(s.tokenizer)
    tokenizer.chat_template = ALTERNATING
    s.servicer.templater = ChatTemplater(tokenizer)
    s.node.templater = ChatTemplater(tokenizer)
    yield s
    s.close()


def _grpc_chat(s: Served, messages: list[dict[str, str]], session_id: str = "") -> list[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in messages]),
        sampling=inference_pb2.SamplingParams(max_tokens=2), session_id=session_id)
    return list(s.stub.Generate(request, metadata=(("authorization", f"Bearer {s.key}"),), timeout=60))


def test_a_chat_completion_the_template_refuses_is_a_400_naming_messages(served: Served) -> None:
    for n in (1, 2):  # (an n > 1 body renders once, at the edge)
        status, body = served.post("/chat/completions", {"messages": TWO_USERS, "max_tokens": 2, "n": n})
        assert status == 400, body
        assert WORDS in body["error"]["message"] and body["error"]["param"] == "messages", body
    status, body = served.post("/chat/completions", {"messages": TWO_USERS[:1], "max_tokens": 2})
    assert status == 200, body


def test_tokenize_of_messages_the_template_refuses_is_a_400(served: Served) -> None:
    req = urllib.request.Request(served.base.removesuffix("/v1") + "/tokenize",
                                 json.dumps({"model": served.model, "messages": TWO_USERS}).encode(),
                                 {"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    body = json.loads(err.value.read())
    assert err.value.code == 400 and WORDS in body["error"]["message"], body
    assert body["error"]["param"] == "messages", body


def test_a_grpc_chat_the_template_refuses_is_invalid_argument(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _grpc_chat(served, TWO_USERS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and WORDS in err.value.details(), err.value


def test_a_session_turn_the_template_refuses_on_the_node_is_invalid_argument(served: Served) -> None:
    """The node renders a session's later turn over its kept history (the gateway does not
    hold it): a turn that breaks the alternation is refused there, and the session goes on."""
    first = _grpc_chat(served, TWO_USERS[:1], session_id="alt-1")
    assert first[-1].WhichOneof("event") == "finished"
    with pytest.raises(grpc.RpcError) as err:  # history ends with the assistant: user, user breaks it
        _grpc_chat(served, [{"role": "assistant", "content": "No."}], session_id="alt-1")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and WORDS in err.value.details(), err.value
    after = _grpc_chat(served, [{"role": "user", "content": "Then tell me more."}], session_id="alt-1")
    assert after[-1].WhichOneof("event") == "finished"
    served.node.engine.check_integrity()  # raises on broken bookkeeping
