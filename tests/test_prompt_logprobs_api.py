"""``echo`` and vLLM's ``prompt_logprobs`` on the OpenAI API (``services.openai_api.prompt_logprobs``),
served end to end (the tiny checkpoint's node, the scheduler, the gateway and its HTTP API):
``prompt_logprobs`` in vLLM's shape (a completion's on each choice, a chat's on the body) equal
to a transformers forward's log_softmax; an echoed prompt's text and logprobs first (the first
token's null), with ``max_tokens`` 0 the prompt alone; streamed, and with ``n`` 2; bad values
are 400s naming the field."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from starlette.responses import JSONResponse
from transformers import LlamaForCausalLM

from bench.chaos_stack import tiny_checkpoint
from services.openai_api import HttpServer, OpenAIEdge, create_app
from services.openai_api.context import CallAborted
from services.openai_api.logprobs import MAX_WHOLE_LOGPROBS, OFF_LOOP_LOGPROBS, Logprobs, TokenTexts
from services.openai_api.prompt_logprobs import PromptExtras, check_prompt_logprobs
from services.openai_api.response_budget import OFF_LOOP_CHARS, Held
from services.openai_api.responses import ECHO_CHARS_PER_PIECE, PROMPT_ENTRIES_PER_TURN, Generation
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


def _entry(k: int) -> list:
    return [5, -1.0, 1] + [x for i in range(k) for x in (i + 6, -1.0 - i)]


@pytest.mark.parametrize(("prompt_k", "echo_k"), [(20, None), (0, None), (3, 5), (None, 20), (20, 20)])
def test_a_prompt_the_up_front_check_accepts_is_never_refused_by_its_entries(prompt_k: int | None,
                                                                              echo_k: int | None) -> None:
    """``check_prompt_logprobs``, ``PromptExtras.check_prompt`` and ``feed`` count the same unit
    (1 + k per prompt token): the longest prompt accepted up front takes all its entries; one
    token more is refused up front and at its ``started`` event (review 28c F3: the feed counted
    3 + 2k numbers per entry, so with k 20 prompts of 6,097..12,483 tokens ran their whole
    prefill, then were refused)."""
    per = sum(1 + k for k in (prompt_k, echo_k) if k is not None)
    longest = (MAX_WHOLE_LOGPROBS - (1 + (echo_k or 0))) // per  # max_tokens 1
    check_prompt_logprobs(1, longest, 1, prompt_k, echo_k)
    with pytest.raises(ValueError):
        check_prompt_logprobs(1, longest + 1, 1, prompt_k, echo_k)
    extras = PromptExtras(1, prompt_k, "x" if echo_k is not None else None, echo_k, False, TokenTexts())
    logprobs = Logprobs(False, echo_k, TokenTexts()) if echo_k is not None else None
    entry = _entry(max(prompt_k or 0, echo_k or 0))
    for start in range(0, longest - 1, 512):  # the node's deltas
        extras.feed([list(entry) for _ in range(min(512, longest - 1 - start))], logprobs)
    extras.check_prompt(longest)
    extras.check_prompt(MAX_WHOLE_LOGPROBS // per)  # (without the completion's tokens)
    with pytest.raises(CallAborted) as info:
        extras.check_prompt(MAX_WHOLE_LOGPROBS // per + 1)
    assert info.value.param == "prompt_logprobs" and info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(CallAborted):  # the guard: a node sending more than the budget
        extras.feed([entry] * (MAX_WHOLE_LOGPROBS // per), logprobs)


def test_a_chats_prompt_past_the_budget_is_refused_before_its_entries_are_read() -> None:
    """A chat's rendered length is known from its ``started`` event: past the budget its
    response is refused there, before any prompt entry is read, and its events are closed (its
    request aborted on its node) (review 28c F3: it ran its whole prefill first)."""
    read, closed = [], []

    async def events() -> Any:
        try:
            read.append(1)
            yield {"type": "delta", "token_ids": [], "text": "", "prompt_logprobs": [_entry(20)]}
        finally:
            closed.append(1)

    async def run(prompt_tokens: int) -> None:
        stream = events()
        await stream.__anext__()  # (started: its generator runs)
        read.clear()
        extras = PromptExtras(0, 20, None, None, False, TokenTexts())
        generation = Generation(stream, {"type": "started", "prompt_tokens": prompt_tokens}, True, "m",
                                prompt=extras)
        async for _ in generation.pieces():
            pass

    with pytest.raises(CallAborted) as info:
        asyncio.run(run(MAX_WHOLE_LOGPROBS // 21 + 1))
    assert info.value.param == "prompt_logprobs" and "prompt's 12484 tokens" in info.value.message
    assert not read and closed


def _im_start(served: Served) -> int:
    return served.tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_an_echo_is_decoded_once_per_body_off_the_event_loop_and_built_off_it(served: Served,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Review s33 F1: each choice of an echo decoded the whole token prompt on the gateway's
    event loop (n 16: 16 decodes; 32,768 tokens: 0.4-0.7 s of the loop every tenant's calls
    share), and the whole body (n copies of the echo) was built there too, its text not counted.
    Now the body's parse decodes it once, on the tenant's worker-thread turn, and a body of
    more than ``OFF_LOOP_CHARS`` characters is built on a worker thread."""
    prompt = [_im_start(served)] * 1000  # (12,000 characters echoed: 16 choices are past OFF_LOOP_CHARS)
    loop, echoed = served.thread, served.tokenizer.decode(prompt)
    decodes: list[tuple[threading.Thread, int]] = []
    renders: list[tuple[threading.Thread, int]] = []
    decode, render = type(served.tokenizer).decode, JSONResponse.render

    def counted_decode(self: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        decodes.append((threading.current_thread(), len(ids) if isinstance(ids, list) else 1))
        return decode(self, ids, *args, **kwargs)

    def counted_render(self: Any, content: Any) -> bytes:
        out = render(self, content)
        renders.append((threading.current_thread(), len(out)))
        return out

    monkeypatch.setattr(type(served.tokenizer), "decode", counted_decode)
    monkeypatch.setattr(JSONResponse, "render", counted_render)
    status, body = served.post("/completions", {"prompt": prompt, "echo": True, "max_tokens": 1, "n": 16})
    assert status == 200, body
    assert len(body["choices"]) == 16 and all(c["text"].startswith(echoed) for c in body["choices"])
    whole = [thread for thread, size in decodes if size == len(prompt)]
    assert len(whole) == 1 and whole[0] is not loop, decodes
    big = [thread for thread, size in renders if size > 16 * len(echoed)]
    assert len(big) == 1 and big[0] is not loop, renders
    assert OFF_LOOP_CHARS < 16 * len(echoed)


def test_a_streamed_echo_is_sent_in_bounded_pieces(served: Served) -> None:
    """Review s33 F1: a streamed echo was one chunk, up to ``MAX_PROMPT_CHARS`` characters (6 MB
    of JSON) encoded at once on the event loop, per choice. It goes in pieces of at most
    ``ECHO_CHARS_PER_PIECE`` characters now, with its logprobs as before."""
    prompt = [_im_start(served)] * 1400  # 16,800 characters: two pieces
    status, chunks = served.post("/completions", {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": True,
                                                  "logprobs": 0, "temperature": 0})
    assert status == 200, chunks
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    echoed = served.tokenizer.decode(prompt)
    assert "".join(texts).startswith(echoed) and len(echoed) > ECHO_CHARS_PER_PIECE
    assert max(len(t) for t in texts) <= ECHO_CHARS_PER_PIECE
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(prompt) + 2


def test_a_body_is_refused_before_it_is_built_when_its_budget_has_no_room_for_it() -> None:
    """Review s33 F1: a whole response was built (an echo's n copies, on the event loop) before
    its tenant's ``ResponseBudget`` was looked at. Its least size (a byte a character and a
    value) is checked first now; a body that may fit is still held once built."""
    from tests.test_logprobs_bytes import _edge, _request

    edge = _edge()
    built: list[int] = []

    def build() -> dict[str, Any]:
        built.append(1)
        return {"text": "x" * 100}

    async def run() -> None:
        hold = edge.responses.hold("t", edge.responses.per_tenant_bytes - 50)
        refused = await edge.render(_request(), Held(0, 100), build)
        assert refused.status_code == 429 and not built
        too_big = await edge.render(_request(), Held(0, 10), build)  # (it may fit: built, then refused)
        assert too_big.status_code == 429 and built == [1]
        hold.release()
        held = await edge.render(_request(), Held(0, 100), build)
        assert held.status_code == 200 and edge.responses.per_tenant["t"] == len(held.body)

    asyncio.run(run())


def test_where_a_body_is_built_counts_its_characters_and_values() -> None:
    """``Held.off_loop``: past ``OFF_LOOP_LOGPROBS`` values, ``OFF_LOOP_CHARS`` characters, or
    their shares together; ``Generation.held`` counts its text's characters."""
    assert not Held(OFF_LOOP_LOGPROBS, 0).off_loop() and Held(OFF_LOOP_LOGPROBS + 1, 0).off_loop()
    assert not Held(0, OFF_LOOP_CHARS).off_loop() and Held(0, OFF_LOOP_CHARS + 1).off_loop()
    assert not Held(OFF_LOOP_LOGPROBS // 2, OFF_LOOP_CHARS // 2).off_loop()
    assert Held(OFF_LOOP_LOGPROBS // 2, OFF_LOOP_CHARS // 2 + 1).off_loop()
    assert Held.total([Held(1, 2), Held(3, 4)]) == Held(4, 6)

    async def none() -> Any:
        yield {}

    generation = Generation(none(), {"prompt_tokens": 1}, False, "m")
    assert generation.held("中" * 10) == Held(0, 10)


@pytest.mark.parametrize("stream", [False, True])
def test_the_prompts_logprobs_are_bounded_across_n_streamed_too(served: Served, stream: bool) -> None:
    """Review s33 F2: a streamed echo with logprobs was bounded per choice only, so n 16 x 1,400
    tokens x 21 moved 15 MB through the event loop (stalled up to 4.7 s) where the same body not
    streamed is a 400. The bound across n holds for a stream too (its prompt's part: its
    generated tokens' are paced by its node), a 400 naming ``logprobs``."""
    prompt = list(range(100, 1500))
    status, reply = served.post("/completions", {"prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 1,
                                                 "n": 16, "stream": stream})
    assert status == 400 and reply["error"]["param"] == "logprobs", reply
    assert "n 16" in reply["error"]["message"] and "1400 tokens" in reply["error"]["message"]
    per = 1 + 20
    longest = MAX_WHOLE_LOGPROBS // (16 * per)
    check_prompt_logprobs(16, longest, 1000, None, 20, stream=True)  # (a stream's generated tokens: not counted)
    with pytest.raises(ValueError, match="^logprobs: .*n 16, logprobs 20"):
        check_prompt_logprobs(16, longest + 1, 1, None, 20, stream=True)


def test_a_deltas_many_prompt_entries_are_fed_between_the_loops_other_work() -> None:
    """Review s33 F2 (the loop's lag at the bound): a delta coalesced while its client read
    slowly holds up to its whole prompt's entries (12,483 of 20 alternatives at the per-choice
    bound), all fed into the echo's logprobs in one turn of the event loop. They go in
    ``PROMPT_ENTRIES_PER_TURN`` at a time now, other tasks running in between; same result."""
    count = 4 * PROMPT_ENTRIES_PER_TURN + 3
    turns: list[int] = []

    async def events() -> Any:
        yield {"type": "delta", "token_ids": [7], "text": "x", "logprobs": [[-1.0] + [9, -2.0] * 20],
               "prompt_logprobs": [_entry(20) for _ in range(count)]}
        yield {"type": "finished", "prompt_tokens": count + 1, "completion_tokens": 1, "finish_reason": "length"}

    async def run() -> tuple[list[str], int]:
        async def tick() -> None:
            while True:
                turns.append(1)
                await asyncio.sleep(0)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0)
        turns.clear()
        logprobs = Logprobs(False, 20, TokenTexts())
        generation = Generation(events(), {"type": "started", "prompt_tokens": count + 1}, False, "m", logprobs=logprobs,
                                prompt=PromptExtras(1, None, "p" * (count + 1), 20, False, TokenTexts()))
        pieces = [piece async for piece in generation.pieces()]
        ticker.cancel()
        return pieces, len(logprobs)

    pieces, held = asyncio.run(run())
    assert len(turns) >= count // PROMPT_ENTRIES_PER_TURN, turns
    assert "".join(pieces) == "p" * (count + 1) + "x" and held == 1 + count * 21 + 21  # (the first token: null)
