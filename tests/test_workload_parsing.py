"""Reading the model's replies: the lead's plan, a search query, a named title."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workloads.deepresearch.parsing import (
    MAX_QUERY_WORDS,
    MAX_QUESTION_WORDS,
    clean_query,
    names_title,
    parse_plan,
)
from workloads.text import tokenize


def test_numbered_bulleted_and_labelled_items_become_sub_questions() -> None:
    text = (
        "Here is the plan:\n"
        "1. **Sub-agent 1:** When was the Eiffel Tower built?\n"
        "2) Question 2 - who designed it\n"
        "- Why is Paris called the City of Light?\n"
        "* \"What river crosses Paris?\"\n"
        "That is all."
    )
    assert parse_plan(text, 5) == [
        "When was the Eiffel Tower built?", "who designed it",
        "Why is Paris called the City of Light?", "What river crosses Paris?",
    ]  # fmt: skip
    assert parse_plan(text, 2) == ["When was the Eiffel Tower built?", "who designed it"]


def test_without_list_items_the_questions_in_the_text_are_used() -> None:
    assert parse_plan("First, what is Saturn V? Then: who built it? Done.", 3) == [
        "First, what is Saturn V?", "Then: who built it?",
    ]  # fmt: skip


def test_unusable_placeholder_and_repeated_items_are_dropped() -> None:
    """A 135M model copies the prompt's "<question>" placeholder and repeats lines."""
    text = "1. Organic farming: <question>\n2. Bat: <question>\n3. organic FARMING\n4. ?\n5. 42 43"
    assert parse_plan(text, 5) == ["Organic farming"]
    assert parse_plan("Sure! I can help with that.", 3) == []
    assert parse_plan("", 3) == []
    with pytest.raises(ValueError, match="max_items must be >= 0, got -1"):
        parse_plan("1. a b", -1)


@given(st.text(max_size=400), st.integers(min_value=0, max_value=6))
def test_parse_plan_never_fails_and_keeps_its_promises(text: str, n: int) -> None:
    items = parse_plan(text, n)
    assert len(items) <= n
    assert all(2 <= len(tokenize(item)) and len(item.split()) <= MAX_QUESTION_WORDS for item in items)
    assert len({tuple(tokenize(item)) for item in items}) == len(items)
    assert parse_plan(text, n) == items  # deterministic


@given(st.lists(st.text(alphabet="abcdefghij XYZ?", min_size=3, max_size=40), max_size=6))
def test_every_numbered_usable_line_is_found_in_order(lines: list[str]) -> None:
    text = "\n".join(f"{i}. {line}" for i, line in enumerate(lines, start=1))
    items = parse_plan(text, len(lines))
    kept = iter(tokenize(line) for line in lines)
    assert all(any(tokenize(item) == k for k in kept) for item in items)  # a subsequence


def test_clean_query_takes_the_first_line_without_labels_or_quotes() -> None:
    assert clean_query('Search query: "Eiffel Tower history"\nThis finds it.') == "Eiffel Tower history"
    assert clean_query("\n\n**Saturn V rocket**.") == "Saturn V rocket"
    assert clean_query("Query = Dutch language") == "Dutch language"
    assert clean_query('"" ...') == ""
    assert clean_query("<query>") == ""
    long = " ".join(f"w{i}" for i in range(30))
    assert clean_query(long).split() == long.split()[:MAX_QUERY_WORDS]


@given(st.text(max_size=200))
def test_clean_query_is_empty_or_has_words(text: str) -> None:
    query = clean_query(text)
    assert query == "" or (tokenize(query) and len(query.split()) <= MAX_QUERY_WORDS)
    assert "\n" not in query


def test_names_title_matches_whole_tokens_in_order() -> None:
    assert names_title("I will read Saturn V first.", "Saturn V")
    assert names_title("saturn v", "Saturn V")
    assert not names_title("Saturn is a planet", "Saturn V")
    assert not names_title("Saturnine", "Saturn")
    assert not names_title("anything", "...")
