"""The gateway's chat renders: small ones in its process, large ones in render children
(``GatewayTemplater``, ``RenderPool``).

The gateway renders chats (its ``first_turn``, a session turn's size estimates, a
``prefix_messages`` prefix, an HTTP body's shared render, ``/tokenize``) on its worker threads
(``InferenceServicer.off_loop``: one turn per tenant), all through ``ChatTemplater.render``.
A render is pure-Python jinja that holds the GIL, which the gateway's event loop, serving
every tenant's calls and streams, needs too. Regression (review s35 E F3, "other places"):
one tenant's 1000-message chats took the GIL from every other tenant's requests at the
gateway (renders in its process).

``GatewayTemplater.render`` renders a chat in this process when it is small
(``IN_PROCESS_MESSAGES`` messages and ``IN_PROCESS_CHARS`` characters of JSON less its
strings' contents at most, ``structure_chars``: a render of ~1-5 ms, less than handing it to a
child costs), else in a child of ``RenderPool``
(``services.render_process.RenderProcess``, ``owner="gateway"``: the cache node's renderer
child, ``render`` requests); its text is tokenized here as before (``ChatTemplater.encode``:
the tokenizer's Rust code runs without the GIL). Renders through a child give the same text
as in this process (the messages and tools cross as JSON text, as they came off the wire:
an integer past 64 bits crosses exactly), so the same token ids.

The pool holds at most ``RENDER_CHILDREN`` children, one per worker thread: a worker thread
runs one tenant's turn at a time, so no tenant holds two children and no render waits for a
child another tenant's render holds. Had every child a render under way (a caller off the
worker threads), a render waits for the next free one, in the order they asked (FIFO).
Regression (diff review s35 of 2adbb9d, R3): all of a gateway's renders went to one shared
child, so a 1-message chat waited 2,787 ms behind another tenant's 3000-message chat (1 ms
before).

A tokenizer that cannot be saved for a child (``save_pretrained`` raises other than
``OSError``: a tokenizer class of its own; ``render_process.TokenizerUnsaved``) leaves every
render in the gateway's process, as before (logged once); nothing else does (diff review s36
R2 F4: any failure to make a child, a full ``/tmp`` or no descriptor left, disabled children
for the gateway's life, and once so any render's error, a ``RenderTooLarge`` included, re-ran
it in the gateway's process). A child that cannot be made fails that render (``RenderFailed``).

Children start on the first large render that finds none free (~1-3 s, paid by that render;
no gateway start pays it) and live until ``close`` (the gateway's ``stop``), after which a
large render fails (``RenderFailed``) and none starts (R5 of that review: a render after stop
started a new child). A child that ends, hangs past its timeout or answers out of protocol
fails only the render under way (``RenderFailed``: the gateway's fault, INTERNAL) and is
started again by the next render it takes; one past its memory cap
(``render_worker.MEMORY_BYTES``) fails it with ``RenderTooLarge`` (a ``TemplateRefusal``:
INVALID_ARGUMENT / HTTP 400 naming ``messages``), and restarts; one past ``RENDER_TIMEOUT_S``
(10 s) fails it with ``RenderTooSlow`` (a ``TemplateRefusal`` too), and restarts. After
``render_process.START_FAILURES`` failed starts in a row (a tokenizer that does not load under
the cap: the error names it) no child starts for ``START_BACKOFF_S``; large renders fail at
once meanwhile (``RenderFailed``).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Any

from services.chat import ChatTemplater, Messages, TemplateRefusal
from services.gateway import TOKENIZER_THREADS
from services.render_process import (
    RenderFailed,
    RenderProcess,
    RenderTimedOut,
    StartGuard,
    TokenizerUnsaved,
)

log = logging.getLogger(__name__)

IN_PROCESS_MESSAGES = 32
"""Most messages a chat rendered in the gateway's own process may have. Measured (SmolLM2's
template, this 2-core host, best of 5): 32 messages of 100 characters render in 0.54 ms, 64 in
1.05 ms, 1,000 in 15.8 ms (a template's cost grows with the messages it loops over)."""

IN_PROCESS_CHARS = 16 << 10
"""Most characters of JSON less its strings' contents (``structure_chars``: the messages and
tools) a chat rendered in the gateway's own process may have. Measured as above: 64 tools
(27.5K characters of JSON) render in 3.4 ms, 16 (6.9K) in 0.9 ms, through a template that
writes them with ``tojson`` (its cost grows with the tools' values); a message's plain text is
cheap here (1 Mi characters in one message: 0.9-4.6 ms of this thread's CPU, ASCII to emoji)
and dear through a child (5.9-24.7 ms: its JSON, and the UTF-8 both ways; 39.6 ms for emoji
with ``\\u`` escapes), so it is not counted. Such a chat renders without the child's memory cap,
as every chat did before the children: a template that writes a message out many times is
bounded by the children only for the chats sent to them."""

RENDER_TIMEOUT_S = 10.0
"""Longest wait (wall time) for one render in a gateway's child (the node's is
``render_process.RENDER_TIMEOUT_S``, 60 s, for a render that tokenizes too); past it the child
is killed (and started again by the next large render, ~2-9 s) and the request refused as too
large for its template (``RenderTooSlow``). Measured in a child on this loaded 2-core host (best
and worst of 3): 1,024 messages of 1 KiB with 32 tools (SmolLM2's template) 85-121 ms, one
message of 1 Mi characters 20-26 ms, 1,024 tool-call messages of ~1 KiB with 32 tools (a
Hermes-style template) 0.3-1.9 s: 10 s is ~5x the slowest seen, and holds a tenant's turn and a
worker thread at most that long (diff review s36 R2 F3: 60 s, then "send this one again")."""

RENDER_CHILDREN = TOKENIZER_THREADS
"""Most render children a gateway runs: one per worker thread (``InferenceServicer.off_loop``),
each of which runs one tenant's turn at a time. Each child holds ~125 MiB (its tokenizer and
transformers' import: ``render_worker.MEMORY_BYTES``)."""


def structure_chars(value: Any, most: int) -> int:
    """About the characters of ``value``'s JSON less its strings' contents (what a template's
    cost grows with: the values it loops over and writes out with ``tojson``, not the length of
    a message's text, which it copies), counted up to just past ``most``: a string 2 (its
    quotes), a dict key its length + 3, any other value 8. Regression (diff review s36 R2 F2):
    a chat of one 1 Mi-emoji message went to a child (its JSON's length), which cost the
    gateway's thread 39.6 ms of this thread's CPU (GIL) (24.7 ms with UTF-8 JSON) against 4.6 ms
    rendered here."""
    stack, chars = [value], 0
    while stack and chars <= most:
        item = stack.pop()
        if isinstance(item, str):
            chars += 2
        elif isinstance(item, dict):
            chars += 8 + sum(len(k) + 3 if isinstance(k, str) else 8 for k in item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            chars += 8
            stack.extend(item)
        else:
            chars += 8
    return chars


class RenderTooSlow(TemplateRefusal):
    """A chat's render in a gateway's child ran past ``RENDER_TIMEOUT_S``: the request's size
    for its template (INVALID_ARGUMENT / HTTP 400 naming ``messages``, as ``RenderTooLarge``),
    not a failure to send again."""


class RenderPool:
    """At most ``size`` render children for ``tokenizer`` (``RenderProcess``, ``owner="gateway"``),
    each rendering one chat at a time; made on demand, until ``close``.

    Args:
        tokenizer: the gateway's tokenizer (saved by each child's ``RenderProcess``).
        size: the most children (``RENDER_CHILDREN``).
        process_args: more arguments for each ``RenderProcess`` (tests: ``memory_bytes``,
            ``start_guard``; ``render_timeout_s`` is ``RENDER_TIMEOUT_S`` unless given). Its
            children share one ``StartGuard``: after ``render_process.START_FAILURES`` failed
            starts in a row none starts for ``START_BACKOFF_S`` (renders fail at once).
    """

    def __init__(self, tokenizer: Any, size: int = RENDER_CHILDREN, **process_args: Any) -> None:
        if size < 1:
            raise ValueError(f"a render pool needs at least one child; got {size}")
        self.tokenizer = tokenizer
        self.size = size
        self.process_args = {"render_timeout_s": RENDER_TIMEOUT_S, "start_guard": StartGuard()} | process_args
        self.processes: list[RenderProcess] = []  # every child made (``close`` stops them)
        self.waits = 0  # renders that found every child busy and waited for one
        self.closed = False
        self.unsaved: TokenizerUnsaved | None = None  # why the tokenizer could not be saved for a child (none is made)
        self._idle: list[RenderProcess] = []
        self._making = 0  # children being made (counted against ``size``)
        self._queue: collections.deque[object] = collections.deque()  # tickets of waiting renders, FIFO
        self._cond = threading.Condition()

    def render(self, payload: bytes) -> str:
        """``RenderProcess.render_text(payload)`` in a free child (waiting for one, in turn, when
        all ``size`` are busy). Raises what that raises, ``RenderTooSlow`` for its
        ``RenderTimedOut``; ``RenderFailed`` once ``close``d or where no child could be made;
        ``TokenizerUnsaved`` where the tokenizer cannot be saved for one (``unsaved``: for good)."""
        process = self._take()
        try:
            return process.render_text(payload)
        except RenderTimedOut:
            raise RenderTooSlow(f"messages: the chat template did not render them within "
                                f"{process.render_timeout_s:g} s; send fewer or shorter messages, or fewer "
                                "tools") from None
        finally:
            with self._cond:
                if not self.closed:
                    self._idle.append(process)
                self._cond.notify_all()

    def _take(self) -> RenderProcess:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            waited = False
            try:
                while not self.closed and not (self._queue[0] is ticket and (
                        self._idle or len(self.processes) + self._making < self.size)):
                    waited = True
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may go now
            if self.closed:
                raise RenderFailed("the gateway is stopping: its chat renderer processes are stopped")
            self.waits += waited
            if self._idle:
                return self._idle.pop()  # the one used last: warm
            self._making += 1
        try:
            process = RenderProcess(self.tokenizer, owner="gateway", **self.process_args)
        except BaseException as exc:
            with self._cond:
                self._making -= 1
                self._cond.notify_all()
            if isinstance(exc, TokenizerUnsaved):  # (``save_pretrained``'s: it stays so)
                if self.unsaved is None:
                    self.unsaved = exc
                    log.warning("gateway: chats render in the gateway's process (its tokenizer could not be saved "
                                "for a render child: %s)", exc)
                raise
            if isinstance(exc, Exception) and not isinstance(exc, RenderFailed):  # (passing: this render fails)
                raise RenderFailed(f"the gateway's chat renderer process could not be made: {type(exc).__name__}: "
                                   f"{exc}") from exc
            raise
        with self._cond:
            self._making -= 1
            if not self.closed:
                self.processes.append(process)
                return process
        process.close()  # (closed while it was made: it never starts a child)
        raise RenderFailed("the gateway is stopping: its chat renderer processes are stopped")

    def close(self) -> None:
        """Stop every child (a render under way fails, ``RenderFailed``); no render starts one
        from now on (any thread; idempotent)."""
        with self._cond:
            self.closed = True
            processes, self._idle = list(self.processes), []
            self._cond.notify_all()
        for process in processes:
            process.close()


class GatewayTemplater(ChatTemplater):
    """The gateway's ``ChatTemplater``: ``render`` in this process for a small chat, else in a
    child of its ``pool`` (see the module docstring); everything else as ``ChatTemplater``.

    Args:
        tokenizer: the gateway's tokenizer, with its chat template.
        pool: the children's pool (None: a ``RenderPool`` of ``RENDER_CHILDREN``).
        in_process_messages / in_process_chars: the bounds of a chat rendered here.
    """

    def __init__(self, tokenizer: Any, pool: RenderPool | None = None,
                 in_process_messages: int = IN_PROCESS_MESSAGES, in_process_chars: int = IN_PROCESS_CHARS) -> None:
        super().__init__(tokenizer)
        self.pool = pool if pool is not None else RenderPool(tokenizer)
        self.in_process_messages = in_process_messages
        self.in_process_chars = in_process_chars
        self.child_renders = 0  # renders sent to a child

    def render(self, messages: Messages, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """``ChatTemplater.render``, in a child when the chat is not small (raises what it
        raises, ``RenderTooLarge``, and ``RenderFailed`` where the child failed or the gateway
        stopped)."""
        if (len(messages) <= self.in_process_messages
                and structure_chars([messages, tools], self.in_process_chars) <= self.in_process_chars) \
                or self.pool.unsaved is not None:  # (no child can load this tokenizer: here, as before)
            return super().render(messages, add_generation_prompt, tools)
        try:  # (non-ASCII as itself: ``\\u`` escapes cost ~9x a plain chat's in-process render; R2 F2)
            text = json.dumps([list(messages), bool(add_generation_prompt), tools or None], ensure_ascii=False)
        except (TypeError, ValueError):  # not JSON (never from an edge: they take JSON and protobuf)
            log.warning("gateway: a chat whose values are not JSON renders in the gateway's process", exc_info=True)
            return super().render(messages, add_generation_prompt, tools)
        payload = text.encode("utf-8", "surrogatepass")  # (a lone surrogate crosses exactly)
        del text
        self.child_renders += 1
        try:
            return self.pool.render(payload)
        except TokenizerUnsaved:  # (only this: any other error is the render's own, answered so)
            self.child_renders -= 1
        return super().render(messages, add_generation_prompt, tools)

    def close(self) -> None:
        """Stop the render children (the gateway's ``stop``); a later large render fails."""
        self.pool.close()
