"""Cloze fact questions cut from real articles, and the exact-match grader."""

from __future__ import annotations

import pytest

from workloads.corpus import get_article, load_corpus
from workloads.facts import BLANK, fact_questions, grade
from workloads.text import tokenize, truncate_to_sentences


def test_name_question_from_king_lear() -> None:
    (question,) = fact_questions(get_article("King Lear"), max_words=150)
    assert question.kind == "name"
    assert question.answer == "William Shakespeare"
    assert question.question == (
        'According to the article on King Lear, what name goes in the blank? "The Tragedy of '
        "King Lear, often shortened to King Lear, is a tragedy written by ____ in late 1605 or "
        'early 1606."'
    )


def test_year_questions_from_richard_pryor() -> None:
    questions = fact_questions(get_article("Richard Pryor"), max_words=150)
    assert [(q.kind, q.answer) for q in questions] == [
        ("name", "Primetime Emmy Award"),
        ("year", "1998"),
        ("name", "Kennedy Center Mark Twain Prize"),
        ("year", "1974"),
    ]
    assert questions[3].question == (
        "According to the article on Richard Pryor, what year goes in the blank? "
        '"He won the Writers Guild of America Award in ____."'
    )


def test_names_glued_by_connectors_are_not_cut() -> None:
    """Regression: "Rock and Roll Hall of Fame" once gave the answer "Roll Hall"."""
    answers = [q.answer for q in fact_questions(get_article("Robert Johnson"))]
    assert "Roll Hall" not in answers
    assert "Gustav Fröhlich" in [
        q.answer for q in fact_questions(get_article("Metropolis (1927 film)"))
    ]


def test_every_question_is_answerable_from_the_text_it_was_cut_from() -> None:
    checked = 0
    for article in load_corpus()[::50]:
        text = truncate_to_sentences(article.extract, 150)
        for q in fact_questions(article, max_words=150):
            assert q.sentence in text
            assert q.question.count(BLANK) == 1
            assert q.question.replace(BLANK, q.answer).endswith(f'"{q.sentence}"')
            assert grade(text, q.answer)
            checked += 1
    assert checked > 100


def test_grade_is_a_token_exact_match() -> None:
    assert grade("It was 1968.", "1968")
    assert not grade("It was 19681.", "1968")
    assert grade("written by william   SHAKESPEARE!", "William Shakespeare")
    assert not grade("written by William and Shakespeare", "William Shakespeare")
    assert not grade("", "Fritz Lang")
    assert tokenize("Gustav Fröhlich") == ["gustav", "fröhlich"]
    assert grade("It stars Gustav Fröhlich.", "Gustav Fröhlich")
    with pytest.raises(ValueError, match="no word tokens"):
        grade("anything", " -- ")
