"""Prompt text is bounded by what can ever fit before anything renders or tokenizes it, and
what is rendered or tokenized at the gateway runs off its event loop
(``ChatTemplater.check_fits``, ``InferenceServicer.off_loop``).

Regression (security review): a chat or completion of up to 1 Mi characters was rendered and
tokenized (~3.6 s) before its token bounds were checked, on the gateway's event loop and, for
a session turn, on the cache node's step thread: each refused request froze every other
tenant's streams for seconds.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.chat import ChatTemplater
from tests.gateway_harness import NODE_INFO, serve
from workloads.corpus import load_corpus


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    return ChatTemplater(AutoTokenizer.from_pretrained(resolve_model_dir(None)))


@contextmanager
def ann_generate(tmp_path: Path, templater: ChatTemplater) -> Iterator[Callable[..., tuple[grpc.StatusCode, str]]]:
    """A gateway harness (no node) with tenant "ann"; yields ``generate(content, session_id="",
    max_tokens=4, policy="")``, which sends one chat message and returns the call's refusal
    (every call ends in one: there is no node)."""
    with serve(tmp_path, templater) as gw, grpc.insecure_channel(gw.address) as ch:
        reg = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="ann")),
            metadata=(("authorization", f"Bearer {gw.admin_key}"),))
        stub = inference_pb2_grpc.InferenceServiceStub(ch)

        def generate(content: str, session_id: str = "", max_tokens: int = 4,
                     policy: str = "") -> tuple[grpc.StatusCode, str]:
            req = inference_pb2.GenerateRequest(
                chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=content)]),
                session_id=session_id, policy=policy, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens))
            try:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {reg.api_key}"),), timeout=30))
            except grpc.RpcError as err:
                return err.code(), err.details()
            raise AssertionError("the harness has no node: every call ends in an error")

        yield generate


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cc", "Cs")) | st.sampled_from("\n\t\r"),
                    min_size=1, max_size=400))
def test_a_token_never_stands_for_more_characters_than_the_bound(templater: ChatTemplater, text: str) -> None:
    """The bound refuses only text that can never fit: any text's characters are at most its
    tokens times ``max_token_chars`` (emoji, CJK, combining marks, whitespace included;
    control characters the vocabulary lacks are dropped by the tokenizer, so they count
    against the bound without adding tokens)."""
    ids = templater.encode(text)
    templater.check_fits(len(text), len(ids))  # never raises for a text of exactly that many tokens


def test_real_text_that_fits_passes_and_longer_text_is_refused_untokenized(templater: ChatTemplater,
                                                                            monkeypatch) -> None:
    text = " ".join(a.extract for a in load_corpus()[:40])
    ids = templater.encode(text)
    templater.check_fits(len(text), len(ids))
    calls = []
    monkeypatch.setattr(templater, "encode", lambda t: calls.append(t) or [])
    with pytest.raises(ValueError, match="can never fit in 100 tokens"):
        templater.check_fits(100 * templater.max_token_chars + 1, 100)
    assert not calls


def test_text_that_can_never_fit_is_refused_before_rendering_and_the_rest_renders_off_the_loop(
        tmp_path: Path, templater: ChatTemplater, monkeypatch) -> None:
    rendered_on: list[bool] = []  # per rendering: on an event loop's thread?
    first_turn = templater.first_turn

    def spy(messages):  # type: ignore[no-untyped-def]
        try:
            asyncio.get_running_loop()
            rendered_on.append(True)
        except RuntimeError:
            rendered_on.append(False)
        return first_turn(messages)

    monkeypatch.setattr(templater, "first_turn", spy)
    room = min(NODE_INFO["max_model_len"], NODE_INFO["pool_tokens"])
    huge = "x" * (room * templater.max_token_chars + 1)
    with ann_generate(tmp_path, templater) as generate:
        for sid in ("", "s1"):  # a first turn, a session turn (which the node would render)
            code, message = generate(huge, sid)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "can never fit" in message, (code, message)
        assert rendered_on == []  # refused unrendered
        # a session turn under the character bound but over the pool in tokens: refused at
        # the gateway from its estimate, never sent to a node to render
        words = " ".join(["hello"] * (room + 50))
        code, message = generate(words, "s1")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(
            f"This model's maximum context length is {room} prompt tokens on a cache node. However, the messages "
            "alone take ") and "they can never fit, whatever the session's history" in message, message
        code, _ = generate("What is the capital of France?")  # fits: rendered, then no node
        assert code != grpc.StatusCode.INVALID_ARGUMENT
        assert rendered_on and not any(rendered_on)  # every rendering ran off the event loop


DROPPED = "\x04\x06\x13\x14\x16\x1d"  # the characters SmolLM2's vocabulary encodes to no token


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cc", "Cs")) | st.sampled_from("\n\t\r"),
                    min_size=1, max_size=400))
def test_text_the_tokenizer_keeps_always_comes_to_the_tokens_it_stands_for(templater: ChatTemplater,
                                                                           text: str) -> None:
    """``check_tokens_cover`` refuses no text the tokenizer keeps, even with no slack: its
    characters are at most its tokens times ``max_token_chars``."""
    assert len(text) <= len(templater.encode(text)) * templater.max_token_chars
    templater.check_tokens_cover(len(text), len(templater.encode(text)))


@pytest.mark.parametrize("char", DROPPED)
def test_a_session_turn_of_characters_the_tokenizer_drops_is_refused(templater: ChatTemplater, char: str) -> None:
    """Regression (security review F3, ``/tmp/secrev17/r3_session_text_growth.py``): a turn of
    331,776 characters the tokenizer drops passed the per-turn bound, came to ~12 tokens and
    was kept whole by the node: 112 MB per session. Its tokens now refuse it; a turn with a
    few such characters among its text passes."""
    room = 4096
    content = "hi" + char * (room * templater.max_token_chars - 2)
    messages = [{"role": "user", "content": content}]
    templater.check_messages_fit(messages, room)  # the per-turn bound lets it through
    tokens = len(templater.first_turn(messages))
    assert tokens < 40
    with pytest.raises(ValueError, match="characters the tokenizer drops"):
        templater.check_tokens_cover(len(content), tokens)
    few = "Name a colour." + char * 40
    templater.check_tokens_cover(len(few), len(templater.first_turn([{"role": "user", "content": few}])))


def test_a_session_turn_past_the_context_and_the_pool_is_told_the_smaller(
        tmp_path: Path, templater: ChatTemplater, monkeypatch) -> None:
    """Review 25b R2: a full-cache turn past both the context limit and the (smaller) pool was
    told the context, then, trimmed to it, the pool. Now the first refusal names the pool; under
    a compressing policy, which may outgrow the pool, the context."""
    monkeypatch.setitem(NODE_INFO, "pool_tokens", 1024)
    monkeypatch.setitem(NODE_INFO, "max_model_len", 1500)
    words = " ".join(["hello"] * 700)  # ~700 tokens: with 900 more, past both 1024 and 1500
    with ann_generate(tmp_path, templater) as send:
        code, message = send(words, "s1", 900)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and re.fullmatch(
            r"This model's maximum context length is 1024 tokens on a cache node under a KV policy that keeps "
            r"every token \(its KV pool holds 1024 tokens\)\. However, you requested at least \d+ tokens "
            r"\(\d+ at least in the messages, with the session's history on top, 900 in the completion\): that "
            r"can never fit\. Please reduce the length of the messages or completion\.", message), message
        code, message = send(words, "s1", 900, "snapkv-0.5")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and message.startswith(
            "This model's maximum context length is 1500 tokens. However, you requested at least"), message


@pytest.mark.parametrize("content", [
    "Name a colour.", " " * 300 + "x", "\U0001F600" * 50, "def f():\n" + "        pass\n" * 20,
    "a" + "\x04" * 2000, "\x1d" * 20 + "ok",
])
def test_the_gateways_bound_on_a_session_turn_is_never_tighter_than_the_nodes(templater: ChatTemplater,
                                                                               content: str) -> None:
    """The gateway counts a session turn's tokens as its estimate less the conversation's
    overhead; the node counts the tokens the turn adds after the history. The gateway's count
    is never more, so it refuses only turns the node would refuse."""
    first = [{"role": "user", "content": "Name a colour."}]
    history = templater.first_turn(first) + [42, templater.eos_token_id]
    past = [*first, {"role": "assistant", "content": " Blue"}]
    turn = [{"role": "user", "content": content}]
    node_tokens = len(templater.continuation(past, history, turn)) - len(history)
    gateway_tokens = len(templater.first_turn(turn)) - templater.conversation_overhead
    assert gateway_tokens <= node_tokens, (gateway_tokens, node_tokens)


def test_the_gateway_refuses_a_session_turn_of_dropped_characters(tmp_path: Path, templater: ChatTemplater) -> None:
    """Regression (security review F3): the gateway sent such a turn on to a node, which kept
    its text. Now INVALID_ARGUMENT at the gateway; an ordinary session turn is not refused so."""
    with serve(tmp_path, templater) as gw, grpc.insecure_channel(gw.address) as ch:
        reg = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="ann")),
            metadata=(("authorization", f"Bearer {gw.admin_key}"),))
        stub = inference_pb2_grpc.InferenceServiceStub(ch)

        def generate(content: str) -> tuple[grpc.StatusCode, str]:
            req = inference_pb2.GenerateRequest(
                chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=content)]),
                session_id="s1", sampling=inference_pb2.SamplingParams(max_tokens=1))
            try:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {reg.api_key}"),), timeout=30))
            except grpc.RpcError as err:
                return err.code(), err.details()
            raise AssertionError("the harness has no node: every call ends in an error")

        code, message = generate("hi" + "\x04" * 100_000)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "characters the tokenizer drops" in message, (code, message)
        code, message = generate("What is the capital of France?" + "\x04" * 10)
        assert code != grpc.StatusCode.INVALID_ARGUMENT, message


def test_a_session_turn_whose_own_tokens_and_max_tokens_can_never_fit_is_refused_unrendered(
        tmp_path: Path, templater: ChatTemplater, monkeypatch) -> None:
    """Regression (security review 20 S4): a session turn under the character bound whose own
    tokens + max_tokens exceed the context limit or (under the full cache) the node's pool was
    sent to the node, rendered and tokenized on its one render thread (~0.2-0.4 s), and only
    then refused for size, while other tenants' turns waited behind it. Now the gateway refuses
    it from its estimate (a lower bound of the turn's tokens). A compressing policy may outgrow
    the pool in tokens, so under one only the context limit is checked here."""
    monkeypatch.setitem(NODE_INFO, "pool_tokens", 1024)  # the context limit stays 2048
    words = " ".join(["hello"] * 700)  # ~700 tokens: under the 1024-token room alone
    with ann_generate(tmp_path, templater) as send:

        def generate(max_tokens: int, policy: str = "") -> tuple[grpc.StatusCode, str]:
            return send(words, "s1", max_tokens, policy)

        code, message = generate(400)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and re.fullmatch(
            r"This model's maximum context length is 1024 tokens on a cache node under a KV policy that keeps "
            r"every token \(its KV pool holds 1024 tokens\)\. However, you requested at least (\d+) tokens "
            r"\(\d+ at least in the messages, with the session's history on top, 400 in the completion\): that "
            r"can never fit\. Please reduce the length of the messages or completion\.", message), message
        code, message = generate(1500, "snapkv-0.5")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and re.fullmatch(
            r"This model's maximum context length is 2048 tokens\. However, you requested at least \d+ tokens "
            r"\(\d+ at least in the messages, with the session's history on top, 1500 in the completion\)\. "
            r"Please reduce the length of the messages or completion\.", message), message
        for max_tokens, policy in ((200, ""), (400, "snapkv-0.5")):  # may fit: on to the (absent) node
            code, message = generate(max_tokens, policy)
            assert code != grpc.StatusCode.INVALID_ARGUMENT, (max_tokens, policy, message)
