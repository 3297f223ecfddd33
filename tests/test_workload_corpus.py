"""Corpus loading, text helpers and the BM25 search over the real vital articles."""

from __future__ import annotations

import math

import pytest

from workloads.bm25 import BM25Index
from workloads.corpus import corpus_path, get_article, load_corpus, search
from workloads.text import first_words, split_sentences, tokenize, truncate_to_sentences


def test_corpus_is_the_installed_vital_articles_file() -> None:
    articles = load_corpus()
    assert corpus_path().name == "summaries_en-us.json"
    assert len(articles) == 10033
    assert [a.title for a in articles] == sorted(a.title for a in articles)
    lear = get_article("King Lear")
    assert lear.topic == "Arts"
    assert lear.extract.startswith("The Tragedy of King Lear, often shortened to King Lear,")


def test_sentences_do_not_break_after_initials() -> None:
    text = (
        "2001: A Space Odyssey is a 1968 film by Stanley Kubrick, with Arthur C. Clarke. "
        "Its plot was inspired by stories. It was released in the U.S. Army era."
    )
    assert split_sentences(text) == [
        "2001: A Space Odyssey is a 1968 film by Stanley Kubrick, with Arthur C. Clarke.",
        "Its plot was inspired by stories.",
        "It was released in the U.S. Army era.",
    ]


def test_truncate_keeps_whole_sentences_and_at_least_the_first() -> None:
    text = "One two three. Four five six. Seven eight."
    assert truncate_to_sentences(text, 6) == "One two three. Four five six."
    assert truncate_to_sentences(text, 5) == "One two three."
    assert truncate_to_sentences(text, 1) == "One two three."
    with pytest.raises(ValueError, match="max_words"):
        truncate_to_sentences(text, 0)
    assert first_words(text, 3) == "One two three. ..."
    assert tokenize("Fritz Lang's 1927 film") == ["fritz", "lang", "s", "1927", "film"]


def test_bm25_score_matches_the_formula() -> None:
    index = BM25Index(["a b", "a c c", "d"])
    # idf(c) = ln(1 + (3 - 1 + 0.5) / (1 + 0.5)); doc 1: tf 2, length 3, avgdl 2.
    norm = 1.5 * (1 - 0.75 + 0.75 * 3 / 2)
    expected = math.log(1 + 2.5 / 1.5) * 2 * 2.5 / (2 + norm)
    assert index.top_k("c", 3) == [(1, pytest.approx(expected))]
    assert index.top_k("zzz", 3) == []
    assert [doc for doc, _ in index.top_k("a", 5)] == [0, 1]  # shorter doc first
    with pytest.raises(ValueError, match="k must be positive"):
        index.top_k("a", 0)


def test_search_finds_the_article_and_its_neighbours() -> None:
    hits = search("King Lear", k=3)
    assert [h.title for h in hits] == ["King Lear", "Othello", "King Arthur"]
    assert hits[0].score > hits[1].score > hits[2].score
    assert hits[0].snippet.startswith("The Tragedy of King Lear, often shortened to King Lear,")
    assert hits[0].snippet.endswith(" ...")
