"""``echo`` and vLLM's ``prompt_logprobs`` on the OpenAI API (``services.openai_api.prompt_logprobs``),
served end to end (the tiny checkpoint's node, the scheduler, the gateway and its HTTP API):
``prompt_logprobs`` in vLLM's shape (a completion's on each choice, a chat's on the body) equal
to a transformers forward's log_softmax; an echoed prompt's text and logprobs first (the first
token's null), with ``max_tokens`` 0 the prompt alone; streamed, and with ``n`` 2; bad values
are 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from bench.chaos_stack import tiny_checkpoint
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.logprobs import TokenTexts
from tests.test_logprobs_served import PROMPT, Served

TEXT = "The capital of France is Paris, and the capital of Germany is"


class TextServed(Served):
    """``Served`` whose HTTP API encodes text prompts with the tokenizer."""

    def __init__(self) -> None:
        super().__init__()
        self.run(self.http.stop())
        edge = OpenAIEdge(self.servicer, self.node.describe()["model_id"],
                          lambda text: self.tokenizer(text, add_special_tokens=False).input_ids, lambda: 1,
                          tokens=TokenTexts(self.tokenizer))
        self.http = HttpServer(create_app(edge))
        self.base = f"http://127.0.0.1:{self.run(self.http.start('127.0.0.1', 0))}/v1"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = TextServed()
    yield s
    s.close()


@pytest.fixture(scope="module")
def forward() -> Any:
    model = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint()), torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"

    def rows(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]

    return rows


def _check_field(field: list, prompt: list[int], rows: torch.Tensor, k: int, served: Served) -> None:
    """vLLM's ``prompt_logprobs``: null, then per token a map id -> {logprob, rank, decoded_token}."""
    assert len(field) == len(prompt) and field[0] is None
    for i, item in enumerate(field[1:]):
        row, token = rows[i], prompt[i + 1]
        top = row.topk(k).indices.tolist()
        assert set(item) == {str(t) for t in [token, *top]}
        assert item[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert item[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert item[str(token)]["decoded_token"] == served.tokenizer.decode([token])
        for rank, t in enumerate(top, 1):
            assert item[str(t)]["rank"] == (rank if t != token else item[str(token)]["rank"])


def test_a_completions_prompt_logprobs_are_vllms_shape_and_the_forwards(served: Served, forward: Any) -> None:
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 3})
    assert status == 200, body
    _check_field(body["choices"][0]["prompt_logprobs"], PROMPT, forward(PROMPT), 3, served)
    assert "prompt_logprobs" not in served.post("/completions", {"prompt": PROMPT, "max_tokens": 2})[1]["choices"][0]


def test_a_chats_prompt_logprobs_are_on_the_body(served: Served) -> None:
    status, body = served.post("/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}],
                                                     "max_tokens": 2, "prompt_logprobs": 0, "n": 2})
    assert status == 200, body
    field = body["prompt_logprobs"]
    assert len(field) == body["usage"]["prompt_tokens"] and field[0] is None  # (usage counts the prompt once)
    assert all(len(item) == 1 and next(iter(item.values()))["rank"] >= 1 for item in field[1:])


def test_echo_puts_the_prompt_and_its_logprobs_first(served: Served, forward: Any) -> None:
    plain = served.post("/completions", {"prompt": TEXT, "temperature": 0, "max_tokens": 3, "logprobs": 2})[1]["choices"][0]
    status, body = served.post("/completions", {"prompt": TEXT, "temperature": 0, "max_tokens": 3, "logprobs": 2, "echo": True})
    assert status == 200, body
    choice, prompt = body["choices"][0], served.tokenizer(TEXT).input_ids
    assert choice["text"] == TEXT + plain["text"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [served.tokenizer.decode([t]) for t in prompt] + plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    rows = forward(prompt)
    for i, t in enumerate(prompt[1:]):
        assert logprobs["token_logprobs"][i + 1] == pytest.approx(float(rows[i, t]), abs=1e-4)
        assert len(logprobs["top_logprobs"][i + 1]) in (2, 3)  # the token and the top 2 (texts may merge)
    assert logprobs["token_logprobs"][len(prompt):] == plain["logprobs"]["token_logprobs"]
    assert logprobs["text_offset"][len(prompt)] == len(TEXT)
    assert "prompt_logprobs" not in choice  # (echo's logprobs are the choice's own)


def test_echo_offsets_index_the_echoed_text_with_special_tokens(served: Served) -> None:
    """Every token's ``text_offset`` points at its text in the echoed prompt and the completion
    after it, also for a prompt holding special tokens, which the echo keeps (review 28c F2:
    every offset after ``<|im_start|>`` fell 12 characters short)."""
    chat = "<|im_start|>user\nThe capital of France is<|im_end|>\n"
    ids = served.tokenizer(chat, add_special_tokens=False).input_ids
    assert any(served.tokenizer.decode([t], skip_special_tokens=True) == "" for t in ids)  # special ones
    for prompt in (chat, ids, TEXT):
        status, body = served.post("/completions", {"prompt": prompt, "max_tokens": 4, "echo": True, "logprobs": 1,
                                                    "temperature": 0})
        assert status == 200, body
        text, logprobs = body["choices"][0]["text"], body["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) > 4
        echoed = len(ids) if prompt is not TEXT else len(served.tokenizer(TEXT).input_ids)
        for i, (token, offset) in enumerate(zip(logprobs["tokens"], logprobs["text_offset"])):
            if i >= echoed and token in served.tokenizer.all_special_tokens:
                continue  # a generated special token: the completion's text skips it
            assert text[offset:].startswith(token), (prompt, token, offset, text)


def test_echo_with_max_tokens_zero_is_the_prompt_alone(served: Served) -> None:
    status, body = served.post("/completions", {"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(served.tokenizer(TEXT).input_ids)
    assert body["usage"]["completion_tokens"] == 0
    status, body = served.post("/completions", {"prompt": TEXT, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_echo_streamed_and_with_n_two(served: Served) -> None:
    plain = served.post("/completions", {"prompt": TEXT, "temperature": 0, "max_tokens": 3})[1]["choices"][0]["text"]
    status, chunks = served.post("/completions", {"prompt": TEXT, "temperature": 0, "max_tokens": 3, "echo": True, "stream": True,
                                                  "logprobs": 1})
    assert status == 200
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TEXT + plain
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(served.tokenizer(TEXT).input_ids) + 3
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True, "n": 2})
    assert status == 200 and all(c["text"].startswith(served.tokenizer.decode(PROMPT)) for c in body["choices"])


@pytest.mark.parametrize(("path", "fields"), [
    ("/completions", {"prompt_logprobs": 21}),
    ("/completions", {"prompt_logprobs": -1}),
    ("/completions", {"prompt_logprobs": 1, "stream": True}),
    ("/completions", {"prompt_logprobs": 0, "prefix_tokens": 3}),
    ("/chat/completions", {"prompt_logprobs": "2"}),
    ("/chat/completions", {"prompt_logprobs": 1, "stream": True}),
])
def test_bad_prompt_logprobs_are_400_naming_the_field(served: Served, path: str, fields: dict) -> None:
    body = {"prompt": PROMPT} if path == "/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    status, reply = served.post(path, {**body, "max_tokens": 2, **fields})
    assert status == 400 and reply["error"]["param"] == "prompt_logprobs", reply
