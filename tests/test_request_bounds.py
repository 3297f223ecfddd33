"""Every list and string of a GenerateRequest has a documented bound (issue 18 fault 9:
``stop_token_ids`` and other lists were unbounded). At the bound a request passes; one past
it is a ValueError (the gateway's INVALID_ARGUMENT) naming the field and the limit."""

from __future__ import annotations

import pytest

from cache_node.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from kvstrata.v1 import inference_pb2
from services import convert


def _chat(*contents: str) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(chat=inference_pb2.ChatMessages(
        messages=[inference_pb2.ChatMessage(role="user", content=c) for c in contents]))


def test_stop_token_ids_bound() -> None:
    """issue 18 fault 9: stop_token_ids is bounded (sampling and the domain type)."""
    ok = inference_pb2.SamplingParams(max_tokens=4, stop_token_ids=range(MAX_STOP_TOKEN_IDS))
    assert len(convert.sampling_params_from_pb(ok).stop_token_ids) == MAX_STOP_TOKEN_IDS
    over = inference_pb2.SamplingParams(max_tokens=4, stop_token_ids=range(MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match=rf"^sampling\.stop_token_ids holds {MAX_STOP_TOKEN_IDS + 1} ids; "
                                         rf"at most {MAX_STOP_TOKEN_IDS}"):
        convert.sampling_params_from_pb(over)
    with pytest.raises(ValueError, match="^stop_token_ids holds"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(ValueError, match="^stop_token_ids must be non-negative integers"):
        SamplingParams(stop_token_ids=(3, -1))


def test_prompt_token_ids_bound() -> None:
    """issue 18 fault 9: tokens.ids is bounded."""
    ok = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1] * convert.MAX_PROMPT_TOKEN_IDS))
    assert len(convert.prompt_from_pb(ok)) == convert.MAX_PROMPT_TOKEN_IDS
    ok.tokens.ids.append(1)
    with pytest.raises(ValueError, match=rf"^tokens\.ids holds {convert.MAX_PROMPT_TOKEN_IDS + 1} ids; "
                                         rf"at most {convert.MAX_PROMPT_TOKEN_IDS}"):
        convert.prompt_from_pb(ok)


def test_chat_message_count_bound() -> None:
    """issue 18 fault 9: chat.messages is bounded in count."""
    assert len(convert.prompt_from_pb(_chat(*["hi"] * convert.MAX_CHAT_MESSAGES))) == convert.MAX_CHAT_MESSAGES
    with pytest.raises(ValueError, match=rf"^chat\.messages holds {convert.MAX_CHAT_MESSAGES + 1} messages; "
                                         rf"at most {convert.MAX_CHAT_MESSAGES}"):
        convert.prompt_from_pb(_chat(*["hi"] * (convert.MAX_CHAT_MESSAGES + 1)))


def test_chat_text_bound() -> None:
    """issue 18 fault 9: the prompt text (all messages' contents together) is bounded."""
    half = convert.MAX_PROMPT_CHARS // 2
    assert len(convert.prompt_from_pb(_chat("a" * half, "b" * half))) == 2
    with pytest.raises(ValueError, match=rf"^chat\.messages hold {convert.MAX_PROMPT_CHARS + 1} characters; "
                                         rf"at most {convert.MAX_PROMPT_CHARS}"):
        convert.prompt_from_pb(_chat("a" * half, "b" * (half + 1)))


def test_request_policy_string_bound() -> None:
    """issue 18 fault 9: the policy override is a bounded, well-formed name."""
    spec_policy = ""
    assert convert.policy_from_pb("snapkv-0.25", spec_policy) == "snapkv-0.25"
    assert convert.policy_from_pb("", "h2o") == "h2o"
    with pytest.raises(ValueError, match=r"^policy must match"):
        convert.policy_from_pb("snapkv-" + "1" * 100, spec_policy)
