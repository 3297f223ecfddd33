"""The text of every prompt. Short on purpose: a 135M-parameter model on a CPU reads them.

Which model output feeds which prompt: the lead's plan gives each sub-agent its
sub-question (:func:`search_prompt`); a sub-agent's reply to that prompt is its search
query, whose hits open its first :func:`read_prompt`; its quotes and answer reach the
lead's :func:`report_prompt` as findings.
"""

from __future__ import annotations

from collections.abc import Sequence

from workloads.corpus import SearchHit

LEAD_SYSTEM = (
    "You are the lead researcher. You split a research brief among sub-agents, "
    "then write a short report from their findings."
)
SUBAGENT_SYSTEM = (
    "You are a research sub-agent with an encyclopedia search tool. "
    "Answer briefly, using words from the text."
)


def plan_prompt(topics: Sequence[str]) -> str:
    """The lead's first turn: one numbered question per topic, one topic per sub-agent."""
    listed = "\n".join(f"{i}. {topic}: <question>" for i, topic in enumerate(topics, start=1))
    return (
        f"Research brief: collect facts about {'; '.join(topics)}. You have {len(topics)} "
        "sub-agents. Write one question about each topic for a sub-agent, as this list:\n"
        f"{listed}"
    )


def fallback_question(target: str) -> str:
    """The generator's sub-question for a sub-agent the lead's plan gave none."""
    return f"What does the encyclopedia say about {target}?"


def search_prompt(sub_question: str) -> str:
    """A sub-agent's first turn: its sub-question; the reply is its search query."""
    return (
        f"Your task: {sub_question}\n"
        "Write a search query for the encyclopedia. Reply with the query only."
    )


def search_results(query: str, hits: Sequence[SearchHit]) -> str:
    """The search tool's output as the agent sees it."""
    lines = [f"{i}. {hit.title}: {hit.snippet}" for i, hit in enumerate(hits, start=1)]
    return f'Search results for "{query}":\n' + ("\n".join(lines) if lines else "(no results)")


def read_prompt(title: str, text: str, results: str = "") -> str:
    """A sub-agent's reading turn: the search results (first read only) and one article.

    Asking for a quote (not a free-form note) keeps a small model's replies close to the
    text; with a free-form note SmolLM2-135M repeats that note as its answer later.
    """
    head = f"{results}\n" if results else ""
    return (
        f"{head}You open the article {title}.\nArticle: {title}\n{text}\n"
        "Quote the sentence of this article that matters most for your task."
    )


def answer_prompt(question: str) -> str:
    """A sub-agent's last turn: the graded question."""
    return f"{question}\nReply with the missing words only."


def report_prompt(topics: Sequence[str], findings: str) -> str:
    """The lead's last turn, with its sub-agents' findings."""
    return (
        f"Your sub-agents report:\n{findings}\n"
        f"Write a short research report on {'; '.join(topics)}."
    )
