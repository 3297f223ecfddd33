"""The OpenAI edge's log probabilities (``services.openai_api.logprobs``): each token's ``bytes``
are the bytes it really holds (SmolLM2's real byte-level BPE tokenizer; a SentencePiece
byte-fallback one; any other: its text's UTF-8), ``text_offset`` indexes the returned text,
and a whole response's entries are bounded before the request runs, held compactly and
built off the event loop when many; a stream's chunk carries a bounded number of them."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request
from tokenizers import Tokenizer, decoders, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bench.chaos_stack import tiny_checkpoint
from services.node_request import logprobs_entry
from services.openai_api.app import OpenAIEdge
from services.openai_api.context import CallAborted
from services.openai_api.logprobs import (
    LOGPROB_TOKENS_PER_CHUNK,
    MAX_WHOLE_LOGPROBS,
    OFF_LOOP_LOGPROBS,
    Logprobs,
    Token,
    TokenTexts,
    token_bytes_scheme,
)
from services.openai_api.response_budget import Held
from services.openai_api.responses import Generation
from services.openai_api.schemas import ChatCompletionRequest, CompletionRequest

TEXTS = ["日本語 😀 café", "naïve résumé — 東京タワー 🎉🎉 ok", "Ünïcödé ñ 中文 👩‍👩‍👧 €100", "plain ascii"]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """SmolLM2's real tokenizer (the tiny checkpoint's: the served model's vocabulary)."""
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint()))


def _collect(chat: bool, tokens: TokenTexts, ids: list[int], top: int = 0) -> dict[str, Any]:
    lp = Logprobs(chat, top, tokens)
    lp.add(ids, [logprobs_entry(-0.5, [(t, -0.5) for t in ids[:top]]) for _ in ids])
    return lp.whole()


