"""The gateway's render children (``services.gateway_render``): faults of diff review s36 R2.

F2: a large plain-text chat cost the gateway's thread more GIL time through a child than
rendered in process (1 Mi emoji: 39.6 ms of its CPU, ``\\u`` escapes and UTF-8 both ways, against 4.6 ms):
a chat whose size is its strings' text now renders in process, and a child's request carries
its JSON as UTF-8 bytes (non-ASCII unescaped, lone surrogates and bigints exact).
F3: a render slow on a client's chat held a tenant's turn and a worker thread the node's 60 s,
then failed INTERNAL "send this one again": now ``RENDER_TIMEOUT_S`` (10 s) and ``RenderTooSlow``
(INVALID_ARGUMENT naming messages). F4: any failure to make a child (a passing full ``/tmp``)
disabled children for good and let any render error fall back to the gateway's process. F6: a
tokenizer that cannot load under the memory cap failed every large chat "exit status 1" (the
cap unnamed), each starting a child again (~9 s).

Real parts: SmolLM2's tokenizer, real render children (``services.render_worker``).
"""

from __future__ import annotations

import copy
import errno
import json
import time
from typing import Any

import pytest
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from services import gateway_render, render_process, render_worker
from services.chat import ChatTemplater, TemplateRefusal
from services.gateway_render import GatewayTemplater, RenderPool
from services.render_process import RenderFailed


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def _with_template(tokenizer: Any, template: str) -> Any:
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


MANY = [{"role": "user", "content": f"m{i} \U0001f600"} for i in range(40)]  # (past IN_PROCESS_MESSAGES: a child)


def test_a_chat_of_long_plain_text_renders_in_process(tokenizer: Any) -> None:
    """F2: one message of 1 Mi emoji (and 32 of 32K CJK characters) renders in the gateway's
    process: no child (fa49863..62b4b85: its 4 MiB of JSON went to one)."""
    templater = GatewayTemplater(tokenizer, RenderPool(tokenizer, 1))
    local = ChatTemplater(tokenizer)
    try:
        for chat in ([{"role": "user", "content": "\U0001f600" * (1 << 20)}],
                     [{"role": "user", "content": "\u4e2d" * (32 << 10)}] * 32):
            assert templater.render(chat) == local.render(chat)
        assert templater.child_renders == 0 and templater.pool.processes == []
        tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            f"p{k}": {"type": "string"} for k in range(8)}}}} for i in range(64)]
        assert templater.render(MANY[:1], True, tools) == local.render(MANY[:1], True, tools)  # (structure: a child)
        assert templater.child_renders == 1
    finally:
        templater.close()


def test_a_render_request_carries_utf8_json_exactly(tokenizer: Any) -> None:
    """F2: the child takes a ``render`` request's JSON as UTF-8 bytes (non-ASCII as itself, a
    lone surrogate passed, an integer past 64 bits exact) and renders what the gateway would."""
    templater = ChatTemplater(_with_template(tokenizer, "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
                                                         "{{ tools | tojson }}"))
    chat = [{"role": "user", "content": "é 日本 \U0001f600 \ud800 end"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 10 ** 30, "x": 0.1}}}]
    payload = json.dumps([chat, True, tools], ensure_ascii=False).encode("utf-8", "surrogatepass")
    assert b"\\u" not in payload
    reply = render_worker.render(templater, ["render", payload])
    assert reply[0] == "text", reply
    assert reply[1].decode("utf-8", "surrogatepass") == templater.render(chat, True, tools)


SLOW = ("{%- for m in messages -%}{%- for a in messages -%}{%- for b in messages -%}{{ '' }}{%- endfor -%}"
        "{%- endfor -%}{{ m['content'] }}{%- endfor -%}")
"""A template whose render grows with the cube of a chat's messages (400: minutes)."""


def test_a_render_past_the_gateways_timeout_is_the_requests_size(tokenizer: Any) -> None:
    """F3: the gateway's children wait ``gateway_render.RENDER_TIMEOUT_S`` (10 s, not the
    node's 60 s); past it the render is ``RenderTooSlow``, a ``TemplateRefusal`` naming
    ``messages`` (INVALID_ARGUMENT / 400), not ``RenderFailed`` "send this one again"; the next
    render gets a fresh child."""
    slow = _with_template(tokenizer, SLOW)
    templater = GatewayTemplater(slow, RenderPool(slow, 1, render_timeout_s=2.0), -1, -1)
    try:
        started = time.monotonic()
        with pytest.raises(TemplateRefusal) as refused:
            templater.render([{"role": "user", "content": "x"}] * 400)
        assert type(refused.value).__name__ == "RenderTooSlow"
        assert str(refused.value).startswith("messages: ") and "within 2 s" in str(refused.value)
        assert time.monotonic() - started < 30
        assert templater.render(MANY[:3]) == ChatTemplater(slow).render(MANY[:3])
        assert templater.pool.processes[0].num_starts == 2
    finally:
        templater.close()
    assert gateway_render.RENDER_TIMEOUT_S == 10.0 < render_process.RENDER_TIMEOUT_S
    assert RenderPool(tokenizer, 1).process_args["render_timeout_s"] == gateway_render.RENDER_TIMEOUT_S


