"""The text of every prompt. Short on purpose: a 135M-parameter model on a CPU reads them."""

from __future__ import annotations

from collections.abc import Sequence

from workloads.corpus import SearchHit
from workloads.deepresearch.plan import FINDINGS_MARK

LEAD_SYSTEM = (
    "You are the lead researcher. You split a research brief among sub-agents, "
    "then write a short report from their findings."
)
SUBAGENT_SYSTEM = (
    "You are a research sub-agent. You get search results and articles. "
    "Answer briefly, using words from the text."
)


def plan_prompt(titles: Sequence[str]) -> str:
    """The lead's first turn: one line of work per sub-agent."""
    topics = "; ".join(titles)
    return (
        f"Research brief: collect facts about {topics}. "
        f"You have {len(titles)} sub-agents. Write one short line per sub-agent "
        "saying which article it should read."
    )


def search_prompt(question: str, query: str, hits: Sequence[SearchHit]) -> str:
    """A sub-agent's first turn: its task and the search tool's results."""
    lines = [f"{i}. {hit.title}: {hit.snippet}" for i, hit in enumerate(hits, start=1)]
    results = "\n".join(lines) if lines else "(no results)"
    return (
        f"Task: {question}\n"
        f'Search results for "{query}":\n{results}\n'
        "Which article will you read first? Reply with its title only."
    )


def read_prompt(title: str, text: str) -> str:
    """A sub-agent's reading turn: one article's (cut) text.

    Asking for a quote (not a free-form note) keeps a small model's replies close to the
    text; with a free-form note SmolLM2-135M repeats that note as its answer later.
    """
    return f"Article: {title}\n{text}\nQuote the sentence of this article that matters most for the task."


def answer_prompt(question: str) -> str:
    """A sub-agent's last turn: the graded question."""
    return f"{question}\nReply with the missing words only."


def report_prompt(titles: Sequence[str]) -> str:
    """The lead's last turn; ``FINDINGS_MARK`` is filled in by the runner."""
    return (
        f"Your sub-agents report:\n{FINDINGS_MARK}\n"
        f"Write a short research report on {'; '.join(titles)}."
    )
