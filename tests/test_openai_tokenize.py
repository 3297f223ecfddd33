"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` served end to end, without Ray: the real
CacheNode, scheduler, gateway gRPC server and OpenAI app of ``test_logprobs_served`` (a tiny
random Llama with SmolLM2's real tokenizer), the app's ``encode`` the gateway's own
(``encode_text``), so ``/v1/completions`` tokenizes a text prompt as in production.

Wikipedia text round-trips (tokenize, then detokenize: the same text; the ids the tokenizer's
own); a chat's ``count`` is the ``usage.prompt_tokens`` a chat completion of the same messages
(and tools, with a template that renders them) reports, and a text prompt's the one a completion
reports; bad input is a 400 naming its field, an unknown model a 404, no key a 401. Before
this, both routes were a 404 "no such endpoint"."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from services.chat import ChatTemplater, encode_text
from services.convert import MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.logprobs import TokenTexts
from tests.test_logprobs_served import Served
from tests.test_tool_calls_served import TOOL_TEMPLATE, TOOLS
from workloads.corpus import load_corpus


class Tokenizing:
    """``Served`` with an app whose ``encode`` is the gateway's (``gateway_server._start_http``)."""

    def __init__(self) -> None:
        self.s = s = Served()
        info = s.node.describe()
        self.http = HttpServer(create_app(OpenAIEdge(s.servicer, info["model_id"],
                                                     lambda text: encode_text(s.tokenizer, text), lambda: 1,
                                                     tokens=TokenTexts(s.tokenizer))))
        self.root = f"http://127.0.0.1:{s.run(self.http.start('127.0.0.1', 0))}"
        self.vocab = info["vocab_size"]

    def post(self, path: str, body: dict[str, Any], key: str | None = "") -> tuple[int, Any]:
        """Status and JSON body of a POST to ``path`` (from the root) with the tenant's key
        (``key`` None: no Authorization header)."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key or self.s.key}"
        req = urllib.request.Request(f"{self.root}{path}", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def ok(self, path: str, body: dict[str, Any]) -> Any:
        status, answer = self.post(path, {"model": self.s.model, **body})
        assert status == 200, answer
        return answer

    def close(self) -> None:
        self.s.run(self.http.stop())
        self.s.close()


@pytest.fixture(scope="module")
def tk() -> Iterator[Tokenizing]:
    t = Tokenizing()
    yield t
    t.close()


def _articles(step: int = 125) -> list[str]:
    return [f"{a.title}: {a.extract}" for a in load_corpus()[::step]]


def test_wikipedia_text_round_trips_through_tokenize_and_detokenize(tk: Tokenizing) -> None:
    """Each text's ids are the tokenizer's (``tokenizer(text)``; SmolLM2 adds no special
    token), ``token_strs`` their vocabulary pieces, ``max_model_len`` the tenant's as
    ``/v1/models`` says; detokenizing them gives the text back."""
    tok = tk.s.tokenizer
    req = urllib.request.Request(f"{tk.root}/v1/models", headers={"Authorization": f"Bearer {tk.s.key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        max_model_len = json.loads(resp.read())["data"][0]["max_model_len"]
    texts = _articles()
    assert len(texts) >= 40
    for text in texts:
        answer = tk.ok("/tokenize", {"prompt": text, "return_token_strs": True})
        assert answer["tokens"] == tok(text).input_ids == encode_text(tok, text), text[:60]
        assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == max_model_len
        assert answer["token_strs"] == tok.convert_ids_to_tokens(answer["tokens"])
        assert tk.ok("/detokenize", {"tokens": answer["tokens"]}) == {"prompt": text}
    # ``model`` may be left out (vLLM's: the served model); no token_strs unless asked
    status, answer = tk.post("/tokenize", {"prompt": texts[0]})
    assert status == 200 and set(answer) == {"count", "max_model_len", "tokens"}, answer


def test_a_chats_count_is_what_a_chat_completion_reports(tk: Tokenizing) -> None:
    """``/tokenize`` of messages renders them as ``/v1/chat/completions`` does: its count is the
    completion's ``usage.prompt_tokens`` (plain, with tools, with a template that renders tools
    and the history's tool calls); ``add_generation_prompt`` false leaves the assistant header
    out; ``add_special_tokens`` true changes nothing for SmolLM2 (no BOS)."""
    s = tk.s
    templater = s.servicer.templater
    for text in _articles(1000):
        messages = [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "Who?"}]}]
        usage = s.post("/chat/completions", {"messages": messages, "max_tokens": 1})[1]["usage"]
        answer = tk.ok("/tokenize", {"messages": messages})
        assert answer["count"] == usage["prompt_tokens"] == len(answer["tokens"])
        rendered = [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": f"{text}\nWho?"}]
        assert answer["tokens"] == templater.first_turn(rendered)
        bare = tk.ok("/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert bare["tokens"] == templater.encode(templater.render(rendered, add_generation_prompt=False))
        assert answer["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < answer["count"]
        assert tk.ok("/tokenize", {"messages": messages, "add_special_tokens": True}) == answer
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    tokenizer = copy.deepcopy(s.tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    kept, s.servicer.templater = s.servicer.templater, ChatTemplater(tokenizer)
    try:
        for messages, tools in ((history[:1], None), (history[:1], TOOLS), (history, TOOLS)):
            extra = {"tools": tools, "tool_choice": "none"} if tools else {}
            usage = s.post("/chat/completions", {"messages": messages, "max_tokens": 1, **extra})[1]["usage"]
            answer = tk.ok("/tokenize", {"messages": messages, **({"tools": tools} if tools else {})})
            assert answer["count"] == usage["prompt_tokens"], (messages, tools)
        assert answer["count"] > tk.ok("/tokenize", {"messages": history})["count"] + 100  # the tools rendered
    finally:
        s.servicer.templater = kept


def test_a_prompts_count_is_what_a_completion_reports(tk: Tokenizing) -> None:
    """A text prompt without special tokens is tokenized as ``/v1/completions`` tokenizes it."""
    for text in _articles(2000):
        status, done = tk.post("/v1/completions", {"model": tk.s.model, "prompt": text, "max_tokens": 1})
        assert status == 200, done
        answer = tk.ok("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert answer["count"] == done["usage"]["prompt_tokens"]


def test_a_count_past_the_context_is_answered(tk: Tokenizing) -> None:
    """As vLLM: the count of a prompt past ``max_model_len`` (but within ``MAX_PROMPT_TOKEN_IDS``)."""
    text = " ".join(_articles(50))
    answer = tk.ok("/tokenize", {"prompt": text})
    assert answer["count"] > answer["max_model_len"] and answer["count"] == len(tk.s.tokenizer(text).input_ids)


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/detokenize", {"tokens": [504, 49152]}, "tokens.1", "49152 is not a token id of this model"),
    ("/detokenize", {"tokens": [504, -1]}, "tokens.1", "is not a token id of this model (they lie in [0, 49152))"),
    ("/detokenize", {"tokens": [504, 1 << 40]}, "tokens.1", "is not a token id"),
    ("/detokenize", {"tokens": [0] * (MAX_PROMPT_TOKEN_IDS + 1)}, "tokens", "at most 131072 items"),
    ("/detokenize", {"tokens": [504, "7"]}, "tokens.1", "Input should be a valid integer"),
    ("/detokenize", {"tokens": [504, True]}, "tokens.1", "Input should be a valid integer"),
    ("/detokenize", {"tokens": [504, 1.5]}, "tokens.1", "Input should be a valid integer"),
    ("/detokenize", {"tokens": "504"}, "tokens", "Input should be a valid list"),
    ("/detokenize", {}, "tokens", "Field required"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt", "unsupported field"),
    ("/tokenize", {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, "prompt", "at most 1048576 characters"),
    ("/tokenize", {"prompt": " x" * (MAX_PROMPT_TOKEN_IDS + 10)}, "prompt", "at most 131072 are allowed"),
    ("/tokenize", {"prompt": 5}, "prompt", "Input should be a valid string"),
    ("/tokenize", {"prompt": ["hi"]}, "prompt", "Input should be a valid string"),
    ("/tokenize", {}, "messages", "give a prompt (text) or messages (a chat), one of them"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt", "not both"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt",
     "applies to messages (a chat), not to a prompt"),
    ("/tokenize", {"prompt": "hi", "tools": TOOLS}, "tools", "applies to messages"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", "valid boolean"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs", "valid boolean"),
    ("/tokenize", {"prompt": "hi", "chat_template": "{{ x }}"}, "chat_template", "unsupported field"),
    ("/tokenize", {"messages": []}, "messages", "must hold at least one message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message", "not served"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", "Input should be"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]}, "messages",
     "at most 1048576 are allowed"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]},
     "messages.1.tool_call_id", "required on a tool message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]},
                                {"role": "tool", "tool_call_id": "c2", "content": "4"}]},
     "messages.2.tool_call_id", "'c2' answers no tool call of an earlier assistant message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools.0.function", "Field required"),
])
def test_bad_input_is_a_400_naming_the_field(tk: Tokenizing, path: str, body: dict[str, Any], param: str,
                                             message: str) -> None:
    status, answer = tk.post(path, {"model": tk.s.model, **body})
    assert status == 400, answer
    error = answer["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", "invalid_argument")
    assert message in error["message"], error


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_key_and_the_model_are_checked(tk: Tokenizing, path: str) -> None:
    """No key or a bad one: 401 ``invalid_api_key`` (before the body is read); another model: 404
    ``model_not_found`` naming ``model``, as the completions routes answer them."""
    body = {"model": tk.s.model, "prompt": "hi"} if path == "/tokenize" else {"model": tk.s.model, "tokens": [504]}
    for key in (None, "sk-not-a-key"):
        status, answer = tk.post(path, body, key=key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key", answer
    status, answer = tk.post(path, {**body, "model": "gpt-4o"})
    assert status == 404 and (answer["error"]["code"], answer["error"]["param"]) == ("model_not_found", "model")


class CountingTemplater(ChatTemplater):
    """A ``ChatTemplater`` counting its ``first_turn`` calls (a chat rendered for a request)."""

    renders = 0

    def first_turn(self, messages: Any, tools: Any = None) -> list[int]:
        type(self).renders += 1
        return super().first_turn(messages, tools)


def test_a_chat_with_n_choices_is_rendered_once_and_each_node_request_is_unchanged(tk: Tokenizing) -> None:
    """``n`` 4: the chat is rendered once (it was 4 times, one per choice), every choice's
    request reaches the node as n 1's does (the same ``token_ids``, no messages: the gateway
    renders a chat to tokens either way), its ``prompt_tokens`` is ``/tokenize``'s count, and a
    refusal for size reads as n 1's ("in the messages")."""
    s = tk.s
    servicer = s.servicer
    sent: list[Any] = []
    prepare = servicer._prepare

    async def recording(call: Any, tenant: Any, context: Any) -> Any:
        req, hashes = await prepare(call, tenant, context)
        sent.append((req.token_ids, req.messages, tuple(hashes), req.prefix_tokens))
        return req, hashes

    kept = servicer.templater
    servicer.templater, servicer._prepare = CountingTemplater(s.tokenizer), recording
    try:
        messages = [{"role": "user", "content": _articles(3000)[0]}]
        status, one = s.post("/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0.0})
        assert status == 200 and CountingTemplater.renders == 1 and len(sent) == 1, one
        status, four = s.post("/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0.0,
                                                    "n": 4})
        assert status == 200 and CountingTemplater.renders == 2 and len(sent) == 5, four
        assert all(request == sent[0] and request[0] and not request[1] for request in sent[1:])
        assert four["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"] == \
            tk.ok("/tokenize", {"messages": messages})["count"]
        assert [c["message"]["content"] for c in four["choices"]] == [one["choices"][0]["message"]["content"]] * 4
        refusals = [s.post("/chat/completions", {"messages": messages, "max_tokens": 1 << 20, "n": n}) for n in (1, 2)]
        assert refusals[0] == refusals[1] and refusals[0][0] == 400, refusals
        assert "in the messages" in refusals[0][1]["error"]["message"] and "prompt" not in refusals[0][1]["error"][
            "message"], refusals
    finally:
        servicer.templater, servicer._prepare = kept, prepare
