"""Plain-text helpers shared by the corpus, the fact questions and the prompts.

Sentences are split with a rule that does not break after initials or short
abbreviations ("Arthur C. Clarke", "Dr. Who", "U.S. Army"): a sentence ends at
``.``, ``!`` or ``?`` preceded by two lowercase letters, digits or a closing
bracket/quote, and followed by whitespace and an uppercase letter or a quote.
"""

from __future__ import annotations

import re

_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]\"'”]{2}[.!?])\s+(?=[A-Z\"“(])")
_TOKEN = re.compile(r"\w+", re.UNICODE)


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences (stripped, non-empty), in order."""
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens (``\\w+`` runs): the unit of search and of grading."""
    return _TOKEN.findall(text.lower())


def truncate_to_sentences(text: str, max_words: int) -> str:
    """The longest run of whole leading sentences with at most ``max_words`` words.

    The first sentence is always kept, even when it alone is longer, so the
    result is never empty for a non-empty text.

    Raises:
        ValueError: ``max_words`` is not positive.
    """
    if max_words <= 0:
        raise ValueError(f"max_words must be positive, got {max_words}")
    kept: list[str] = []
    words = 0
    for sentence in split_sentences(text):
        n = len(sentence.split())
        if kept and words + n > max_words:
            break
        kept.append(sentence)
        words += n
    return " ".join(kept)


def first_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace words of ``text``, with "..." when cut."""
    words = text.split()
    if len(words) <= max_words:
        return " ".join(words)
    return " ".join(words[:max_words]) + " ..."
