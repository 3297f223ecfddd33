"""Fact questions with known answers, cut from an article's own sentences.

Each question is a cloze: one sentence of the article with a year or a
capitalized name replaced by a blank, and the removed text as the answer. The
answer is therefore always in the text an agent reads, and grading is an exact
token match. Everything here is deterministic.

Rules:
- **year**: the sentence holds exactly one 4-digit year (1000-2099, not part of
  a longer word such as "1990s") and the year is not in the title.
- **name**: a run of two or more Capitalized words that does not start the
  sentence, does not begin with a function word ("The", "In", ...), is not
  glued to a longer name by a hyphen or a connector ("Rock and Roll Hall of
  Fame" yields nothing), shares no word with the title, and occurs once in the
  sentence.
- Sentences longer than ``MAX_SENTENCE_WORDS`` words are skipped (short prompts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from workloads.corpus import Article
from workloads.text import split_sentences, tokenize, truncate_to_sentences

MAX_SENTENCE_WORDS = 40
BLANK = "____"
_YEAR = re.compile(r"(?<![\w.,-])(1\d{3}|20\d{2})(?![\w-])")
_NAME = re.compile(r"(?<![\w-])[A-Z][a-zà-öø-ÿ]+(?: [A-Z][a-zà-öø-ÿ]+)+(?![\w-])")
_CONNECTOR = re.compile(r"(?:[A-Z]\w*\s+(?:and|of|de|von|van|da|del|la|du)\s+$)")
_CONNECTED = re.compile(r"^\s+(?:and|of|de|von|van|da|del|la|du)\s+[A-Z]")
_FUNCTION_WORDS = frozenset(
    {"The", "A", "An", "In", "On", "At", "Of", "For", "From", "By", "With", "Its", "His", "Her"}
    | {"Their", "This", "That", "These", "It", "As", "After", "Before", "During", "Since"}
    | {"Under", "Over", "Between"}
)


@dataclass(frozen=True)
class FactQuestion:
    """One graded question about one article.

    Attributes:
        title: the article (document id) the answer comes from.
        kind: ``"year"`` or ``"name"``.
        question: the text asked to the model.
        answer: the expected answer, exactly as written in the article.
        sentence: the article sentence the question was cut from.
    """

    title: str
    kind: str
    question: str
    answer: str
    sentence: str


def _cloze(title: str, kind: str, sentence: str, start: int, end: int) -> FactQuestion:
    blanked = f"{sentence[:start]}{BLANK}{sentence[end:]}"
    question = f'According to the article on {title}, what {kind} goes in the blank? "{blanked}"'
    return FactQuestion(title, kind, question, sentence[start:end], sentence)


def _year_question(title: str, sentence: str) -> FactQuestion | None:
    years = list(_YEAR.finditer(sentence))
    if len(years) != 1 or years[0].group(0) in title:
        return None
    return _cloze(title, "year", sentence, years[0].start(), years[0].end())


def _name_question(title: str, sentence: str) -> FactQuestion | None:
    title_words = set(tokenize(title))
    for match in _NAME.finditer(sentence):
        name = match.group(0)
        if match.start() == 0 or name.split()[0] in _FUNCTION_WORDS:
            continue
        if _CONNECTOR.search(sentence[: match.start()]) or _CONNECTED.match(
            sentence[match.end() :]
        ):
            continue
        if title_words & set(tokenize(name)) or sentence.count(name) != 1:
            continue
        return _cloze(title, "name", sentence, match.start(), match.end())
    return None


def fact_questions(article: Article, max_words: int | None = None) -> list[FactQuestion]:
    """All questions for ``article``, in sentence order (year before name per sentence).

    Args:
        article: the source article.
        max_words: when set, only the leading sentences an agent is shown
            (:func:`workloads.text.truncate_to_sentences`) are used.
    """
    text = article.extract
    if max_words is not None:
        text = truncate_to_sentences(text, max_words)
    questions: list[FactQuestion] = []
    for sentence in split_sentences(text):
        if len(sentence.split()) > MAX_SENTENCE_WORDS:
            continue
        for make in (_year_question, _name_question):
            question = make(article.title, sentence)
            if question is not None:
                questions.append(question)
    return questions


def grade(answer_text: str, expected: str) -> bool:
    """True when ``expected`` appears in ``answer_text`` as whole tokens.

    Both are lowercased and cut into ``\\w+`` tokens; the expected tokens must
    appear contiguously, so "1968" matches "It was 1968." but not "19681", and
    "Arthur Clarke" matches "by arthur clarke" but not "Arthur C. Clarke".

    Raises:
        ValueError: ``expected`` has no word tokens.
    """
    want = tokenize(expected)
    if not want:
        raise ValueError(f"expected answer {expected!r} has no word tokens")
    got = tokenize(answer_text)
    n = len(want)
    return any(got[i : i + n] == want for i in range(len(got) - n + 1))
