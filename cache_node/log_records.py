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
from collections.abc import Callable, Sequence
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
        each exception's message and notes escaped; nothing when no exception is attached.

        Never raises: it runs in the log call itself (the record factory), where an error would
        reach the caller, not the handler's ``handleError``. When the traceback cannot be
        rendered here (an exception whose ``__notes__`` raises, which ``traceback`` itself
        cannot render on 3.11), ``exc_text`` stays unset and the handler's formatter writes it,
        unescaped, as before (its error, if any, to ``handleError``).

        Regression (diff review s40 r5 of 8a627a5): a note whose ``str`` raised, or an exception
        chained to 1,000 others (``_escape_messages`` recursed), raised out of
        ``log.exception`` (RuntimeError, RecursionError) and ended the calling thread's work;
        a ``SyntaxError``'s message and text were written raw."""
        if not self.exc_info or self.exc_info[1] is None or self.exc_text:
            return
        try:
            shown = traceback.TracebackException(*self.exc_info)
            _escape_messages(shown)
            self.exc_text = "".join(shown.format()).removesuffix("\n")
        except Exception:  # noqa: BLE001 - a log call never raises (the formatter's way then, as before)
            self.exc_text = None


def _text(value: object, what: str, show: Callable[[object], str] = str) -> str:
    """``show(value)``, or ``traceback``'s own stand-in (``"<note str() failed>"``) when it raises."""
    try:
        return show(value)
    except Exception:  # noqa: BLE001 - any object's str may raise (as ``traceback._safe_string``)
        return f"<{what} {show.__name__}() failed>"


def _escape_messages(shown: traceback.TracebackException) -> None:
    """Escape the message (``_str``: what ``format_exception_only`` writes after the type's
    name; a ``SyntaxError``'s ``msg``, ``filename`` and ``text``) and the notes of ``shown`` and
    of every exception it chains or groups, once each, without recursion (a chain may be
    thousands long: ``TracebackException`` walks it with a queue too)."""
    pending, seen = [shown], set()
    while pending:
        one = pending.pop()
        if id(one) in seen:
            continue
        seen.add(id(one))
        one._str = escape_controls(_text(one._str, "exception"))  # type: ignore[attr-defined]  # (3.10 to 3.15)
        if hasattr(one, "msg"):  # a SyntaxError (set for those alone), written by its fields
            for name in ("msg", "filename"):
                if isinstance(getattr(one, name), str):
                    setattr(one, name, escape_controls(getattr(one, name)))
            if isinstance(one.text, str):  # (its end of line kept: ``_format_syntax_error`` strips it)
                text = one.text.rstrip("\n")
                one.text = escape_controls(text) + one.text[len(text):]
        notes = getattr(one, "__notes__", None)
        if isinstance(notes, Sequence) and not isinstance(notes, str | bytes):
            one.__notes__ = [escape_controls(_text(note, "note")) for note in notes]  # type: ignore[attr-defined]
        elif notes is not None:  # (written by ``repr``, as 3.13 writes it; 3.11 split a str into lines)
            one.__notes__ = [escape_controls(_text(notes, "__notes__", repr))]  # type: ignore[attr-defined]
        pending.extend(other for other in (one.__cause__, one.__context__, *(getattr(one, "exceptions", None) or ()))
                       if other is not None)


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