@pytest.mark.parametrize("text", TEXTS)
def test_joined_bytes_are_the_texts_utf8_with_smollm2s_tokenizer(smollm2: Any, text: str) -> None:
    """Review 26c F1: a token holding part of a character (日, 語, 😀 split over tokens by
    SmolLM2) reported the bytes of U+FFFD, so no client could rebuild the character, and
    ``text_offset`` summed U+FFFD lengths (9 for " café" in "日本語 😀 café", past the text).
    Now ``bytes`` are the token's own: joined, they are the text's exact UTF-8; ``token`` is
    still the id decoded alone (vLLM's); ``text_offset`` is the character, in the text, that
    the token's first byte belongs to."""
    tokens = TokenTexts(smollm2)
    assert tokens.scheme == "byte_level"
    ids = smollm2.encode(text, add_special_tokens=False)
    content = _collect(True, tokens, ids, top=2)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == text.encode()
    assert [e["token"] for e in content] == [smollm2.decode([t]) for t in ids]
    for e in content:  # the alternatives have their own bytes too
        assert [t["bytes"] for t in e["top_logprobs"]] == [list(tokens(t).data) for t in ids[:2]]
    completion = _collect(False, tokens, ids)
    assert completion["tokens"] == [smollm2.decode([t]) for t in ids]
    held = [bytes(e["bytes"]) for e in content]
    want = [len(b"".join(held[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]  # the tail: incomplete
    assert completion["text_offset"] == want and all(0 <= o < len(text) for o in want)


def test_the_reviews_example_has_exact_bytes_and_offsets(smollm2: Any) -> None:
    ids = smollm2.encode("日本語 😀 café", add_special_tokens=False)
    completion = _collect(False, TokenTexts(smollm2), ids)
    content = _collect(True, TokenTexts(smollm2), ids)["content"]
    assert ids == [23274, 115, 40993, 179, 120, 248, 40303, 218, 37366]
    assert [bytes(e["bytes"]) for e in content] == [b"\xe6\x97", b"\xa5", b"\xe6\x9c\xac", b"\xe8", b"\xaa", b"\x9e",
                                                    b" \xf0\x9f\x98", b"\x80", b" caf\xc3\xa9"]
    assert completion["text_offset"] == [0, 0, 1, 2, 2, 2, 3, 4, 5]  # " café" at 5 in the 10-character text
    assert "日本語 😀 café"[5:] == " café"


def test_a_token_after_a_broken_character_is_offset_past_its_replacement(smollm2: Any) -> None:
    """Review 26f F1: a token holding only the start of a character ([230, 181], 2 of 3 bytes)
    followed by an ASCII token: the text is "x\ufffdarks" and "arks" starts at 2, but its
    offset was 1 (the U+FFFD was counted only when the next token's bytes were decoded, after
    its offset was taken), so ``text[offset:]`` of "arks" began with the U+FFFD."""
    tokens = TokenTexts(smollm2)
    broken = next(t for t in range(len(smollm2)) if tokens(t).data == b"\xe6\xb5")
    ids = [*smollm2.encode("x", add_special_tokens=False), broken, *smollm2.encode("arks", add_special_tokens=False)]
    text = b"".join(tokens(t).data for t in ids).decode("utf-8", "replace")
    assert text == "x\ufffdarks"
    offsets = _collect(False, tokens, ids)["text_offset"]
    assert offsets == [0, 1, 2] and text[offsets[2]:] == "arks"


def test_special_tokens_keep_their_text_and_add_no_offset(smollm2: Any) -> None:
    """A special token (the text skips it: the node decodes with skip_special_tokens) keeps its
    text and that text's bytes (vLLM's), and moves no later token's offset; an id past the
    vocabulary is empty."""
    tokens = TokenTexts(smollm2)
    end = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert tokens(end) == Token("<|im_end|>", b"<|im_end|>", False)
    ids = [end, *smollm2.encode(" hi", add_special_tokens=False)]
    assert _collect(False, tokens, ids)["text_offset"] == [0, 0]
    assert tokens(10**9) == Token("", b"", True)


def _sentencepiece() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer as Llama 2's tokenizer.json has it: BPE with byte
    fallback, decoded by Replace('▁', ' '), ByteFallback, Fuse, Strip."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁caf": 257, "▁hi": 258, "é": 259}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_sentencepiece_byte_fallback_tokens_are_their_bytes() -> None:
    """``<0xNN>`` is byte NN and ``▁`` a space: "▁hi▁caf" + "é" + 😀's four byte tokens join to
    the UTF-8 of " hi café😀"; the other schemes' detection."""
    tok = _sentencepiece()
    tokens = TokenTexts(tok)
    assert tokens.scheme == "sentencepiece" and token_bytes_scheme(object()) is None
    ids = [258, 257, 259, *(1 + b for b in "😀".encode())]
    content = _collect(True, tokens, ids)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content) == " hi café😀".encode()
    assert _collect(False, tokens, ids)["text_offset"] == [0, 3, 7, 8, 8, 8, 8]


def test_an_unknown_tokenizer_gets_its_decoded_texts_bytes() -> None:
    """A tokenizer of no known byte scheme (here WordPiece's decoder; a slow one has none):
    ``bytes`` are the decoded text's UTF-8 and offsets their lengths, as before."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "ab": 1, "é": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokens = TokenTexts(tok)
    assert tokens.scheme is None
    assert tokens(2) == Token("é", "é".encode(), True)
    assert TokenTexts()(7) == Token("token_id:7", b"token_id:7", True)  # no tokenizer at all


def test_a_whole_responses_entries_are_held_compactly() -> None:
    """Review 26c F2: a chat's collector held a dict per entry (51 MiB for 8192 tokens with 20
    alternatives); it now holds flat arrays until the body is built: under 24 bytes a value."""
    tokens = TokenTexts()
    lp = Logprobs(True, 20, tokens)
    for t in range(2000):  # the token texts cached first: they are the tokenizer's, not the collector's
        tokens(t)
    entry = logprobs_entry(-0.5, [(t, -1.0) for t in range(20)])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for t in range(2000):
            lp.add([t], [entry])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(lp) == 2000 * 21
    assert held < 24 * len(lp), held


def _body(chat: bool, **fields: Any) -> ChatCompletionRequest | CompletionRequest:
    if chat:
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                     **fields})
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


class _Servicer:
    """What the edge reads of the gateway here: the model's limits and ``off_loop``."""

    def __init__(self) -> None:
        self.info = {"max_model_len": 8192, "pool_tokens": 1 << 20}
        self.off_loop_calls: list[str] = []

    async def off_loop(self, tenant_id: str, work: Any) -> Any:
        self.off_loop_calls.append(tenant_id)
        return await asyncio.to_thread(work)


def _edge() -> OpenAIEdge:
    return OpenAIEdge(_Servicer(), "m@digest:bf16", list, lambda: 1)  # type: ignore[arg-type]


TENANT = SimpleNamespace(tenant_id="t", spec=SimpleNamespace(max_context_tokens=None))


