"""Log lines that a client cannot forge: control characters in this project's log messages are
written escaped.

Client-chosen text reaches our log messages as arguments (session ids, request ids, tool and
grammar names, exception texts quoting them); an id holding ``"\\n"`` wrote a second, forged
line into the node's or the gateway's log (review s33, suspicion 1: a session id ``"\\u0000\\n"``
is accepted, and session/request ids were logged with ``%s`` at a dozen places). Rather than
each call site, the record of every logger of this project (``OWN_LOGGERS``) escapes the
control characters of its formatted message (``getMessage``: C0 and C1 controls, DEL, U+2028,
U+2029, lone surrogates and the bidirectional formatting controls U+061C, U+200E, U+200F,
U+202A-U+202E, U+2066-U+2069, as ``repr`` writes them: ``CONTROL``, the characters the API
edges refuse in ids too, ``services.client_ids``). Its traceback (``exc_info``) keeps its
lines, but the messages of its exceptions (chained and grouped ones too, and their notes) are
escaped as the message is: they quote client text and other processes' replies as often.
Other libraries' records are untouched.

Regression (s40 security hunt): a bidirectional override (U+202E) was written as it came,
reordering the rest of its line on an operator's terminal; an exception's message in a
traceback was written raw, so its ``"\\n"`` forged lines and its ESC sequences reached the
terminal.

``install`` wraps the process's log record factory (``logging.setLogRecordFactory``); it runs
when ``cache_node`` is imported (every kvstrata process imports it) and is idempotent.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Any

OWN_LOGGERS = frozenset({"cache_node", "services", "tenants", "cli", "workloads", "bench", "kvstrata"})
"""Top-level package names whose loggers' messages are escaped."""

CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""The characters a log message writes escaped (the module's list)."""


def escape_controls(text: str) -> str:
    """``text`` with each control character written as ``repr`` writes it (``"\\n"`` as the
    two characters backslash and n)."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class EscapedRecord(logging.LogRecord):
    """A ``LogRecord`` whose message, and its traceback's exception messages, have their control
    characters escaped."""

    def getMessage(self) -> str:
        message = super().getMessage()
        return escape_controls(message) if CONTROL.search(message) else message

    def escape_traceback(self) -> None:
        """Set ``exc_text`` (the traceback a ``Formatter`` writes instead of formatting
        ``exc_info``) to ``exc_info``'s traceback as ``Formatter.formatException`` writes it,
        each exception's message and notes escaped; nothing when no exception is attached."""
        if not self.exc_info or self.exc_info[1] is None or self.exc_text:
            return
        shown = traceback.TracebackException(*self.exc_info)
        _escape_messages(shown, set())
        self.exc_text = "".join(shown.format()).removesuffix("\n")


def _escape_messages(shown: traceback.TracebackException, seen: set[int]) -> None:
    """Escape the message (``_str``: what ``format_exception_only`` writes after the type's
    name) and the notes of ``shown`` and of the exceptions it chains or groups, once each."""
    if id(shown) in seen:
        return
    seen.add(id(shown))
    shown._str = escape_controls(str(shown._str))  # type: ignore[attr-defined]  # (3.10 to 3.13)
    notes = getattr(shown, "__notes__", None)
    if isinstance(notes, list | tuple):
        shown.__notes__ = [escape_controls(str(note)) for note in notes]  # type: ignore[attr-defined]
    for other in (shown.__cause__, shown.__context__, *(getattr(shown, "exceptions", None) or ())):
        if other is not None:
            _escape_messages(other, seen)


def install() -> None:
    """Make this project's loggers' records ``EscapedRecord``s: the process's log record factory
    (whatever it is: Ray's workers set one that stamps the time) is wrapped, and a plain
    ``LogRecord`` it makes for one of ``OWN_LOGGERS`` becomes an ``EscapedRecord`` (the same
    fields; a subclass with no state of its own). Idempotent."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "escapes_controls", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        if type(record) is logging.LogRecord and record.name.split(".", 1)[0] in OWN_LOGGERS:
            record.__class__ = EscapedRecord
            record.escape_traceback()  # type: ignore[attr-defined]
        return record

    factory.escapes_controls = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
