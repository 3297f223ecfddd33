"""Log lines that a client cannot forge: control characters in this project's log messages are
written escaped.

Client-chosen text reaches our log messages as arguments (session ids, request ids, tool and
grammar names, exception texts quoting them); an id holding ``"\\n"`` wrote a second, forged
line into the node's or the gateway's log (review s33, suspicion 1: a session id ``"\\u0000\\n"``
is accepted, and session/request ids were logged with ``%s`` at a dozen places). Rather than
each call site, the record of every logger of this project (``OWN_LOGGERS``) escapes the
control characters of its formatted message (``getMessage``: C0 and C1 controls, DEL, U+2028,
U+2029, as ``repr`` writes them); a traceback (``exc_info``) is added by the handler's
formatter after that, as before. Other libraries' records are untouched.

``install`` wraps the process's log record factory (``logging.setLogRecordFactory``); it runs
when ``cache_node`` is imported (every kvstrata process imports it) and is idempotent.
"""

from __future__ import annotations

import logging
import re
from typing import Any

OWN_LOGGERS = frozenset({"cache_node", "services", "tenants", "cli", "workloads", "bench", "kvstrata"})
"""Top-level package names whose loggers' messages are escaped."""

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with each control character written as ``repr`` writes it (``"\\n"`` as the
    two characters backslash and n)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class EscapedRecord(logging.LogRecord):
    """A ``LogRecord`` whose message has its control characters escaped."""

    def getMessage(self) -> str:
        message = super().getMessage()
        return escape_controls(message) if _CONTROL.search(message) else message


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
        return record

    factory.escapes_controls = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