@pytest.mark.parametrize(("chat", "fields", "field"), [
    (True, {"n": 16, "logprobs": True, "top_logprobs": 20}, "top_logprobs"),  # the review's: no max_tokens
    (True, {"n": 2, "logprobs": True, "top_logprobs": 20, "max_tokens": 6243}, "top_logprobs"),
    (True, {"n": 16, "logprobs": True, "top_logprobs": 0, "max_completion_tokens": 16385}, "top_logprobs"),
    (False, {"n": 4, "logprobs": 5, "max_tokens": 10923}, "logprobs"),
])
def test_a_whole_response_past_the_logprobs_bound_is_refused_naming_the_field(chat: bool, fields: dict,
                                                                               field: str) -> None:
    """Review 26c F2: n x max_tokens x (1 + k) over ``MAX_WHOLE_LOGPROBS`` is a 400 naming the
    logprobs field and telling the client to stream (a chat without max_tokens counts what
    the context leaves: 8191 here); streamed, or within the bound, it is served."""
    edge = _edge()
    with pytest.raises(CallAborted) as info:
        edge.check_whole(_body(chat, **fields), TENANT)
    assert info.value.code.name == "INVALID_ARGUMENT" and info.value.param == field
    assert info.value.message.startswith(f"{field}: a non-streamed response may hold at most {MAX_WHOLE_LOGPROBS} ")
    assert "stream it (stream: true)" in info.value.message
    edge.check_whole(_body(chat, **fields, stream=True), TENANT)  # a stream's chunks are bounded
    edge.check_whole(_body(chat, **{**fields, "n": 1}), TENANT)  # one choice is within it


def test_the_bound_without_max_tokens_is_the_tenants_context() -> None:
    edge = _edge()
    body = _body(True, logprobs=True, top_logprobs=20)  # 21 x 8191 = 172,011: within
    edge.check_whole(body, TENANT)
    small = SimpleNamespace(tenant_id="t", spec=SimpleNamespace(max_context_tokens=4096))
    edge.check_whole(_body(True, n=3, logprobs=True, top_logprobs=20), small)  # 3 x 21 x 4095 = 257,985
    with pytest.raises(CallAborted):
        edge.check_whole(_body(True, n=3, logprobs=True, top_logprobs=20), TENANT)


def _request() -> Request:
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""})
    request.state.tenant_id = "t"
    return request


def test_a_body_with_many_logprobs_is_built_off_the_event_loop() -> None:
    """Review 26c F2: the whole body was built on the event loop (7.9 s for n 16 x 8192 x 21).
    Past ``OFF_LOOP_LOGPROBS`` it is built on a worker thread, the tenant's turn."""
    edge = _edge()
    threads: list[threading.Thread] = []

    def build() -> dict[str, Any]:
        threads.append(threading.current_thread())
        return {"ok": 1}

    async def both() -> None:
        loop = threading.current_thread()
        small = await edge.render(_request(), Held(OFF_LOOP_LOGPROBS), build)
        big = await edge.render(_request(), Held(OFF_LOOP_LOGPROBS + 1), build)
        assert small.body == big.body == b'{"ok":1}'
        assert threads[0] is loop and threads[1] is not loop

    asyncio.run(both())
    assert edge.servicer.off_loop_calls == ["t"]  # type: ignore[attr-defined]


async def _events(deltas: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for delta in deltas:
        yield delta


def test_a_streamed_chunk_carries_a_bounded_number_of_entries() -> None:
    """Review 26c F2 (streams): tokens that add no text (a run of special tokens, or a
    delta coalesced while its client read slowly) all went into the next text's chunk. A
    chunk now carries at most ``LOGPROB_TOKENS_PER_CHUNK`` tokens' entries; the others go
    first, in chunks of empty text, in order."""
    n = 3 * LOGPROB_TOKENS_PER_CHUNK + 5
    entries = [logprobs_entry(-0.25, [(7, -0.25)]) for _ in range(n)]
    deltas = [{"type": "delta", "text": "", "token_ids": [1] * (n - 1), "logprobs": entries[:-1]},
              {"type": "delta", "text": "end", "token_ids": [2], "logprobs": entries[-1:]}]
    gen = Generation(_events(deltas), {"prompt_tokens": 1}, False, "m",
                     logprobs=Logprobs(False, 1, TokenTexts(), streamed=True))

    async def chunks() -> list[tuple[str, int]]:
        out = []
        async for text in gen.pieces():
            part = gen.chunk(text)["choices"][0]["logprobs"]
            out.append((text, len(part["tokens"]) if part else 0))
        return out

    got = asyncio.run(chunks())
    assert got == [("", LOGPROB_TOKENS_PER_CHUNK)] * 3 + [("end", 5)]
    whole = Generation(_events(deltas), {"prompt_tokens": 1}, False, "m",
                       logprobs=Logprobs(False, 1, TokenTexts()))

    async def texts() -> list[str]:
        return [t async for t in whole.pieces()]

    assert asyncio.run(texts()) == ["end"]  # a whole response: no empty pieces
    assert len(whole.logprobs.whole()["tokens"]) == n  # type: ignore[union-attr]
