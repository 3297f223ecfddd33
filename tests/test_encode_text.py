"""``services.chat.encode_text`` gives exactly ``tokenizer(text).input_ids`` (real SmolLM2
tokenizer). It tokenizes through the backend's ``encode_batch_fast``, which releases the GIL
and builds no offsets (the event-loop stall it removes is measured by ``bench/tokenize_stall.py``,
not timed here)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.chat import ChatTemplater, encode_text


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def reference(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tokenizer(text, add_special_tokens=False).input_ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", " \n\n", "\u00e9\u0301", "\U0001f600", "  x"])),
    max_size=8))
def test_equals_the_tokenizers_call_on_any_text(tokenizer, parts: list[str]) -> None:  # type: ignore[no-untyped-def]
    text = "".join(parts)
    assert encode_text(tokenizer, text) == reference(tokenizer, text)


def test_equals_on_rendered_chat_and_wikipedia_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from workloads.corpus import load_corpus

    templater = ChatTemplater(tokenizer)
    for article in load_corpus()[:: 250]:
        rendered = templater.render([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": f"{article.title}: {article.extract}"}])
        assert templater.encode(rendered) == reference(tokenizer, rendered)
