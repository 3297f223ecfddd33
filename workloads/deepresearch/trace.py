"""``trace.jsonl``: what a run sent and what its agents decided, and its exact replay.

One row per sent call, in plan order (sessions by arrival; per session the lead's plan,
the sub-agents' calls, the report). A row holds the call's plan fields (``call_id``,
``research_id``, ``session_id``, ``tenant``, ``agent``, ``kind``, ``turn``, ``pause_s``,
``max_tokens``, ``expected_answer``), the session's ``arrival_s``, the ``messages`` sent
this turn, ``doc_ids``, the agent's ``decision`` (parsed sub-questions, query, hits, chosen
article, fallbacks: :mod:`workloads.deepresearch.agents`), its ``status`` and character
counts (``prompt_chars``; ``context_chars``: characters sent in the agent's session so
far, model replies excluded).

:func:`load_replay` turns a trace back into a :class:`WorkloadPlan` whose calls carry their
recorded messages: running it sends the same messages, per agent in the same order, with
the same arrivals, pauses and dependencies (a sub-agent after its lead's plan, the report
after every sub-agent), whatever the model replies. Calls the recorded run never sent
(skipped) are not in the trace, so they are not replayed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvstrata.durable_files import write_file_atomic
from workloads.deepresearch.plan import (
    CALL_KINDS,
    AgentScript,
    ChatMessage,
    PlannedCall,
    ResearchSession,
    WorkloadPlan,
)

_FIELDS = ("call_id", "research_id", "session_id", "tenant", "agent", "kind", "turn",
           "pause_s", "max_tokens", "arrival_s", "messages")  # fmt: skip


def write_trace(rows: Iterable[Mapping[str, Any]], path: str | Path) -> int:
    """Write trace rows as JSONL (keys sorted, UTF-8), atomically (``write_file_atomic``, mode
    0644); returns the line count."""
    lines = [json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows]
    write_file_atomic(path, "".join(lines), 0o644)
    return len(lines)


def _call(row: Mapping[str, Any], where: str) -> PlannedCall:
    missing = [name for name in _FIELDS if name not in row]
    if missing:
        raise ValueError(f"{where}: trace row lacks {missing}")
    if row["kind"] not in CALL_KINDS or not row["messages"]:
        raise ValueError(f"{where}: kind {row['kind']!r} unknown or no messages")
    messages = tuple(ChatMessage(m["role"], m["content"]) for m in row["messages"])
    return PlannedCall(
        call_id=row["call_id"], research_id=row["research_id"], session_id=row["session_id"],
        tenant=row["tenant"], agent=row["agent"], kind=row["kind"], turn=int(row["turn"]),
        pause_s=float(row["pause_s"]), max_tokens=int(row["max_tokens"]),
        expected_answer=row.get("expected_answer"), messages=messages,
        doc_ids=tuple(row.get("doc_ids", ())),
        decision_json=json.dumps(row.get("decision", {}), sort_keys=True),
    )  # fmt: skip


def _session(research_id: str, rows: list[Mapping[str, Any]], path: str | Path) -> ResearchSession:
    by_agent: dict[str, list[PlannedCall]] = {}
    for row in rows:
        by_agent.setdefault(row.get("session_id", ""), []).append(_call(row, f"{path}:{row['_line']}"))
    where = f"{path}:{rows[0]['_line']}"
    scripts = [AgentScript(sid, calls[0].agent, tuple(calls)) for sid, calls in by_agent.items()]
    leads = [s for s in scripts if s.agent == "lead"]
    if len(leads) != 1 or leads[0].calls[0].kind != "plan":
        raise ValueError(f"{where}: session {research_id} needs one lead whose first call is its plan")
    subs = tuple(s for s in scripts if s.agent != "lead")
    return ResearchSession(research_id, rows[0]["tenant"], float(rows[0]["arrival_s"]), leads[0], subs)


def load_replay(path: str | Path, seed: int = 0) -> WorkloadPlan:
    """The plan that replays the trace at ``path`` exactly (see the module docstring).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a row is not JSON or lacks a field, or a session has no lead plan;
            the message names the file and line.
    """
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    with Path(path).open(encoding="utf-8") as lines:
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc})") from exc
            if not isinstance(row, dict) or "research_id" not in row:
                raise ValueError(f"{path}:{n}: trace row lacks ['research_id']")
            grouped.setdefault(row["research_id"], []).append(row | {"_line": n})
    if not grouped:
        raise ValueError(f"{path}: the trace has no calls")
    sessions = [_session(rid, rows, path) for rid, rows in grouped.items()]
    sessions.sort(key=lambda s: (s.arrival_s, s.research_id))
    duration_s = max(s.arrival_s for s in sessions) + 1e-9
    return WorkloadPlan(seed, duration_s, tuple(sessions))
