"""``PolicyEnv.from_tokenizer`` with the real SmolLM2 tokenizer: the sentence-end ids found by one
Rust ``decode_batch`` over the vocabulary are those found decoding one id at a time, the
path a tokenizer that cleans up spaces (or has no Rust backend) still takes."""

from __future__ import annotations

import copy

import pytest

from cache_node.policies.base import PolicyEnv


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


def one_at_a_time(tokenizer) -> frozenset[int]:  # type: ignore[no-untyped-def]
    ends = set()
    for tid in range(len(tokenizer)):
        text = tokenizer.decode([tid]).rstrip(" ")
        if text and (text[-1] in ".!?\n" or text.endswith(".\"")):
            ends.add(tid)
    return frozenset(ends)


def test_the_batch_decode_finds_the_ids_decoding_one_at_a_time_finds(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert not tokenizer.clean_up_tokenization_spaces  # SmolLM2: the Rust decode_batch path
    env = PolicyEnv.from_tokenizer(tokenizer)
    expected = one_at_a_time(tokenizer)
    assert env.sentence_end_token_ids == expected
    assert len(expected) > 100  # "." "!" "?" "\n" and their many spellings


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_one_id_at_a_time(tokenizer) -> None:  # type: ignore[no-untyped-def]
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    env = PolicyEnv.from_tokenizer(cleaning)
    assert env.sentence_end_token_ids == one_at_a_time(cleaning)
