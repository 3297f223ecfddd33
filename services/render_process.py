"""The chat renderer process, seen from the cache node (``services.render_worker`` is the child's
side and the wire).

The node's renderer thread (``services.cache_node_streams.Streams._render``, which takes
tenants in turn) hands each chat request's render and tokenization to one child process
(``RenderProcess``) and waits for the reply without holding the GIL, so the node's step thread
decodes on while a tenant's chats render. Regression (review s35 E F3): renders ran on the
renderer thread, in the node's process, and took the GIL from the step thread: one tenant's
1000-message chats slowed every tenant's decoding ~3-4x.

``RemoteTemplater`` is the ``services.chat.ChatTemplater`` the renderer thread renders with
(``Requests._prompt``): its bounds (``check_fits``, ...) are the node's templater's own, run
here; ``first_turn`` and ``continue_session`` run in the child. Replies are untrusted bytes: a
frame over ``MAX_REPLY_BYTES``, of another shape, with token ids out of the vocabulary's range,
more ids than its input can render to (``MAX_TOKENS_PER_CHAR``), a continuation that does not
start with its history, or an error of an unknown kind kills the child. A child that ends, or
does not answer within ``render_timeout_s`` (wall time: it is killed), or cannot start,
fails the request it was rendering with ``RenderFailed`` (the node's INTERNAL error, naming
it); the next render starts a fresh child (~1-3 s, paid by that render).

The child is started as ``cache_node.grammar_process`` starts a grammar compiler: with
``subprocess`` (fork and exec: nothing of the node's threads or CUDA state), from the renderer
thread (it ends with that thread's node: ``PR_SET_PDEATHSIG``), with the few environment
variables of ``grammar_process.child_env`` (no credential), in a private directory (its
``TMPDIR`` too), its stderr a pipe the node logs (bounded), and it confines itself
(``cache_node.sandbox``) once loaded. ``close`` (the node's shutdown) kills it (``grammar_process.Child``:
never by a pid once reaped); the thread using its pipes (a render's, a start's) reaps it and closes them,
never ``close`` from another thread. The start
(``grammar_process.start_child``, ``ready_report``) is the grammar compiler's own code.

The gateway renders its large chats in children of this class too (``owner="gateway"``, one
per worker thread: ``services.gateway_render``), through ``render_text``: the chat template's
text, which the gateway tokenizes itself. Every child caps its memory (``memory_bytes``,
``render_worker.MEMORY_BYTES``, before it loads the tokenizer): a render past it fails alone
(``RenderTooLarge``, a ``TemplateRefusal``: a ``MemoryError`` in its Python, or its abort on a
tokenizer allocation, SIGABRT after "memory allocation of N bytes failed" on its stderr) and the
child is killed, the next render starting a fresh one; any other death of the child is
``RenderFailed`` (``_ended``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import signal
import sys
import threading
import time
import weakref
from array import array
from typing import Any

from cache_node.grammar_process import (
    Child,
    child_env,
    read_exact,
    ready_report,
    start_child,
    write_all,
)
from cache_node.grammar_worker import HEADER_BYTES, frame, header_size
from cache_node.msgpack_bounds import UnpackBounds, unpackb_within
from cache_node.process_temp import process_temp_dir
from services.chat import ChatTemplater, Messages, TemplateRefusal
from services.render_worker import MEMORY_BYTES

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
"""Longest wait for a new child to load the tokenizer and say it is ready (~1-3 s on a busy
2-core host)."""

RENDER_TIMEOUT_S = 60.0
"""Longest wait (wall time) for one render's reply; past it the child is killed and the request
fails. A render of the largest chat a node takes (~1M characters) takes ~1-4 s."""

START_FAILURES = 3
"""Consecutive failed starts after which no child is started for ``START_BACKOFF_S`` (``StartGuard``)."""

START_BACKOFF_S = 60.0
"""How long no child starts after ``START_FAILURES`` failed starts in a row: renders fail at once
meanwhile (``RenderFailed`` naming the last failure), instead of ~9 s each starting a child that
cannot start (a tokenizer that does not load under the memory cap)."""

MAX_REPLY_BYTES = 64 << 20
"""Largest reply frame read (16M token ids)."""

MAX_TOKENS_PER_CHAR = 8
"""Most token ids one character of a render's input may come to, plus ``TEMPLATE_TOKENS``: a
reply with more is out of protocol (a byte fallback gives at most one per UTF-8 byte, 4; twice
that for a template that writes a value out twice or indents tools' JSON)."""

TEMPLATE_TOKENS = 1 << 16
"""Token ids a chat template may add to its messages' (roles, headers, a default system prompt)."""

_REPLY_BOUNDS = UnpackBounds(max_array_len=3, max_map_len=0, max_str_len=1 << 16, max_bin_len=MAX_REPLY_BYTES,
                             max_containers=1, max_elements=3)
_ERRORS: dict[str, type[Exception]] = {"TemplateRefusal": TemplateRefusal, "ValueError": ValueError,
                                       "TypeError": TypeError, "KeyError": KeyError}
_KINDS = (*_ERRORS, "memory", "internal")

class RenderFailed(Exception):
    """The node's (or gateway's) chat renderer process failed a request: it ended, did not
    answer in time, answered out of protocol or could not start (the server's fault, not the
    request's)."""


class RenderTimedOut(RenderFailed):
    """A render's reply did not come within the child's ``render_timeout_s`` (the child was
    killed). The node answers it as its ``RenderFailed``; the gateway as the request's size
    (``services.gateway_render``: ``RenderTooSlow``)."""


class TokenizerUnsaved(Exception):
    """The tokenizer could not be saved for a child (its ``save_pretrained`` raised other than
    ``OSError``: a tokenizer class of its own): no child can render for it, ever. An ``OSError``
    there (a full or unwritable temporary directory, no file descriptor left) is passing:
    ``RenderFailed`` instead."""


class StartGuard:
    """Consecutive failed starts of the children sharing it (one ``RenderProcess``, or every
    child of a gateway's pool): after ``START_FAILURES`` in a row no child starts for
    ``START_BACKOFF_S`` (a render fails at once, ``RenderFailed`` naming the last failure);
    a start that succeeds clears them. Regression (diff review s36 R2 F6): a tokenizer that
    cannot load under the memory cap started a child, ~9 s, for every large chat, each failing."""

    def __init__(self, failures: int = 0, backoff_s: float = 0.0) -> None:
        self.failures_allowed = failures or START_FAILURES
        self.backoff_s = backoff_s or START_BACKOFF_S
        self.failures = 0
        self.last = ""
        self.until = 0.0  # monotonic time before which no child starts
        self._lock = threading.Lock()

    def check(self, owner: str) -> None:
        """``RenderFailed`` while backing off."""
        with self._lock:
            left = self.until - time.monotonic()
            if left > 0:
                raise RenderFailed(f"the {owner}'s chat renderer process failed to start {self.failures} times in a "
                                   f"row (last: {self.last}); none is started for another {left:.0f} s")

    def failed(self, why: str) -> None:
        with self._lock:
            self.failures += 1
            self.last = why[:500]
            if self.failures >= self.failures_allowed:
                self.until = time.monotonic() + self.backoff_s

    def started(self) -> None:
        with self._lock:
            self.failures, self.until = 0, 0.0


class RenderTooLarge(TemplateRefusal):
    """A render needed more memory than its child may use (``render_worker.MEMORY_BYTES``): the
    request's fault (INVALID_ARGUMENT / HTTP 400 naming ``messages``, wherever a template's
    refusal is answered so), its child restarted for the next render."""


class RenderProcess:
    """One chat renderer child for ``tokenizer`` (started by ``start``, or by the first render).

    Args:
        tokenizer: the node's tokenizer (with its chat template); saved once to a private
            directory the child loads it from (``save_pretrained``: raises what it raises).
        argv: the child's command, to which the node's pid is appended (tests give another).
        start_timeout_s: longest wait for a new child's ``ready``.
        render_timeout_s: longest wait for one render's reply.
        owner: whose renderer it is, in its errors' words ("node", "gateway").
        memory_bytes: the child's data segment cap (``render_worker.MEMORY_BYTES``; 0: none).
        start_guard: the back-off after failed starts (``StartGuard``; None: its own).

    Raises:
        TokenizerUnsaved: ``save_pretrained`` raised other than ``OSError``.
        RenderFailed: the tokenizer's directory could not be made or written (``OSError``).
    """

    def __init__(self, tokenizer: Any, argv: tuple[str, ...] = (sys.executable, "-m", "services.render_worker"),
                 start_timeout_s: float = START_TIMEOUT_S, render_timeout_s: float = RENDER_TIMEOUT_S,
                 owner: str = "node", memory_bytes: int = MEMORY_BYTES, start_guard: StartGuard | None = None) -> None:
        self.vocab_size = len(tokenizer)  # (the node's own count: a reply's ids are checked against it)
        self.argv = argv
        self.start_timeout_s = start_timeout_s
        self.render_timeout_s = render_timeout_s
        self.owner = owner
        self.memory_bytes = memory_bytes
        self.start_guard = start_guard if start_guard is not None else StartGuard()
        try:
            self._tokenizer_dir = process_temp_dir("render-tokenizer")
        except OSError as exc:
            raise RenderFailed(f"the {owner}'s chat renderer process could not start: {exc}") from None
        self._remove_tokenizer = weakref.finalize(self, shutil.rmtree, self._tokenizer_dir, True)
        try:
            tokenizer.save_pretrained(self._tokenizer_dir)
        except OSError as exc:  # (passing: a full disk, no descriptor left)
            self._remove_tokenizer()
            raise RenderFailed(f"the {owner}'s chat renderer process could not start: its tokenizer could not be "
                               f"saved for it: {exc}") from None
        except Exception as exc:
            self._remove_tokenizer()
            raise TokenizerUnsaved(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            self._remove_tokenizer()
            raise
        self.proc: Child | None = None
        self.workdir: str | None = None
        self._remove_workdir: weakref.finalize | None = None
        self.sandbox = ""  # the running child's ``cache_node.sandbox.confine`` report
        self.num_starts = 0
        self.renders = 0  # replies read
        self.busy = False  # a render (or a start) is under way
        self.closed = False
        self._starting = False  # (``_ended``'s words: during a start, a memory failure is the cap's)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    # ---- the renders (the renderer thread's) ------------------------------------------------
    def first_turn(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """``ChatTemplater.first_turn`` in the child (raises what it raised there, or ``RenderFailed``)."""
        return self._render(["first_turn", list(messages), _tools_text(tools)], _chars(messages, tools), None)[0]

    def continue_session(self, history_messages: Messages, history_tokens: list[int], new_messages: Messages,
                         tools: list[dict[str, Any]] | None = None, same_tools: bool = True,
                         tool_reply: str | None = None) -> tuple[list[int], bool]:
        """``ChatTemplater.continue_session`` in the child (raises what it raised there, or ``RenderFailed``)."""
        request = ["continue_session", list(history_messages), array("i", history_tokens).tobytes(),
                   list(new_messages), _tools_text(tools), same_tools, tool_reply]
        chars = _chars([*history_messages, *new_messages], tools) + len(tool_reply or "")
        return self._render(request, chars, history_tokens)

    def render_text(self, payload: bytes) -> str:
        """``ChatTemplater.render`` in the child, of ``payload``: the JSON text of ``[messages,
        add_generation_prompt, tools]``, UTF-8 (``surrogatepass``; non-ASCII characters as
        themselves, not ``\\u`` escapes: ``services.gateway_render``) (raises what the render
        raised there, ``RenderTooLarge``, ``RenderTimedOut`` or ``RenderFailed``). The reply is
        the child's word: text within ``MAX_REPLY_BYTES``."""
        reply = self._exchange(["render", payload])
        if reply[0] != "text" or len(reply) != 2 or not isinstance(reply[1], bytes):
            raise self._out_of_protocol("a malformed reply")
        try:
            return reply[1].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self._out_of_protocol("a rendering that is not UTF-8") from None

    def _render(self, request: list[Any], chars: int, history: list[int] | None) -> tuple[list[int], bool]:
        reply = self._exchange(request)
        return self._checked(reply, chars, history)

    def _exchange(self, request: list[Any]) -> list[Any]:
        """Send ``request`` to the child (started first where none runs) and read its reply:
        an ``error`` reply raised as its kind's exception, any other returned."""
        self._take()
        try:
            if self.pid is None:
                self._start()
            deadline = time.monotonic() + self.render_timeout_s
            try:
                packed = frame(request)
            except (OverflowError, TypeError, ValueError) as exc:  # nothing sent: the request's values
                raise ValueError(f"the chat's messages cannot be handed to the renderer: {exc}") from None
            self._write(packed, deadline)
            reply = self._reply(deadline)
            self.renders += 1
            if reply[0] == "error":
                if len(reply) != 3:
                    raise self._out_of_protocol("a malformed reply")
                kind, message = reply[1], reply[2]
                if not isinstance(kind, str) or not isinstance(message, str) or kind not in _KINDS:
                    raise self._out_of_protocol("an error of an unknown kind")
                if kind == "internal":
                    raise RenderFailed(f"the chat template failed on the {self.owner}: {message}")
                if kind == "memory":  # (its heap may be in pieces: the next render gets a fresh child)
                    self.kill()
                    raise self._too_large(message)
                raise _ERRORS[kind](message)
            return reply
        finally:
            self._release()

    def _too_large(self, what: str) -> RenderTooLarge:
        return RenderTooLarge(f"messages: {what[:200]} ({self.memory_bytes >> 20} MiB); send fewer or shorter "
                              "messages, or fewer tools")

    def _checked(self, reply: list[Any], chars: int, history: list[int] | None) -> tuple[list[int], bool]:
        """An ``ok`` reply's token ids and whether it continued ``history``, checked: ids within
        the vocabulary, at most ``MAX_TOKENS_PER_CHAR`` per character of the input (its history
        aside) plus ``TEMPLATE_TOKENS``, a continuation starting with its history.

        Regression (s38): a reply of two values (``["ok", ids]``) raised ``ValueError`` from the
        unpacking here: the request was refused as the client's bad input (its message "not
        enough values to unpack"), and the child, left running, answered every later render
        so; an ``["error", kind]`` reply raised ``IndexError``."""
        if len(reply) != 3:
            raise self._out_of_protocol("a malformed reply")
        kind, data, continued = reply
        if kind != "ok" or not isinstance(data, bytes) or not isinstance(continued, bool) or len(data) % 4:
            raise self._out_of_protocol("a malformed reply")
        ids = array("i")
        ids.frombytes(data)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise self._out_of_protocol(f"token ids outside the vocabulary (0..{self.vocab_size - 1})")
        most = (len(history) if history else 0) + 1 + MAX_TOKENS_PER_CHAR * chars + TEMPLATE_TOKENS
        if len(ids) > most:
            raise self._out_of_protocol(f"{len(ids)} token ids for {chars} characters")
        if continued and (history is None or ids[: len(history)] != array("i", history)):
            raise self._out_of_protocol("a continuation that does not start with its history")
        return ids.tolist(), continued

    def _out_of_protocol(self, what: str) -> RenderFailed:
        self.kill()
        return RenderFailed(f"the {self.owner}'s chat renderer process answered out of protocol ({what}); it was "
                            "restarted: send the request again")

    # ---- the process ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the child (reaping one that ended), send its ``init`` frame and wait for its
        ``ready``, within ``start_timeout_s`` (else ``RenderFailed``; at once while its
        ``start_guard`` backs off): the node's warm start, ahead of its first render. A child
        whose tokenizer did not load under its memory cap says so (``["failed", "memory",
        ...]``), and the error names the cap. Once ``close`` ran, none starts (``RenderFailed``,
        "shutting down"), and one ``close`` met while it was spawned is killed at once; a
        ``close`` met while it waits for the ``ready`` kills the child, and this thread reaps it
        and closes its pipes, failing "shutting down" too.

        It follows the renders' rules (``busy``: one thread uses the child's pipes, and only
        that thread closes them). Raises ``RuntimeError`` while another thread uses this
        process (a bug: each ``RenderProcess`` has one user thread at a time).

        Regressions (s39, a node shut down during its render child's warm start): the renderer
        thread started the child after ``close`` (which had found none to kill), and it ran on,
        importing for ~10 s of CPU, to fail on the tokenizer ``close`` had removed. And a
        ``close`` during the wait for ``ready`` found the process not busy: it reaped the child
        and closed its pipes on the shutdown thread while the renderer thread polled and read
        them (``EBADF``, or, had a descriptor number been reused meanwhile, a read of another
        file: a socket, a spill file)."""
        self._take()
        try:
            self._start()
        finally:
            self._release()

    def _start(self) -> None:
        """``start``, by the thread using this process (``busy``)."""
        self.kill()
        self._refuse_closed()
        self.start_guard.check(self.owner)
        started = time.monotonic()
        try:
            self.workdir = process_temp_dir("render")
            self._remove_workdir = weakref.finalize(self, shutil.rmtree, self.workdir, True)
            env = child_env(os.environ)
            env.update(TMPDIR=self.workdir, HF_HOME=self.workdir, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")  # (no "PyTorch was not found")
            self.proc = start_child(self.argv, self.workdir, env, "chat renderer", log)
            self._refuse_closed()  # (a ``close`` while it was spawned found no child to kill)
            self.num_starts += 1
            self._starting = True
            deadline = started + self.start_timeout_s
            self._write(frame(["init", self._tokenizer_dir, self.memory_bytes]), deadline)
            reply = self._reply(deadline)
            if reply[0] == "failed" and len(reply) == 3 and reply[1] == "memory" and isinstance(reply[2], str):
                raise RenderFailed(f"its tokenizer did not load under its memory cap of {self.memory_bytes >> 20} MiB "
                                   f"(render_worker.MEMORY_BYTES): {reply[2][:200]}")
            sandbox = ready_report(reply)
            if sandbox is None:
                raise self._out_of_protocol("its start")
        except (RenderFailed, OSError) as exc:
            self.kill()
            if self.closed:  # (``close`` killed it: the shutdown's doing, no failure to start)
                raise RenderFailed(f"the {self.owner} is shutting down") from None
            failure = RenderFailed(f"the {self.owner}'s chat renderer process could not start: {exc}")
            self.start_guard.failed(str(failure))
            raise failure from None
        except BaseException:
            self.kill()
            raise
        finally:
            self._starting = False
        self.start_guard.started()
        self.sandbox = sandbox
        log.info("chat renderer process %d ready in %.1f s (%s)", self.proc.pid, time.monotonic() - started,
                 self.sandbox)

    def _refuse_closed(self) -> None:
        """Raises ``RenderFailed`` once ``close`` ran."""
        with self._lock:
            if self.closed:
                raise RenderFailed(f"the {self.owner} is shutting down")

    def _take(self) -> None:
        """Mark this process used by the calling thread (``busy``) for a render or a start;
        ``RenderFailed`` ("shutting down") once ``close`` ran."""
        with self._lock:
            if self.closed:
                raise RenderFailed(f"the {self.owner} is shutting down")
            if self.busy:
                raise RuntimeError(f"the {self.owner}'s chat renderer process is in use by another thread")
            self.busy = True

    def _release(self) -> None:
        """The end of ``_take``'s use: after a ``close`` met meanwhile (which only killed the
        child), this thread reaps the child, closes its pipes and removes the tokenizer."""
        with self._lock:
            self.busy = False
            closed = self.closed
        if closed:
            self.kill()
            self._remove_tokenizer()

    def close(self) -> None:
        """Stop the child (the node's shutdown; any thread; returns at once where the child is
        in use): a render or start under way fails (``RenderFailed``), and no other starts.
        The child's pipes are closed by the thread using them: a busy process's child is only
        killed here (SIGKILL), and that thread reaps it once its poll or read sees the end."""
        with self._lock:
            self.closed = True
            if self.busy:
                if self.proc is not None:
                    self.proc.kill()  # (``Child.kill``: never a process that got its pid once reaped)
                return
        self.kill()
        self._remove_tokenizer()

    def kill(self) -> None:
        """End the child (SIGKILL), reap it and close its pipes; a no-op when there is none.
        The using thread's (or any thread's while none is busy): never while another thread
        polls the pipes. Not with ``_lock`` held."""
        with self._lock:  # (``close`` signals ``proc`` under it: never after its ``reap`` here)
            proc, self.proc = self.proc, None
            remove_workdir, self._remove_workdir, self.workdir = self._remove_workdir, None, None
        self.sandbox = ""
        if proc is not None:
            proc.reap()
        if remove_workdir is not None:
            remove_workdir()

    def _write(self, data: bytes, deadline: float) -> None:
        """Write ``data`` to the child's non-blocking stdin by ``deadline`` (monotonic)."""
        assert self.proc is not None and self.proc.stdin is not None
        write_all(self.proc.stdin.fileno(), data, lambda fd, event: self._wait(fd, event, deadline), self._ended)

    def _reply(self, deadline: float) -> list[Any]:
        """The next reply frame by ``deadline``: a list of two or three values."""
        size = header_size(self._read(HEADER_BYTES, deadline))
        if size > MAX_REPLY_BYTES:
            raise self._out_of_protocol(f"a reply of {size} bytes; at most {MAX_REPLY_BYTES}")
        body = self._read(size, deadline)
        try:
            reply = unpackb_within(body, _REPLY_BOUNDS, "a chat renderer's reply")
        except Exception:  # noqa: BLE001 - msgpack raises several kinds; all mean a bad reply
            reply = None
        if not (isinstance(reply, list) and len(reply) in (2, 3) and isinstance(reply[0], str)):
            raise self._out_of_protocol("a malformed reply")
        return reply

    def _read(self, size: int, deadline: float) -> bytes:
        assert self.proc is not None and self.proc.stdout is not None
        return read_exact(self.proc.stdout.fileno(), size, lambda fd, event: self._wait(fd, event, deadline),
                          self._ended)

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        """Until ``fd`` is ready for ``event`` (or hung up), by ``deadline``; past it the child
        is killed (``RenderFailed``)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RenderTimedOut(f"the {self.owner}'s chat renderer process did not answer within "
                                   f"{self.render_timeout_s:g} s; it was killed and is restarted for the next "
                                   "request")
            poller = select.poll()
            poller.register(fd, event | select.POLLHUP | select.POLLERR)
            if poller.poll(min(left, 1.0) * 1000):
                return

    def _ended(self, when: str) -> RenderFailed | RenderTooLarge:
        """The child is gone (reaped here): why, as the error of the request it was serving. A
        death by SIGABRT under a memory cap whose last words on its stderr
        (``Child.stderr_tail``, ``_died_of_memory``) were a failed allocation's (the tokenizer's
        Rust: "memory allocation of N bytes failed"; C++'s ``std::bad_alloc``) is an allocation
        past the cap: during a start the cap's (``RenderFailed`` naming it), during a render the
        request's size (``RenderTooLarge``, as a ``MemoryError`` in its Python is). Any other
        death, SIGABRT included, is this server's: ``RenderFailed`` (INTERNAL, "send this one
        again"), and the next request gets a fresh child. Regressions: (s40) that render failed
        INTERNAL, not as its size; (s41) every SIGABRT under the cap was the request's size,
        an abort that had nothing to do with memory (a library's assertion, a signal from
        outside) included: its client was told to send less, and did not retry."""
        proc = self.proc
        code = None if proc is None else proc.wait(1.0)
        self.kill()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        if code == -signal.SIGABRT and self.memory_bytes and proc is not None \
                and _died_of_memory(proc.stderr_tail.last_lines(_LAST_WORDS, wait_s=1.0)):
            if not self._starting:
                return self._too_large("rendering them needs more memory than the chat renderer may use (its "
                                       "process ended: an allocation past its cap failed)")
            how += f"; an allocation past its memory cap of {self.memory_bytes >> 20} MiB failed while its tokenizer " \
                   "loaded (render_worker.MEMORY_BYTES)"
        return RenderFailed(f"the {self.owner}'s chat renderer process ended {when} ({how}); it is restarted for the "
                            "next request: send this one again")


_LAST_WORDS = 40
"""The last lines of a dead child's stderr ``_died_of_memory`` reads (a fault handler's report
of the abort, a stack of ~30 lines, may follow the allocation's line)."""

_RUST_ALLOC_FAILED = re.compile(r"memory allocation of \d+ bytes failed")
_ABORT_REPORTS = ("Fatal Python error: Aborted", "stack backtrace:")
"""Lines that start a report of the abort itself (Python's fault handler's, Rust's backtrace
under ``RUST_BACKTRACE``): they and what follows them are left aside."""
_RUST_NOTE = "note: "
"""Rust's hint after its allocation failure ("note: run with `RUST_BACKTRACE=1` ...")."""


def _died_of_memory(lines: list[str]) -> bool:
    """Whether a child that died by SIGABRT said a failed allocation was why (``lines``: its
    stderr's last non-blank lines, ``StderrTail.last_lines``): its last line Rust's "memory
    allocation of N bytes failed", or one of its last two C++'s ``std::bad_alloc`` (its
    ``terminate`` report); the reports of the abort itself (``_ABORT_REPORTS`` and what follows)
    and Rust's trailing notes left aside. Only the words just before its death count: the same
    words written earlier by a child that went on serving do not. Untrusted bytes, but the
    child's own: at worst a child that forges them has its render refused as too large."""
    for report in _ABORT_REPORTS:
        if report in lines:
            lines = lines[:len(lines) - 1 - lines[::-1].index(report)]
    while lines and lines[-1].startswith(_RUST_NOTE):
        lines = lines[:-1]
    last = lines[-2:]
    return bool(last) and (_RUST_ALLOC_FAILED.fullmatch(last[-1]) is not None
                           or any("std::bad_alloc" in line for line in last))


def _chars(messages: Messages, tools: list[dict[str, Any]] | None) -> int:
    """Characters of a render's input, bounded from above (what its token ids are checked
    against): every string in its messages, nested ones too (content parts, ``tool_calls``'
    names and arguments), 32 for each other value, and its tools' JSON. Regression (diff review
    s35 R2): only a message's top-level strings counted, so a chat whose tool-call arguments
    came to more than ~65K tokens was refused "out of protocol" (and the shared child killed)."""
    return _value_chars(list(messages)) + (len(_tools_text(tools) or "") if tools else 0)


def _value_chars(value: Any) -> int:
    stack, chars = [value], 0
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            chars += 32
    return chars


def _tools_text(tools: list[dict[str, Any]] | None) -> str | None:
    """``tools`` as JSON text for the child (msgpack packs no integer past 64 bits, which a
    tool's JSON schema may hold: diff review s35 R1, the turn failed INTERNAL)."""
    return None if tools is None else json.dumps(tools)


class RemoteTemplater:
    """The ``ChatTemplater`` the node's renderer thread renders with: ``local``'s bounds, and
    ``process``'s renders (``first_turn``, ``continue_session``)."""

    def __init__(self, local: ChatTemplater, process: RenderProcess) -> None:
        self.local = local
        self.process = process

    def check_fits(self, num_chars: int, max_tokens: int, what: str = "prompt") -> None:
        self.local.check_fits(num_chars, max_tokens, what)

    def check_messages_fit(self, messages: Messages, max_tokens: int) -> None:
        self.local.check_messages_fit(messages, max_tokens)

    def check_tokens_cover(self, num_chars: int, num_tokens: int, what: str = "messages") -> None:
        self.local.check_tokens_cover(num_chars, num_tokens, what)

    def first_turn(self, messages: Messages, tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.process.first_turn(messages, tools)

    def continue_session(self, history_messages: Messages, history_tokens: list[int], new_messages: Messages,
                         tools: list[dict[str, Any]] | None = None, same_tools: bool = True,
                         tool_reply: str | None = None) -> tuple[list[int], bool]:
        return self.process.continue_session(history_messages, history_tokens, new_messages, tools, same_tools,
                                             tool_reply)

