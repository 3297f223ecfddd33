"""Reading what a small model wrote: the lead's plan, a search query, a named title.

Everything here is a pure function of the text, so an agent's decisions are deterministic
given the model's outputs. The rules are written for what SmolLM2-135M-Instruct actually
produces: numbered or bulleted lists, "Sub-agent 1: ..." labels, markdown emphasis, the
prompt's "<question>" placeholder copied as is, quotes around a query, a query followed by
an explanation on the next lines.
"""

from __future__ import annotations

import re

from workloads.text import tokenize

MAX_QUESTION_WORDS = 30
MAX_QUERY_WORDS = 12
_ITEM = re.compile(r"^\s*(?:\(?\d{1,2}[.):]|[-*•+]|[a-z][.)]|#+)\s+(?P<body>\S.*)$")
_LABEL = re.compile(
    r"^(?:(?:sub[- ]?)?agent|question|task|q)\s*\d{0,2}\s*(?:[:.)-]|\bshould\b)\s*", re.IGNORECASE
)
_QUERY_LABEL = re.compile(r"^(?:search\s+)?(?:query|search)\s*[:=-]\s*", re.IGNORECASE)
_QUESTION = re.compile(r"[^.?!\n]*[A-Za-z][^.?!\n]*\?")
_EMPHASIS = re.compile(r"[*_`]+")
_PLACEHOLDER = re.compile(r"<[^<>\n]{0,40}>")
_EDGE = " \t\"'“”‘’«»:;,.-"


def _clean(text: str, max_words: int) -> str:
    """``text`` without emphasis marks, template placeholders ("<question>"), edge quotes
    and punctuation, cut to ``max_words``."""
    words = _PLACEHOLDER.sub("", _EMPHASIS.sub("", text)).split()[:max_words]
    return " ".join(words).strip(_EDGE)


def _usable(text: str) -> bool:
    """At least two word tokens, one of them with a letter."""
    tokens = tokenize(text)
    return len(tokens) >= 2 and any(any(ch.isalpha() for ch in t) for t in tokens)


def _candidates(text: str) -> list[str]:
    """List items (numbered, bulleted, lettered, headed), else the questions in the text."""
    items = []
    for line in text.splitlines():
        match = _ITEM.match(line)
        if match:
            items.append(match.group("body"))
        elif line.strip().endswith("?"):
            items.append(line.strip())
    return items or [q.strip() for q in _QUESTION.findall(text)]


def parse_plan(text: str, max_items: int) -> list[str]:
    """The sub-questions of a lead's plan, in order, at most ``max_items``.

    A candidate is a list item ("1. ...", "2) ...", "- ...", "* ...", "a) ...") or a line
    ending in "?"; when the text has neither, each question in it ("...?") is one. A
    candidate loses a leading label ("Sub-agent 2:", "Question 1 -"), markdown emphasis,
    "<...>" placeholders and edge quotes, is cut to ``MAX_QUESTION_WORDS`` words, and is kept when it has at least
    two word tokens (one with a letter) and is not a repeat (same tokens) of an earlier one.

    Raises:
        ValueError: ``max_items`` is negative.
    """
    if max_items < 0:
        raise ValueError(f"max_items must be >= 0, got {max_items}")
    found: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for candidate in _candidates(text):
        body = _clean(_LABEL.sub("", _EMPHASIS.sub("", candidate).strip()), MAX_QUESTION_WORDS)
        key = tuple(tokenize(body))
        if len(found) < max_items and _usable(body) and key not in seen:
            found.append(body)
            seen.add(key)
    return found


def clean_query(text: str) -> str:
    """The search query in a model's reply, or "" when there is none.

    The first non-empty line, without a "Query:"/"Search query:" label, emphasis and edge
    quotes or punctuation, cut to ``MAX_QUERY_WORDS`` words; "" unless it has a word token
    with a letter or digit.
    """
    line = next((ln for ln in text.splitlines() if ln.strip(_EDGE + "*_`")), "")
    query = _clean(_QUERY_LABEL.sub("", _clean(line, MAX_QUERY_WORDS * 2)), MAX_QUERY_WORDS)
    return query if tokenize(query) else ""


def names_title(text: str, title: str) -> bool:
    """True when ``title``'s word tokens occur contiguously in ``text`` (case-insensitive)."""
    want, got = tokenize(title), tokenize(text)
    n = len(want)
    return n > 0 and any(got[i : i + n] == want for i in range(len(got) - n + 1))
