"""Inputs the in-process chat templater renders, rendered the same by a cache node's render
child (``services.render_process``; diff review s35 of 8e7c8d6).

- R1: a tool whose JSON schema holds an integer past 64 bits (valid JSON) could not be packed
  for the child (msgpack): the request failed INTERNAL. Tools now go to the child as JSON text.
- R2: the bound a reply's token ids are checked against counted only a message's top-level
  strings: a chat whose tool-call arguments came to ~270K characters was refused "out of
  protocol" and the shared child killed. Every nested string counts now.
- R4: the child's warm-up render (a lone user message) raised under a template that asks for a
  system message first, so the child never started: every chat failed INTERNAL, each start
  costing ~1.7 s of CPU. A refused warm-up is logged and the child serves.

Real parts: SmolLM2's tokenizer, a real ``RenderProcess`` child, ``ChatTemplater`` in process
as the reference.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from services.chat import ChatTemplater
from services.render_process import RemoteTemplater, RenderProcess
from tests.test_tool_calls_served import TOOL_TEMPLATE

SYSTEM_FIRST = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}"
                "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _templater(template: str) -> ChatTemplater:
    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    tokenizer.chat_template = template
    return ChatTemplater(tokenizer)


@pytest.fixture(scope="module")
def tools_child() -> Iterator[tuple[ChatTemplater, RemoteTemplater]]:
    local = _templater(TOOL_TEMPLATE)
    process = RenderProcess(local.tokenizer)
    yield local, RemoteTemplater(local, process)
    process.close()


def test_a_tool_schema_integer_past_64_bits_renders_as_in_process(tools_child: Any) -> None:
    local, remote = tools_child
    tools = json.loads('[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object",'
                       '"properties":{"n":{"type":"integer","maximum":100000000000000000000}}}}}]')
    messages = [{"role": "user", "content": "hi"}]
    assert remote.first_turn(messages, tools) == local.first_turn(messages, tools)  # before: OverflowError
    assert remote.first_turn(messages) == local.first_turn(messages)


def test_long_tool_call_arguments_render_as_in_process(tools_child: Any) -> None:
    local, remote = tools_child
    arguments = json.dumps({"xs": list(range(40000))})  # ~270K characters
    messages = [{"role": "user", "content": "list them"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "user", "content": "thanks"}]
    remote.first_turn(messages[:1])
    pid = remote.process.pid
    expected = local.first_turn(messages)
    assert len(expected) > 8 * 40 + 65536  # past the old bound
    assert remote.first_turn(messages) == expected  # before: "out of protocol", the child killed
    assert remote.process.pid == pid


def test_a_template_asking_for_a_system_message_first_still_gets_a_child() -> None:
    local = _templater(SYSTEM_FIRST)
    process = RenderProcess(local.tokenizer)
    try:
        remote = RemoteTemplater(local, process)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        for _ in range(2):
            assert remote.first_turn(messages) == local.first_turn(messages)  # before: RenderFailed
        assert process.num_starts == 1
        with pytest.raises(Exception, match="system message must come first"):  # its refusal: the request's
            remote.first_turn(messages[1:])
        assert process.num_starts == 1
    finally:
        process.close()
