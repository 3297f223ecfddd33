"""The gateway renders and tokenizes chats in a child process, not in its own.

Regression (review s35 E F3, its "other places"): the gateway rendered chat templates (jinja,
pure Python) and tokenized chats on its worker threads (``RequestPreparation.off_loop``), in
the process whose event loop serves every tenant's streams: one tenant's 1000-message chats
(~236 ms each) took the GIL from every other tenant's streaming. They now render in the
gateway's render child (``services.render_process``, ``RequestPreparation.chat_renderer``).
The tests spy on the gateway's own templater (no render or tokenization of a chat in this
process) and check the token ids are those the in-process render gave; a killed child fails
only the request it was rendering (INTERNAL, naming the gateway's renderer), and the next chat
renders in a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from cache_node.sampling_params import SamplingParams
from services.chat import ChatTemplater
from services.gateway_inputs import GenerateInput
from services.gateway_prepare import RequestPreparation
from services.render_process import RemoteTemplater
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.test_chat_template_refusals import ALTERNATING, TWO_USERS, WORDS
from tests.test_tool_calls_served import TOOL_TEMPLATE, TOOLS

TENANT = SimpleNamespace(spec=TenantSpec("t"), tenant_id="t", kv_namespace="t")

CHATS: list[tuple[list[dict[str, Any]], Any]] = [
    ([{"role": "user", "content": "What is the weather in Paris?"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Weather in Oslo?"}],
     TOOLS),
    ([{"role": "user", "content": "Résumé ✓ 日本語 " * 20}], TOOLS),
]


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _Preparation(RequestPreparation):
    """The gateway's request preparation alone (``InferenceServicer``'s attributes it reads)."""

    def __init__(self, templater: ChatTemplater) -> None:
        self.info = {**NODE_INFO, "vocab_size": len(templater.tokenizer)}
        self.templater = templater
        self._tokenizing = {}
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(2)


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    tokenizer.chat_template = TOOL_TEMPLATE  # (renders tools: SmolLM2's own template leaves them out)
    templater = ChatTemplater(tokenizer)
    _ = templater.max_token_chars, templater.conversation_overhead  # (as the gateway's start computes them)
    return templater


@pytest.fixture()
def preparation(templater: ChatTemplater) -> Iterator[_Preparation]:
    preparation = _Preparation(templater)
    yield preparation
    preparation.close_render_child()
    preparation._tokenizer_pool.shutdown(wait=False)


def prepare(preparation: _Preparation, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> Any:
    call = GenerateInput(prompt=messages, sampling=SamplingParams(max_tokens=2), tools=tools, **kwargs)
    return asyncio.run(preparation._prepare(call, TENANT, _Context()))[0]


def test_the_gateway_renders_chats_in_its_render_child(templater: ChatTemplater, preparation: _Preparation,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat's render (whole chat, with tools), a ``prefix_messages`` prefix and a session
    turn's size estimates give the ids the gateway's own templater gives, and none of them
    renders or tokenizes in the gateway's process (failed on the old code: its templater's
    ``first_turn`` was called on a worker thread)."""
    expected = [templater.first_turn(messages, tools) for messages, tools in CHATS]
    prefix = templater.encode(templater.render(CHATS[1][0][:3], add_generation_prompt=False, tools=TOOLS))
    estimate = templater.estimate_tokens(CHATS[1][0])
    tools_tokens = len(templater.first_turn(CHATS[1][0], TOOLS)) - len(templater.first_turn(CHATS[1][0]))
    calls: list[str] = []
    for name in ("render", "encode", "first_turn", "continue_session", "estimate_tokens"):
        def spy(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            raise AssertionError(f"the gateway's own templater was called: {_name}")
        monkeypatch.setattr(templater, name, spy)

    for (messages, tools), ids in zip(CHATS, expected, strict=True):
        assert list(prepare(preparation, messages, tools).token_ids) == ids
    req = prepare(preparation, CHATS[1][0], TOOLS, prefix_messages=3)
    assert list(req.token_ids) == expected[1] and req.prefix_tokens == len(prefix) > 0
    turn = prepare(preparation, CHATS[1][0], TOOLS, session_id="s")  # the node renders it; the gateway sizes it
    assert not req.messages and turn.messages and not turn.token_ids
    assert turn.extra["prompt_tokens_estimate"] == str(estimate)
    assert turn.extra["prompt_tokens_tools"] == str(tools_tokens) and tools_tokens > 0
    assert calls == []
    child = preparation._render_child
    assert isinstance(child, RemoteTemplater) and child.process.owner == "gateway"
    assert child.process.renders == 3 + 1 + 1 + 3  # (a session turn: its estimate, with and without tools)
    assert child.process.num_starts == 1  # started on the first chat, kept


def test_a_template_refusal_stays_invalid_argument(templater: ChatTemplater, preparation: _Preparation) -> None:
    """The template's refusal (``raise_exception``), raised in the child, is the request's
    fault: INVALID_ARGUMENT with the template's words; a replaced templater gets a child of its
    own, and the chat it accepts renders as in-process."""
    tokenizer = copy.deepcopy(templater.tokenizer)
    tokenizer.chat_template = ALTERNATING
    alternating = ChatTemplater(tokenizer)
    preparation.templater = alternating
    with pytest.raises(_Aborted) as refused:
        prepare(preparation, TWO_USERS)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and WORDS in refused.value.details
    assert list(prepare(preparation, TWO_USERS[:1]).token_ids) == alternating.first_turn(TWO_USERS[:1])
    assert preparation._render_child is not None and preparation._render_child.local is alternating


def test_a_killed_render_child_fails_only_its_request(preparation: _Preparation) -> None:
    """A child killed mid-render fails that request (INTERNAL, naming the gateway's chat
    renderer and the signal), and the next chat renders in a new child."""
    messages, tools = CHATS[1]
    first = prepare(preparation, messages, tools)  # starts the child
    process = preparation._render_child.process  # type: ignore[union-attr]
    pid = process.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it cannot answer: the render is under way when it is killed

    async def killed_mid_render() -> None:
        call = GenerateInput(prompt=messages, sampling=SamplingParams(max_tokens=2), tools=tools)
        task = asyncio.ensure_future(preparation._prepare(call, TENANT, _Context()))
        deadline = time.monotonic() + 30
        while not process.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert process.busy
        await asyncio.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(_Aborted) as failed:
            await task
        assert failed.value.code == grpc.StatusCode.INTERNAL
        assert "gateway's chat renderer process ended" in failed.value.details
        assert "signal 9" in failed.value.details

    asyncio.run(killed_mid_render())
    again = prepare(preparation, messages, tools)
    assert again.token_ids == first.token_ids
    assert process.num_starts == 2 and process.pid not in (None, pid)
