"""A bad body's 400 costs a bounded amount of work, whatever its size.

Regression (security review): every list in the request schema collected one error per bad
element and per union member, and the 400 was formatted on the gateway's event loop (which
serves every tenant's gRPC and HTTP calls): a 160 KiB ``prompt`` of alternating ints and
strings made 131,041 errors and froze every tenant's streams for 5.8 s; a 640 KiB one, 13.9 s
(and a body with 100,000 undeclared keys, one error per key). Now each list stops at its
first bad element (``fail_fast``), a list of prompts is refused before any is validated, one
undeclared field is reported, and a bad value is echoed without serializing it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cache_node.sampling_params import MAX_STOP_STRINGS
from services.convert import MAX_CHAT_MESSAGES, MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS
from services.openai_api.app import (
    MAX_BODY_STRINGS,
    BodyShape,
    body_shape,
    check_body_shape,
    invalid,
)
from services.openai_api.context import CallAborted
from services.openai_api.schemas import MAX_CONTENT_PARTS, ChatCompletionRequest, CompletionRequest

USER = {"role": "user", "content": "hi"}

CASES = [
    (CompletionRequest, {"prompt": [0, ""] * 65_000}, "prompt.1", "Input should be a valid integer"),
    (CompletionRequest, {"prompt": [[0]] * 65_000}, "prompt",
     "only one prompt per request is supported, got 65000"),
    (CompletionRequest, {"prompt": ["x"] * 65_000}, "prompt",
     "only one prompt per request is supported, got 65000"),
    (CompletionRequest, {"prompt": [[0, "x"] * 60_000]}, "prompt.0.1", None),
    (CompletionRequest, {"prompt": [0] * (MAX_PROMPT_TOKEN_IDS + 1)}, "prompt",
     f"holds {MAX_PROMPT_TOKEN_IDS + 1} tokens; at most {MAX_PROMPT_TOKEN_IDS} are allowed"),
    (CompletionRequest, {"prompt": "x", "stop": [1] * 100_000}, "stop",
     f"at most {MAX_STOP_STRINGS} stop strings are allowed, got 100000"),
    (CompletionRequest, {"prompt": "x", "stop": ["a", 1]}, "stop.1", None),
    (CompletionRequest, {"prompt": "x", **{f"k{i}": 1 for i in range(50_000)}}, "k0", "unsupported field"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}] * 20_000}]},
     "messages.0.content.0.text", "Input should be a valid string"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                           * (MAX_CONTENT_PARTS + 1)}]}, "messages.0.content", None),
    (ChatCompletionRequest, {"messages": [{"role": "nobody", "content": 1}] * MAX_CHAT_MESSAGES},
     "messages.0.role", None),
    (ChatCompletionRequest, {"messages": [{**USER, "x": 1}] * MAX_CHAT_MESSAGES}, "messages.0.x",
     "unsupported field"),
]


@pytest.mark.parametrize(("kind", "body", "field", "message"), CASES)
def test_a_huge_bad_body_is_one_400_from_a_handful_of_errors(kind, body, field, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as info:
        kind.model_validate({"model": "m", **body})
    assert info.value.error_count() <= 8  # before: one per bad element (131,041 for the first)
    error = json.loads(invalid(info.value).body)["error"]
    assert error["param"] == field
    if message is not None:
        assert error["message"] == f"{field}: {message}"


def test_a_huge_no_op_field_is_not_echoed_back() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "tool_choice": [0] * 500_000})
    with pytest.raises(ValueError, match=r"^tool_choice: only .* got an array of 500000 items$"):
        body.to_input(lambda text: [1])
    with pytest.raises(ValidationError) as info:  # a served field now: its discriminator's message
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "response_format": [0] * 500_000})
    assert json.loads(invalid(info.value).body)["error"]["message"] == \
        'response_format: type must be "text", "json_object" or "json_schema"'


def test_the_largest_valid_bodies_still_validate() -> None:
    ids = CompletionRequest.model_validate({"model": "m", "prompt": [1] * MAX_PROMPT_TOKEN_IDS})
    assert len(ids.prompt) == MAX_PROMPT_TOKEN_IDS
    parts = [{"type": "text", "text": "a"}] * MAX_CONTENT_PARTS
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [USER] * (MAX_CHAT_MESSAGES - 1) + [{"role": "user", "content": parts}]})
    assert chat.to_input().prompt[-1]["content"] == "\n".join(["a"] * MAX_CONTENT_PARTS)


# ---- the body's structure is bounded before json.loads builds it -----------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('a,"\\/\n[]{}:é\U0001f600'), max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.text(alphabet=st.sampled_from('k,"\\'), max_size=4), inner, max_size=5),
    max_leaves=30,
)


def _shape(value: Any) -> tuple[int, int]:
    """(strings, separators) counted on the parsed value: keys are strings, every container
    of n items has n - 1 separators."""
    if isinstance(value, str):
        return 1, 0
    if isinstance(value, list):
        parts = [_shape(v) for v in value]
        return sum(p[0] for p in parts), sum(p[1] for p in parts) + max(len(value) - 1, 0)
    if isinstance(value, dict):
        parts = [_shape(v) for v in value.values()]
        return len(value) + sum(p[0] for p in parts), sum(p[1] for p in parts) + max(len(value) - 1, 0)
    return 0, 0


def _containers(value: Any) -> tuple[int, int]:
    """(containers, depth) counted on the parsed value: a container is one level deeper than
    its deepest item."""
    if not isinstance(value, (list, dict)):
        return 0, 0
    parts = [_containers(v) for v in (value.values() if isinstance(value, dict) else value)]
    return 1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0)


@settings(max_examples=300, deadline=None)
@given(_JSON, st.booleans(), st.booleans())
def test_body_shape_counts_what_json_parses(value: Any, ascii_only: bool, compact: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    assert body_shape(text.encode(), 1 << 20) == BodyShape(*_shape(json.loads(text)), *_containers(json.loads(text)))


def test_a_body_of_millions_of_values_is_refused_before_it_is_parsed() -> None:
    ids = json.dumps({"model": "m", "prompt": [0] * 4_194_000}, separators=(",", ":")).encode()
    with pytest.raises(CallAborted, match="holds more than .* JSON values"):
        check_body_shape(ids)  # before: json.loads built 4.2M ints holding the GIL
    strings = json.dumps({"model": "m", "prompt": [""] * (MAX_BODY_STRINGS + 1)}).encode()
    with pytest.raises(CallAborted, match="holds more than .* JSON strings"):
        check_body_shape(strings)


def test_the_largest_valid_bodies_pass_the_shape_check() -> None:
    check_body_shape(json.dumps({"model": "m", "prompt": [131_071] * MAX_PROMPT_TOKEN_IDS}).encode())
    text = ('a, "b", \\c, ' * 90_000)[:MAX_PROMPT_CHARS]  # long text: only structure counts
    check_body_shape(json.dumps({"model": "m", "prompt": text}).encode())
    chat = {"model": "m", "stop": ["a", "b"], "messages": [
        {"role": "user", "content": [{"type": "text", "text": ", ,"}] * 8}] * MAX_CHAT_MESSAGES}
    check_body_shape(json.dumps(chat).encode())
    ChatCompletionRequest.model_validate(chat)