def test_a_passing_failure_to_make_a_child_fails_that_render_only(tokenizer: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """F4: a full ``/tmp`` while a child is made (``OSError``) fails that render
    (``RenderFailed``, naming it) and leaves children on: the next large render gets one.
    Before (d3b531b) it set ``pool.unsaved`` for the gateway's life and rendered in process."""
    real = render_process.process_temp_dir
    full = [1]

    def process_temp_dir(name: str) -> str:
        if full:
            full.pop()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(name)

    monkeypatch.setattr(render_process, "process_temp_dir", process_temp_dir)
    templater = GatewayTemplater(tokenizer, RenderPool(tokenizer, 1))
    try:
        with pytest.raises(RenderFailed, match="No space left on device"):
            templater.render(MANY)
        assert templater.pool.unsaved is None
        assert templater.render(MANY) == ChatTemplater(tokenizer).render(MANY)
        assert templater.child_renders == 2 and templater.pool.processes[0].renders == 1
    finally:
        templater.close()


def test_only_an_unsaved_tokenizer_falls_back_to_the_gateways_process(tokenizer: Any) -> None:
    """F4: once ``pool.unsaved`` is set (by another thread's failed save), a render the child
    refused (``RenderTooLarge``, past the memory cap) is that refusal, not rendered again in the
    gateway's process (d3b531b: any error fell back once ``unsaved`` was set)."""
    big = _with_template(tokenizer, "{% for i in range(1100) %}{{ messages[0]['content'] }}{% endfor %}")
    templater = GatewayTemplater(big, RenderPool(big, 1, memory_bytes=300 << 20), -1, -1)  # (ready: ~124 MiB)
    pool = templater.pool
    real_take = pool._take

    def take() -> Any:  # (the race: another thread's construction failed after this render passed the check)
        process = real_take()
        unsaved = getattr(render_process, "TokenizerUnsaved", NotImplementedError)  # (62b4b85: any exception)
        pool.unsaved = unsaved("NotImplementedError: this tokenizer saves nowhere")
        return process

    pool._take = take  # type: ignore[method-assign]
    try:
        with pytest.raises(render_process.RenderTooLarge):
            templater.render([{"role": "user", "content": "x" * (256 << 10)}])  # (280 MB rendered)
    finally:
        templater.close()


def test_a_tokenizer_that_does_not_load_under_the_cap_is_named_and_backed_off(tokenizer: Any) -> None:
    """F6: a child whose tokenizer cannot load under its memory cap (100 MiB here, for a large
    tokenizer under 1 GiB) fails the render naming the cap; after ``START_FAILURES`` failed
    starts in a row the next render fails at once (no child started) for the back-off.
    Before: "exit status 1", the cap unnamed, a new child (~9 s) for every large chat."""
    guard = {"start_guard": render_process.StartGuard(failures=2, backoff_s=60)} \
        if hasattr(render_process, "StartGuard") else {}  # (62b4b85: none)
    templater = GatewayTemplater(tokenizer, RenderPool(tokenizer, 1, memory_bytes=100 << 20, **guard))
    try:
        for _ in range(2):
            with pytest.raises(RenderFailed, match="did not load under its memory cap of 100 MiB"):
                templater.render(MANY)
        started = time.monotonic()
        with pytest.raises(RenderFailed, match="failed to start 2 times in a row .*memory cap of 100 MiB"):
            templater.render(MANY)
        assert time.monotonic() - started < 1.0
        assert templater.pool.processes[0].num_starts == 2
    finally:
        templater.close()


def test_a_request_frame_past_the_memory_cap_is_the_requests_size_and_the_child_serves_on(tokenizer: Any) -> None:
    """Task s40: a request whose frame alone does not fit under the child's memory cap (a
    100 MiB chat, a child capped at 200 MiB holding ~124 MiB ready) is that request's size
    refusal (``RenderTooLarge``), as a render past the cap is; the child reads past the frame
    and serves the next request. Before, the frame was read outside ``serve``'s ``try``: the
    child ended with exit status 1 and the request failed ``RenderFailed`` (INTERNAL)."""
    templater = GatewayTemplater(tokenizer, RenderPool(tokenizer, 1, memory_bytes=200 << 20), -1, -1)
    try:
        with pytest.raises(render_process.RenderTooLarge):
            templater.render([{"role": "user", "content": "x" * (100 << 20)}])
        children = list(templater.pool.processes)
        assert templater.render(MANY) == ChatTemplater(tokenizer).render(MANY)
        assert templater.pool.processes == children and len(children) == 1  # the same child served on
    finally:
        templater.close()
