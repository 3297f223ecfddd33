"""Client text in this project's log messages cannot forge log lines (``cache_node.log_records``).

Review s33 (suspicion 1): session ids accept ``"\\n"`` and NUL, and were logged with ``%s``
(``services/gateway.py``'s failed close, ``cache_node_streams``, ``cache_node_requests``,
``global_scheduler_recovery``): one id wrote a second, forged line into the log. Every record of
this project's loggers escapes its message's control characters now, whatever the call site;
other libraries' records and tracebacks are as before.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cache_node import log_records


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield out
    finally:
        root.removeHandler(handler)


def test_an_id_with_newlines_stays_on_its_log_line(captured: io.StringIO) -> None:
    forged = "s1\nWARNING:services.auth:admin key accepted from 10.0.0.1\x00\u2028\x85"
    logging.getLogger("services.gateway").warning("closing session %s on node %s", forged, "n0")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("cache_node.engine").exception("request %s: its step failed", "r\r\n1")
    logging.getLogger("elsewhere.lib").warning("their %s", "a\nb")
    lines = captured.getvalue().splitlines()
    assert lines[0] == ("closing session s1\\nWARNING:services.auth:admin key accepted from 10.0.0.1\\x00"
                        "\\u2028\\x85 on node n0")
    assert lines[1] == "request r\\r\\n1: its step failed" and lines[2] == "Traceback (most recent call last):"
    assert lines[-2:] == ["their a", "b"]  # another library's record: untouched


def test_installed_over_rays_record_factory_in_a_fresh_process() -> None:
    """Ray's workers set a record factory of their own before our code loads; it is wrapped,
    not replaced, and installing twice wraps once."""
    code = (
        "import logging, io, ray._private.log as rl\n"
        "rl._setup_log_record_factory()\n"
        "ray_factory = logging.getLogRecordFactory()\n"
        "from cache_node import log_records\n"
        "log_records.install(); log_records.install()\n"
        "f = logging.getLogRecordFactory()\n"
        "r = f('services.x', logging.WARNING, 'x.py', 1, 'id %s', ('a\\nb',), None)\n"
        "print(type(r).__name__, repr(r.getMessage()), f is not ray_factory)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["EscapedRecord", "'id", "a\\\\nb'", "True"], out.stdout


def test_a_bidi_override_and_a_surrogate_are_escaped(captured: io.StringIO) -> None:
    """s40: U+202E (right-to-left override) reordered the rest of its line on a terminal."""
    logging.getLogger("services.gateway").warning("session %s closed", "a\u202eb\u2066c\ud800d\u061c")
    assert captured.getvalue() == "session a\\u202eb\\u2066c\\ud800d\\u061c closed\n"


def test_a_tracebacks_exception_messages_are_escaped_its_lines_kept(captured: io.StringIO) -> None:
    """s40: an exception's message in a traceback was written raw: its newline forged a line,
    its ESC sequence reached the terminal. Now every message of the chain (and its notes) is
    escaped as the record's message is, the traceback's own lines unchanged."""
    forged = "r1\nWARNING:services.auth:tenant=bob admin key accepted\x1b[2J"
    try:
        try:
            raise KeyError(forged)
        except KeyError as inner:
            outer = ValueError(f"request {forged} could not start")
            outer.add_note("note\x1b]0;t\x07")
            raise outer from inner
    except ValueError:
        logging.getLogger("cache_node.engine").exception("request %s failed", forged)
    text = captured.getvalue()
    assert "\x1b" not in text and "\nWARNING:services.auth" not in text
    lines = text.splitlines()
    assert lines[0] == "request r1\\nWARNING:services.auth:tenant=bob admin key accepted\\x1b[2J failed"
    assert lines[1] == "Traceback (most recent call last):"
    assert "KeyError: 'r1\\nWARNING:services.auth:tenant=bob admin key accepted\\x1b[2J'" in lines
    assert "The above exception was the direct cause of the following exception:" in lines
    message = "ValueError: request r1\\nWARNING:services.auth:tenant=bob admin key accepted\\x1b[2J could not start"
    assert lines[-2:] == [message, "note\\x1b]0;t\\x07"]
    assert not any(line.startswith("WARNING:services.auth") for line in lines)


def test_escape_controls_writes_them_as_repr_does() -> None:
    assert log_records.escape_controls("a\tb\x1bc\x7f") == "a\\tb\\x1bc\\x7f"
    assert log_records.escape_controls("plain ünïcode") == "plain ünïcode"


class _Unprintable:
    """A note no ``str`` can write (``traceback`` writes ``<note str() failed>`` for it)."""

    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_traceback_it_cannot_escape_never_raises_out_of_the_log_call(captured: io.StringIO) -> None:
    """Diff review s40 r5 of 8a627a5: the traceback is escaped in the record factory, inside the
    log call, so its errors reached the caller instead of the handler: a note whose ``str``
    raised (RuntimeError) and an exception chained to 3,000 others (RecursionError in the
    escaping's recursion; ``traceback`` walks chains with a queue) raised out of
    ``log.exception`` and ended the calling thread's work."""
    log = logging.getLogger("cache_node.engine")
    try:
        failure = ValueError("step failed\x1b[2J")
        failure.__notes__ = ["ok note", _Unprintable()]
        raise failure
    except ValueError:
        log.exception("request %s failed", "r1")
    chained = None
    for i in range(3000):
        link = KeyError(f"k{i}\n")
        link.__context__ = chained
        chained = link
    try:
        raise ValueError("last\nWARNING:forged") from chained
    except ValueError:
        log.exception("request %s failed", "r2")
    lines = captured.getvalue().splitlines()
    assert lines[:1] == ["request r1 failed"] and "ValueError: step failed\\x1b[2J" in lines
    assert lines[lines.index("ValueError: step failed\\x1b[2J") + 1:][:2] == ["ok note", "<note str() failed>"]
    assert "request r2 failed" in lines and lines[-1] == "ValueError: last\\nWARNING:forged"
    assert "KeyError: 'k0\\n'" in lines and "KeyError: 'k2999\\n'" in lines
    assert not any(line.startswith("WARNING:forged") for line in lines)


def test_a_syntax_errors_message_and_text_are_escaped(captured: io.StringIO) -> None:
    """Diff review s40 r5 of 8a627a5: ``traceback`` writes a SyntaxError from its ``msg``, ``text``
    and ``filename``, not its ``str``: they were written raw (a forged line, an ESC)."""
    try:
        raise SyntaxError("bad\nWARNING:forged\x1b[2J", ("f\x1b.py", 1, 2, "x\x1b]0;t\x07y\n"))
    except SyntaxError:
        logging.getLogger("services.chat").exception("template %s", "t")
    text = captured.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    lines = text.splitlines()
    assert lines[-4:-2] == ['  File "f\\x1b.py", line 1', "    x\\x1b]0;t\\x07y"]
    assert lines[-2].strip().startswith("^")  # (the caret's width is the Python version's: 3.13 underlines more)
    assert lines[-1] == "SyntaxError: bad\\nWARNING:forged\\x1b[2J"
