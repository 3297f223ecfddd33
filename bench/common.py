"""Shared benchmark helpers: statistics, Wikipedia chat prompts, the JSON result line.

Every benchmark builds its prompts here so that all systems it compares see the same token
ids, and ends its stdout with :func:`emit_json` (one JSON object, the last line).
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from workloads.corpus import Article


class ChatTokenizer(Protocol):
    """The slice of a transformers tokenizer the prompt builders use."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


# ---- statistics ---------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """``{"p50": ..., "p95": ..., "p99": ...}`` for the given ``qs``."""
    return {f"p{q:g}": percentile(values, q) for q in qs}


# ---- prompts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatRequest:
    """One benchmark request: the chat text and its templated token ids.

    ``kind``: "summarize", "question" or "compare"; ``titles``: the articles it reads.
    """

    kind: str
    titles: tuple[str, ...]
    user_text: str
    prompt_token_ids: tuple[int, ...]


def chat_prompt(tokenizer: ChatTokenizer, user_text: str) -> list[int]:
    """Token ids of a one-turn chat with the model's template and the assistant header."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    return [int(t) for t in ids]


def clip_words(text: str, max_words: int) -> str:
    """The first ``max_words`` words of ``text``."""
    words = text.split()
    return " ".join(words[:max_words])


def _question(article: Article, rng: random.Random) -> str:
    templates = (
        "What is {t} best known for, according to the text?",
        "According to the text, when and where is {t} first mentioned, and why does it matter?",
        "Which facts in the text describe {t}? Answer briefly.",
        "Explain in plain words what the text says {t} is.",
    )
    return rng.choice(templates).format(t=article.title)


def wiki_chat_requests(
    tokenizer: ChatTokenizer,
    articles: Sequence[Article],
    num_requests: int,
    seed: int = 0,
    min_words: int = 40,
    max_words: int = 220,
) -> list[ChatRequest]:
    """A mixed chat workload over Wikipedia extracts, deterministic in ``seed``.

    Request ``i`` reads ``1 + i % 3`` articles, each clipped to a random word budget in
    ``[min_words, max_words]``, and asks to summarize them, to answer a question about the
    first, or (with 2-3 articles) to compare them. Prompt lengths vary roughly 100-900 tokens.

    Raises:
        ValueError: ``num_requests`` < 1, or fewer usable articles than one request needs.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    pool = [a for a in articles if len(a.extract.split()) >= min_words]
    if len(pool) < 3:
        raise ValueError(f"need >= 3 articles with >= {min_words} words, got {len(pool)}")
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        docs = rng.sample(pool, 1 + i % 3)
        texts = [f"## {a.title}\n{clip_words(a.extract, rng.randint(min_words, max_words))}" for a in docs]
        body = "\n\n".join(texts)
        kind = ("summarize", "question", "compare")[i % 3] if len(docs) > 1 else rng.choice(
            ("summarize", "question")
        )
        if kind == "summarize":
            ask = "Summarize the text above in three sentences."
        elif kind == "question":
            ask = _question(docs[0], rng)
        else:
            ask = "Compare the subjects of the articles above: what do they have in common?"
        user = f"{body}\n\n{ask}"
        out.append(ChatRequest(kind, tuple(a.title for a in docs), user, tuple(chat_prompt(tokenizer, user))))
    return out


def shared_document(tokenizer: ChatTokenizer, articles: Sequence[Article], target_tokens: int,
                    seed: int = 0) -> str:
    """Concatenated article extracts of about ``target_tokens`` tokens (never fewer)."""
    rng = random.Random(seed)
    order = list(articles)
    rng.shuffle(order)
    parts: list[str] = []
    n = 0
    for a in order:
        part = f"## {a.title}\n{a.extract}"
        parts.append(part)
        n += len(tokenizer.encode(part + "\n\n", add_special_tokens=False))
        if n >= target_tokens:
            break
    return "\n\n".join(parts)


# ---- output -------------------------------------------------------------------------------
def emit_json(result: dict[str, Any]) -> None:
    """Print ``result`` as one JSON line on stdout; callers make it the last line."""
    sys.stdout.flush()
    print(json.dumps(result, sort_keys=True, allow_nan=False), flush=True)
